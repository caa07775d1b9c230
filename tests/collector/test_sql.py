"""The ``calls`` view: whole prompts rebuilt from (parent_call_id, prefix_len, prompt_suffix_ids) in one pass per
episode, equal to the assembler's sequences and to the prompts the harness sent; unknown logprobs counted."""

import json

import pyarrow.parquet as pq

from bench.collector_generate import SyntheticEpisode, write_calls
from collector.collect import collect
from collector.sql import connect
from sidecar.record import to_table

SYSTEM = list(range(1000, 1032))


def long_episode(turns: int) -> tuple[SyntheticEpisode, dict[str, list[int]]]:
    """A long agent episode as the sidecar records it: linear turns, a compaction every 100 turns, a sub-agent
    interleaved with its own context, and a retry; returns the prompt each call sent."""
    episode = SyntheticEpisode("long")
    sent: dict[str, list[int]] = {}

    def call(prompt: list[int], completion: list[int]) -> None:
        row = episode.call(prompt, completion)
        sent[row["call_id"]] = prompt

    prompt, helper = [*SYSTEM, 1, 2, 3], [*SYSTEM, 9, 9]
    for turn in range(turns):
        completion = [50_000 + 3 * turn, 50_001 + 3 * turn]
        call(prompt, completion)
        if turn % 37 == 5:  # a retry of the same prompt
            call(prompt, [70_000 + turn])
        if turn % 10 == 3:  # a sub-agent's turn between the main agent's
            call(helper, [60_000 + turn])
            helper = [*helper, 60_000 + turn, 61_000 + turn]
        prompt = [*prompt, *completion, 80_000 + turn]
        if turn % 100 == 99:  # compaction: the system prompt and a summary
            prompt = [*SYSTEM, 90000 + turn]
    return episode, sent


