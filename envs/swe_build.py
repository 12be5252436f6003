"""Build SWE-bench-style instances by injecting small bugs into a library's sdist and keeping those its tests catch."""

from __future__ import annotations

import asyncio
import difflib
import os
import posixpath
import random
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollway.envs.mutations import Mutation, apply_mutation, iter_module_mutations
from rollway.envs.pytest_report import PytestReport, node_file, parse_pytest_output, pytest_command
from rollway.envs.sdist import Snapshot, parse_requirement, prepare_snapshot
from rollway.sandboxes.base import SandboxError, SandboxSpec
from rollway.sandboxes.config import SandboxConfig
from rollway.sandboxes.local import LocalSandboxProvider

# Folders that hold no library code or tests worth running (docs, benchmarks, build output).
_SKIP_DIRS = {".git", ".tox", ".nox", "build", "dist", "docs", "doc", "examples", "example", "bench",
              "benchmarks", "benchmark", "__pycache__", ".rollway", "node_modules", "venv", ".venv"}
_NOT_LIBRARY = {"setup.py", "conftest.py", "noxfile.py", "tasks.py", "versioneer.py", "_version.py",
                "fabfile.py", "docs_conf.py"}


class BuildError(RuntimeError):
    """The library cannot yield tasks; the message says why and what to try."""


@dataclass
class BuildOptions:
    sdist: str
    max_tasks: int = 5
    seed: int = 0
    max_failing: int = 5
    max_candidates: int = 400
    """Give up after trying this many mutations."""
    max_per_function: int = 1
    """Keep at most this many bugs in one function, so tasks spread over the library."""
    cache_dir: str | None = None
    sandbox_root: str | None = None
    """Folder of the local jail the archive's tests run in (sandbox.root); default /tmp/rollway-sandboxes."""
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))
    resume: list[dict[str, Any]] = field(default_factory=list)
    """Instances an interrupted build of the same sdist and seed already kept (they count toward max_tasks)."""
    skip_candidates: int = 0
    """Candidates (in the seeded order) that interrupted build already tried: not tried again."""
    on_tried: Callable[[int, dict[str, Any] | None], None] | None = None
    """Called after each candidate with how many were tried so far and the instance kept (or None), so a
    caller can record progress and resume (`rollway tasks build buglocal`)."""


# ---------------------------------------------------------------- layout of an unpacked sdist


def _walk_py(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")
                             and not d.endswith(".egg-info"))
        found += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return found


def _is_test_path(rel: Path) -> bool:
    name = rel.name
    in_tests_dir = any(part in ("tests", "test", "testing") for part in rel.parts[:-1])
    return name.startswith("test_") or name.endswith("_test.py") or (in_tests_dir and name != "__init__.py")


def find_test_files(root: Path) -> list[str]:
    """Test modules pytest would collect by default naming: tests/ and test/ folders (top level or
    inside the package) and test_*.py / *_test.py files anywhere outside docs and benchmarks."""
    files = []
    for path in _walk_py(root):
        rel = path.relative_to(root)
        if rel.name.startswith("test_") or rel.name.endswith("_test.py"):
            files.append(rel.as_posix())
    if not files:
        raise BuildError(f"no test files (test_*.py or *_test.py) in {root}; this sdist ships no tests, "
                         "pick another library or version")
    return files


def python_path(root: Path) -> tuple[str, ...]:
    """Import roots, relative to the repository root: `.` and `src` for src-layout projects."""
    return (".", "src") if (root / "src").is_dir() else (".",)


def find_library_files(root: Path) -> dict[str, bytes]:
    """Library source files (path relative to root -> bytes): modules under the import roots that
    are neither tests nor packaging helpers."""
    files: dict[str, bytes] = {}
    for base in python_path(root):
        base_dir = root / base
        for path in _walk_py(base_dir):
            rel_to_base = path.relative_to(base_dir)
            if base == "." and rel_to_base.parts[0] == "src" and len(python_path(root)) > 1:
                continue
            if _is_test_path(rel_to_base) or path.name in _NOT_LIBRARY:
                continue
            if len(rel_to_base.parts) > 1 and not _is_package_dir(base_dir, rel_to_base):
                continue  # scripts in tool folders are not importable library code
            files[path.relative_to(root).as_posix()] = path.read_bytes()
    if not files:
        raise BuildError(f"no library modules found under {root}; is this a pure-Python project?")
    return files


def _is_package_dir(base: Path, rel: Path) -> bool:
    """True when every folder from `base` down to the file has an __init__.py (a real package)."""
    folder = base
    for part in rel.parts[:-1]:
        folder = folder / part
        if not (folder / "__init__.py").is_file():
            return False
    return True


