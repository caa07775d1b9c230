"""`forge eval compare` on two hand-made eval.json files, against p-values worked out without scipy."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from forge.evaluation.compare import compare, fisher_greater, welch_greater
from forge.evaluation.report import SCHEMA, read

FORGE = str(Path(sys.executable).parent / "forge")

# Task t (threshold 1.0): A solves 1 of 4, B 4 of 4. Task u (threshold 0.5, partial credit): A 0 of 3, B 4 of 4.
# Task v is only in B.
A_REWARDS = {"t": [1.0, 0.0, 0.0, 0.0], "u": [0.0, 0.2, 0.4]}
B_REWARDS = {"t": [1.0, 1.0, 1.0, 1.0], "u": [0.5, 1.0, 0.6, 0.9], "v": [1.0, 1.0]}
THRESHOLDS = {"t": 1.0, "u": 0.5, "v": 1.0}


def eval_json(path: Path, run: str, rewards: dict[str, list[float]]) -> Path:
    """An eval.json as `forge eval` writes it, by hand: only what compare reads (it recomputes every figure)."""
    tasks = [
        {"task_id": task, "success_threshold": THRESHOLDS[task],
         "samples": [{"index": i, "episode_id": f"{run}.{task}.{i}", "reward": r} for i, r in enumerate(values)]}
        for task, values in rewards.items()
    ]  # fmt: skip
    path.write_text(json.dumps({"schema": SCHEMA, "run_id": run, "k": [1, 2], "tasks": tasks}))
    return path


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with df degrees of freedom: 1/2 − ∫₀ᵗ density, by Simpson's rule (no scipy)."""
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def density(x: float) -> float:
        return scale * (1 + x * x / df) ** (-(df + 1) / 2)

    steps = 20_000
    h = t / steps
    inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
    return 0.5 - h / 3 * (density(0.0) + inner + density(t))


def welch_by_hand(a: list[float], b: list[float]) -> float:
    """Welch's t and Welch–Satterthwaite df from their formulas, then the one-sided tail above."""

    def mean(x: list[float]) -> float:
        return sum(x) / len(x)

    def var(x: list[float]) -> float:
        return sum((v - mean(x)) ** 2 for v in x) / (len(x) - 1)

    sa, sb = var(a) / len(a), var(b) / len(b)
    t = (mean(b) - mean(a)) / math.sqrt(sa + sb)
    df = (sa + sb) ** 2 / (sa**2 / (len(a) - 1) + sb**2 / (len(b) - 1))
    return t_sf(t, df)


def test_the_tests_give_the_hand_computed_p_values():
    # Fisher, task t: B 4/4 vs A 1/4. Under H0, B's successes are hypergeometric (8 samples, 5 successes, B draws
    # 4): p = P(X ≥ 4) = C(5,4)·C(3,0)/C(8,4) = 5/70 = 1/14.
    assert fisher_greater(1, 4, 4, 4).p == pytest.approx(1 / 14, rel=1e-12)
    # Welch, task t: B has no variance, so df = n_A − 1 = 3 and t = (1 − 1/4)/√(0.25/4) = 3; Student's t with 3 df
    # has P(T > 3) = 1/2 − (1/π)(√3/4 + arctan √3) = 1/6 − √3/(4π).
    assert welch_greater(A_REWARDS["t"], B_REWARDS["t"]).p == pytest.approx(1 / 6 - math.sqrt(3) / (4 * math.pi))
    assert t_sf(3.0, 3.0) == pytest.approx(1 / 6 - math.sqrt(3) / (4 * math.pi), rel=1e-9)  # the integrator itself
    # Welch, task u: unequal variances, a fractional df.
    assert welch_greater(A_REWARDS["u"], B_REWARDS["u"]).p == pytest.approx(
        welch_by_hand(A_REWARDS["u"], B_REWARDS["u"]), rel=1e-6
    )
    assert welch_greater([0.0], [1.0, 1.0]).p is None  # n < 2 on a side
    assert welch_greater([0.0, 0.0], [1.0, 1.0]).p is None  # no variance on either side


def test_compare_two_files_per_task_and_overall(tmp_path):
    a = read(eval_json(tmp_path / "a.json", "eval-a", A_REWARDS))
    b = read(eval_json(tmp_path / "b.json", "eval-b", B_REWARDS))
    result = compare(a, b)
    assert [r.name for r in result.rows] == ["t", "u"] and result.only_b == ["v"] and result.only_a == []
    t, u = result.rows
    assert (t.a.successes, t.a.n, t.b.successes, t.b.n) == (1, 4, 4, 4)
    assert (u.a.successes, u.a.n, u.b.successes, u.b.n) == (0, 3, 4, 4)
    assert t.fisher.p == pytest.approx(1 / 14)
    # Overall (t and u, v left out): A 1 of 7, B 8 of 8; Fisher p = C(9,8)·C(6,0)/C(15,8) = 9/6435 = 1/715.
    whole = result.overall
    assert (whole.a.successes, whole.a.n, whole.b.successes, whole.b.n) == (1, 7, 8, 8)
    assert whole.fisher.p == pytest.approx(1 / 715, rel=1e-9)
    pooled_a, pooled_b = A_REWARDS["t"] + A_REWARDS["u"], B_REWARDS["t"] + B_REWARDS["u"]
    assert whole.welch.p == pytest.approx(welch_by_hand(pooled_a, pooled_b), rel=1e-6)
    assert whole.a.mean_reward == pytest.approx(1.6 / 7) and whole.b.mean_reward == pytest.approx(7.0 / 8)
    # pass@2 per task from the samples (k = 2 is in both files): A's t is 1 − C(3,2)/C(4,2) = 1/2.
    assert t.a.pass_at[2] == pytest.approx(0.5) and t.b.pass_hat[2] == 1.0


def test_the_cli_names_the_tests_and_prints_the_p_values(tmp_path):
    a = eval_json(tmp_path / "a.json", "eval-a", A_REWARDS)
    b = eval_json(tmp_path / "b.json", "eval-b", B_REWARDS)
    done = subprocess.run([FORGE, "eval", "compare", str(a), str(b)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Welch's t-test, one-sided" in out and "Fisher's exact test, one-sided" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["t"], ["u"], ["all"])}
    assert rows["t"][10] == f"{1 / 14:.3g}" and rows["all"][10] == f"{1 / 715:.3g}"  # p Fisher
    assert rows["t"][6] == f"{1 / 6 - math.sqrt(3) / (4 * math.pi):.3g}"  # p Welch
    assert rows["t"][9] == "+0.750"  # Δ pass@1 = 4/4 − 1/4
    assert "left out (in one file only): A -; B v" in out
    assert out.strip().splitlines()[-1].startswith("overall mean reward 0.229 → 0.875, n = 7 | 8, Welch one-sided p")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no eval.json at"),
        ("{not json", "is not JSON"),
        ('{"tasks": []}', "is not a `forge eval` result"),
        (json.dumps({"schema": SCHEMA, "tasks": [{"task_id": "t"}]}), "a malformed `forge eval` result"),
    ],
)
def test_a_bad_file_is_a_one_line_error(tmp_path, content, message):
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    good = eval_json(tmp_path / "a.json", "eval-a", A_REWARDS)
    done = subprocess.run([FORGE, "eval", "compare", str(good), str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert done.stdout == ""