def test_whole_prompts_of_a_long_episode_equal_what_was_sent_and_the_assembled_segments(tmp_path):
    episode, sent = long_episode(320)
    store = str(tmp_path / "store")
    rows = episode.rows
    assert sum(1 for r in rows if r["parent_call_id"]) > 300  # stored as references, not whole
    write_calls(store, rows[: len(rows) // 2], name="s-calls-0")
    write_calls(store, rows[len(rows) // 2 :], name="s-calls-1")  # chains cross files
    con = connect(store)
    rebuilt = dict(con.execute("SELECT call_id, prompt_token_ids FROM calls").fetchall())
    assert rebuilt == sent

    segments = collect(store, state_dir=tmp_path / "state").segments.to_pylist()
    assert len(segments) > 4  # compactions, the sub-agent and the retries forked
    for segment in segments:
        for call_id, prompt_end in zip(segment["call_ids"], segment["call_prompt_ends"], strict=True):
            assert rebuilt[call_id] == segment["input_ids"][:prompt_end]


def test_parents_are_rebuilt_first_whatever_their_seq_and_a_missing_parent_gives_null(tmp_path):
    episode = SyntheticEpisode("ep")
    prompts = []
    prompt = [*SYSTEM, 1]
    for turn in range(5):
        episode.call(prompt, [500 + turn])
        prompts.append(prompt)
        prompt = [*prompt, 500 + turn, 600 + turn]
    rows = [dict(r) for r in episode.rows]
    for row in rows[3:]:
        row["seq"] -= 3  # a restarted sidecar counted again from 0: children before their parents in seq
    orphan = SyntheticEpisode("orphan")
    orphan.call([*SYSTEM, 7], [8])
    orphan.call([*SYSTEM, 7, 8, 9], [10])
    store = str(tmp_path / "store")
    write_calls(store, rows + orphan.rows[1:])  # the orphan's first call never reached the store
    rebuilt = dict(connect(store).execute("SELECT call_id, prompt_token_ids FROM calls").fetchall())
    assert [rebuilt[r["call_id"]] for r in rows] == prompts
    assert rebuilt[orphan.rows[1]["call_id"]] is None


def test_unknown_logprobs_are_the_records_count_or_counted_in_records_written_before_it(tmp_path):
    nan = float("nan")
    episode = SyntheticEpisode("ep")
    new = episode.call(SYSTEM, [1, 2, 3], logprobs=[-0.1, nan, nan])
    new["n_unknown_logprobs"] = 2
    old = episode.call([*SYSTEM, 1, 2, 3, 4], [5, 6], logprobs=[nan, -0.2])  # the column null: counted here
    none = episode.call([*SYSTEM, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10], logprobs=[])  # no logprobs at all: all unknown
    store = tmp_path / "store"
    write_calls(str(store), [new, old, none])
    # A file from before the column existed: no such column at all.
    legacy = SyntheticEpisode("legacy")
    legacy.call(SYSTEM, [1, 2], logprobs=[nan, nan])
    table = to_table(legacy.rows, "calls").drop_columns(["n_unknown_logprobs"])
    pq.write_table(table, store / "calls" / "run=run-1" / "date=2026-01-05" / "legacy-calls-0.parquet")
    counts = dict(connect(str(store)).execute("SELECT call_id, n_unknown_logprobs FROM calls").fetchall())
    assert counts == {new["call_id"]: 2, old["call_id"]: 1, none["call_id"]: 3, legacy.rows[0]["call_id"]: 2}
    only_legacy = tmp_path / "legacy-store"
    (only_legacy / "calls").mkdir(parents=True)
    pq.write_table(table, only_legacy / "calls" / "legacy-calls-0.parquet")
    assert connect(str(only_legacy)).execute("SELECT n_unknown_logprobs FROM calls").fetchall() == [(2,)]


def test_requests_stored_as_differences_are_rebuilt_exactly_parents_first_and_a_missing_parent_gives_null(tmp_path):
    from sidecar.request_delta import RequestIndex

    index = RequestIndex(min_shared=8)
    episode = SyntheticEpisode("ep")
    sent, rows = [], []
    messages = ["ünïcode 😀 start", "a \\ud800 escape"]
    for turn in range(6):
        messages.append(f"turn {turn} " + "x" * turn)
        text = json.dumps({"messages": messages, "billing": f"cch={turn}", "tools": ["t"] * 5}, ensure_ascii=False)
        row = episode.call([*SYSTEM, turn], [turn])
        delta = index.split("ep", text)
        row.update(request_json=delta.middle, request_parent_call_id=delta.parent_call_id,
                   request_prefix_chars=delta.prefix_chars, request_suffix_chars=delta.suffix_chars)  # fmt: skip
        index.remember("ep", row["call_id"], text)
        sent.append(text)
        rows.append(row)
    assert all(r["request_parent_call_id"] for r in rows[1:]) and len(rows[-1]["request_json"]) < len(sent[-1]) / 2
    store = tmp_path / "store"
    write_calls(str(store), rows[::-1])  # children before their parents
    rebuilt = dict(connect(str(store)).execute("SELECT call_id, request_json FROM calls").fetchall())
    assert [rebuilt[r["call_id"]] for r in rows] == sent
    # The first call's row never reached the store: what extends it cannot be rebuilt, and says so with NULL.
    lost = tmp_path / "lost"
    write_calls(str(lost), rows[1:])
    assert set(dict(connect(str(lost)).execute("SELECT call_id, request_json FROM calls").fetchall()).values()) == {
        None
    }


def test_files_written_before_the_new_columns_read_with_whole_requests_and_null_bounds(tmp_path):
    legacy = SyntheticEpisode("legacy")
    row = legacy.call(SYSTEM, [1, 2])
    row["request_json"] = '{"messages":[]}'
    new_columns = ["request_parent_call_id", "request_prefix_chars", "request_suffix_chars",
                   "max_tokens_requested", "max_tokens_served"]  # fmt: skip
    table = to_table(legacy.rows, "calls").drop_columns(new_columns)
    (tmp_path / "calls").mkdir()
    pq.write_table(table, tmp_path / "calls" / "legacy-calls-0.parquet")
    got = (
        connect(str(tmp_path))
        .execute("SELECT request_json, max_tokens_requested, max_tokens_served, request_parent_call_id FROM calls")
        .fetchall()
    )
    assert got == [('{"messages":[]}', None, None, None)]