# ---------------------------------------------------------------- running the archive's tests, jailed


@dataclass
class Run:
    report: PytestReport
    output: str
    duration_s: float
    timed_out: bool


_LOG = ".rollway/build/pytest.log"
"""Where a run's pytest output goes (a file: -rA lists every test, more than a command's output keeps)."""


def jail_config(root: str | None = None) -> SandboxConfig:
    """The local jail the archive's tests run in: no network, the workspace only, a cleared environment,
    limits roomy enough for a library's whole suite."""
    return SandboxConfig(type="local", root=root, memory_mb=4096, workspace_mb=2048, max_processes=512,
                         max_file_mb=512, tmp_mb=1024)


class _Loop:
    """A private event loop on its own thread: the sync builder drives the async sandbox through it,
    whether or not its caller already runs a loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollway-swe-build", daemon=True)
        self._thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@dataclass
class Baseline:
    test_files: list[str]
    passing: set[str]
    duration_s: float


def run_baseline(work: _Workspace, log: Callable[[str], None], timeout_s: float = 900) -> Baseline:
    """Tests that pass on the clean tree, twice in a row (flaky tests would make bad tasks).
    Files that fail to import here (a missing optional dependency) are dropped, not fatal; a clean run
    that does not finish ends the build at once (every candidate would wait as long)."""
    root = work.root

    def clean_run(files: list[str]) -> Run:
        done = work.run(files, timeout_s=timeout_s)
        if done.timed_out:
            tail = "\n".join(done.output.strip().splitlines()[-5:])
            raise BuildError(f"the clean test suite in {root} did not finish in {timeout_s:.0f} s (a test that waits "
                             f"for a terminal or the network, or a suite too slow to grade); pytest said last:\n"
                             f"{tail}\npick another library or version")
        return done

    files = find_test_files(root)
    first = clean_run(files)
    if first.report.collection_errors:
        broken = set(first.report.collection_errors)
        log(f"baseline: dropping {len(broken)} test file(s) that do not import here: {sorted(broken)[:5]}")
        files = [f for f in files if f not in broken and not any(f.startswith(b.rstrip("/") + "/") for b in broken)]
        first = clean_run(files)
    second = clean_run(files)
    passing = first.report.passed() & second.report.passed()
    failing = len(first.report.outcomes) - len(first.report.passed())
    log(f"baseline: {len(passing)} passing tests in {len(files)} files ({failing} failing, dropped), "
        f"{first.duration_s:.1f}s per run")
    if not passing:
        tail = "\n".join(first.output.strip().splitlines()[-15:])
        raise BuildError(f"no test passes on the clean sdist in {root}; pytest said:\n{tail}\n"
                         "install the test dependencies into the rollway venv or pick another library")
    files = sorted({node_file(n) for n in passing})
    return Baseline(files, passing, first.duration_s)


# ---------------------------------------------------------------- candidates and instances


def ordered_candidates(library: dict[str, bytes], seed: int) -> list[Mutation]:
    """All candidate mutations in a seeded random order (same seed, same order)."""
    candidates = list(iter_module_mutations(library))
    random.Random(seed).shuffle(candidates)
    return candidates


def select_test_files(root: Path, baseline: Baseline, mutation: Mutation) -> list[str]:
    """Test files that mention the mutated module or function (a fast first check); all when none do."""
    module = Path(mutation.path).stem
    names = {module if module != "__init__" else Path(mutation.path).parent.name,
             mutation.function.split(".")[-1], mutation.function.split(".")[0]}
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in sorted(names) if n) + r")\b")
    chosen = [f for f in baseline.test_files if pattern.search((root / f).read_text("utf-8", "replace"))]
    return chosen or baseline.test_files


def make_patch(path: str, before: bytes, after: bytes) -> str:
    """Git-style unified diff (a/ b/ prefixes) turning `before` into `after`."""
    old = before.decode("utf-8").splitlines(keepends=True)
    new = after.decode("utf-8").splitlines(keepends=True)
    lines = [f"diff --git a/{path} b/{path}\n"]
    for line in difflib.unified_diff(old, new, f"a/{path}", f"b/{path}", n=3):
        lines.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(lines)


def problem_statement(sdist: str, failing: list[str], report: PytestReport) -> str:
    """What a user would report: which tests fail and how, never where the bug is or how to fix it."""
    lines = [f"Some behaviour of `{sdist}` is broken: tests of its own test suite fail on this checkout.",
             "", "Failing tests:"]
    for node in failing:
        message = report.messages.get(node, "")
        excerpt = (message[:300] + " ...") if len(message) > 300 else message
        lines.append(f"- `{node}`" + (f": {excerpt}" if excerpt else ""))
    lines += ["", "The rest of the test suite passes. Find the cause in the library source and fix it, "
              "without changing the tests, so that these tests pass again."]
    return "\n".join(lines)


def _instance_id(sdist: str, mutation: Mutation, k: int) -> str:
    name, version = parse_requirement(sdist)
    return f"{name.lower().replace('-', '_')}__{version}__{_id_function(mutation.function)}__{k}"


def _id_function(function: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", function)


def make_instance(snapshot: Snapshot, baseline: Baseline, root: Path, mutation: Mutation, k: int,
                  failing: list[str], report: PytestReport, seed: int) -> dict[str, Any]:
    clean = (root / mutation.path).read_bytes()
    buggy = apply_mutation(clean, mutation)
    fail_to_pass = sorted(failing)
    pass_to_pass = sorted(baseline.passing - set(failing))
    return {
        "instance_id": _instance_id(snapshot.sdist, mutation, k),
        "repo": snapshot.sdist,
        "snapshot": snapshot.to_dict(),
        "base_commit": f"sdist-sha256:{snapshot.sha256}",
        "problem_statement": problem_statement(snapshot.sdist, fail_to_pass, report),
        "FAIL_TO_PASS": fail_to_pass,
        "PASS_TO_PASS": pass_to_pass,
        "patch": make_patch(mutation.path, buggy, clean),
        "test_patch": "",
        "bug_patch": make_patch(mutation.path, clean, buggy),
        "mutation": mutation.to_dict(),
        "test_files": sorted({node_file(n) for n in fail_to_pass + pass_to_pass}),
        "python_path": list(python_path(root)),
        "test_command": pytest_command(sorted({node_file(n) for n in fail_to_pass + pass_to_pass}),
                                       python_path=python_path(root)),
        "seed": seed,
    }


# ---------------------------------------------------------------- the build loop


class _Workspace:
    """The archive's tests run here: a local bubblewrap sandbox holding a copy of the snapshot (no network,
    the workspace only, none of the host's environment, as the invoking user never), where mutations are
    applied and undone one at a time. Everything the builder reads comes from `root`, the pristine
    snapshot, never from the jail's copy, which the tests may change (a planted symlink included)."""

    def __init__(self, snapshot_path: Path, sandbox_root: str | None = None) -> None:
        self.root = snapshot_path
        self._loop = _Loop()
        provider = LocalSandboxProvider(jail_config(sandbox_root))
        try:
            spec = SandboxSpec(source_dir=str(snapshot_path))
            self._box = self._loop.run(provider.create(spec, f"swe-build-{uuid.uuid4().hex[:12]}"))
        except BaseException:
            self._loop.close()
            raise

    def run(self, files: list[str], timeout_s: float, rewrite_asserts: bool = False) -> Run:
        """pytest on `files` in the jail; on timeout the jail's whole process tree dies (a mutated loop may
        never end, and it may have spawned workers)."""
        cmd = pytest_command(files, python_path=python_path(self.root), rewrite_asserts=rewrite_asserts)
        start = time.monotonic()
        done = self._loop.run(self._box.exec(f"mkdir -p {posixpath.dirname(_LOG)} && {cmd} > {_LOG} 2>&1",
                                             timeout_s=timeout_s))
        try:
            text = self._loop.run(self._box.read_file(_LOG))
        except SandboxError:  # the tests removed or replaced the log: nothing to read is nothing passed
            text = done.output
        return Run(parse_pytest_output(text), text, time.monotonic() - start, done.timed_out)

    def run_mutated(self, mutation: Mutation, files: list[str], timeout_s: float,
                    rewrite_asserts: bool = False) -> Run:
        clean = (self.root / mutation.path).read_bytes()
        self._loop.run(self._box.write_bytes(mutation.path, apply_mutation(clean, mutation)))
        try:
            return self.run(files, timeout_s, rewrite_asserts)
        finally:
            self._loop.run(self._box.write_bytes(mutation.path, clean))

    def close(self) -> None:
        try:
            self._loop.run(self._box.destroy())
        finally:
            self._loop.close()


