"""Episode assembly over synthetic records of known structure, recorded as the sidecar records them.

Prompts are split against earlier calls with the sidecar's own PrefixIndex (parent call + prefix + suffix);
each case checks segments, masks, logprobs and statuses exactly.
"""

import math

import pyarrow as pa
import pytest

from bench.collector_generate import SyntheticEpisode, lp_for
from collector.assemble import _Episode, assemble, finalize
from collector.episode import EPISODE_SCHEMA, SCHEMA_VERSION, SEGMENT_SCHEMA, Episode, Segment, SegmentHeader
from sidecar.record import to_table

SYSTEM = list(range(1000, 1032))  # 32 ids: longer than the sidecar's minimum shared prefix (16)


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def run(*episodes: SyntheticEpisode, rewards: list[dict] | None = None, idle: float = 0.0):
    rows = [row for episode in episodes for row in episode.rows]
    reward_rows = rewards if rewards is not None else [{"episode_id": e.episode_id, "reward": 1.0} for e in episodes]
    segments, episode_table = finalize(*assemble(to_table(rows, "calls"), to_table(reward_rows, "rewards")), idle)
    return segments.to_pylist(), {e["episode_id"]: e for e in episode_table.to_pylist()}


def expected(pieces: list[tuple[list[int], int]]) -> tuple[list[int], list[int], list[float]]:
    """(ids, mask, logprobs) from (ids, trainable?) pieces; trainable pieces carry lp_for(their ids)."""
    tokens, mask, lps = [], [], []
    for piece, trainable in pieces:
        tokens += piece
        mask += [trainable] * len(piece)
        lps += lp_for(piece) if trainable else [0.0] * len(piece)
    return tokens, mask, lps


def check(segment: dict, pieces: list[tuple[list[int], int]]) -> None:
    tokens, mask, lps = expected(pieces)
    assert segment["input_ids"] == tokens
    assert segment["loss_mask"] == mask
    assert segment["behaviour_logprobs"] == pytest.approx(lps, abs=1e-6)
    assert segment["n_trainable"] == sum(mask)


def linear(episode: SyntheticEpisode, turns: int, base: int = 0) -> list[tuple[list[int], int]]:
    """A linear chat: each prompt is the previous prompt + completion + a new user/tool message."""
    pieces: list[tuple[list[int], int]] = [(SYSTEM + ids(base + 100, 10), 0)]
    for turn in range(turns):
        if turn:
            pieces.append((ids(base + 200 + 10 * turn, 5), 0))
        prompt = [t for p, _ in pieces for t in p]
        completion = ids(base + 5000 + 100 * turn, 7)
        episode.call(prompt, completion)
        pieces.append((completion, 1))
    return pieces


@pytest.mark.parametrize("parents", [True, False], ids=["parent-references", "ids-compared"])
def test_a_linear_conversation_is_one_segment_with_masks_on_the_completions(parents):
    episode = SyntheticEpisode("ep", parents=parents)
    pieces = linear(episode, 4)
    segments, episodes = run(episode)
    assert len(segments) == 1
    check(segments[0], pieces)
    last = episode.rows[-1]
    prompt = [t for p, _ in pieces[:-1] for t in p]
    assert segments[0]["input_ids"] == prompt + last["completion_token_ids"]
    assert segments[0]["call_ids"] == [r["call_id"] for r in episode.rows]
    assert segments[0]["fork_reason"] == "start"
    assert episodes["ep"]["status"] == "complete" and episodes["ep"]["reward"] == 1.0
    assert (episodes["ep"]["n_merged"], episodes["ep"]["n_forked"], episodes["ep"]["n_segments"]) == (3, 0, 1)
    if parents:  # the sidecar stored suffixes only
        assert all(r["parent_call_id"] for r in episode.rows[1:])


