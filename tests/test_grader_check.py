"""`rollway grader check`, the hostile-agent suite for graders: every row contained on both sandboxes
(real bubblewrap jail, real Docker engine, real task families: toolz SWE task, its SWE-bench row and
image, HumanEval, a Harbor example, toy), and the suite itself flags broken graders. Only the model
is faked: the tool-call rows play a scripted policy through the real agent and reward actors."""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid

import pytest

from rollway.envs.base import Episode, Grade, Task
from rollway.envs.config import ToyTasksConfig
from rollway.envs.toy import ToyTaskSet
from rollway.runners import cmd_grader
from rollway.runners.grader_attacks import Target
from rollway.runners.grader_check import DOCKER_ONLY, FAMILIES, Family, Options, run_suite
from rollway.sandboxes.base import Sandbox, SandboxProvider


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rollway grader")
    cmd_grader.add_arguments(parser)
    return cmd_grader.run(parser.parse_args(argv))


def holes(report: dict) -> list[str]:
    return [f"{r['attack']} ({r['family']}, {r['sandbox']}): {r['reason']}" for r in report["rows"]
            if not r["contained"]]


CASES = [(kind, family) for kind in ("local", "docker") for family in FAMILIES
         if kind == "docker" or family not in DOCKER_ONLY]
"""One test per sandbox and family, so a parallel run spreads the suite's minutes over its workers."""


def test_the_cases_cover_every_family_on_every_sandbox_it_runs_on():
    assert {f for k, f in CASES if k == "docker"} == set(FAMILIES)
    assert {f for k, f in CASES if k == "local"} == set(FAMILIES) - DOCKER_ONLY


@pytest.mark.slow
@pytest.mark.timeout(1200)  # up to 20 rows, two side by side
@pytest.mark.parametrize(("kind", "family"), CASES)
def test_every_grader_contains_every_attack(kind, family):
    """The whole suite, a family at a time: every built-in family's grader (swebench and harbor on docker
    only), the tool-call rows with toy. Each row names the attack and why it was not contained."""
    prefix = f"gc-{uuid.uuid4().hex[:6]}-"
    if kind == "docker":
        from docker_engine import count_containers, ensure_engine

        ensure_engine()
    report = asyncio.run(run_suite(Options(sandbox=kind, families=(family,), name_prefix=prefix)))
    assert {r["family"] for r in report["rows"]} == {family} | ({"agent-tools"} if family == "toy" else set())
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
    """A grader that turns a strange workspace into an error (an opt-out from a zero)."""

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        if (await sandbox.exec("test -e reward.json && echo seen")).output.strip() == "seen":
            raise RuntimeError("reward.json is in the way")
        return Grade(0.0, False)


class HangingTaskSet(ToyTaskSet):
    """A grader that waits on something the agent controls (here: forever once reward.txt exists)."""

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        while (await sandbox.exec("test -e reward.txt && echo wait")).output.strip() == "wait":
            await asyncio.sleep(0.5)
        return Grade(0.0, False)


def test_suite_flags_broken_graders():
    """The forged-reward attack against three broken graders: fooled (reward 1), crashed (a failed attempt),
    wedged (no verdict in time); and against the real toy grader: contained."""
    def family(cls: type[ToyTaskSet]) -> Family:
        taskset = cls(ToyTasksConfig(type="toy", count=1))
        return Family("trusting", taskset, taskset.tasks()[0], Target("trusting"))

    broken = [family(TrustingTaskSet), family(CrashingTaskSet), family(HangingTaskSet), family(ToyTaskSet)]
    report = asyncio.run(run_suite(Options(sandbox="local", attacks=("forged_reward_files",), row_timeout_s=15),
                                   families=broken))
    verdicts = [(r["contained"], r["reason"].split(" ")[0]) for r in report["rows"]]
    assert verdicts == [(False, "scored"), (False, "raised"), (False, "wedged:"), (True, "reward")], report["rows"]
    assert not report["all_contained"]
