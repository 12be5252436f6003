"""Shared fixtures: one embedded broker per test session (per worker when the suite runs in parallel,
`pytest -n N`), fresh topic names per test, expensive builds made once for all workers, and the longest
tests scheduled first."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jobs import run_with_progress

from rollway.sandboxes.base import ExecResult, Sandbox

ROOT = Path(__file__).resolve().parent.parent


DURATIONS = Path(__file__).with_name("durations.txt")
"""Seconds each test of a second or more took in a whole run (`--store-durations` rewrites the file): with
`pytest -n N` the units of work (a test, or the tests of one `SAME_WORKER` module) go out longest first, so no
worker begins a multi-minute unit when the others are nearly done, and long waits (a run's timeout, a stage's
grace) overlap the CPU-bound runs instead of gathering at the end. A test missing from the file counts as a
second: it runs after the known slow ones, never not at all."""
UNKNOWN_S = 1.0


SAME_WORKER = {"test_vllm_server.py": "vllm_url", "test_policies_engine.py": "engine", "test_harness_views.py": "run",
               "test_fleet.py": "fleet", "test_prometheus.py": "prometheus",
               "test_report.py": "smoke_run", "test_show.py": "smoke_run", "test_rerun.py": "smoke_run"}
"""Module -> the expensive fixture its tests share (a vLLM server, an engine, a whole run, the session's
`smoke_run`): with `pytest -n N` all tests of the modules that name one fixture go to one worker, so it is
made once (a session fixture used by tests on three workers is made three times)."""


def _unit(nodeid: str) -> str:
    """The scheduler's unit of work a test belongs to: its module's shared fixture, or the test alone."""
    return SAME_WORKER.get(Path(nodeid.split("::", 1)[0]).name, nodeid)


def _durations() -> dict[str, float]:
    known = {}
    if DURATIONS.exists():
        for line in DURATIONS.read_text().splitlines():
            seconds, _, nodeid = line.partition(" ")
            if nodeid and not line.startswith("#"):
                known[nodeid] = float(seconds)
    return known


def pytest_configure(config):
    """Each torch process of the suite (a learner, the built-in engine, a test's own model) computes on one
    thread unless OMP_NUM_THREADS says otherwise: four workers share two cores, and a process that spreads
    its ops over both cores spins and contends with the others' work (a small model's training steps, one
    other busy process beside it: 12.9 core-seconds on two threads against 9.2 on one, and slower)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each test's seconds (setup, call and teardown) to {DURATIONS.name} for the scheduling")


def pytest_collection_modifyitems(config, items):
    known = _durations()
    units: dict[str, float] = {}
    for item in items:
        unit = _unit(item.nodeid)
        units[unit] = units.get(unit, 0.0) + known.get(item.nodeid, UNKNOWN_S)
    items.sort(key=lambda item: -units[_unit(item.nodeid)])  # stable: a unit's tests keep their collection order


_taken: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _taken[report.nodeid] = _taken.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """With --store-durations, the process that saw every test (xdist's controller, or the only one) updates
    the file with the tests it ran (others keep their entries); a run with a failure changes nothing."""
    config = session.config
    if not config.getoption("--store-durations") or hasattr(config, "workerinput"):
        return
    if exitstatus != 0:
        print(f"\n{DURATIONS.name} not written: the run failed")
        return
    known = {**_durations(), **_taken}
    lines = [f"{seconds:.1f} {nodeid}" for nodeid, seconds in sorted(known.items(), key=lambda kv: -kv[1])
             if seconds >= UNKNOWN_S]
    DURATIONS.write_text("# written by `pytest --store-durations`: seconds per test (1 s or more)\n"
                         + "\n".join(lines) + "\n")


