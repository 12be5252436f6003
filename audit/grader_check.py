"""`rollway grader check`: the hostile-agent suite for graders. Each row plays one attack on one task
family in one sandbox type through the pipeline's own seams (the task set's sandbox as the init stage
makes it, the agent's bash tool or the agent actor itself, then the task set's grade as the reward stage
calls it) and reports whether the attack was contained: reward 0 with a reason, or an observation for
the model. A reward above 0, a grading error (an infrastructure failure is an opt-out from a zero) or
a row that gets no verdict in time is not contained. A failure once the agent's code ran is graded as the
reward stage grades it (`grade_after_agent`, base/blame.py): reward 0 with its reason, contained."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollway.audit.grader_attacks import (
    ATTACKS,
    GATEWAY_ATTACKS,
    HARNESS_ATTACKS,
    OVERSIZE_ATTACKS,
    OVERSIZE_LIMIT,
    TOOL_ATTACKS,
    Attack,
    AttackNotRun,
    Target,
)
from rollway.envs.base import Episode, Grade, Task, TaskSet, grade_after_agent
from rollway.sandboxes.base import Sandbox, SandboxProvider, again_while_output_lost

FAMILIES = ("swe", "swebench", "humaneval", "harbor", "toy")
DOCKER_ONLY = {"swebench", "harbor"}
"""Families whose tasks run in their own images (sandbox.type=docker only)."""
TWINS_ON_DOCKER = {"swe": "swebench"}
"""Family -> the family it is on docker when both play the built-in task: `swe` and `swebench` are one task
set, and on docker both grade the same toolz row in the same instance image, so the twin's rows would
repeat every row (tests/test_grader_check.py checks the two stay one)."""
REPO = Path(__file__).resolve().parent.parent
SWE_SDIST = "toolz==1.2.0"
TEST_TIMEOUT_S = 150.0
"""The families' own test timeout here: long enough for the task's tests on a loaded machine (a row whose
tests time out is inconclusive, see `verdict`)."""
SHORT_TEST_TIMEOUT_S = 8.0
"""The test timeout of the rows whose attack is to outlast it (`Attack.times_out`): they only show that a
run that never ends is stopped and scored 0, at any timeout."""


@dataclass
class Row:
    attack: str
    family: str
    sandbox: str
    contained: bool
    reason: str
    seconds: float = 0.0
    what: str = ""


@dataclass
class Family:
    """One task of a family, ready to attack."""

    name: str
    taskset: TaskSet
    task: Task
    target: Target


@dataclass
class Options:
    sandbox: str = "local"
    families: tuple[str, ...] = FAMILIES
    attacks: tuple[str, ...] = ()
    """Only these rows (names); empty: all."""
    row_timeout_s: float = 300.0
    cache_dir: Path = field(default_factory=lambda: Path("~/.cache/rollway/grader-check").expanduser())
    swe_instances: str | None = None
    swebench_rows: str | None = None
    mirror: str | None = None
    harbor: str | None = None
    jobs: int = 2
    """Rows played side by side (each in its own sandboxes)."""
    name_prefix: str = "gcheck-"
    """Names of the attacked sandboxes start with it (a test counts what is left)."""


# ---------------------------------------------------------------- the task families


def _build_rows(opts: Options) -> tuple[str, str]:
    """The toolz SWE task as SWE-bench rows over a git mirror (`rollway tasks build swe`), built once into
    the cache for both SWE families (the instance image is made when a swebench row first needs it). Under
    a file lock and renamed into place: checks run side by side (two test workers, two terminals) build it
    once and never read a half-written file."""
    folder = opts.cache_dir / "swe-rows"
    out, mirror = folder / "rows.jsonl", folder / "mirror"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            partial = folder / "rows.partial.jsonl"
            # The default command (its git mirror goes next to --out): the test suite's SWE row is this build.
            proc = subprocess.run([sys.executable, "-m", "rollway.runners", "tasks", "build", "swe", "--sdist",
                                   SWE_SDIST, "--max-tasks", "1", "--seed", "0", "--out", str(partial)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"building the {SWE_SDIST} task failed: {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
            partial.replace(out)
    return str(out), str(mirror)


def _family(name: str, opts: Options, test_timeout_s: float = TEST_TIMEOUT_S) -> Family:
    from rollway.envs import config as c
    from rollway.envs.factory import build_taskset
    from rollway.sandboxes.config import SandboxConfig

    if name in ("swe", "swebench"):
        # One task path: `swe` is the row graded in this sandbox (local: its tree from the mirror), swebench
        # the same kind of row in its instance image (docker only).
        given = (opts.swe_instances, None) if name == "swe" else (opts.swebench_rows, opts.mirror)
        path, mirror = given if given[0] else _build_rows(opts)
        cls = c.SWETasksConfig if name == "swe" else c.SWEBenchTasksConfig
        taskset = build_taskset(cls(type=name, path=path, mirror=mirror, limit=1, test_timeout_s=test_timeout_s),
                                SandboxConfig(type=opts.sandbox))  # type: ignore[arg-type]
        inst = taskset.instances[taskset.tasks()[0].task_id]
        source = inst.patch.split("diff --git a/", 1)[1].split(" ", 1)[0]
        return _swe_family(name, taskset, source, inst.fail_to_pass, inst.pass_to_pass)
    if name == "humaneval":
        taskset = build_taskset(c.HumanEvalTasksConfig(type="humaneval", limit=1, test_timeout_s=test_timeout_s))
        task = taskset.tasks()[0]
        problem = taskset.problems[task.task_id]
        return Family(name, taskset, task, Target(name, "solution.py", extra={
            "prompt": problem["prompt"], "entry_point": problem["entry_point"]}))
    if name == "harbor":
        path = opts.harbor or str(REPO / "examples" / "harbor" / "file-permissions")
        taskset = build_taskset(c.HarborTasksConfig(type="harbor", path=path, limit=1))
        return Family(name, taskset, taskset.tasks()[0], Target(name))
    if name == "toy":
        taskset = build_taskset(c.ToyTasksConfig(type="toy", count=1))
        return Family(name, taskset, taskset.tasks()[0], Target(name))
    raise ValueError(f"unknown task family {name!r}; use one of {', '.join(FAMILIES)}")


def _swe_family(name: str, taskset: TaskSet, source: str, f2p: list[str], p2p: list[str]) -> Family:
    return Family(name, taskset, taskset.tasks()[0], Target(name, source, tests=[*f2p, *p2p], fail_to_pass=list(f2p)))


# ---------------------------------------------------------------- playing one row


async def play_workspace(attack: Attack, fam: Family, provider: SandboxProvider, prefix: str = "gcheck-"
                         ) -> tuple[bool, str]:
    """The task's sandbox made as the init stage makes it, the attack played in it, graded as the reward
    stage grades it; (contained, reason)."""
    await fam.taskset.prepare(fam.task)

    async def play() -> tuple[bool, str]:
        box = await provider.create(fam.taskset.sandbox_spec(fam.task), f"{prefix}{uuid.uuid4().hex[:10]}")
        try:
            return await _play_in(attack, fam, provider, box)
        finally:
            await box.destroy()

    # The row's own commands (the suite's: grading turns a lost output into the agent's 0) can meet Docker's
    # lost-output race (moby#27289, more frequent under load): the row is played again in a fresh sandbox.
    return await again_while_output_lost(play, lambda lost: None)


async def _play_in(attack: Attack, fam: Family, provider: SandboxProvider, box: Any) -> tuple[bool, str]:
    target = Target(**{**asdict(fam.target), "extra": {**fam.target.extra, "nonce": uuid.uuid4().hex[:10]}})
    check = await attack.play(box, target)
    episode = Episode(episode_id=f"grader-check-{attack.name}", attempt=0, task=fam.task, messages=[],
                      stop_reason="finish")
    try:
        grade = await grade_after_agent(fam.taskset, fam.task, box, provider, episode)
    except asyncio.CancelledError:
        await _unwedge(box)
        raise
    extra = await check(box, grade) if check else None
    return verdict(grade, extra, timeout_expected=attack.times_out)


async def _unwedge(box: Sandbox) -> None:
    """A grader blocked reading a FIFO (in a worker thread that cannot be cancelled) is given a writer,
    so the process can exit."""
    with contextlib.suppress(Exception):
        await box.exec("for f in $(find . -maxdepth 4 -type p 2>/dev/null); do timeout 2 sh -c \"echo 0 > $f\"; "
                       "done", timeout_s=10)


def verdict(grade: Grade, extra: str | None, timeout_expected: bool = False) -> tuple[bool, str]:
    """(contained, reason) of a graded row: contained only at reward 0 with nothing else found, and, unless
    the attack is to outlast the test timeout, with tests that finished (a timed-out run judged nothing)."""
    if grade.reward > 0 or grade.resolved:
        return False, f"scored reward {grade.reward:g} (resolved={grade.resolved}): the grader was fooled"
    if extra:
        return False, extra
    why = grade.stop_reason or grade.details.get("outcome") or "unresolved"
    if why == "agent_failure":  # failed after the agent's code ran: its 0 (base/blame.py)
        why += f" ({grade.details.get('failure_kind')})"
    if why == "test_timeout" and not timeout_expected:
        return False, ("inconclusive: the tests did not finish within the test timeout, so the attack was never "
                       "judged (a slow machine: raise the timeout; an attack that stalls the run: mark it times_out)")
    counts = grade.details.get("fail_to_pass")
    if isinstance(counts, dict):
        why += f", FAIL_TO_PASS {counts.get('passed')}/{counts.get('total')}"
    ignored = grade.details.get("ignored_files")
    if ignored:
        why += f", ignored {len(ignored)} file(s)"
    return True, f"reward 0: {why}"


async def play_tool_call(name: str, output: str, opts: Options, oversize: bool = False) -> tuple[bool, str]:
    """The model's output played through the agent actor (parsing, tools) on a toy task, then a
    `finish`; graded by the reward actor. The episode must come back graded, not failed. `oversize`: the
    output every turn, under OVERSIZE_LIMIT; the episode must come back graded 0 for being over the limit."""
    from rollway.audit.verify import play_episode
    from rollway.config.run import load_config

    turns = [output] if oversize else [output, '<tool_call>{"name": "finish", "arguments": {}}</tool_call>']
    cfg = load_config(None, ["tasks.type=toy", "tasks.count=1", f"sandbox.type={opts.sandbox}",
                             'tools.enabled=["bash", "editor", "search", "finish"]', "agent.max_turns=3",
                             "agent.max_tokens_per_turn=1000000", "agent.max_total_tokens=4000000",
                             *(OVERSIZE_LIMIT if oversize else []),
                             "policy=" + json.dumps({"type": "scripted", "script": [{"when": "", "turns": turns}]})])
    with tempfile.TemporaryDirectory(prefix="rollway-grader-check-") as run_dir:
        try:
            traj = await play_episode(cfg, Path(run_dir), "toy-000")
        except RuntimeError as exc:
            return False, f"the attempt failed instead of {'a graded 0' if oversize else 'an observation'}: {str(exc)[:300]}"
    if traj.reward > 0:
        return False, f"scored reward {traj.reward:g}"
    if oversize:
        kind = traj.grade.get("failure_kind")
        if kind != "OutputRefused" or not traj.num_turns:
            return False, (f"ended with {traj.stop_reason} ({kind}), {traj.num_turns} turn(s) kept: not graded 0 for "
                           "being over broker.max_message_bytes on the turns that fit")
        stage = traj.grade.get("failure_stage")
        return True, f"reward 0: {traj.stop_reason} (OutputRefused in {stage}), {traj.num_turns} turn(s) kept"
    first = traj.turns[0].observations if traj.turns else []
    shown = "; ".join(o.content[:80].replace("\n", " ") for o in first[:2]) or "no observation"
    more = f" (+{len(first) - 2} more)" if len(first) > 2 else ""
    return True, f"observation: {shown}{more}"


async def play_harness(name: str, argv: list[str], opts: Options, bootstrap: str,
                       stop_reason: str | None = None) -> tuple[bool, str]:
    """A harness episode on toy-000 whose program is `argv`, through the init, agent (the worker's gateway
    on the embedded broker, the launcher) and reward actors. The episode must come back graded 0 with the
    program's failure as its reason, not failed (a retried failure is an opt-out from the zero); with
    `stop_reason`, ended for that reason (a gateway's bound), not by the program's own limits."""
    from rollway.audit.verify import play_episode
    from rollway.config.run import load_config

    with tempfile.TemporaryDirectory(prefix="rollway-grader-check-") as run_dir:
        cfg = load_config(None, ["tasks.type=toy", "tasks.count=1", f"sandbox.type={opts.sandbox}",
                                 f"broker.bootstrap={bootstrap}", f"topics.prefix=gcheck{uuid.uuid4().hex[:8]}-",
                                 # A program the gateway did not bound ends at its silence: a row's time.
                                 "agent.harness=" + json.dumps({"command": argv, "silence_limit_s": 30}),
                                 *([f"sandbox.gateway_root={run_dir}/gateway"] if opts.sandbox == "docker" else []),
                                 "policy=" + json.dumps({"type": "scripted", "chat_format": "bytes-chatml",
                                                         "script": [{"when": "", "turns": ["I give up."]}]})])
        try:
            traj = await play_episode(cfg, Path(run_dir), "toy-000")
        except Exception as exc:  # noqa: BLE001 - any failed attempt is this row's finding
            return False, f"the attempt failed instead of a graded 0: {type(exc).__name__}: {str(exc)[:300]}"
    if traj.reward > 0:
        return False, f"scored reward {traj.reward:g}"
    if stop_reason is not None and traj.stop_reason != stop_reason:
        return False, f"ended with {traj.stop_reason}, not {stop_reason}: the gateway did not bound the episode"
    kind = traj.grade.get("failure_kind") or traj.grade.get("outcome") or traj.stop_reason
    return True, f"reward 0: {traj.stop_reason} ({kind})"


async def run_row(attack: str, family: str, play: Any, opts: Options, what: str) -> Row:
    start = time.monotonic()
    try:
        contained, reason = await asyncio.wait_for(play(), opts.row_timeout_s)
    except TimeoutError:
        contained, reason = False, f"wedged: no verdict within {opts.row_timeout_s:g}s"
    except AttackNotRun as exc:
        contained, reason = False, f"the attack could not be set up (fix the suite): {exc}"
    except Exception as exc:  # noqa: BLE001 - any grading error is this row's finding
        contained, reason = False, f"raised {type(exc).__name__} (a failed attempt, not a 0): {str(exc)[:300]}"
    return Row(attack, family, opts.sandbox, contained, reason, round(time.monotonic() - start, 1), what)


async def run_suite(opts: Options, families: list[Family] | None = None) -> dict[str, Any]:
    """Every selected row on `opts.sandbox`; `families` replaces the built-in ones (the self-test's)."""
    from rollway.sandboxes.config import SandboxConfig
    from rollway.sandboxes.factory import build_sandbox_provider

    provider = build_sandbox_provider(SandboxConfig(type=opts.sandbox))  # type: ignore[arg-type]
    short: dict[str, Family] = {}
    skipped: dict[str, str] = {}
    if families is None:
        wanted = [f for f in opts.families if opts.sandbox == "docker" or f not in DOCKER_ONLY]
        if opts.sandbox == "docker" and not (opts.swe_instances or opts.swebench_rows):
            twins = {f: TWINS_ON_DOCKER[f] for f in wanted if TWINS_ON_DOCKER.get(f) in wanted}
            wanted = [f for f in wanted if f not in twins]
            skipped.update({f: f"on docker it is {t}: the same task set, row and image" for f, t in twins.items()})
        families = [_family(f, opts) for f in wanted]
        short = {f: _family(f, opts, SHORT_TEST_TIMEOUT_S) for f in wanted
                 if any(a.times_out and f in a.families and _selected(a.name, opts) for a in ATTACKS)}
    plays: list[tuple[str, str, Any, str]] = []
    for fam in families:
        plays += [(a.name, fam.name, functools.partial(play_workspace, a, short.get(fam.name, fam) if a.times_out
                                                       else fam, provider, opts.name_prefix), a.what)
                  for a in ATTACKS if fam.name in a.families and _selected(a.name, opts)]
    broker = None
    if any(f.name == "toy" for f in families):
        plays += [(name, "agent-tools", functools.partial(play_tool_call, name, output, opts, name in OVERSIZE_ATTACKS),
                   what) for name, (what, output) in (TOOL_ATTACKS | OVERSIZE_ATTACKS).items() if _selected(name, opts)]
        harness = {name: (*row, None) for name, row in HARNESS_ATTACKS.items() if _selected(name, opts)}
        harness |= {name: (*row, "harness_refused_limit") for name, row in GATEWAY_ATTACKS.items()
                    if _selected(name, opts)}
        if harness:  # the gateway records the program's calls on a real broker
            from rollway.runtime.broker import EmbeddedBroker

            broker = EmbeddedBroker(0).start()
            plays += [(name, "harness", functools.partial(play_harness, name, argv, opts, broker.bootstrap, stop), what)
                      for name, (what, argv, stop) in harness.items()]
    slots = asyncio.Semaphore(opts.jobs)

    async def one(name: str, family: str, play: Any, what: str) -> Row:
        async with slots:
            return await run_row(name, family, play, opts, what)

    try:
        played = {family for _, family, _, _ in plays}
        for fam in [*families, *short.values()]:  # an image to build: once, before rows start side by side
            if fam.name in played:
                await fam.taskset.prepare(fam.task)
        rows = await asyncio.gather(*(one(*p) for p in plays))
    finally:
        await provider.close()
        if broker is not None:
            broker.stop()
    return {"sandbox": opts.sandbox, "total": len(rows), "contained": sum(r.contained for r in rows),
            "all_contained": all(r.contained for r in rows), "rows": [asdict(r) for r in rows],
            "families_skipped": skipped}


def _selected(name: str, opts: Options) -> bool:
    return not opts.attacks or name in opts.attacks


def table(report: dict[str, Any]) -> str:
    rows = report["rows"]
    width = max([len(r["attack"]) for r in rows] + [6])
    lines = [f"{'row':<{width}}  {'family':<11} {'sandbox':<7} contained  reason"]
    for r in rows:
        lines.append(f"{r['attack']:<{width}}  {r['family']:<11} {r['sandbox']:<7} {'yes' if r['contained'] else 'NO':<9}  "
                     f"{r['reason']}")
    lines.append(f"{report['contained']}/{report['total']} contained on {report['sandbox']}")
    lines += [f"family {f} not played: {why}" for f, why in report.get("families_skipped", {}).items()]
    return "\n".join(lines)
