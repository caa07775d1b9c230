"""pass@k and pass^k against values worked out by hand, and a task set's figures."""

from fractions import Fraction as F

import pytest

from forge.evaluation.metrics import overall_figures, pass_at_k, pass_hat_k, task_figures

# n = 5 samples, c successes, k = 1..5. C(5, k) = 5, 10, 10, 5, 1.
# pass@k = 1 − C(5−c, k)/C(5, k): the chance that k of the 5, drawn without replacement, are not all failures.
# c = 1: C(4,k) = 4, 6, 4, 1, 0 → 1 − 4/5, 1 − 6/10, 1 − 4/10, 1 − 1/5, 1 − 0/1
# c = 2: C(3,k) = 3, 3, 1, 0, 0 → 1 − 3/5, 1 − 3/10, 1 − 1/10, 1, 1
# c = 3: C(2,k) = 2, 1, 0, 0, 0 → 1 − 2/5, 1 − 1/10, 1, 1, 1
# c = 4: C(1,k) = 1, 0, 0, 0, 0 → 1 − 1/5, 1, 1, 1, 1
PASS_AT = {
    0: [F(0), F(0), F(0), F(0), F(0)],
    1: [F(1, 5), F(2, 5), F(3, 5), F(4, 5), F(1)],
    2: [F(2, 5), F(7, 10), F(9, 10), F(1), F(1)],
    3: [F(3, 5), F(9, 10), F(1), F(1), F(1)],
    4: [F(4, 5), F(1), F(1), F(1), F(1)],
    5: [F(1), F(1), F(1), F(1), F(1)],
}
# pass^k = C(c, k)/C(5, k): the chance that all k drawn succeed.
# c = 2: C(2,k) = 2, 1, 0, 0, 0 → 2/5, 1/10, 0, 0, 0
# c = 3: C(3,k) = 3, 3, 1, 0, 0 → 3/5, 3/10, 1/10, 0, 0
# c = 4: C(4,k) = 4, 6, 4, 1, 0 → 4/5, 6/10, 4/10, 1/5, 0
PASS_HAT = {
    0: [F(0), F(0), F(0), F(0), F(0)],
    1: [F(1, 5), F(0), F(0), F(0), F(0)],
    2: [F(2, 5), F(1, 10), F(0), F(0), F(0)],
    3: [F(3, 5), F(3, 10), F(1, 10), F(0), F(0)],
    4: [F(4, 5), F(3, 5), F(2, 5), F(1, 5), F(0)],
    5: [F(1), F(1), F(1), F(1), F(1)],
}


@pytest.mark.parametrize("c", range(6))
@pytest.mark.parametrize("k", range(1, 6))
def test_estimators_match_the_hand_computed_values_for_n_5(c, k):
    assert pass_at_k(5, c, k) == pytest.approx(float(PASS_AT[c][k - 1]), abs=1e-12)
    assert pass_hat_k(5, c, k) == pytest.approx(float(PASS_HAT[c][k - 1]), abs=1e-12)


def test_k_larger_than_n_is_not_computable_and_nonsense_is_refused():
    assert pass_at_k(2, 1, 3) is None and pass_hat_k(2, 1, 3) is None
    for n, c, k in ((5, 6, 1), (5, -1, 1), (5, 2, 0)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_a_task_counts_successes_at_its_threshold_and_a_task_set_averages_its_tasks():
    # Rewards with partial credit; threshold 0.5: 0.5 counts (≥), 0.49 does not.
    first = task_figures([1.0, 0.5, 0.49, 0.0, 0.0], 0.5, [3])
    assert (first.n, first.successes, first.mean_reward) == (5, 2, pytest.approx(0.398))
    assert first.pass_at == {1: pytest.approx(0.4), 3: pytest.approx(0.9)}
    assert first.pass_hat == {1: pytest.approx(0.4), 3: pytest.approx(0.0)}
    second = task_figures([1.0, 1.0], 1.0, [3])  # n = 2 < k = 3: not computable
    assert second.pass_at == {1: 1.0, 3: None} and second.pass_hat == {1: 1.0, 3: None}
    both = overall_figures([first, second], [1.0, 0.5, 0.49, 0.0, 0.0, 1.0, 1.0])
    assert (both.n, both.successes) == (7, 4)
    assert both.mean_reward == pytest.approx(3.99 / 7)
    assert both.pass_at[1] == pytest.approx((0.4 + 1.0) / 2)  # the tasks' mean, not 4/7
    assert both.pass_at[3] is None and both.pass_hat[3] is None  # one task's is not computable
    assert task_figures([], 1.0, [1]).mean_reward is None
