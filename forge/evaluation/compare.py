"""`forge eval compare A.json B.json`: is B better than A? Per task and overall, with one-sided tests named.

Two tests, each one-sided (the question is whether B — e.g. the trained policy — is better than A, the base):
- mean reward: Welch's t-test on the per-sample rewards (``scipy.stats.ttest_ind(b, a, equal_var=False,
  alternative="greater")``). Rewards may carry partial credit, so the mean is the primary figure; Welch does not
  assume the two policies' reward variances or sample counts are equal.
- success rate: Fisher's exact test on the success counts (``scipy.stats.fisher_exact([[c_B, n_B − c_B],
  [c_A, n_A − c_A]], alternative="greater")``): exact at any n, where a normal approximation is poor at the small
  counts of a CPU evaluation.
"Overall" pools the samples of the tasks both files hold (a task in only one is listed and left out).
"""

import warnings
from dataclasses import dataclass

from forge.evaluation.metrics import Figures
from forge.evaluation.report import EvalReport, TaskResult, number, overall, render_table

WELCH = "Welch's t-test, one-sided (H1: B's mean reward > A's)"
FISHER = "Fisher's exact test, one-sided (H1: B's success odds > A's)"


@dataclass(frozen=True)
class TestResult:
    p: float | None  # None: not computable (``note`` says why)
    statistic: float | None = None
    note: str = ""


def welch_greater(a: list[float], b: list[float]) -> TestResult:
    """Welch's t-test of mean(b) > mean(a)."""
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        return TestResult(None, note="needs 2 or more rewards on each side")
    if len(set(a)) == 1 and len(set(b)) == 1:
        return TestResult(None, note="every reward equal within each side: no variance to test against")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_ind(b, a, equal_var=False, alternative="greater")
    return TestResult(float(result.pvalue), float(result.statistic))


def fisher_greater(c_a: int, n_a: int, c_b: int, n_b: int) -> TestResult:
    """Fisher's exact test of B's success odds > A's."""
    from scipy import stats

    if n_a == 0 or n_b == 0:
        return TestResult(None, note="no samples on one side")
    result = stats.fisher_exact([[c_b, n_b - c_b], [c_a, n_a - c_a]], alternative="greater")
    return TestResult(float(result.pvalue), float(result.statistic))


@dataclass
class Row:
    """One task (or "all"): both sides' figures and the two tests."""

    name: str
    a: Figures
    b: Figures
    welch: TestResult
    fisher: TestResult


@dataclass
class Comparison:
    a: EvalReport
    b: EvalReport
    ks: list[int]  # the k both files report
    rows: list[Row]
    overall: Row
    only_a: list[str]
    only_b: list[str]


def _row(name: str, a: list[TaskResult], b: list[TaskResult], ks: list[int]) -> Row:
    fa, fb = overall(a, ks), overall(b, ks)
    rewards_a, rewards_b = [r for t in a for r in t.rewards], [r for t in b for r in t.rewards]
    return Row(
        name, fa, fb, welch_greater(rewards_a, rewards_b), fisher_greater(fa.successes, fa.n, fb.successes, fb.n)
    )


def compare(a: EvalReport, b: EvalReport) -> Comparison:
    ks = sorted(set(a.ks) & set(b.ks) | {1})
    tasks_a, tasks_b = {t.task_id: t for t in a.tasks}, {t.task_id: t for t in b.tasks}
    common = [t for t in tasks_a if t in tasks_b]
    rows = [_row(t, [tasks_a[t]], [tasks_b[t]], ks) for t in common]
    whole = _row("all", [tasks_a[t] for t in common], [tasks_b[t] for t in common], ks)
    return Comparison(a, b, ks, rows, whole, [t for t in tasks_a if t not in tasks_b],
                      [t for t in tasks_b if t not in tasks_a])  # fmt: skip


def _diff(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{b - a:+.3f}"


def _p(test: TestResult) -> str:
    return "n/a" if test.p is None else f"{test.p:.3g}"


def render(comparison: Comparison) -> str:
    c = comparison
    extra = [k for k in c.ks if k > 1]
    header = ["task", "n A", "n B", "mean A", "mean B", "Δ mean", "p Welch", "succ A", "succ B", "Δ pass@1",
              "p Fisher", *[name for k in extra for name in (f"Δ pass@{k}", f"Δ pass^{k}")]]  # fmt: skip

    def cells(row: Row) -> list[str]:
        a, b = row.a, row.b
        return [
            row.name, str(a.n), str(b.n), number(a.mean_reward), number(b.mean_reward),
            _diff(a.mean_reward, b.mean_reward), _p(row.welch), f"{a.successes}/{a.n}", f"{b.successes}/{b.n}",
            _diff(a.pass_at[1], b.pass_at[1]), _p(row.fisher),
            *[_diff(fa[k], fb[k]) for k in extra for fa, fb in ((a.pass_at, b.pass_at), (a.pass_hat, b.pass_hat))],
        ]  # fmt: skip

    lines = [
        f"A: {c.a.path} (run {c.a.run_id})",
        f"B: {c.b.path} (run {c.b.run_id})",
        "",
        render_table(header, [cells(r) for r in c.rows], cells(c.overall)),
        "",
        f"p Welch: {WELCH}, on per-sample rewards.",
        f"p Fisher: {FISHER}, on success counts.",
        "Δ = B − A; all: the samples of the tasks both files hold, pooled (its pass@k: the tasks' mean).",
    ]
    notes = {f"{r.name}: {t.note}" for r in [*c.rows, c.overall] for t in (r.welch, r.fisher) if t.note}
    lines += [f"n/a {note}" for note in sorted(notes)]
    if any(v is None for r in [*c.rows, c.overall] for f in (r.a, r.b) for v in f.pass_at.values()):
        lines.append("n/a in Δ pass@k: k > n on a side")
    if c.only_a or c.only_b:
        lines.append(f"left out (in one file only): A {', '.join(c.only_a) or '-'}; B {', '.join(c.only_b) or '-'}")
    lines += ["", verdict(c)]
    return "\n".join(lines)


def verdict(comparison: Comparison, what: str = "overall") -> str:
    """One line: "overall mean reward 0.310 → 0.470, n = 64 | 64, Welch one-sided p = 0.004; successes …"."""
    row = comparison.overall
    a, b = row.a, row.b
    n = f"n = {a.n} each" if a.n == b.n else f"n = {a.n} | {b.n}"
    welch = "n/a" if row.welch.p is None else f"{row.welch.p:.3g}"
    fisher = "n/a" if row.fisher.p is None else f"{row.fisher.p:.3g}"
    return (f"{what} mean reward {number(a.mean_reward)} → {number(b.mean_reward)}, {n}, Welch one-sided p = {welch}; "
            f"successes {a.successes}/{a.n} → {b.successes}/{b.n}, Fisher one-sided p = {fisher}")  # fmt: skip