def test_compaction_starts_a_segment_and_later_turns_extend_it():
    episode = SyntheticEpisode("ep")
    first = linear(episode, 2)
    summary_prompt = SYSTEM + ids(7000, 12)  # history replaced by a summary: shares only the system prompt
    episode.call(summary_prompt, ids(8000, 6))
    episode.call(summary_prompt + ids(8000, 6) + ids(7100, 4), ids(8100, 5))
    segments, episodes = run(episode)
    assert [s["fork_reason"] for s in segments] == ["start", "diverged"]
    check(segments[0], first)
    check(segments[1], [(summary_prompt, 0), (ids(8000, 6), 1), (ids(7100, 4), 0), (ids(8100, 5), 1)])
    assert segments[1]["shared_prefix_len"] == len(SYSTEM)
    assert segments[1]["fork_call_id"] == episode.rows[1]["call_id"]
    assert segments[1]["call_ids"] == [episode.rows[2]["call_id"], episode.rows[3]["call_id"]]
    assert (episodes["ep"]["n_merged"], episodes["ep"]["n_forked"]) == (2, 1)


def test_interleaved_sub_agents_join_the_segment_they_extend():
    """Six sub-agents, each with its own context, called round-robin: more than the sidecar's index keeps per
    episode (4 calls), so most prompts arrive without a usable parent and ids are compared."""
    episode = SyntheticEpisode("ep")
    agents = [[(ids(20_000 + 1000 * a, 24), 0)] for a in range(6)]
    for turn in range(3):
        for a, pieces in enumerate(agents):
            if turn:
                pieces.append((ids(30_000 + 1000 * a + 10 * turn, 3), 0))
            completion = ids(40_000 + 1000 * a + 10 * turn, 4)
            episode.call([t for p, _ in pieces for t in p], completion)
            pieces.append((completion, 1))
    segments, episodes = run(episode)
    assert len(segments) == 6
    assert [s["fork_reason"] for s in segments] == ["start"] + ["unrelated"] * 5
    for segment, pieces in zip(segments, agents, strict=True):
        check(segment, pieces)
        assert segment["n_calls"] == 3
    assert episodes["ep"]["n_merged"] == 12


def test_parallel_calls_on_one_history_fork_with_the_history_as_context():
    episode = SyntheticEpisode("ep")
    history = linear(episode, 2)
    prompt = [t for p, _ in history for t in p]
    episode.call(prompt + ids(600, 3), ids(9000, 4))  # two tool results answered in parallel
    episode.call(prompt + ids(700, 3), ids(9100, 4))
    segments, _ = run(episode)
    assert [s["fork_reason"] for s in segments] == ["start", "diverged"]
    check(segments[0], [*history, (ids(600, 3), 0), (ids(9000, 4), 1)])
    check(segments[1], [(prompt, 0), (ids(700, 3), 0), (ids(9100, 4), 1)])
    assert segments[1]["shared_prefix_len"] == len(prompt)


def test_a_retry_is_kept_apart_and_the_conversation_continues_from_it():
    episode = SyntheticEpisode("ep")
    history = linear(episode, 2)
    prompt = [t for p, _ in history for t in p] + ids(600, 3)
    episode.call(prompt, ids(9000, 4))
    episode.call(prompt, ids(9100, 4))  # the harness retried the same prompt
    episode.call(prompt + ids(9100, 4) + ids(650, 2), ids(9200, 4))  # and went on from the retry's answer
    segments, episodes = run(episode)
    assert [s["fork_reason"] for s in segments] == ["start", "retry"]
    check(segments[0], [*history, (ids(600, 3), 0), (ids(9000, 4), 1)])
    check(segments[1], [(prompt, 0), (ids(9100, 4), 1), (ids(650, 2), 0), (ids(9200, 4), 1)])
    assert segments[1]["fork_call_id"] == episode.rows[2]["call_id"]
    assert episodes["ep"]["n_retries"] == 1 and episodes["ep"]["status"] == "complete"


def test_a_retry_after_an_upstream_error_continues_and_the_episode_says_which_call_failed():
    episode = SyntheticEpisode("ep")
    history = linear(episode, 2)
    prompt = [t for p, _ in history for t in p] + ids(600, 3)
    failed = episode.call(None, None, status="upstream_error", error="HTTP 503")  # no ids: nothing to merge
    episode.call(prompt, ids(9000, 4))
    segments, episodes = run(episode)
    assert len(segments) == 1
    check(segments[0], [*history, (ids(600, 3), 0), (ids(9000, 4), 1)])
    assert episodes["ep"]["status"] == "error"
    assert failed["call_id"] in episodes["ep"]["status_detail"] and "upstream_error" in episodes["ep"]["status_detail"]
    assert episodes["ep"]["n_calls_without_ids"] == 1 and episodes["ep"]["n_call_errors"] == 1


