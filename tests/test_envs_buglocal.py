"""Bug localisation tasks (issue 28): built from real toolz mutation instances, graded from the model's
`locate` call, played end to end through `rollway up` with a scripted policy (the model is the only
faked part)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollway.envs.base import Episode, Task
from rollway.envs.buglocal import answer_of, judge, normalise_file, normalise_function
from rollway.envs.config import TasksConfig
from rollway.envs.factory import build_taskset
from rollway.envs.swe import load_instances
from rollway.schemas.messages import Observation, TurnRecord

ROOT = Path(__file__).resolve().parent.parent


def _turn(*observations: Observation) -> TurnRecord:
    return TurnRecord(turn=0, completion_ids=[], logprobs=[], policy_version=0, finish_reason="stop",
                      assistant_text="", observations=list(observations))


def _episode(*turns: TurnRecord) -> Episode:
    return Episode("e", 0, Task("t", "p"), [], list(turns))


def test_answer_is_read_from_the_accepted_locate_call_only():
    rejected = Observation(tool="locate", arguments={"file": "a.py"}, content="missing function", is_error=True)
    other = Observation(tool="bash", arguments={"command": "echo locate a.py f"}, content="")
    assert answer_of(_episode(_turn(other, rejected))) is None
    accepted = Observation(tool="locate", arguments={"file": "./pkg//a.py", "function": "Foo.bar()"},
                           content="Answer recorded.", ends_episode=True)
    answer = answer_of(_episode(_turn(other), _turn(accepted)))
    assert judge("pkg/a.py", "Foo.bar", answer).reward == 1.0
    assert (normalise_file("/pkg/a.py"), normalise_function("def Foo.bar")) == ("pkg/a.py", "Foo.bar")


def test_right_file_wrong_function_scores_zero_with_file_credit():
    grade = judge("pkg/a.py", "Foo.bar", {"file": "pkg/a.py", "function": "Foo.baz"})
    assert (grade.reward, grade.details["file_correct"], grade.details["function_correct"]) == (0.0, True, False)
    grade = judge("pkg/a.py", "Foo.bar", {"file": "pkg/b.py", "function": "Foo.bar"})
    assert (grade.reward, grade.details["file_correct"]) == (0.0, False)
    assert judge("pkg/a.py", "Foo.bar", None).details["outcome"] == "no_answer"


@pytest.fixture(scope="module")
def toolz_instances(toolz_two_tasks) -> Path:
    """Two toolz mutation instances, built once per session (conftest.py)."""
    return toolz_two_tasks


@pytest.mark.slow
def test_taskset_splits_by_library_and_asks_where_not_how(toolz_instances):
    taskset = build_taskset(TasksConfig(type="buglocal", path=str(toolz_instances)))
    task = taskset.tasks()[0]
    assert "locate(file, function)" in task.prompt and "fix it" not in task.prompt
    assert taskset.default_tools == ("bash", "search", "locate")
    with pytest.raises(ValueError, match="no instance of the selected libraries"):
        build_taskset(TasksConfig(type="buglocal", path=str(toolz_instances), exclude_repos=["toolz"]))
    assert len(build_taskset(TasksConfig(type="buglocal", path=str(toolz_instances), repos=["toolz"])).tasks()) == 2


def _call(tool: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


@pytest.mark.slow
def test_located_bug_is_rewarded_and_a_wrong_function_is_not_through_the_pipeline(toolz_instances, broker, tmp_path):
    """`rollway up`: the scripted model searches, then names the right function on one task and another
    function of the right file on the other."""
    right, wrong = load_instances(toolz_instances)
    name = right["mutation"]["function"]
    cfg = {"run": {"name": "buglocal-e2e", "timeout_s": 300},
           "tasks": {"type": "buglocal", "path": str(toolz_instances)},
           "scheduler": {"group_size": 1, "episode_deadline_s": 200},
           "agent": {"max_turns": 4, "max_tokens_per_turn": 1024, "max_total_tokens": 60000},
           "policy": {"type": "scripted", "script": [
               {"when": re.escape(right["FAIL_TO_PASS"][0]), "turns": [
                   _call("search", action="definition", name=name.split(".")[-1]),
                   _call("locate", file=right["mutation"]["path"], function=name)]},
               {"when": "", "turns": [
                   _call("bash", command="ls"),
                   _call("locate", file=wrong["mutation"]["path"], function="not_the_function")]}]}}
    config = tmp_path / "buglocal.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rollway.runners", "up", str(config), "--run-dir", str(run_dir),
                          "--bootstrap", broker.bootstrap, f"topics.prefix=bl{tmp_path.name[-6:]}-"],
                         cwd=ROOT, capture_output=True, text=True, timeout=320)
    assert out.returncode == 0, out.stderr[-3000:]
    trajs = {json.loads(x)["episode"]["task_id"]: json.loads(x)
             for x in (run_dir / "trajectories.jsonl").read_text().splitlines()}
    good, bad = trajs[right["instance_id"]], trajs[wrong["instance_id"]]
    assert (good["reward"], good["resolved"]) == (1.0, True)
    search = good["turns"][0]["observations"][0]
    assert search["tool"] == "search" and not search["is_error"] and right["mutation"]["path"] in search["content"]
    assert bad["reward"] == 0.0 and not bad["resolved"]
    assert bad["grade"]["file_correct"] is True