def judge(run: Run, expected: set[str], max_failing: int) -> tuple[list[str] | None, str]:
    """Failing tests when the mutant is a usable bug, else None and the reason it is not."""
    if run.timed_out:
        return None, "timeout"
    if run.report.collection_errors:
        return None, "collection error"
    failing = sorted(t for t in expected if run.report.outcomes.get(t) != "passed")
    if not failing:
        return None, "no test fails"
    if len(failing) > max_failing:
        return None, f"{len(failing)} tests fail"
    return failing, f"{len(failing)} failing"


def build_instances(opts: BuildOptions) -> list[dict[str, Any]]:
    """Mutate the library, keep mutants that 1..max_failing baseline tests catch, up to max_tasks."""
    snapshot = prepare_snapshot(opts.sdist, opts.cache_dir)
    opts.log(f"snapshot: {snapshot.sdist} sha256 {snapshot.sha256[:12]} at {snapshot.path}")
    work = _Workspace(Path(snapshot.path), opts.sandbox_root)
    try:
        return _search(opts, snapshot, work)
    finally:
        work.close()


def _search(opts: BuildOptions, snapshot: Snapshot, work: _Workspace) -> list[dict[str, Any]]:
    baseline = run_baseline(work, opts.log)
    library = find_library_files(work.root)
    candidates = ordered_candidates(library, opts.seed)
    opts.log(f"candidates: {len(candidates)} mutations in {len(library)} library files (seed {opts.seed})")
    timeout_s = max(20.0, 4 * baseline.duration_s + 10)
    per_function_index = _per_function_index(candidates)
    kept: list[dict[str, Any]] = list(opts.resume)
    used: dict[tuple[str, str], int] = {}
    for row in kept:
        key = (row["mutation"]["path"], row["mutation"]["function"])
        used[key] = used.get(key, 0) + 1
    for tried, mutation in enumerate(candidates[: opts.max_candidates], start=1):
        if len(kept) >= opts.max_tasks:
            break
        key = (mutation.path, mutation.function)
        if tried <= opts.skip_candidates or used.get(key, 0) >= opts.max_per_function:
            continue
        instance, verdict = _try(opts, snapshot, work, baseline, mutation, per_function_index[mutation],
                                 timeout_s)
        status = f"kept ({len(kept) + 1}/{opts.max_tasks})" if instance else "skipped"
        opts.log(f"[{tried}/{min(len(candidates), opts.max_candidates)}] {mutation.path}:{mutation.line} "
                 f"{mutation.function} {mutation.operator} {mutation.original!r}->{mutation.replacement!r}: "
                 f"{verdict}, {status}")
        if instance:
            kept.append(instance)
            used[key] = used.get(key, 0) + 1
        if opts.on_tried is not None:
            opts.on_tried(tried, instance)
    if not kept:
        raise BuildError(f"no mutation of {opts.sdist} made 1..{opts.max_failing} tests fail; try another "
                         "--seed, a larger --max-failing or --max-candidates")
    return kept