@pytest.hookimpl(optionalhook=True)  # a pytest without xdist loads this file too
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler for this suite: each test is its own unit of work, except the tests of a
    `SAME_WORKER` fixture, which are one unit; units go out in collection order (longest first, from `DURATIONS`). (xdist's
    own `xdist_group` marks do nothing under pytest 9: the worker renames `item._nodeid`, which pytest 9
    no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SAME_WORKER.get(Path(module).name, nodeid)

    config.option.loadscopereorder = False  # keep the longest-first order, not the largest unit first
    return Scheduling(config, log)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(folder)` run once per test run, however many pytest-xdist workers ask (they share the
    parent of their base temporary folders), under a file lock; a failed build is retried by the next."""
    import fcntl
    import shutil

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder, done = root / f"built-{name}", root / f"built-{name}.done"
    with open(root / f"built-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            done.touch()
    return folder


@pytest.fixture(autouse=True)
def _logging_is_reset_after_each_test():
    """A test that runs a command in this process (`rollway up`, `tasks verify`) configures structlog and the
    root logger for it; the next test must not inherit that (e.g. a stream that test's capture closed)."""
    import logging

    import structlog

    yield
    structlog.reset_defaults()
    logging.getLogger().handlers = []


@pytest.fixture(scope="session")
def broker():
    from rollway.runtime.broker import EmbeddedBroker

    b = EmbeddedBroker(0).start()
    yield b
    b.stop()


@pytest.fixture
def topic_prefix() -> str:
    """A fresh topic set (and consumer groups) per test on the shared broker."""
    return f"t{uuid.uuid4().hex[:8]}-"


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0, interval_s: float = 0.1,
               what: str = "condition") -> None:
    """Poll `predicate` until true; fail the test with `what` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="session")
def toolz_two_tasks(tmp_path_factory) -> Path:
    """Two toolz SWE instances in the older instances format (`rollway tasks build swe --sdist toolz==1.2.0
    --max-tasks 2 --seed 0 --format instances`): what `tasks.type: buglocal` reads, and what `swe`/`swebench`
    convert on load into SWE-bench rows over a git mirror (the one SWE task path), built once per test run
    (`built_once`): the build runs the archive's test suite per candidate bug in the jail (about a minute
    here), and several test modules need the same instances. The build is deterministic: its first row
    equals a one-task build's (tests/test_envs_swe.py checks that)."""
    import argparse

    from rollway.runners import cmd_tasks

    def build(folder: Path) -> None:
        parser = argparse.ArgumentParser(prog="rollway tasks")
        cmd_tasks.add_arguments(parser)
        args = parser.parse_args(["build", "swe", "--sdist", "toolz==1.2.0", "--max-tasks", "2", "--seed", "0",
                                  "--format", "instances", "--out", str(folder / "toolz.jsonl")])
        assert cmd_tasks.run(args) == 0

    return built_once(tmp_path_factory, "toolz", build) / "toolz.jsonl"


@pytest.fixture(scope="session")
def toolz_swebench_row(tmp_path_factory) -> Path:
    """The folder of one toolz SWE-bench row over git (`rows.jsonl`, the repository in `mirror/`), built by
    the default command (`rollway tasks build swe --sdist toolz==1.2.0 --max-tasks 1 --seed 0`) the way
    `rollway grader check` builds its SWE row when given none, once per test run for every test that needs
    an SWE-bench row (the build runs the archive's suite per candidate bug; it is deterministic, so every such
    test would build this same row). Its parent is a grader check cache folder holding it (`cache_dir`)."""
    from rollway.audit.grader_check import Options, _build_rows

    folder = built_once(tmp_path_factory, "toolz-swebench", lambda folder: _build_rows(Options(cache_dir=folder)))
    return folder / "swe-rows"


@pytest.fixture(scope="session")
def toolz_one_task(toolz_two_tasks, tmp_path_factory) -> Path:
    """The first of `toolz_two_tasks` alone, as a one-task instances file."""
    out = tmp_path_factory.mktemp("toolz1") / "toolz.jsonl"
    out.write_text(toolz_two_tasks.read_text().splitlines()[0] + "\n")
    return out


@pytest.fixture(scope="session")
def smoke_run(broker, tmp_path_factory):
    """One real `rollway up examples/smoke.yaml` on the session broker, shared by the report, show and
    re-run tests: its run folder, topic prefix and console output."""
    import sys
    from types import SimpleNamespace

    run_dir = tmp_path_factory.mktemp("smoke") / "run"
    prefix = f"smoke{uuid.uuid4().hex[:6]}-"
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "up", "examples/smoke.yaml", "--bootstrap",
                          broker.bootstrap, "runtime.processes=one", "--run-dir", str(run_dir), f"topics.prefix={prefix}"],
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return SimpleNamespace(run_dir=run_dir, prefix=prefix, bootstrap=broker.bootstrap, stderr=out.stderr)


class HiddenFolderSandbox(Sandbox):
    """A real sandbox seen as if it lived elsewhere (no host folder): tools must then list and read
    through exec/read_file instead of the host folder."""

    def __init__(self, inner: Sandbox) -> None:
        self.inner = inner

    @property
    def handle(self) -> dict[str, Any]:
        return self.inner.handle

    async def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        return await self.inner.exec(command, timeout_s)

    async def read_file(self, path: str) -> str:
        return await self.inner.read_file(path)

    async def write_file(self, path: str, content: str) -> None:
        await self.inner.write_file(path, content)

    async def diff(self) -> str:
        return await self.inner.diff()

    async def destroy(self) -> None:
        await self.inner.destroy()
