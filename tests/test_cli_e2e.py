"""End to end through the real CLI: `rollway up`, separate stage processes, replay, dead letters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from conftest import ROOT, wait_until
from jobs import run_with_progress, wait_with_progress

pytestmark = pytest.mark.e2e
ROLLWAY = [sys.executable, "-m", "rollway.runners"]


def rollway(*args: str, **kw) -> subprocess.CompletedProcess:
    return run_with_progress([*ROLLWAY, *args], cwd=ROOT, **kw)


def replay(topic: str, bootstrap: str, *extra: str) -> list[dict]:
    out = rollway("replay", topic, "--bootstrap", bootstrap, "--json", *extra)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_up_runs_the_smoke_job_to_completion(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    out = rollway("up", "examples/smoke.yaml", "--run-dir", str(run_dir))
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episodes_scheduled"] == summary["episodes_completed"] == 8
    assert summary["episodes_failed"] == 0
    assert summary["reward_mean"] == 1.0 and summary["turns_mean"] == 4
    assert summary["suspected_reward_hacks"] == 0  # counted per run (envs/reach_check.py)
    assert set(summary["stage_seconds_total"]) >= {"init", "agent_gen", "agent_tool", "reward"}
    assert summary["stage_seconds_total"]["init"] > 0
    trajs = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len({t["episode"]["episode_id"] for t in trajs}) == 8
    assert {t["episode"]["group_id"] for t in trajs}.__len__() == 4
    for t in trajs:
        assert len(t["token_ids"]) == len(t["loss_mask"]) == len(t["logprobs"]) > 0
    assert wall < 120, f"smoke job took {wall:.1f}s"  # about 15 s here; a hang, not a loaded machine, crosses 120
    # A small job runs every stage in the command's own process (runtime.processes=auto), each stage the
    # sole owner of its partitions (no group join), and still logs each stage to its own files.
    pids = {json.loads(p.read_text())["stage"]: json.loads(p.read_text())["pid"] for p in (run_dir / "status").glob("*.json")}
    assert set(pids) == {"scheduler", "init", "agent", "reward", "learner", "sink"} and len(set(pids.values())) == 1, pids
    for stage in pids:
        lines = [json.loads(x) for x in (run_dir / "logs" / f"{stage}.jsonl").read_text().splitlines()]
        assert lines and {x["stage"] for x in lines} == {stage}, (stage, lines[:3])
        assert any(x["event"] == "partitions assigned" and x.get("sole_worker") for x in lines), stage
        assert "stage worker stopped" in (run_dir / "logs" / f"{stage}-0.out").read_text()
    assert {json.loads(x)["stage"] for x in (run_dir / "logs" / "up.jsonl").read_text().splitlines()} == {"up"}
    assert (run_dir / "report.html").stat().st_size > 0 and list((run_dir / "plots").glob("*.png"))  # drawn by default


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited (its parent has not reaped it yet)


def pids_with(fragment: str) -> set[int]:
    """Processes whose command line contains `fragment`."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if fragment in cmdline:
                found.add(int(entry))
    return found


def descendants(pid: int) -> set[int]:
    """Every process below `pid` now (children, their children, ...)."""
    found: set[int] = set()
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo = [pid]
    while todo:
        for kid in children.get(todo.pop(), []):
            found.add(kid)
            todo.append(kid)
    return found