def _per_function_index(candidates: list[Mutation]) -> dict[Mutation, int]:
    """k in an instance id: the mutation's rank among those whose function has the same name in the id,
    in source order (seed-free). Counted over every file: two files may define one function name (python-
    slugify's `_decode_entities`), and `A.b` and `A_b` read the same in an id."""
    index: dict[Mutation, int] = {}
    counts: dict[str, int] = {}
    for m in sorted(candidates, key=lambda m: (m.path, m.start, m.end, m.replacement)):
        key = _id_function(m.function)
        index[m] = counts.get(key, 0)
        counts[key] = index[m] + 1
    return index


def _try(opts: BuildOptions, snapshot: Snapshot, work: _Workspace, baseline: Baseline, mutation: Mutation,
         k: int, timeout_s: float) -> tuple[dict[str, Any] | None, str]:
    files = select_test_files(work.root, baseline, mutation)
    expected = {t for t in baseline.passing if node_file(t) in set(files)}
    run = work.run_mutated(mutation, files, timeout_s)
    failing, verdict = judge(run, expected, opts.max_failing)
    if failing is None:
        return None, verdict
    if files != baseline.test_files:
        # The quick check ran a subset: FAIL_TO_PASS must come from the whole suite.
        run = work.run_mutated(mutation, baseline.test_files, timeout_s)
        failing, verdict = judge(run, baseline.passing, opts.max_failing)
        if failing is None:
            return None, f"whole suite: {verdict}"
    # The statuses came from the row's own command (plain asserts); the statement shows how each test fails
    # as a user would see it, with pytest's assert detail: one more run of the failing tests' files.
    told = work.run_mutated(mutation, sorted({node_file(t) for t in failing}), timeout_s, rewrite_asserts=True)
    report = PytestReport(run.report.outcomes, {**run.report.messages, **told.report.messages},
                          run.report.collection_errors)
    return make_instance(snapshot, baseline, work.root, mutation, k, failing, report, opts.seed), verdict
