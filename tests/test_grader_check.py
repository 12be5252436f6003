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

from rollway.envs.base import Episode, Grade, Task
from rollway.envs.config import ToyTasksConfig
from rollway.envs.toy import ToyTaskSet
from rollway.runners import cmd_grader
from rollway.runners.grader_attacks import ATTACKS, Target
from rollway.runners.grader_check import (
    DOCKER_ONLY,
    FAMILIES,
    TWINS_ON_DOCKER,
    Family,
    Options,
    _family,
    run_suite,
)
from rollway.sandboxes.base import Sandbox, SandboxProvider


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
    assert {r["family"] for r in report["rows"]} == {family} | ({"agent-tools"} if family == "toy" else set())
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
    """A grader that turns a strange workspace into an error (an opt-out from a zero)."""

    async def grade(self, task: Task, sandbox: Sandbox, provider: SandboxProvider, episode: Episode) -> Grade:
        if (await sandbox.exec("test -e reward.json && echo seen")).output.strip() == "seen":
            raise RuntimeError("reward.json is in the way")
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
