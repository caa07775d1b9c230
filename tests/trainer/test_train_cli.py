"""`forge train` without a model: its help, its argument checks and `forge train plot`."""

import json

from click.testing import CliRunner

from forge.cli import cli


def test_train_is_listed_and_its_missing_arguments_fail_in_one_line():
    runner = CliRunner()
    assert "train" in runner.invoke(cli, ["--help"]).output
    result = runner.invoke(cli, ["train"])
    assert result.exit_code == 2 and "needs --store and --policy-url" in result.output
    result = runner.invoke(cli, ["train", "--store", "x", "--policy-url", "http://h", "--workers", "0"])
    assert result.exit_code == 2 and "--workers must be ≥ 1" in result.output
    result = runner.invoke(cli, ["train", "--store", "x", "--policy-url", "http://h", "--workers", "3",
                                 "--workers-per-node", "2"])  # fmt: skip
    assert result.exit_code == 2 and "--workers-per-node must divide --workers" in result.output
    result = runner.invoke(cli, ["train", "--store", "x", "--policy-url", "http://h", "--kl-coef", "nan"])
    assert result.exit_code == 2 and "--kl-coef must be a number ≥ 0" in result.output
    result = runner.invoke(cli, ["train", "--store", "x", "--policy-url", "http://h", "--kl-type", "bogus"])
    assert result.exit_code == 2 and "--kl-type one of" in result.output


def test_plot_draws_the_metrics_of_a_run(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "reward_mean": 0.1 * i, "kl_behaviour": 0.0, "entropy": 2.0, "clip_frac": 0.0,
             "tokens_per_s": 50.0, "publish_s": 3.0} for i in (1, 2, 3)]  # fmt: skip
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(cli, ["train", "plot", str(metrics)])
    assert result.exit_code == 0, result.output
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.jsonl").write_text("not json\n")
    result = CliRunner().invoke(cli, ["train", "plot", str(tmp_path / "bad.jsonl")])
    assert result.exit_code == 2 and "not a metrics JSON-lines file" in result.output
