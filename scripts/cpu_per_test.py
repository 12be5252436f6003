"""CPU seconds of each test's whole process tree (children, sandboxes and servers it starts; not Docker's
containers), from a `cpuacct` cgroup (v1) per test. A profiling aid, not part of the suite; as root:

    PYTHONPATH=scripts .venv/bin/python -m pytest -p cpu_per_test -n 4 tests
    python scripts/cpu_per_test.py          # the table, from /tmp/cpu-per-test/*.jsonl

A process a test starts and leaves running (a session's server) stays in that test's cgroup: the table
reads each cgroup at the end, so its later CPU is counted there too."""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import sys
import time

ROOT = "/sys/fs/cgroup/cpuacct"
BASE = os.path.join(ROOT, "cpu-per-test")
OUT = "/tmp/cpu-per-test"


def _usage(path: str) -> float:
    with open(os.path.join(path, "cpuacct.usage")) as handle:
        return int(handle.read()) / 1e9


def _move(path: str) -> None:
    with open(os.path.join(path, "cgroup.procs"), "w") as handle:
        handle.write(str(os.getpid()))


try:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        path = os.path.join(BASE, f"{re.sub(r'[^A-Za-z0-9_.-]', '_', item.nodeid)[-200:]}-{os.getpid()}")
        os.makedirs(path, exist_ok=True)
        os.makedirs(OUT, exist_ok=True)
        start = time.time()
        _move(path)
        try:
            yield
        finally:
            _move(ROOT)
            with open(os.path.join(OUT, f"{os.getpid()}.jsonl"), "a") as handle:
                handle.write(json.dumps({"test": item.nodeid, "cgroup": path, "start": start,
                                         "wall": time.time() - start, "cpu": _usage(path)}) + "\n")
except ImportError:  # the table needs no pytest
    pass


def table(top: int = 40) -> None:
    rows = [json.loads(line) for name in glob.glob(os.path.join(OUT, "*.jsonl")) for line in open(name)]
    for row in rows:
        row["cpu"] = _usage(row["cgroup"]) if os.path.isdir(row["cgroup"]) else row["cpu"]
    files = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        entry = files[row["test"].split("::")[0]]
        entry[0] += row["cpu"]
        entry[1] += row["wall"]
        entry[2] += 1
    print(f"{len(rows)} tests, {sum(r['cpu'] for r in rows):.0f} core-seconds\n\ncore-s  test-s  tests  file")
    for name, (cpu, wall, count) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{cpu:6.1f} {wall:7.1f} {count:6d}  {name}")
    print("\ncore-s  test-s  test")
    for row in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        print(f"{row['cpu']:6.1f} {row['wall']:7.1f}  {row['test']}")


if __name__ == "__main__":
    table(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
