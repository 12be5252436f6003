"""`rollway grader check`, the hostile-agent suite for graders: every row contained on both sandboxes
(real bubblewrap jail, real Docker engine, real task families: toolz SWE task, its SWE-bench row and
image, HumanEval, a Harbor example, toy), and the suite itself flags broken graders. Only the model
is faked: the tool-call rows play a scripted policy through the real agent and reward actors."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import uuid

import pytest

from rollway.audit.grader_attacks import ATTACKS, Target
from rollway.audit.grader_check import (
    DOCKER_ONLY,
    FAMILIES,
    TWINS_ON_DOCKER,
    Family,
    Options,
    _family,
    run_suite,
)
from rollway.envs.base import Episode, Grade, Task
from rollway.envs.config import ToyTasksConfig
from rollway.envs.swe_grading import GradingEnvError
from rollway.envs.toy import ToyTaskSet
from rollway.runners import cmd_grader
from rollway.sandboxes.base import OUTPUT_LOST_PLAYS, OutputLost, Sandbox, SandboxProvider


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rollway grader")
    cmd_grader.add_arguments(parser)
    return cmd_grader.run(parser.parse_args(argv))


def holes(report: dict) -> list[str]:
    return [f"{r['attack']} ({r['family']}, {r['sandbox']}): {r['reason']}" for r in report["rows"]
            if not r["contained"]]


SPLIT = {"swe": 2, "swebench": 2}
"""Families with many slow rows (each runs a real test suite): their attacks in this many parts."""
CASES = [(kind, family, part) for kind in ("local", "docker") for family in FAMILIES
         if (kind == "docker" and family not in TWINS_ON_DOCKER) or (kind == "local" and family not in DOCKER_ONLY)
         for part in range(SPLIT.get(family, 1))]
"""One test per sandbox, family and part, so a parallel run spreads the suite's minutes over its workers. A
family that is another on docker (`TWINS_ON_DOCKER`: `swe` is `swebench` there) is played there as that one;
`test_swe_on_docker_is_swebench` fails when the two stop being one."""


def part_of(family: str, part: int) -> tuple[str, ...]:
    """The attack names of one part of a family's rows (every row when the family is not split)."""
    names = [a.name for a in ATTACKS if family in a.families]
    return tuple(names[part::SPLIT[family]]) if family in SPLIT else ()


def test_the_cases_cover_every_family_and_row_on_every_sandbox_it_runs_on():
    assert {f for k, f, _ in CASES if k == "docker"} == set(FAMILIES) - set(TWINS_ON_DOCKER)
    assert set(TWINS_ON_DOCKER.values()) <= {f for k, f, _ in CASES if k == "docker"}
    assert {f for k, f, _ in CASES if k == "local"} == set(FAMILIES) - DOCKER_ONLY
    for kind in ("local", "docker"):
        for family in SPLIT:
            parts = [part_of(f, p) for k, f, p in CASES if (k, f) == (kind, family)]
            names = [n for p in parts for n in p]
            assert sorted(names) == sorted(a.name for a in ATTACKS if family in a.families) or not parts


def test_swe_on_docker_is_swebench(toolz_swebench_row):
    """Why the docker cases leave `swe` out: on docker its task set, task, row, grading settings and image
    source are `swebench`'s, so every row would be played twice on identical code. The whole check (`rollway
    grader check --type docker`) skips it the same way, and says so."""
    from rollway.sandboxes.config import SandboxConfig
    from rollway.sandboxes.factory import build_sandbox_provider

    opts = Options(sandbox="docker", cache_dir=toolz_swebench_row.parent)
    provider = build_sandbox_provider(SandboxConfig(type="docker"))
    try:
        for name, twin in TWINS_ON_DOCKER.items():
            a, b = _family(name, opts), _family(twin, opts)
            assert type(a.taskset) is type(b.taskset) and a.task == b.task
            assert dataclasses.replace(a.target, family=twin) == b.target  # what the attacks know: the same
            assert a.taskset.instances == b.taskset.instances and a.taskset.settings == b.taskset.settings
            assert a.taskset.uses_images(provider) and b.taskset.uses_images(provider)
            images = [(t.mirror, t.images.template, t.images.base_image, t.images.network) for t in (a.taskset, b.taskset)]
            assert images[0] == images[1]
    finally:
        asyncio.run(provider.close())
    report = asyncio.run(run_suite(Options(sandbox="docker", families=("swe", "swebench"), attacks=("no-such-row",))))
    assert report["total"] == 0 and set(report["families_skipped"]) == set(TWINS_ON_DOCKER)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "family", "part"), CASES)
