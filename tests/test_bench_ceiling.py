"""The ceiling benchmark: its timing wrappers, and a tiny `rollway bench ceiling --json` run (one real
agent worker on the embedded broker against the simulated server answering at once)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from jobs import run_with_progress

from rollway.bench.ceiling import CallTimers


class Target:
    def work(self, x: int) -> int:
        return x + 1

    async def wait(self, x: int) -> int:
        await asyncio.sleep(0.01)
        return x * 2


def test_call_timers_time_sync_and_async_calls_and_restore_the_originals():
    target, timers = Target(), CallTimers()
    original = target.work
    timers.wrap(target, "work", "cpu")
    timers.wrap(target, "wait", "io")
    assert target.work(1) == 2 and asyncio.run(target.wait(3)) == 6
    assert timers.calls == {"cpu": 1, "io": 1} and timers.seconds["io"] >= 0.01 > timers.seconds["cpu"]
    assert timers.per_turn_ms(2)["io"] == pytest.approx(1000 * timers.seconds["io"] / 2)
    timers.restore()
    assert target.work == original and target.work(1) == 2 and timers.calls["cpu"] == 1, "unwrapped: not timed"


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_ceiling_json_counts_every_turn_and_breaks_it_down(tmp_path):
    out = tmp_path / "ceiling"
    proc = run_with_progress(
        [sys.executable, "-m", "rollway.runners", "bench", "ceiling", "--json", "--out", str(out),
         "episodes=12", "slots=2", "tool_overlap=2", "turns_median=3", "thought_tokens_median=10"],
        cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, in_flight in (("serial", 1), ("concurrent", 2 + 2 + 2)):
        r = result[name]
        assert r["turns_in_flight"] == in_flight and r["turns_per_s"] > 0 and r["cpu_ms_per_turn"] > 0
        assert 0 < r["turns_timed"] < r["turns"]
        for key in ("decode", "tokenisation", "inference_round_trip", "tool_dispatch", "produce", "handle"):
            assert r["per_turn_ms"][key] > 0, key
        assert r["per_turn_ms"]["handle"] >= r["per_turn_ms"]["inference_round_trip"]


def test_sim_server_dies_with_a_bench_killed_from_outside(tmp_path):
    """A bench process SIGKILLed while its simulated server runs (no cleanup code runs) takes the
    server with it: the kernel's parent-death signal, not an exit handler, ends the child."""
    import os
    import signal
    import time

    script = ("import sys, time\nfrom pathlib import Path\n"
              "from rollway.bench.run import SimServer\nfrom rollway.bench.workload import WorkloadConfig, "
              "plan_workload, write_plans\n"
              "out = Path(sys.argv[1]); wl = WorkloadConfig(episodes=2)\n"
              "write_plans(plan_workload(wl), out / 'plans.jsonl')\n"
              "with SimServer(out / 'plans.jsonl', wl, out / 'sim.log') as s:\n"
              "    print(s.proc.pid, flush=True); time.sleep(600)\n")
    bench = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(bench.stdout.readline())
        os.kill(server_pid, 0)  # running
        bench.send_signal(signal.SIGKILL)
        bench.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.waitpid(server_pid, os.WNOHANG)  # not our child: raises; zombie reaped by init
            except ChildProcessError:
                pass
            try:
                os.kill(server_pid, 0)
            except ProcessLookupError:
                return
            if Path(f"/proc/{server_pid}/stat").read_text().split(")")[1].split()[0] == "Z":
                return
            time.sleep(0.1)
        os.kill(server_pid, signal.SIGKILL)
        pytest.fail("the sim server outlived its killed parent")
    finally:
        if bench.poll() is None:
            bench.kill()