def test_a_rewritten_tool_call_id_forks_at_the_rewritten_token():
    episode = SyntheticEpisode("ep")
    history = linear(episode, 2)
    prompt = [t for p, _ in history for t in p]
    rewritten = list(prompt)
    at = len(prompt) - 3  # inside the last completion: the harness rewrote a tool-call id
    rewritten[at] = 99_999
    episode.call(rewritten + ids(600, 3), ids(9000, 4))
    segments, _ = run(episode)
    assert [s["fork_reason"] for s in segments] == ["start", "diverged"]
    assert segments[1]["shared_prefix_len"] == at
    check(segments[1], [(rewritten + ids(600, 3), 0), (ids(9000, 4), 1)])


def test_a_truncated_stream_keeps_its_sampled_ids_and_marks_the_episode_error():
    episode = SyntheticEpisode("ep")
    history = linear(episode, 1)
    prompt = [t for p, _ in history for t in p] + ids(600, 3)
    cut = episode.call(prompt, ids(9000, 2), status="truncated", error="client hung up")
    segments, episodes = run(episode)
    check(segments[0], [*history, (ids(600, 3), 0), (ids(9000, 2), 1)])
    assert segments[0]["call_statuses"] == ["ok", "truncated"]
    assert episodes["ep"]["status"] == "error" and episodes["ep"]["n_truncated"] == 1
    assert f"call {cut['call_id']} (seq 1) truncated: client hung up" in episodes["ep"]["status_detail"]


def test_a_missing_reward_is_unfinished_within_the_idle_window_then_no_reward():
    rewarded, pending = SyntheticEpisode("rewarded"), SyntheticEpisode("pending")
    linear(rewarded, 2)
    linear(pending, 2)
    rewards = [{"episode_id": "rewarded", "reward": 0.5}]
    assert run(rewarded, pending, rewards=rewards, idle=3600)[1]["pending"]["status"] == "unfinished"
    _, episodes = run(rewarded, pending, rewards=rewards, idle=0)
    assert episodes["pending"]["status"] == "no_reward" and episodes["pending"]["reward"] is None
    assert episodes["rewarded"]["status"] == "complete" and episodes["rewarded"]["reward"] == 0.5


def test_latest_rewards_per_episode_and_per_call_are_joined():
    episode = SyntheticEpisode("ep")
    linear(episode, 3)
    second = episode.rows[1]["call_id"]
    rewards = [
        {"episode_id": "ep", "reward": 0.0, "at": pa.scalar(1, pa.timestamp("us", tz="UTC")).as_py()},
        {"episode_id": "ep", "reward": 2.0, "at": pa.scalar(2, pa.timestamp("us", tz="UTC")).as_py()},
        {"episode_id": "ep", "call_id": second, "reward": 0.25},
    ]
    segments, episodes = run(episode, rewards=rewards)
    assert episodes["ep"]["reward"] == 2.0
    assert segments[0]["call_rewards"] == [None, 0.25, None]


def test_policy_versions_mixed_in_an_episode_are_flagged_and_the_group_is_its_first_round():
    episode = SyntheticEpisode("ep", task_id="t-7", run_id="r")
    episode.call(SYSTEM, ids(5000, 3), policy_version="9")
    episode.call(SYSTEM + ids(5000, 3) + ids(300, 2), ids(5100, 3), policy_version="10")
    other = SyntheticEpisode("solo", task_id=None)
    linear(other, 1)
    segments, episodes = run(episode, other)
    ep = episodes["ep"]
    assert (ep["policy_version_min"], ep["policy_version_max"], ep["mixed_versions"]) == ("9", "10", True)
    assert ep["group_id"] == "r/t-7/v9" and segments[0]["mixed_versions"]
    assert episodes["solo"]["group_id"] == "solo" and not episodes["solo"]["mixed_versions"]


def test_a_call_whose_parent_is_not_in_the_store_is_an_error_not_a_guess():
    episode = SyntheticEpisode("ep")
    linear(episode, 3)
    del episode.rows[1]  # a file lost: the third call refers to the second
    segments, episodes = run(episode)
    assert len(segments) == 1 and segments[0]["n_calls"] == 1
    assert episodes["ep"]["status"] == "error"
    assert f"its parent call {episode.rows[0]['call_id'][:-1]}1 is not in the store" in episodes["ep"]["status_detail"]


