"""The collector's commands on a synthetic store: sql (views, formats, shell), episodes, collect, report, view."""

import json
import struct

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from bench.collector_generate import SyntheticEpisode, write_calls, write_rewards
from collector.episode import SEGMENT_SCHEMA
from forge.cli import cli
from tests.collector.conftest import SYSTEM


def forge(*args: str, input: str | None = None):
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def as_json(*args: str) -> list[dict]:
    result = forge(*args, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_episodes_lists_statuses_and_filters(synthetic_store):
    store = ["--store", synthetic_store.uri, "--idle-seconds", "0"]
    rows = {r["episode_id"]: r for r in as_json("episodes", *store)}
    assert {k: r["status"] for k, r in rows.items()} == {
        "broken": "error", "compacted": "complete", "linear": "complete", "pending": "no_reward",
    }  # fmt: skip
    assert (rows["compacted"]["n_segments"], rows["compacted"]["n_merged"], rows["compacted"]["n_forked"]) == (2, 2, 1)
    assert "truncated: client hung up" in rows["broken"]["status_detail"]
    assert [r["episode_id"] for r in as_json("episodes", *store, "--status", "error")] == ["broken"]
    assert [r["episode_id"] for r in as_json("episodes", *store, "--task", "t1")] == ["compacted", "linear"]
    assert [r["episode_id"] for r in as_json("episodes", *store, "--run", "run-b")] == ["broken", "pending"]
    assert as_json("episodes", *store, "--since", "2026-01-06") == []
    assert len(as_json("episodes", *store, "--since", "2026-01-05T00:00")) == 4
    bad = forge("episodes", *store, "--since", "last tuesday")
    assert bad.exit_code == 2 and bad.output.startswith("forge: --since") and "Traceback" not in bad.output


def test_sql_has_the_episode_views_and_an_interactive_shell(synthetic_store):
    store = ["--store", synthetic_store.uri]
    counts = as_json("sql", *store, "SELECT episode_id, count(*) AS n FROM segments GROUP BY 1 ORDER BY 1")
    assert counts == [{"episode_id": "broken", "n": 1}, {"episode_id": "compacted", "n": 2},
                      {"episode_id": "linear", "n": 1}, {"episode_id": "pending", "n": 1}]  # fmt: skip
    csv_out = forge("sql", *store, "--format", "csv", "SELECT episode_id FROM episodes ORDER BY 1")
    assert csv_out.output.splitlines() == ["episode_id", "broken", "compacted", "linear", "pending"]
    session = "SELECT count(*) AS n\nFROM episodes;\nSELECT nonsense FROM nowhere;\nSELECT 41 + 1 AS answer;\n.quit\n"
    result = forge("sql", *store, input=session)
    assert result.exit_code == 0
    assert "n\n-\n4" in result.output.replace(" ", "")  # the multi-line statement ran
    assert "forge: SQL error" in result.output and "answer" in result.output  # an error does not end the shell
    write_rewards(synthetic_store.uri, [{"episode_id": "pending", "reward": 0.5, "components": {"tests": 1.0}}],
                  name="more-rewards")  # fmt: skip
    rewards = as_json("sql", *store, "SELECT components, reward FROM rewards WHERE episode_id = 'pending'")
    assert rewards == [{"components": {"tests": 1.0}, "reward": 0.5}]  # a map is a JSON object
    error = forge("sql", *store, "SELECT * FROM nowhere")
    assert error.exit_code == 2 and error.output.startswith("forge: SQL error")


def test_collect_writes_the_trainable_segments_in_the_episode_schema(synthetic_store, tmp_path):
    out = tmp_path / "batches" / "round-0.parquet"
    result = forge("collect", "--store", synthetic_store.uri, "--out", str(out))
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.schema.equals(SEGMENT_SCHEMA, check_metadata=False)
    assert sorted(set(table["episode_id"].to_pylist())) == ["compacted", "linear"]  # complete ones only
    for row in table.to_pylist():
        assert len(row["input_ids"]) == len(row["loss_mask"]) == len(row["behaviour_logprobs"])
        assert all(lp == 0 for lp, m in zip(row["behaviour_logprobs"], row["loss_mask"], strict=True) if not m)
        assert row["group_id"] == "run-a/t1/v0"
    folder = tmp_path / "all"
    everything = forge("collect", "--store", synthetic_store.uri, "--out", str(folder), "--status", "complete",
                       "--status", "error", "--status", "no_reward", "--status", "unfinished")  # fmt: skip
    assert everything.exit_code == 0
    assert pq.read_table(folder / "segments.parquet").num_rows == 5
    (tmp_path / "a-file").write_text("")
    bad = forge("collect", "--store", synthetic_store.uri, "--out", str(tmp_path / "a-file" / "x.parquet"))
    assert bad.exit_code == 2 and bad.output.startswith("forge: ") and "Traceback" not in bad.output


def test_report_gives_fidelity_per_harness_and_run_and_a_png(synthetic_store, tmp_path):
    png = tmp_path / "fidelity.png"
    rows = as_json("report", "--store", synthetic_store.uri, "--png", str(png))
    by = {(r["grouping"], r["name"]): r for r in rows}
    run_a, codex = by[("run", "run-a")], by[("harness", "codex")]
    # run-a: linear (2 merges) + compacted (2 merges, 1 fork); run-b / codex: broken (1 merge, truncated), pending
    assert (run_a["merge_rate"], run_a["fork_rate"]) == pytest.approx((4 / 5, 1 / 5))
    assert (codex["truncated_calls"], codex["truncated_share"]) == (1, pytest.approx(1 / 4))
    assert (codex["merge_rate"], codex["calls"]) == (1.0, 4)
    assert codex["calls_without_ids"] == 0 and run_a["complete"] == 2
    assert run_a["replica_moves"] == 0  # records without the column (written before replicas) moved nowhere
    assert 0 < run_a["trainable_share"] < 1
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 300 and len(data) > 10_000


def test_view_writes_a_page_with_every_segment_and_masked_tokens(synthetic_store, tmp_path):
    page_path = tmp_path / "compacted.html"
    result = forge("view", "compacted", "--store", synthetic_store.uri, "--html", str(page_path), "--ids")
    assert result.exit_code == 0, result.output
    page = page_path.read_text()
    assert page.count("<section class='segment'") == 2
    segments = as_json("sql", "--store", synthetic_store.uri, "SELECT * FROM segments WHERE episode_id = 'compacted'")
    trainable = sum(s["n_trainable"] for s in segments)
    assert page.count("class='tok gen' title=") == trainable
    assert page.count("class='tok ctx' title=") == sum(len(s["input_ids"]) for s in segments) - trainable
    assert page.count("class='call-boundary' data-call-id=") == 4
    missing = forge("view", "nope", "--store", synthetic_store.uri, "--html", str(page_path))
    assert missing.exit_code == 2 and "no episode 'nope'" in missing.output


def test_view_decodes_with_the_tokenizer_folder_given_and_refuses_a_folder_without_one(
    synthetic_store, prepared_model, tmp_path
):
    page_path = tmp_path / "page.html"
    args = ("view", "compacted", "--store", synthetic_store.uri, "--html", str(page_path))
    result = forge(*args, "--tokenizer", str(prepared_model.serve_dir))
    assert result.exit_code == 0 and "ids shown" not in result.output, result.output
    with_text = page_path.read_text()
    assert forge(*args, "--ids").exit_code == 0
    assert page_path.read_text() != with_text  # token text, not ids, in the first page
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = forge(*args, "--tokenizer", str(empty))
    assert refused.exit_code == 2 and f"--tokenizer {empty}: no tokenizer there" in refused.output


def test_unknown_logprobs_show_in_episodes_report_and_viewer_and_an_infinite_one_is_not_collected(tmp_path):
    nan = float("nan")
    unknown, infinite = SyntheticEpisode("unknown", run_id="r"), SyntheticEpisode("infinite", run_id="r")
    unknown.call(SYSTEM, [1, 2, 3, 4], logprobs=[-0.5, nan, nan, -0.25])
    unknown.call([*SYSTEM, 1, 2, 3, 4, 9], [5, 6], logprobs=[nan, -1.0])
    infinite.call(SYSTEM, [7, 8], logprobs=[-0.5, float("-inf")])
    store = str(tmp_path / "store")
    write_calls(store, unknown.rows + infinite.rows, run="r")
    write_rewards(store, [{"episode_id": "unknown", "reward": 1.0}, {"episode_id": "infinite", "reward": 1.0}],
                  run="r")  # fmt: skip
    rows = {r["episode_id"]: r for r in as_json("episodes", "--store", store)}
    assert (rows["unknown"]["status"], rows["unknown"]["n_unknown_logprobs"]) == ("complete", 3)
    assert rows["infinite"]["status"] == "error" and "infinite" in rows["infinite"]["status_detail"]
    (report,) = [r for r in as_json("report", "--store", store) if r["grouping"] == "run"]
    assert (report["unknown_logprobs"], report["unknown_logprob_share"]) == (3, pytest.approx(3 / 8))
    out = tmp_path / "batch.parquet"
    assert forge("collect", "--store", store, "--run", "r", "--out", str(out)).exit_code == 0
    assert pq.read_table(out)["episode_id"].to_pylist() == ["unknown"]  # never the -inf one
    page = tmp_path / "unknown.html"
    assert forge("view", "unknown", "--store", store, "--html", str(page), "--ids").exit_code == 0
    html = page.read_text()
    assert html.count("class='tok gen unk' title=") == 3 and html.count("class='tok gen' title=") == 3
    assert ", 3 without logprob</h3>" in html  # one segment: the second call extends the first


def test_a_run_option_reads_only_that_runs_partition(synthetic_store):
    store = ["--store", synthetic_store.uri]
    assert as_json("sql", *store, "--run", "run-b", "SELECT DISTINCT run FROM calls_raw") == [{"run": "run-b"}]
    assert [r["episode_id"] for r in as_json("episodes", *store, "--run", "run-a")] == ["compacted", "linear"]
    assert as_json("sql", *store, "--run", "run-b", "SELECT DISTINCT run_id FROM segments") == [{"run_id": "run-b"}]
    assert as_json("sql", *store, "--run", "run-b", "SELECT count(*) AS n FROM episodes") == [{"n": 2}]


def test_forks_are_filed_by_measured_cause_and_none_under_a_fallback(tmp_path):
    """Where a fork's prompt leaves the earlier call's tokens decides its cause: inside that call's generation
    prompt (its answer is missing: mini-swe-agent drops an answer it rejects), in the history before it, or in the
    answer's own turn (rewrites). None is a fallback: a fork with no earlier call to measure is `unknown`."""
    from bench.collector_generate import SyntheticEpisode, write_calls
    from collector.report import fork_causes
    from collector.sql import connect

    system, user, header = list(range(10, 40)), [50, 51, 52], [1, 520, 198]  # header: "<|im_start|>assistant\n"
    first_prompt = system + user + header
    cases = {
        "dropped": system + user + [1, 4093, 198, 60, 61],  # "<|im_start|>user\n Format error": no answer turn
        "history": [*system[:20], 70, 71, *header],  # an earlier message edited (compaction)
        "answer": [*first_prompt, 80, 81, 2, 198, 1, 4093, 198, 62],  # the answer's turn re-rendered
    }
    rows = []
    for name, second_prompt in cases.items():
        episode = SyntheticEpisode(f"ep-{name}", run_id="r")
        episode.call(first_prompt, [90, 91, 92, 2])
        episode.call(second_prompt, [93, 2])
        rows += episode.rows
    write_calls(str(tmp_path), rows, name="calls-0", run="r")
    con = connect(str(tmp_path), episodes=True, idle_seconds=0.0)
    causes = {f["episode_id"]: f["cause"] for f in fork_causes(con)}
    assert causes == {"ep-dropped": "answer_dropped", "ep-history": "rewrite", "ep-answer": "rewrite"}
