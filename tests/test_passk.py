"""pass@k against values computed by hand."""

import pytest

from rollway.learning.passk import evaluate_attempts, pass_at_k


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    # n - c < k: some correct sample is always drawn
    assert pass_at_k(5, 4, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_evaluate_attempts_overall_is_the_mean_over_tasks():
    attempts = [("a", True), ("a", False), ("a", False), ("a", False), ("b", True), ("b", True), ("b", False),
                ("b", False)]
    out = evaluate_attempts(attempts, [1, 2])
    assert out["per_task"]["a"]["pass@1"] == pytest.approx(0.25)
    assert out["per_task"]["b"]["pass@2"] == pytest.approx(5 / 6)
    assert out["pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert out["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)


def test_failed_and_unfinished_attempts_count_as_incorrect():
    from rollway.learning.passk import evaluate_scheduled

    # Task a: 4 scheduled, 2 finished (1 right), 2 failed. Task b: 4 scheduled, none finished.
    out = evaluate_scheduled({"a": 4, "b": 4}, [("a", True), ("a", False)], [1, 2])
    assert out["per_task"]["a"] == {"n": 4, "correct": 1, "failed": 2, "pass@1": 0.25, "pass@2": 0.5}
    assert out["per_task"]["b"]["n"] == 4 and out["per_task"]["b"]["pass@2"] == 0.0
    assert out["attempts"] == 8 and out["completed"] == 2 and out["failed"] == 6
    assert out["pass@1"] == pytest.approx(0.125)  # over trajectories only it was 0.5
    with pytest.raises(ValueError, match="not scheduled"):
        evaluate_scheduled({"a": 1}, [("z", True)], [1])