def test_a_call_without_logprobs_keeps_its_ids_trainable_with_unknown_logprobs():
    episode = SyntheticEpisode("ep")
    history = linear(episode, 1)
    prompt = [t for p, _ in history for t in p] + ids(600, 3)
    episode.call(prompt, ids(9000, 4), logprobs=[])  # an upstream that gives ids but no logprobs
    episode.call(prompt + ids(9000, 4) + ids(700, 2), ids(9100, 3), logprobs=[-0.5, -0.25])  # one missing: wrong
    segments, episodes = run(episode)
    (segment,) = segments
    start = len(prompt)
    assert segment["loss_mask"][start : start + 4] == [1, 1, 1, 1]
    assert all(math.isnan(lp) for lp in segment["behaviour_logprobs"][start : start + 4])
    assert segment["behaviour_logprobs"][: len(history[0][0])] == [0.0] * len(history[0][0])
    assert episodes["ep"]["status"] == "error"
    assert f"{episode.rows[2]['call_id']} (seq 2): completion_logprobs do not match" in episodes["ep"]["status_detail"]
    assert episode.rows[1]["call_id"] not in episodes["ep"]["status_detail"]
    # Unknown logprobs are counted where they are trained: the 4 of the second call, the 3 of the misaligned third.
    assert segment["n_unknown_logprobs"] == 7 and episodes["ep"]["n_unknown_logprobs"] == 7


def test_unknown_logprobs_are_counted_per_segment_and_episode_and_do_not_make_an_error():
    episode = SyntheticEpisode("ep")
    history = linear(episode, 1)
    prompt = [t for p, _ in history for t in p] + ids(600, 3)
    nan = float("nan")
    episode.call(prompt, ids(9000, 4), logprobs=[-0.5, nan, nan, -0.25])  # e.g. a Responses function-call turn
    episode.call(SYSTEM + ids(29_000, 5), ids(9200, 3), logprobs=[nan, -1.0, -2.0])  # compaction: segment 1
    segments, episodes = run(episode)
    assert [s["n_unknown_logprobs"] for s in segments] == [2, 1]
    assert sum(math.isnan(lp) for s in segments for lp in s["behaviour_logprobs"]) == 3
    assert episodes["ep"]["n_unknown_logprobs"] == 3
    assert episodes["ep"]["status"] == "complete" and episodes["ep"]["status_detail"] is None


def test_an_infinite_logprob_on_a_sampled_token_makes_the_episode_an_error():
    episode = SyntheticEpisode("ep")
    history = linear(episode, 1)
    prompt = [t for p, _ in history for t in p] + ids(600, 3)
    bad = episode.call(prompt, ids(9000, 3), logprobs=[-0.5, float("-inf"), -0.25])  # a null from vLLM
    clean = SyntheticEpisode("clean")
    linear(clean, 2)
    segments, episodes = run(episode, clean)
    assert episodes["ep"]["status"] == "error"
    assert [s["status"] for s in segments if s["episode_id"] == "ep"] == ["error"]  # not trainable by default
    assert f"call {bad['call_id']} (seq 1): 1 completion logprobs are infinite" in episodes["ep"]["status_detail"]
    assert episodes["ep"]["n_unknown_logprobs"] == 0  # -inf is not unknown: it is wrong
    assert episodes["clean"]["status"] == "complete"


def test_an_episode_keeps_a_few_problems_worded_and_counts_the_rest():
    episode = SyntheticEpisode("ep")
    prompt = SYSTEM + ids(100, 5)
    for turn in range(40):
        completion = ids(5000 + 10 * turn, 2)
        episode.call(prompt, completion, status="truncated", error="client hung up")
        prompt = prompt + completion + ids(300 + 10 * turn, 2)
    _, episodes = run(episode)
    detail = episodes["ep"]["status_detail"]
    assert detail.count("truncated: client hung up") == 3 and detail.endswith("; and 37 more")
    assert episodes["ep"]["n_truncated"] == 40
    # The worded problems an episode holds are bounded however many its calls have.
    held = _Episode(*(None,) * 3)  # type: ignore[arg-type]
    for n in range(1000):
        held.problem(f"problem {n}")
    assert held.details == ["problem 0", "problem 1", "problem 2"] and held.n_problems == 1000


