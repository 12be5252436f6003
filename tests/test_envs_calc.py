"""The calc task set: safe evaluation, two-tool episodes, grading from the sandbox."""

from __future__ import annotations

import pytest
from conftest import run
from test_actors import play_episode, services

from rollway.envs.calc import CalcTaskSet, evaluate
from rollway.envs.config import TasksConfig
from rollway.envs.factory import build_taskset


def test_evaluate_allows_integer_arithmetic_only():
    assert evaluate("12 * (3 + 4) - -2") == 86
    for bad in ("__import__('os')", "2 ** 100", "1 / 2", "x + 1", "1.5 + 1", "True + 1"):
        with pytest.raises((ValueError, SyntaxError)):
            evaluate(bad)


def test_tasks_are_seeded_and_split_disjointly():
    a = CalcTaskSet(TasksConfig(type="calc", count=40))
    b = CalcTaskSet(TasksConfig(type="calc", count=40))
    assert [t.prompt for t in a.tasks()] == [t.prompt for t in b.tasks()]
    # the split is applied by the framework to every task set (build_taskset)
    train = {t.task_id for t in build_taskset(TasksConfig(type="calc", count=40, split="train")).tasks()}
    test = {t.task_id for t in build_taskset(TasksConfig(type="calc", count=40, split="test")).tasks()}
    assert train and test and not train & test and len(train | test) == 40


def _script(answer: str) -> str:
    return ("policy.script=[{when: '', turns: ['<tool_call>{\"name\": \"calculator\", \"arguments\": "
            "{\"expression\": \"83 + 75\"}}</tool_call>', '<tool_call>{\"name\": \"answer\", \"arguments\": "
            "{\"value\": \"" + answer + "\"}}</tool_call>']}]")


def test_scripted_episode_is_graded_by_its_answer(tmp_path):
    task = CalcTaskSet(TasksConfig(type="calc", count=1)).tasks()[0]
    assert task.prompt == "What is 83 + 75?"
    good = services(tmp_path, "tasks.type=calc", "tasks.count=1", _script("158"))
    traj = run(play_episode(good, task_id=task.task_id, episode_id="r1-g0-s0"))
    assert traj.reward == 1.0 and traj.num_turns == 2 and traj.stop_reason == "finish"
    assert traj.turns[0].observations[0].content == "158"
    # The few-shot examples are in the prompt; the tool specs are not.
    prompt = good.chat.decode(traj.token_ids[: traj.prompt_length])
    assert "12 * 3" in prompt and '"parameters"' not in prompt
    bad = services(tmp_path, "tasks.type=calc", "tasks.count=1", _script("157"))
    assert run(play_episode(bad, task_id=task.task_id, episode_id="r1-g0-s1")).reward == 0.0
