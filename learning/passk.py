"""pass@k with the unbiased estimator of Chen et al. (2021): 1 - C(n-c, k) / C(n, k)."""

from __future__ import annotations

import re
from collections import defaultdict
from math import comb


def task_source(task_id: str) -> str:
    """The source a task id names, what per-source figures group by: the id without its trailing instance
    number (`django__django-11099` -> `django__django`, `HumanEval/12` -> `HumanEval`, `calc-0003` -> `calc`;
    an id without one is its own source), other characters than letters, digits, `_.-` made `_`."""
    return re.sub(r"[^\w.\-]", "_", re.sub(r"[-_/.:#]*\d+$", "", task_id) or task_id)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n attempts, c of
    them correct, is correct."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate_attempts(attempts: list[tuple[str, bool]], ks: list[int]) -> dict:
    """{task_id: [correct?...]} -> pass@k for each k, overall (mean over tasks) and per task.
    A k larger than a task's attempt count is left out for that task."""
    by_task: dict[str, list[bool]] = defaultdict(list)
    for task_id, ok in attempts:
        by_task[task_id].append(ok)
    per_task = {}
    for task_id, results in sorted(by_task.items()):
        n, c = len(results), sum(results)
        per_task[task_id] = {"n": n, "correct": c,
                             **{f"pass@{k}": round(pass_at_k(n, c, k), 6) for k in ks if k <= n}}
    sources: dict[str, list[dict]] = defaultdict(list)
    for task_id, row in per_task.items():
        sources[task_source(task_id)].append(row)
    return {"tasks": len(per_task), "attempts": len(attempts), **_means(per_task.values(), ks),
            "per_source": {s: {"tasks": len(rows), **_means(rows, ks)} for s, rows in sorted(sources.items())},
            "per_task": per_task}


def _means(rows, ks: list[int]) -> dict[str, float]:
    """pass@k averaged over the tasks that have it."""
    out = {}
    for k in ks:
        values = [t[f"pass@{k}"] for t in rows if f"pass@{k}" in t]
        if values:
            out[f"pass@{k}"] = round(sum(values) / len(values), 6)
    return out


def evaluate_scheduled(scheduled: dict[str, int], completed: list[tuple[str, bool]], ks: list[int]) -> dict:
    """pass@k over every scheduled attempt: `scheduled` is {task_id: attempts issued}, `completed`
    the (task_id, correct?) of attempts that produced a trajectory. An attempt that failed or never
    finished counts as incorrect, so a task whose hard samples crash is not scored on its easy ones."""
    done: dict[str, list[bool]] = defaultdict(list)
    for task_id, ok in completed:
        done[task_id].append(ok)
    unknown = sorted(set(done) - set(scheduled))
    if unknown:
        raise ValueError(f"trajectories of tasks that were not scheduled: {unknown[:5]}")
    attempts: list[tuple[str, bool]] = []
    failed: dict[str, int] = {}
    for task_id, n in scheduled.items():
        results = done.get(task_id, [])[:n]
        failed[task_id] = n - len(results)
        attempts += [(task_id, ok) for ok in results] + [(task_id, False)] * failed[task_id]
    out = evaluate_attempts(attempts, ks)
    for task_id, row in out["per_task"].items():
        row["failed"] = failed[task_id]
    return {**out, "completed": len(attempts) - sum(failed.values()), "failed": sum(failed.values())}
