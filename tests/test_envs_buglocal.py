"""Bug localisation tasks (issue 28): built from real toolz mutation instances, graded from the model's
`locate` call, played end to end through `rollway up` with a scripted policy (the model is the only
faked part)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from pathlib import Path

import pytest
import yaml
from jobs import run_with_progress

from rollway.envs.base import Episode, Task
from rollway.envs.buglocal import answer_of, judge, named_in_tests, normalise_file, normalise_function
from rollway.envs.config import TasksConfig
from rollway.envs.factory import build_taskset
from rollway.envs.swe import load_instances
from rollway.schemas.messages import Observation, TurnRecord
from rollway.tools.config import ToolsConfig

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


def test_a_family_with_no_named_bug_says_so_under_the_named_difficulty(toolz_instances, tmp_path):
    """Held-out libraries whose bugs no failing test is named after (jmespath's) gave "no instance of the
    selected libraries (repos=None, ...)", which names the wrong cause."""
    rows = [{**json.loads(x), "FAIL_TO_PASS": ["tests/test_x.py::test_unrelated"]}
            for x in Path(toolz_instances).read_text().splitlines() if x.strip()]
    unnamed = tmp_path / "unnamed.jsonl"
    unnamed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(build_taskset(TasksConfig(type="buglocal", path=str(unnamed), difficulty="all")).tasks()) == len(rows)
    with pytest.raises(ValueError, match=f"none of its {len(rows)} instances .* is `named`"):
        build_taskset(TasksConfig(type="buglocal", path=str(unnamed), difficulty="named"))


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
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "up", "--no-report", str(config), "--run-dir", str(run_dir),
                          "--bootstrap", broker.bootstrap, "runtime.processes=one", f"topics.prefix=bl{tmp_path.name[-6:]}-"],
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    trajs = {json.loads(x)["episode"]["task_id"]: json.loads(x)
             for x in (run_dir / "trajectories.jsonl").read_text().splitlines()}
    good, bad = trajs[right["instance_id"]], trajs[wrong["instance_id"]]
    assert (good["reward"], good["resolved"]) == (1.0, True)
    search = good["turns"][0]["observations"][0]
    assert search["tool"] == "search" and not search["is_error"] and right["mutation"]["path"] in search["content"]
    assert bad["reward"] == 0.0 and not bad["resolved"]
    assert bad["grade"]["file_correct"] is True


def test_worked_examples_of_the_two_arms_differ_only_in_the_navigation_step():
    from rollway.envs.buglocal import worked_example

    search, bash = worked_example("search"), worked_example("bash")
    assert [m["role"] for m in search] == [m["role"] for m in bash]
    differing = [i for i, (a, b) in enumerate(zip(search, bash, strict=True)) if a != b]
    assert differing == [1, 2, 6, 7]  # each example's navigation call and what the tool printed
    assert '"search"' in search[1]["content"] and "grep" in bash[1]["content"]
    assert judge("shapes/geometry.py", "circle_area", {"file": "./shapes/geometry.py",
                                                       "function": "circle_area"}).reward == 1.0


def test_paired_figures_of_the_search_bench():
    from rollway.bench.search import band_warning, gain_difference, paired

    def ev(*rates):
        return {"per_task": {f"t{i}": {"pass@1": r} for i, r in enumerate(rates)}}

    assert band_warning("search", {"pass@8": 0.3}, 8) is None
    assert "0.042, below 0.1-0.7" in band_warning("search", {"pass@8": 0.0417}, 8)
    assert "above" in band_warning("bash", {"pass@8": 0.9}, 8)
    got = paired(ev(0.0, 0.5, 0.25), ev(0.5, 0.5, 0.75), "pass@1")
    assert (got["tasks"], got["diff"], got["se"]) == (3, 0.3333, 0.1667) and got["z"] == 2.0
    before = {"search": ev(0.0, 0.0), "bash": ev(0.0, 0.0)}
    after = {"search": ev(1.0, 0.5), "bash": ev(0.0, 0.5)}
    assert gain_difference(before, after, "pass@1")["diff"] == 0.5