def test_every_grader_contains_every_attack(kind, family, part, request):
    """The whole suite, a family (or part of its rows) at a time: every built-in family's grader (swebench and
    harbor on docker only), the tool-call rows with toy. Each row names the attack and why it was not contained."""
    prefix = f"gc-{uuid.uuid4().hex[:6]}-"
    if kind == "docker":
        from docker_engine import count_containers, ensure_engine

        ensure_engine()
    attacks = part_of(family, part)
    # The SWE families' row: the session's build, the one `rollway grader check` makes when given none.
    cache = {"cache_dir": request.getfixturevalue("toolz_swebench_row").parent} if family in ("swe", "swebench") else {}
    report = asyncio.run(run_suite(Options(sandbox=kind, families=(family,), attacks=attacks, name_prefix=prefix, **cache)))
    assert {r["family"] for r in report["rows"]} == {family} | ({"agent-tools", "harness"} if family == "toy" else set())
    assert not attacks or sorted(r["attack"] for r in report["rows"]) == sorted(attacks)
    if kind == "docker":
        assert count_containers(prefix) == 0  # every attacked sandbox was torn down
    assert not holes(report), "\n".join(holes(report))


def test_cli_reports_a_contained_row_as_json(capsys):
    assert cli(["check", "--type", "local", "--family", "toy", "--attack", "answer_fifo", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    [row] = report["rows"]
    assert (row["attack"], row["family"], row["sandbox"], row["contained"]) == ("answer_fifo", "toy", "local", True)
    assert row["reason"].startswith("reward 0")
    assert cli(["check", "--family", "nope"]) == 2


# ---------------------------------------------------------------- the suite can fail


class TrustingTaskSet(ToyTaskSet):
    """A deliberately broken grader: it believes a reward file the agent can write."""

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        try:
            reward = float((await sandbox.read_file("reward.txt")).strip())
        except Exception:  # noqa: BLE001 - no file: nothing to believe
            reward = 0.0
        return Grade(reward, reward >= 1.0)


class CrashingTaskSet(ToyTaskSet):
    """A grader that blames the environment for a strange workspace (an opt-out from a zero): an error it
    says was found before the agent's code ran. (Any other error once the agent ran is graded 0.)"""

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        if (await sandbox.exec("test -e reward.json && echo seen")).output.strip() == "seen":
            raise GradingEnvError("env_error: reward.json is in the way")
        return Grade(0.0, False)


class TimingOutTaskSet(ToyTaskSet):
    """A grader whose tests never finish in time (a slow machine): its zero judged nothing."""

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        return Grade(0.0, False, stop_reason="test_timeout")


class HangingTaskSet(ToyTaskSet):
    """A grader that waits on something the agent controls (here: forever once reward.txt exists)."""

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        while (await sandbox.exec("test -e reward.txt && echo wait")).output.strip() == "wait":
            await asyncio.sleep(0.5)
        return Grade(0.0, False)


def test_suite_flags_broken_graders():
    """The forged-reward attack against four broken graders: fooled (reward 1), crashed (a failed attempt),
    wedged (no verdict in time), timed out (a zero that judged nothing); and against the real toy grader:
    contained."""
    def family(cls: type[ToyTaskSet]) -> Family:
        taskset = cls(ToyTasksConfig(type="toy", count=1))
        return Family("trusting", taskset, taskset.tasks()[0], Target("trusting"))

    broken = [family(TrustingTaskSet), family(CrashingTaskSet), family(HangingTaskSet), family(TimingOutTaskSet),
              family(ToyTaskSet)]
    report = asyncio.run(run_suite(Options(sandbox="local", attacks=("forged_reward_files",), row_timeout_s=15),
                                   families=broken))
    verdicts = [(r["contained"], r["reason"].split(" ")[0]) for r in report["rows"]]
    assert verdicts == [(False, "scored"), (False, "raised"), (False, "wedged:"), (False, "inconclusive:"),
                        (True, "reward")], report["rows"]
    assert not report["all_contained"]


class LosingOutputTaskSet(ToyTaskSet):
    """A grader whose check before the agent's code meets the engine's lost output (injected: the only fake),
    turned into GradingEnvError as the SWE grader does on the unpatched tree; `losses` plays lose it."""

    losses = 1

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        type(self).losses -= 1
        if type(self).losses >= 0:
            try:
                raise OutputLost("the Docker engine lost the output of a command (injected)")
            except OutputLost as exc:
                raise GradingEnvError(f"env_error: the test runner could not be checked: {exc}") from exc
        return await super().grade(task, sandbox, provider, episode)


def test_a_row_whose_grader_lost_a_commands_output_is_played_again_in_a_fresh_sandbox():
    """Seen in CI: a swebench row's grader lost the output of its check on the unpatched tree (moby#27289)
    and the row was reported as a hole. The row is played again while the loss is the cause; a loss on every
    play is still reported, as is a GradingEnvError with another cause (test_suite_flags_broken_graders)."""
    def run(losses: int) -> dict:
        LosingOutputTaskSet.losses = losses
        taskset = LosingOutputTaskSet(ToyTasksConfig(type="toy", count=1))
        fams = [Family("toy", taskset, taskset.tasks()[0], Target("toy"))]
        [row] = asyncio.run(run_suite(Options(sandbox="local", attacks=("forged_reward_files",), row_timeout_s=60),
                                      families=fams))["rows"]
        return row

    once = run(1)
    assert once["contained"] and LosingOutputTaskSet.losses == -1, once
    always = run(OUTPUT_LOST_PLAYS)
    assert not always["contained"] and "lost the output" in always["reason"], always


@pytest.mark.timeout(600)
def test_opt_out_rows_flag_a_build_that_retries_the_agents_failures(monkeypatch):
    """The weakened build: every failure counted as infrastructure (retried, never graded), as before
    issue 39. The opt-out rows (a harness program killing everything, a test run whose code kills every
    process, a grader failing after the agent's code ran) are then not contained; with the rule they are."""
    from rollway.base import blame

    class FailingAfterAgentTaskSet(ToyTaskSet):
        """A grader that runs the agent's program, which kills the grader's command: an error once it ran."""

        async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
            if (await sandbox.exec("test -e reward.json && sh -c 'kill -9 $PPID'; echo ran")).exit_code != 0:
                raise RuntimeError("the graded program killed the grader's command")
            return Grade(0.0, False)

    def play():
        taskset = FailingAfterAgentTaskSet(ToyTasksConfig(type="toy", count=1))
        fams = [Family("toy", taskset, taskset.tasks()[0], Target("toy"))]
        report = asyncio.run(run_suite(Options(sandbox="local", attacks=("forged_reward_files", "harness_program_kills_all",
                                                                         "tool_kills_every_process"), row_timeout_s=240),
                                       families=fams))
        return {r["attack"]: (r["contained"], r["reason"]) for r in report["rows"]}

    rows = play()
    assert len(rows) == 3 and all(contained for contained, _ in rows.values()), rows
    monkeypatch.setattr(blame, "_is_infrastructure", lambda err: True)
    weakened = play()
    assert not weakened["forged_reward_files"][0] and not weakened["harness_program_kills_all"][0], weakened
    assert weakened["tool_kills_every_process"][0], weakened  # an observation for the model, whatever the rule


def test_gateway_rows_flag_a_gateway_that_does_not_bound_an_episode(monkeypatch):
    """The weakened build: the gateway counts no refusal against the episode (its connection and size limits
    still answer, but an episode that keeps attacking is never ended). The gateway rows then end at the
    program's silence limit instead of the gateway's bound: not contained; with the bounds they are."""
    from rollway.gateway import bounds

    def play():
        report = asyncio.run(run_suite(Options(sandbox="local", families=("toy",), row_timeout_s=240,
                                               attacks=("gateway_holds_connections", "gateway_huge_bodies"))))
        return {r["attack"]: (r["contained"], r["reason"]) for r in report["rows"]}

    rows = play()
    assert len(rows) == 2 and all(contained for contained, _ in rows.values()), rows
    monkeypatch.setattr(bounds, "refuse", lambda handle, limits, what: None)
    weakened = play()
    assert not any(contained for contained, _ in weakened.values()), weakened
    assert all("harness_silence" in reason for _, reason in weakened.values()), weakened


# ---------------------------------------------------------------- answer-leak and secrets rows (issue 39)


def test_the_leak_row_flags_a_sandbox_that_keeps_the_task_trees_file_times(tmp_path, monkeypatch):
    """The answer-leak row against a task tree whose changed file is the newest one (as the builders left
    it before issue 39): contained by the real sandbox (it gives every file one time), not contained once
    that is switched off (the weakened build), with the channel that named the file."""
    import os

    from rollway.sandboxes.base import SandboxSpec

    tree = tmp_path / "tree" / "pkg"
    tree.mkdir(parents=True)
    for i in range(8):
        (tree / f"m{i}.py").write_text(f"def f{i}():\n    return {i}\n")
        os.utime(tree / f"m{i}.py", (1_600_000_000, 1_600_000_000))
    (tree / "m3.py").write_text("def f3():\n    return -3\n")

    class LeakyTaskSet(ToyTaskSet):
        def sandbox_spec(self, task: Task) -> SandboxSpec:
            return SandboxSpec(source_dir=str(tree.parent))

    def family() -> Family:
        taskset = LeakyTaskSet(ToyTasksConfig(type="toy", count=1))
        return Family("leaky", taskset, taskset.tasks()[0], Target("leaky", "pkg/m3.py"))

    opts = Options(sandbox="local", attacks=("answer_leak_probe",), row_timeout_s=120)
    [row] = asyncio.run(run_suite(opts, families=[family()]))["rows"]
    assert row["contained"], row
    monkeypatch.setattr("rollway.sandboxes.local.retime_tree", lambda root: None)
    [row] = asyncio.run(run_suite(opts, families=[family()]))["rows"]
    assert not row["contained"] and "'mtime'" in row["reason"], row


def test_the_secrets_row_flags_a_launcher_spec_left_in_the_workspace():
    """The secrets row against a sandbox that holds a launcher spec file (what a launcher that never removed
    its spec would leave): not contained; against the plain toy sandbox: contained."""
    from rollway.sandboxes.base import SandboxSpec

    class LeftSpecTaskSet(ToyTaskSet):
        def sandbox_spec(self, task: Task) -> SandboxSpec:
            return SandboxSpec(files={".rollway/launch-0123.json": '{"env": {"OPENAI_API_KEY": "k"}}'})

    def family(cls: type[ToyTaskSet]) -> Family:
        taskset = cls(ToyTasksConfig(type="toy", count=1))
        return Family("toy", taskset, taskset.tasks()[0], Target("toy"))

    opts = Options(sandbox="local", attacks=("secrets_in_sight",), row_timeout_s=120)
    rows = asyncio.run(run_suite(opts, families=[family(LeftSpecTaskSet), family(ToyTaskSet)]))["rows"]
    assert [r["contained"] for r in rows] == [False, True], rows
    assert "launch-0123.json" in rows[0]["reason"]


def test_the_oversize_row_flags_a_build_that_drops_an_episode_too_large_for_the_broker(monkeypatch):
    """The row `episode_over_broker_limit`: the model's turns make its episode outgrow broker.max_message_bytes
    after its code ran. Contained: graded 0 (OutputRefused) on the turns that fit. Two weakened builds are
    flagged: one whose stages drop (or retry) the refused episode instead of grading it, and an in-process
    driver that does not apply the broker's size check (the row would then measure nothing)."""
    from rollway.actors import agent, reward
    from rollway.runtime.worker import OutputSender

    def play() -> dict:
        report = asyncio.run(run_suite(Options(sandbox="local", families=("toy",), row_timeout_s=240,
                                               attacks=("episode_over_broker_limit",))))
        [row] = report["rows"]
        return row

    row = play()
    assert row["contained"] and "OutputRefused" in row["reason"], row
    with monkeypatch.context() as weakened:
        for module in (agent, reward):
            weakened.setattr(module, "refused_as_graded_0", lambda *a: None)
        row = play()
    assert not row["contained"] and "the attempt failed" in row["reason"], row
    monkeypatch.setattr(OutputSender, "encode_all", lambda self, outputs: [])
    row = play()
    assert not row["contained"] and "not graded 0 for being over" in row["reason"], row


@pytest.mark.slow
def test_the_leak_row_flags_a_docker_sandbox_that_shows_the_images_copy_of_the_library():
    """The answer-leak row on Docker against a task built from a library the sandbox base image itself holds
    (`zipp`, which Debian's pytest brings into /usr/lib/python3/dist-packages), one line of it changed:
    contained by the real provider (it starts the sandbox from an image without that copy), not contained
    once that is switched off (the weakened build), with `site_packages` naming the file."""
    import tempfile
    from pathlib import Path

    from docker_engine import ensure_engine

    from rollway.sandboxes.base import SandboxSpec

    clean = ensure_engine().containers.run("rollway-sandbox:bookworm", ["cat", "/usr/lib/python3/dist-packages/zipp.py"],
                                           remove=True, network_disabled=True).decode()
    tree = Path(tempfile.mkdtemp(prefix="rollway-zipp-"))
    changed = clean.replace("def __init__(", "def __init__(  # changed\n        ", 1)
    assert changed != clean
    (tree / "zipp.py").write_text(changed)
    for i in range(6):
        (tree / f"other{i}.py").write_text(f"x = {i}\n")

    class ZippTaskSet(ToyTaskSet):
        def sandbox_spec(self, task: Task) -> SandboxSpec:
            return SandboxSpec(source_dir=str(tree))

    def row() -> dict:
        """The row's verdict; a row that got none (it raised: a failed attempt, or no verdict in time) is played
        again, up to three times, as a run re-issues a failed attempt (seen once in a full run: not contained,
        its reason not shown)."""
        for _ in range(3):
            taskset = ZippTaskSet(ToyTasksConfig(type="toy", count=1))
            fams = [Family("leaky", taskset, taskset.tasks()[0], Target("leaky", "zipp.py"))]
            [played] = asyncio.run(run_suite(Options(sandbox="docker", attacks=("answer_leak_probe",),
                                                     row_timeout_s=240), families=fams))["rows"]
            if not played["reason"].startswith(("raised ", "wedged", "the attack could not be set up")):
                break
        return played

    played = row()
    assert played["contained"], f"not contained: {played['reason']}"[:3000]
    with pytest.MonkeyPatch.context() as weakened:
        weakened.setattr("rollway.sandboxes.docker.without_installed_copies", lambda client, image, names: image)
        played = row()
    assert not played["contained"] and "'site_packages'" in played["reason"], f"{played['reason']}"[:3000]


class NonFiniteTaskSet(ToyTaskSet):
    """A grader that hands back what it read (a score a test printed from the agent's code): nan, inf, text."""

    reward: object = float("nan")

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        return Grade(self.reward, False, details={"score_line": "printed by the tests"})  # type: ignore[arg-type]


def _graded_as(reward: object) -> Grade:
    """What grade_after_agent makes of a grader that gives `reward` (its sandbox is never touched: None)."""
    from rollway.envs.base import grade_after_agent

    taskset = NonFiniteTaskSet(ToyTasksConfig())
    taskset.reward = reward
    task = taskset.tasks()[0]
    return asyncio.run(grade_after_agent(taskset, task, None, None, Episode("e", 0, task, [])))


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), -float("inf"), 1e300, -2e6, "1", None, True])
def test_a_grader_reward_that_is_not_a_finite_number_is_graded_zero(reward):
    """Any task set's grade passes one door (grade_after_agent, the reward stage's and `rollway grader
    check`'s): a reward that is not a finite number becomes 0 with outcome bad_reward, the grader's details
    kept; so is one past ±1e6 (1e300 under Dr.GRPO is an advantage of 1e300, inf in float32). The sandbox is not
    used by this grader (None stands in for it)."""
    grade = _graded_as(reward)
    assert (grade.reward, grade.resolved, grade.details["outcome"]) == (0.0, False, "bad_reward")
    assert grade.details["score_line"] == "printed by the tests" and repr(reward) in grade.details["error"]


@pytest.mark.parametrize("reward", [0.0, 1.0, 0.25, -1.0, 100, 1e6])
def test_a_grader_reward_within_range_stands(reward):
    grade = _graded_as(reward)
    assert grade.reward == reward and "outcome" not in grade.details