@pytest.mark.parametrize("processes", ["per-stage", "one"])
def test_sigterm_stops_up_and_everything_it_started(tmp_path, processes):
    """Stage processes, their sandboxes and the broker run in their own sessions; a SIGTERM to `rollway up`
    (kill, a job manager) must stop them too, not leave them running. In one process the stages are
    tasks of `rollway up`: their sandboxes (bubblewrap children) and the broker must end with it."""
    from rollway.runtime.broker import free_port

    run_dir, port = tmp_path / "run", free_port()
    up = subprocess.Popen([*ROLLWAY, "up", "examples/smoke.yaml", "tasks.count=400", f"broker.port={port}",
                           f"runtime.processes={processes}", "--run-dir", str(run_dir)], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: len(list((run_dir / "status").glob("*.json"))) >= 6, timeout_s=60,
                   what="every stage writing its status")
        # A stage process's command is `rollway.runners stage NAME ...`; matching the run folder alone would
        # also catch a child `rollway up` has forked and not yet exec'd (it still shows its parent's command).
        stages = pids_with(f"--run-dir {run_dir}") & pids_with("-m rollway.runners stage ")
        broker = pids_with(f"tcp://127.0.0.1:{port}")
        assert broker and all(alive(p) for p in stages | broker)
        if processes == "per-stage":
            assert len(stages) >= 6
        else:
            assert not stages, "a one-process job started stage processes"
            wait_until(lambda: any("bwrap" in open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")
                                   for p in descendants(up.pid) if os.path.exists(f"/proc/{p}/cmdline")),
                       timeout_s=60, what="a sandbox of the job running")
        started = (stages | broker | descendants(up.pid)) - {up.pid}
        up.send_signal(signal.SIGTERM)
        assert wait_with_progress(up, watch=[run_dir]) == 143  # shutting down: stages write their last status
        wait_until(lambda: not any(alive(p) for p in started), timeout_s=30,
                   what="the stages, their sandboxes and the broker to exit")
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)


def test_sigterm_stops_bench_learn_and_the_phase_it_runs(tmp_path):
    """`rollway bench learn` runs each phase as a child `rollway`; a SIGTERM must reach that child so it
    stops its own stages and their sandboxes (before: the child was SIGKILLed and its workers kept running)."""
    from rollway.runtime.broker import free_port

    run_dir, port = tmp_path / "lb", free_port()
    bench = subprocess.Popen([*ROLLWAY, "bench", "learn", "examples/smoke.yaml", "tasks.count=400",
                              f"broker.port={port}", "--run-dir", str(run_dir)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: len(list((run_dir / "before" / "status").glob("*.json"))) >= 6, timeout_s=90,
                   what="the evaluation's stage processes writing their status")
        # The long-lived processes, which must be running now: the stage workers that wrote the status files
        # and the broker. A command-line match also finds short-lived ones (a child forked by the phase, before
        # its exec, carries the phase's command line: a CI run saw one end between the two looks), and the
        # descendants include sandbox commands that end on their own; they are only waited for below.
        phase = {json.loads(p.read_text())["pid"] for p in (run_dir / "before" / "status").glob("*.json")}
        broker = pids_with(f"tcp://127.0.0.1:{port}")
        matched = pids_with(f"--run-dir {run_dir}/before")
        started = phase | broker | matched | {kid for p in phase | matched for kid in descendants(p)}
        assert phase and broker and all(alive(p) for p in phase | broker)
        bench.send_signal(signal.SIGTERM)
        assert wait_with_progress(bench, watch=[run_dir]) == 143
        wait_until(lambda: not any(alive(p) for p in started), timeout_s=30,
                   what="the phase, its stages' sandboxes and the broker to exit")
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)


def test_config_errors_name_the_key(tmp_path):
    out = rollway("up", "examples/smoke.yaml", "agent.max_turnz=3", "--run-dir", str(tmp_path))
    assert out.returncode == 2 and "agent.max_turnz" in out.stderr
    out = rollway("up", "examples/smoke.yaml", "scheduler.group_size=zero", "--run-dir", str(tmp_path))
    assert out.returncode == 2 and "scheduler.group_size" in out.stderr
    out = rollway("up", "examples/missing.yaml")
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_broker_reports_a_taken_port():
    from rollway.runtime.broker import EmbeddedBroker

    with EmbeddedBroker() as b:
        out = rollway("broker", "--port", str(b.port))
    assert out.returncode != 0 and "already in use" in out.stderr


def test_every_command_has_help(capsys):
    """The real entry point lists every command; each command's --help (argparse, before any of the
    command's own code runs) is then asked in this process: a subprocess each cost a second of imports."""
    from rollway.runners.cli import command_modules, main

    out = rollway("--help")
    assert out.returncode == 0 and "usage:" in out.stdout
    for module in command_modules():
        assert module.NAME in out.stdout
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            main([module.NAME, "--help"])
        assert exited.value.code == 0 and "usage:" in capsys.readouterr().out, module.NAME