@pytest.mark.slow
def test_family_builds_by_library_resumes_from_cache_and_plays_both_arms(broker, tmp_path):
    """`rollway tasks build buglocal` on a small real library (inflection, jailed tests), again from its
    cache without running a test, then `rollway up` per arm with the scripted policy (the only faked part)
    on the built task: the search arm's episode finds the function and is rewarded, the bash arm's names
    a wrong function of the right file."""
    from rollway.envs.buglocal_build import FamilyOptions, build_family
    from rollway.envs.swe_build import BuildError

    lines: list[str] = []
    opts = FamilyOptions(out=tmp_path / "family", train=[], heldout=["inflection==0.5.1"], per_library=1,
                         max_failing=10, log=lines.append)
    with pytest.raises(BuildError, match="both --train and --heldout"):
        build_family(FamilyOptions(out=tmp_path / "x", train=["Inflection==0.5.1"], heldout=["inflection==0.5.1"]))
    built = build_family(opts)
    [row] = load_instances(tmp_path / "family" / "heldout.jsonl")
    assert built["heldout"] == 1 and built["heldout_named"] == built["libraries"]["inflection==0.5.1"]["named"] \
        == int(named_in_tests(row))
    lines.clear()
    # A library the index cannot serve is left out with its reason, the rest is built (from the cache here),
    # and it is tried again next time (not recorded as finished).
    opts.train = ["rollway-no-such-project==1.0"]
    summary = build_family(opts)
    assert summary["heldout"] == 1 and summary["train"] == 0 and not any("baseline" in line for line in lines), lines
    assert "could not download" in summary["left_out"]["rollway-no-such-project==1.0"]
    assert not (tmp_path / "family" / "libs" / "rollway-no-such-project-1.0-s0.progress.json").exists()
    assert json.loads((tmp_path / "family" / "manifest.json").read_text())["left_out"] == summary["left_out"]
    [right] = load_instances(tmp_path / "family" / "heldout.jsonl")
    wrong = right
    name = right["mutation"]["function"]
    runs = {}
    for arm, instance, script in (
            ("search", right, [_call("search", action="definition", name=name.split(".")[-1]),
                               _call("locate", file=right["mutation"]["path"], function=name)]),
            ("bash", wrong, [_call("bash", command=f"grep -rn 'def ' {wrong['mutation']['path']}"),
                             _call("locate", file=wrong["mutation"]["path"], function="not_the_function")])):
        one = tmp_path / f"{arm}.jsonl"
        one.write_text(json.dumps(instance) + "\n")
        cfg = {"run": {"name": f"bl-{arm}", "timeout_s": 200},
               "tasks": {"type": "buglocal", "path": str(one), "worked_example": arm},
               "tools": {"enabled": ["bash", "search", "locate"] if arm == "search" else ["bash", "locate"]},
               "scheduler": {"group_size": 1, "episode_deadline_s": 150},
               "agent": {"max_turns": 3, "max_tokens_per_turn": 256, "max_total_tokens": 20000},
               "policy": {"type": "scripted", "script": [{"when": "", "turns": script}]}}
        config = tmp_path / f"{arm}.yaml"
        config.write_text(yaml.safe_dump(cfg))
        out = run_with_progress([sys.executable, "-m", "rollway.runners", "up", "--no-report", str(config), "--run-dir",
                              str(tmp_path / arm), "--bootstrap", broker.bootstrap, "runtime.processes=one",
                              f"topics.prefix=bl{arm}{tmp_path.name[-6:]}-"],
                             cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[arm] = {json.loads(x)["episode"]["task_id"]: json.loads(x)
                     for x in (tmp_path / arm / "trajectories.jsonl").read_text().splitlines()}
    good, bad = runs["search"][right["instance_id"]], runs["bash"][wrong["instance_id"]]
    assert (good["reward"], good["resolved"]) == (1.0, True)
    assert right["mutation"]["path"] in good["turns"][0]["observations"][0]["content"]
    assert bad["reward"] == 0.0 and bad["grade"]["file_correct"] is True
    assert bad["turns"][0]["observations"][0]["tool"] == "bash"


def test_library_cache_files_are_per_version_and_seed(tmp_path):
    from rollway.envs.buglocal_build import LibraryCache

    files = {LibraryCache(tmp_path, sdist, seed).rows_file.name
             for sdist, seed in (("inflection==0.5.1", 0), ("inflection==0.5.2", 0), ("inflection==0.5.1", 1))}
    assert files == {"inflection-0.5.1-s0.jsonl", "inflection-0.5.2-s0.jsonl", "inflection-0.5.1-s1.jsonl"}
    cache = LibraryCache(tmp_path, "inflection==0.5.1", 0)
    cache.record(7, None)
    assert cache.progress() == {"tried": 7} and cache.rows() == []


def test_named_difficulty_keeps_bugs_whose_function_names_a_failing_test():
    from rollway.envs.buglocal import named_in_tests

    def row(function, *tests):
        return {"mutation": {"function": function}, "FAIL_TO_PASS": list(tests)}

    assert named_in_tests(row("camelize", "t.py::test_camelize[A-a]"))
    assert named_in_tests(row("Foo.bar", "t.py::TestFoo::test_bar_empty"))
    assert not named_in_tests(row("_irregular", "t.py::test_singularize_plural[child-children]"))
    assert not named_in_tests(row("map", "t.py::test_bitmap"))


CAMELIZE_HINT = ('The definition of camelize is in inflection/__init__.py at line 135. If camelize is the changed '
                 'function, answer with:\n<tool_call>{"name": "locate", "arguments": {"file": "inflection/__init__.py", '
                 '"function": "camelize"}}</tool_call>')


def test_a_printed_library_definition_gets_the_same_locate_hint_in_both_arms():
    """search's definition list, search's source view and a grep line `FILE:N:def NAME` give one hint naming
    the first library definition; a test's definition gets a hint that the bug is in the library."""
    from rollway.envs.buglocal import definition_hints

    search = Observation(tool="search", arguments={"action": "definition", "name": "camelize"}, content=(
        "2 definitions of `camelize` (best match first):\n"
        "inflection/__init__.py:135  function camelize: def camelize(string, uppercase_first_letter=True):\n"
        "test_inflection.py:300  function test_camelize: def test_camelize(camel, underscore):"))
    grep = Observation(tool="bash", arguments={"command": 'grep -rn "def camelize" .'}, content=(
        "Exit code: 0\n./test_inflection.py:300:def test_camelize(camel, underscore):\n"
        "./inflection/__init__.py:135:def camelize(string, uppercase_first_letter=True):"))
    assert definition_hints([search]) == [CAMELIZE_HINT] == definition_hints([grep])
    method = Observation(tool="search", arguments={}, content=(
        "method Foo.bar at pkg/a.py:7 (lines 7-9):\n     7\tdef bar(self):\n     8\t    return 1"))
    assert definition_hints([method]) == ['The definition of Foo.bar is in pkg/a.py at line 7. If Foo.bar is the '
                                          'changed function, answer with:\n<tool_call>{"name": "locate", "arguments": '
                                          '{"file": "pkg/a.py", "function": "Foo.bar"}}</tool_call>']
    test_only = Observation(tool="bash", arguments={}, content="Exit code: 0\n./tests/test_a.py:3:def test_bar():")
    assert definition_hints([test_only]) == [
        "tests/test_a.py is a test file: the changed function is in the library. Look up the function the "
        "failing test calls."]
    nothing = Observation(tool="search", arguments={}, content="No definition of `camel_to_snake` found.")
    answer = Observation(tool="locate", arguments={}, content="Answer recorded.", ends_episode=True)
    assert definition_hints([nothing]) == [] and definition_hints([answer]) == []


def test_worked_examples_show_the_user_hint_identically_in_both_arms():
    """hints="user": the hint is a user message after the tool's output (the 135M model answered after it far
    more often than after the same hint inside the tool message)."""
    from rollway.envs.buglocal import definition_hints, worked_example

    search, bash = worked_example("search", hints="user"), worked_example("bash", hints="user")
    assert [m["role"] for m in search][:6] == ["user", "assistant", "tool", "user", "assistant", "tool"]
    differing = [i for i, (a, b) in enumerate(zip(search, bash, strict=True)) if a != b]
    assert differing == [1, 2, 7, 8]
    [hint] = definition_hints([Observation(tool="x", arguments={}, content=search[2]["content"])])
    assert search[3]["content"] == bash[3]["content"] == hint


def test_worked_examples_show_the_hint_identically_in_both_arms():
    from rollway.envs.buglocal import definition_hints, worked_example

    search, bash = worked_example("search", hints="observation"), worked_example("bash", hints="observation")
    differing = [i for i, (a, b) in enumerate(zip(search, bash, strict=True)) if a != b]
    assert differing == [1, 2, 6, 7]
    for messages in (search, bash):
        output = messages[2]["content"]
        [hint] = definition_hints([Observation(tool="x", arguments={}, content=output.split("\n\n")[0])])
        assert output.endswith("\n\n" + hint) and '{"file": "shapes/text.py", "function": "shout"}' in hint
    assert worked_example("search") == [m if i not in (2, 7) else {**m, "content": m["content"].split("\n\n")[0]}
                                        for i, m in enumerate(search)]


def _said(text: str, *observations: Observation) -> TurnRecord:
    return TurnRecord(turn=0, completion_ids=[], logprobs=[], policy_version=0, finish_reason="stop",
                      assistant_text=text, observations=list(observations))


def test_a_plain_text_answer_in_the_last_message_counts_when_text_answers_are_on():
    """`FILE::FUNCTION` as the last message's text is the answer (tasks.text_answer), graded as strictly as
    a locate call; a locate call wins over text; a pytest id of the test file is a wrong answer."""
    last = _said("The bug is in ./inflection/__init__.py::camelize.")
    assert answer_of(_episode(last)) is None  # off: only locate answers
    answer = answer_of(_episode(_turn(), last), text_answer=True)
    assert answer == {"file": "./inflection/__init__.py", "function": "camelize"}
    assert judge("inflection/__init__.py", "camelize", answer).reward == 1.0
    test_id = answer_of(_episode(_said("test_inflection.py::test_camelize[a-b]")), text_answer=True)
    assert judge("inflection/__init__.py", "camelize", test_id).reward == 0.0
    earlier = _episode(_said("inflection/__init__.py::camelize"), _said("I do not know."))
    assert answer_of(earlier, text_answer=True) is None  # only the last message
    locate = Observation(tool="locate", arguments={"file": "a.py", "function": "f"}, content="Answer recorded.")
    assert answer_of(_episode(_said("b.py::g", locate)), text_answer=True) == {"file": "a.py", "function": "f"}


def test_loose_locate_arguments_are_graded_on_their_normalised_values():
    """A module-qualified name (`inflection.camelize`, `pkg.a.Foo.bar`) or `FILE::NAME` in `function` names
    the same function; a bare method name or another module's prefix does not."""
    assert judge("inflection/__init__.py", "camelize", {"file": "inflection/__init__.py",
                                                        "function": "inflection.camelize"}).reward == 1.0
    assert judge("pkg/a.py", "Foo.bar", {"file": "./pkg/a.py", "function": "pkg.a.Foo.bar"}).reward == 1.0
    assert judge("pkg/a.py", "Foo.bar", {"file": "pkg/a.py", "function": "pkg/a.py::Foo.bar"}).reward == 1.0
    assert judge("pkg/a.py", "Foo.bar", {"file": "pkg/a.py", "function": "bar"}).reward == 0.0
    assert judge("pkg/a.py", "Foo.bar", {"file": "pkg/a.py", "function": "pkg.b.Foo.bar"}).reward == 0.0


def test_a_text_answer_ends_the_episode_and_definition_hints_come_as_configured():
    """The buglocal environment's step: a plain-text `FILE::FUNCTION` ends the episode (text_answer); the hint
    after a printed definition is the next user message (definition_hints=user) or ends the observation
    (observation). Faked parts: the task set is its config alone, and the tool run gives a fixed printed
    definition (the search tool needs a sandbox over a built task)."""
    from types import SimpleNamespace

    from rollway.envs.buglocal import BugLocEnvironment, definition_hints
    from rollway.envs.config import BugLocTasksConfig
    from rollway.tools.registry import Step

    printed = Observation(tool="search", arguments={}, content="toolz/itertoolz.py:60  function groupby: def groupby(")

    def step(output, observations=(), **cfg):
        taskset = SimpleNamespace(cfg=BugLocTasksConfig(type="buglocal", path="unused.jsonl", **cfg))
        env = BugLocEnvironment(taskset, Task("t", "p"), {}, None, ToolsConfig())

        async def ran(output, episode):
            return Step([], list(observations))

        env.run_tools = ran
        return asyncio.run(env.step(output, Episode("e", 0, env.task, [], [])))

    assert step("toolz/itertoolz.py::groupby", text_answer=True).done == "user_done"
    assert step("let me look", text_answer=True).done is None
    user = step("", [printed], definition_hints="user")
    assert [user.user_message] == definition_hints([printed]) and user.hints == []
    observed = step("", [printed], definition_hints="observation")
    assert observed.user_message is None and observed.hints == definition_hints([printed])


def test_family_files_take_the_libraries_in_turn():
    """A prefix of train.jsonl or heldout.jsonl (`--eval-tasks`, `tasks.limit`, the first `num_tasks`
    groups) must span the libraries, not hold the first library's rows only."""
    from rollway.envs.buglocal_build import interleave

    a, b, c = [{"id": f"a{i}"} for i in range(3)], [{"id": "b0"}], [{"id": f"c{i}"} for i in range(2)]
    assert [r["id"] for r in interleave([a, b, c])] == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert interleave([]) == [] and interleave([[], a]) == a


def test_the_training_filter_keeps_the_tasks_the_base_policy_solved(tmp_path):
    """`rollway bench search --train-filter N`: train only on tasks the arm's base policy solved at least
    once. The filter's evaluation result is written here by hand (a fake of the `rollway eval` phase, whose
    output format tests/test_eval.py checks); the selection and the file it writes are the real code."""
    import argparse

    from rollway.base.run_dir import RunDir
    from rollway.bench.search import filter_summary, training_tasks

    family = tmp_path / "family"
    family.mkdir()
    rows = [{"instance_id": f"lib__1__f{i}__0", "patch": "x"} for i in range(3)]
    (family / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    root = RunDir(tmp_path / "bench")
    folder = root.sub("search").sub("filter")
    folder.path.mkdir(parents=True)
    per_task = {r["instance_id"]: {"n": 4, "correct": c, "pass@1": c / 4} for r, c in zip(rows, (0, 2, 1), strict=True)}
    folder.eval_result.write_text(json.dumps({"per_task": per_task, "attempts_per_task": 4, "pass@1": 0.25}))
    args = argparse.Namespace(family=str(family), train_filter=4, attempts=8, eval_tasks=None)
    path, kept = training_tasks(args, root, "search")
    assert kept == ["lib__1__f1__0", "lib__1__f2__0"]
    assert [json.loads(x)["instance_id"] for x in path.read_text().splitlines()] == kept
    assert filter_summary(folder) == {"tasks": 3, "attempts_per_task": 4, "kept": 2, "pass@1": 0.25}
    folder.eval_result.write_text(json.dumps({"per_task": {k: {**v, "correct": 0} for k, v in per_task.items()}}))
    assert training_tasks(args, root, "search") is None  # nothing solved: nothing to train on


def test_an_arm_whose_training_never_updated_is_not_evaluated_again_as_if_trained(tmp_path):
    """Seen on seed 4: the bash arm's 128 training episodes all scored 0, so no update ran, and the bench
    evaluated checkpoint step_000000 (the base weights, saved for the engine) as "after", 20 minutes for the
    base policy again under another name. A finished training folder is written here by hand (a fake of
    the `rollway up` phase); the choice of what "after" is, is the real code."""
    import argparse

    from rollway.base.run_dir import RunDir
    from rollway.bench.search import _train, phase_walls, set_aside_unfinished, training_curves
    from rollway.learning.checkpoint import STATE_FILE, TrainerState

    root = RunDir(tmp_path / "bench")
    folder = root.sub("bash").sub("train")
    def checkpoint(step: int) -> None:  # a complete checkpoint folder as the learner leaves it: its state file
        (folder.checkpoints / f"step_{step:06d}").mkdir(parents=True)
        (folder.checkpoints / f"step_{step:06d}" / STATE_FILE).write_text(TrainerState(version=step, step=step).to_json())

    checkpoint(0)
    folder.summary.write_text(json.dumps({"wall_seconds": 993.4}))
    assert phase_walls(root, ["search", "bash"]) == {"bash_train": 993}  # a resumed bench keeps earlier phases' times
    args = argparse.Namespace(family=str(tmp_path), train_filter=0, overrides=[], config="unused.yaml")
    assert _train(args, root, "bash") is None
    assert training_curves(folder)["updates"] == 0
    checkpoint(2)
    folder.metrics.write_text("".join(json.dumps({"step": s, "reward_mean": 0.5}) + "\n" for s in (1, 2)))
    assert _train(args, root, "bash") == str(folder.checkpoints / "step_000002")
    assert training_curves(folder)["updates"] == 2
    # A phase cut short (no result in its folder) is set aside, twice over, and its finished sibling kept.
    for n in (1, 2):
        cut = root.sub("search").sub("train")
        (cut.path / "logs").mkdir(parents=True)
        set_aside_unfinished(cut)
        assert not cut.path.exists() and (cut.path.parent / f"train.interrupted-{n}" / "logs").is_dir()
    assert folder.summary.is_file()


def test_source_archive_of_a_project_whose_build_backend_is_compiled_downloads(tmp_path):
    """bidict 0.24.1 builds with uv_build, which has no pure source form (its sdist needs maturin and
    cargo, with no crates index here): asking pip for no binaries at all made every such project
    unbuildable. Only the project itself must come as a source archive. Real index, real pip."""
    from rollway.envs.sdist import download_sdist

    archive = download_sdist("bidict==0.24.1", tmp_path)
    assert archive.name == "bidict-0.24.1.tar.gz" and archive.stat().st_size > 10_000


def test_seeds_that_disagree_beyond_noise_pool_to_no_effect_with_the_spread_named(tmp_path, capsys):
    """Two runs beyond z 3 in opposite directions (the search bench's seeds 3 and 4 did this) must not pool
    to a confident answer: the random-effects mean is 0 with a wide SE, I^2 says the spread is not noise, and
    an arm's gain that is 0 by construction (no update, SE 0) is left out of its pool, not weighted
    infinitely. Result files written by hand (no training run in the suite)."""
    import argparse

    from rollway.bench.search_seeds import add_arguments, pool, run

    got = pool([(0.3, 0.1), (-0.3, 0.1)])
    assert got["fixed"] == {"diff": 0.0, "se": 0.0707, "z": 0.0}
    assert got["random"]["diff"] == 0.0 and got["random"]["se"] == 0.3  # tau^2 0.17 added to each 0.01
    assert (got["q"], got["i2"], got["above_z3"], got["below_minus_z3"]) == (18.0, 0.944, 1, 1)
    agree = pool([(0.2, 0.1), (0.2, 0.1)])
    assert agree["tau"] == 0.0 and agree["random"]["z"] == round(0.2 / math.sqrt(0.005), 2)

    def fig(d, se):
        return {"tasks": 24, "diff": d, "se": se, "z": round(d / se, 2) if se else None}

    def result(seed, search, bash, after):
        return {"seed": seed, "before": {}, "heldout": ["six==1.16.0"], "gain": {"search": fig(*search),
                "bash": fig(*bash)}, "after_search_minus_bash": {"pass@1": fig(*after)}}

    (tmp_path / "s3").mkdir()
    (tmp_path / "s3" / "search-bench.json").write_text(json.dumps(result(3, (0.2, 0.05), (0.4, 0.07), (-0.17, 0.07))))
    (tmp_path / "s4.json").write_text(json.dumps(result(4, (0.23, 0.07), (0.0, 0.0), (0.26, 0.07))))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([str(tmp_path / "s3"), str(tmp_path / "s4.json"), "--json"])) == 0
    pooled = json.loads(capsys.readouterr().out)["pooled"]
    assert pooled["bash_gain"]["runs"] == 1 and pooled["bash_gain"]["not_measured"] == 1
    assert pooled["search_gain"]["runs"] == 2 and pooled["search_gain"]["random"]["z"] > 3
    assert pooled["after_search_minus_bash"]["i2"] > 0.5 and abs(pooled["after_search_minus_bash"]["random"]["z"]) < 1
    assert run(parser.parse_args([str(tmp_path / "nothing")])) == 2
    assert "no search-bench.json" in capsys.readouterr().err
    # Each bench result names its held-out split, read from the family's held-out rows.
    from rollway.bench.search import heldout_libraries

    (tmp_path / "family").mkdir()
    (tmp_path / "family" / "heldout.jsonl").write_text("".join(
        json.dumps({"instance_id": f"six__{i}", "repo": "six==1.16.0"}) + "\n" for i in range(3)))
    assert heldout_libraries(str(tmp_path / "family")) == ["six==1.16.0"]
