"""pass@k and pass^k from n samples of a task with c successes, unbiased, and the figures of a task and a task set.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): the chance that at least one of k
samples drawn without replacement from the n succeeds, 1 − C(n−c, k) / C(n, k). pass^k (Yao et al. 2024,
τ-bench): the chance that all k of them succeed, C(c, k) / C(n, k). Both are exact expectations over the n
samples, so they are unbiased estimates of the policy's; with k > n there is no such draw: not computable (None).
A task set's figure is the mean of its tasks' (each task weighs the same, whatever its n).
"""

from dataclasses import dataclass, field
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float | None:
    """1 − C(n−c, k) / C(n, k); None when k > n."""
    _check(n, c, k)
    if k > n:
        return None
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float | None:
    """pass^k = C(c, k) / C(n, k); None when k > n."""
    _check(n, c, k)
    if k > n:
        return None
    return comb(c, k) / comb(n, k)


def _check(n: int, c: int, k: int) -> None:
    if not (0 <= c <= n and k >= 1):
        raise ValueError(f"need 0 ≤ c ≤ n and k ≥ 1 (n={n}, c={c}, k={k})")


@dataclass
class Figures:
    """One task's (or a task set's) figures: n samples, c successes, mean reward, pass@k and pass^k for each k."""

    n: int
    successes: int
    mean_reward: float | None  # None: no samples
    pass_at: dict[int, float | None] = field(default_factory=dict)  # k → pass@k (None: not computable)
    pass_hat: dict[int, float | None] = field(default_factory=dict)  # k → pass^k

    def as_json(self) -> dict[str, object]:
        return {
            "n": self.n, "successes": self.successes, "mean_reward": self.mean_reward,
            "pass@1": self.pass_at.get(1), "pass@k": {str(k): v for k, v in self.pass_at.items()},
            "pass^k": {str(k): v for k, v in self.pass_hat.items()},
        }  # fmt: skip


def task_figures(rewards: list[float], threshold: float, ks: list[int]) -> Figures:
    """A task's figures from its samples' rewards; a sample succeeds when its reward ≥ ``threshold``."""
    n, c = len(rewards), sum(r >= threshold for r in rewards)
    ks = sorted({1, *ks})
    return Figures(
        n=n, successes=c, mean_reward=sum(rewards) / n if n else None,
        pass_at={k: pass_at_k(n, c, k) if n else None for k in ks},
        pass_hat={k: pass_hat_k(n, c, k) if n else None for k in ks},
    )  # fmt: skip


def overall_figures(tasks: list[Figures], rewards: list[float]) -> Figures:
    """A task set's figures: n and c summed, the mean reward over every sample, pass@k and pass^k the mean of the
    tasks' (None when a task's is not computable)."""
    ks = sorted({k for t in tasks for k in t.pass_at})

    def mean_of(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known and len(known) == len(values) else None

    return Figures(
        n=sum(t.n for t in tasks), successes=sum(t.successes for t in tasks),
        mean_reward=sum(rewards) / len(rewards) if rewards else None,
        pass_at={k: mean_of([t.pass_at.get(k) for t in tasks]) for k in ks},
        pass_hat={k: mean_of([t.pass_hat.get(k) for t in tasks]) for k in ks},
    )  # fmt: skip