def test_separate_processes_two_agent_workers_replay_and_dead_letters(tmp_path):
    """Broker, then every stage as its own process (two agent workers); garbage on agent-steps
    is dead-lettered while the job completes; replay shows exactly the completed episodes."""
    from rollway.runtime.broker import free_port

    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []

    def start(*args: str, name: str) -> subprocess.Popen:
        f = open(logs / f"{name}.out", "wb")
        p = subprocess.Popen([*ROLLWAY, *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        procs.append(p)
        return p

    common = ["examples/smoke.yaml", "--bootstrap", bootstrap, "--run-dir", str(run_dir), "run.id=mp1",
              "tasks.count=6", "agent.concurrency=2"]
    try:
        start("broker", "--port", str(port), name="broker")
        wait_until(lambda: _listening(port), 15, what="broker")
        for stage in ("sink", "learner", "reward", "init"):
            start("stage", stage, *common, name=stage)
        start("stage", "agent", *common, name="agent-0")
        start("stage", "agent", *common, name="agent-1")
        time.sleep(4)  # let both agent workers join the group before work arrives
        _produce_garbage(bootstrap)
        sched = start("stage", "scheduler", *common, name="scheduler")
        wait_with_progress(sched, watch=[run_dir, logs])  # the whole job advances the run folder and logs
        assert sched.returncode == 0, (logs / "scheduler.out").read_text()[-2000:]
        status = json.loads((run_dir / "scheduler.json").read_text())
        assert status["done"] and status["episodes_completed"] == 12 and status["episodes_failed"] == 0

        trajs = replay("trajectories", bootstrap)
        episodes = {m["value"]["episode"]["episode_id"] for m in trajs}
        assert len(episodes) == status["episodes_completed"]
        for m in trajs:
            v = m["value"]
            assert len(v["token_ids"]) == len(v["loss_mask"]) > 0
            assert m["key"] == v["episode"]["episode_id"] and m["partition"] >= 0 and m["offset"] >= 0
        dead = replay("dead-letters", bootstrap)
        assert any(d["value"]["reason"].startswith("decode:") and d["value"]["source_topic"] == "agent-steps"
                   for d in dead)
        # Both agent workers did turns (the partitions were split between them).
        for name in ("agent-0", "agent-1"):
            assert "partitions assigned" in (logs / f"{name}.out").read_text()
        steps = replay("agent-steps", bootstrap, "--episode", sorted(episodes)[0])
        assert [s["value"]["turn"] for s in steps] == [0, 1, 2, 3]
        assert len({s["partition"] for s in steps}) == 1
        wait_until(lambda: json.loads((run_dir / "sink-status.json").read_text())["episodes_written"] == 12, 30,
                   what="sink")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def _listening(port: int) -> bool:
    from rollway.runtime.broker import port_in_use

    return port_in_use(port)


def _produce_garbage(bootstrap: str) -> None:
    import asyncio

    from aiokafka import AIOKafkaProducer

    async def go():
        p = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await p.start()
        try:
            for i in range(3):
                await p.send_and_wait("agent-steps", b"\x00garbage" + bytes([i]), key=b"junk%d" % i)
        finally:
            await p.stop()

    from rollway.config.run import RunConfig
    from rollway.runtime.kafka import ensure_topics

    asyncio.run(ensure_topics(RunConfig().broker, RunConfig().topics, bootstrap))
    asyncio.run(go())


def test_compose_file_has_kafka_and_a_service_per_stage():
    from rollway.actors import STAGES

    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert "apache/kafka" in services["kafka"]["image"]
    assert "broker,controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]
    for stage in STAGES:
        cmd = services[stage]["command"]
        assert cmd[:3] == ["rollway", "stage", stage] and "--bootstrap" in cmd
        assert cmd[cmd.index("--bootstrap") + 1] == "kafka:9092"