def test_a_call_that_straddles_a_publish_makes_its_episode_mixed():
    episode = SyntheticEpisode("ep", task_id="t", run_id="r", policy_version="3")
    linear(episode, 2)
    episode.rows[-1]["policy_version_end"] = "4"  # the server's version changed while the last call was served
    steady = SyntheticEpisode("steady", task_id="t", run_id="r", policy_version="3")
    linear(steady, 2)
    for row in steady.rows:
        row["policy_version_end"] = "3"
    _, episodes = run(episode, steady)
    ep = episodes["ep"]
    assert (ep["policy_version_min"], ep["policy_version_max"], ep["mixed_versions"]) == ("3", "4", True)
    assert not episodes["steady"]["mixed_versions"] and episodes["steady"]["policy_version_max"] == "3"


@pytest.mark.parametrize(
    ("samplings", "temperature"),
    [
        ([None, None], 1.0),  # no column: records from before it, sampled at vLLM's default
        (["{}", '{"temperature": 1}'], 1.0),  # none sent is vLLM's 1
        (['{"temperature": 0.7}', '{"temperature": 0.7, "top_p": 1.0, "top_k": -1}'], 0.7),  # neutral values
        (['{"temperature": 0.7}', '{"temperature": 0.8}'], None),  # changed mid-segment
        (['{"temperature": 0.7, "top_p": 0.9}'] * 2, None),  # truncated: not log_softmax(logits / T)
        (['{"temperature": 0}'] * 2, None),  # greedy
        (['{"allowed_token_ids": [198]}'] * 2, None),  # a logits processor
        (['{"temperature": "hot"}'] * 2, None),  # unreadable
        (['{"temperature": 0.7, "mirostat": 2}'] * 2, None),  # a parameter collector.sampling does not know
        (['{"temperature": 0.005}'] * 2, None),  # vLLM raises it to 0.01: not what was recorded
        (['{"temperature": 1' + "0" * 400 + "}"] * 2, None),  # an integer no float holds
        (['{"temperature": true}'] * 2, None),
        # what Codex and Claude Code send (a verbosity, an effort, tool_choice auto): no grammar
        (['{"text": {"verbosity": "low"}, "tool_choice": "auto"}', '{"output_config": {"effort": "medium"}}'], 1.0),
        (['{"tool_choice": "required"}'] * 2, None),  # a grammar forces a tool call
        (['{"text": {"format": {"type": "json_schema", "schema": {}}}}'] * 2, None),
        (['{"response_format": {"type": "json_object"}}'] * 2, None),
        (['{"structured_outputs": {"regex": "a+"}}'] * 2, None),
        (['{"output_config": "x"}'] * 2, None),
    ],
)
def test_a_segment_carries_the_temperature_its_calls_were_sampled_at_or_none(samplings, temperature):
    episode = SyntheticEpisode("ep")
    linear(episode, 2)
    for row, sampling in zip(episode.rows, samplings, strict=True):
        row["sampling"] = sampling
    segments, _ = run(episode)
    assert len(segments) == 1 and segments[0]["temperature"] == temperature


def test_the_typed_segment_and_episode_have_exactly_the_schema_columns_and_assembly_fills_them():
    assert set(Segment.__annotations__) == set(SEGMENT_SCHEMA.names) - {"schema_version"}
    assert set(Episode.__annotations__) == set(EPISODE_SCHEMA.names) - {"schema_version"}
    assert set(SegmentHeader.__annotations__) == set(Segment.__annotations__) - {
        "input_ids", "loss_mask", "behaviour_logprobs"
    }  # fmt: skip
    episode = SyntheticEpisode("ep")
    linear(episode, 2)
    segments, episodes = assemble(to_table(episode.rows, "calls"), None)
    assert segments.schema.equals(SEGMENT_SCHEMA) and episodes.schema.equals(EPISODE_SCHEMA)
    assert segments["schema_version"].to_pylist() == [SCHEMA_VERSION]
    assert episodes["schema_version"].to_pylist() == [SCHEMA_VERSION]
