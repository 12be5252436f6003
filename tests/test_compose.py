"""compose for real: the rollway image built here FROM the local base, Apache Kafka swapped for the
embedded broker by the override file, three agent workers, the smoke job run to completion on the real
engine with Docker sandboxes, and nothing left behind."""

from __future__ import annotations

import os
import uuid

import docker
from docker_engine import REPO, count_containers, ensure_engine, remove_labelled
from jobs import run_with_progress

FILES = ["-f", "compose.yaml", "-f", "compose.embedded-broker.yaml"]


def stage_report(stages: list) -> str:
    """Every stage container's exit code, restarts and last lines: with --exit-code-from, compose stops the
    whole job when any container exits, so a scheduler stopped early names no culprit by itself."""
    lines = []
    for c in stages:
        c.reload()
        state = c.attrs["State"]
        tail = c.logs(tail=15).decode(errors="replace")
        lines.append(f"\n--- {c.name}: status={state['Status']} exit={state['ExitCode']} "
                     f"restarts={c.attrs.get('RestartCount')} finished={state.get('FinishedAt')}\n{tail}")
    return "".join(lines)


def test_compose_up_scaled_runs_the_smoke_job() -> None:
    client = ensure_engine()
    project = f"rwtest{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "DOCKER_GID": str(os.stat("/var/run/docker.sock").st_gid), "ROLLWAY_RUN_ID": project}
    compose = ["docker-compose", "-p", project, *FILES]
    try:
        up = run_with_progress([*compose, "up", "--build", "--scale", "agent=3", "--exit-code-from", "scheduler"],
                            cwd=REPO, env=env)  # fmt: skip
        log = up.stdout + up.stderr
        assert up.returncode == 0, log[-4000:]
        for i in (1, 2, 3):
            assert f"{project}_agent_{i}" in log
        stages = client.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"})
        # The scheduler's own log, from the engine: compose's attached output can end before a container's
        # last lines when it exits (seen once: exit code 0, the closing "stage worker stopped" line missing).
        scheduler = [c for c in stages if c.labels["com.docker.compose.service"] == "scheduler"]
        assert len(scheduler) == 1, [c.name for c in stages]
        scheduler_log = scheduler[0].logs().decode(errors="replace")
        # Every episode ended with its trajectory, none given up (counted by the scheduler's tickets: the number
        # of messages it handled varies with the agents' rebalance as workers join, which can cut a turn off and
        # re-issue its attempt, and with duplicates of superseded attempts).
        assert "episodes_completed=8" in scheduler_log and "episodes_failed=0" in scheduler_log, \
            scheduler_log[-3000:] + stage_report(stages)
        assert "dead_lettered=0" in scheduler_log, scheduler_log[-3000:]
        # Every container's stage is pid 1: its per-process files in the shared run folder are named by host
        # too, one per agent worker (one shared name made them overwrite each other and crash).
        listed = client.containers.run("rollway:latest", ["sh", "-c", "ls /runs/compose/status /runs/compose/telemetry"],
                                       volumes={f"{project}_runs": {"bind": "/runs", "mode": "ro"}}, remove=True,
                                       network_mode="none").decode()
        names = listed.split()
        assert len({n for n in names if n.startswith("agent-") and n.endswith(".json")}) == 3, listed
        assert len({n for n in names if n.startswith("agent-") and n.endswith(".jsonl")}) == 3, listed
        for c in stages:
            host = c.attrs["HostConfig"]
            assert c.attrs["Config"]["User"] == "10001:10001" and host["CapDrop"] == ["ALL"], c.name
            assert not host.get("CapAdd") and not host.get("Privileged"), c.name
            mounts = {m["Destination"] for m in c.attrs["Mounts"]}
            service = c.labels["com.docker.compose.service"]
            assert ("/var/run/docker.sock" in mounts) == (service in ("init", "agent", "reward")), c.name
    finally:
        run_with_progress([*compose, "down", "-v", "--remove-orphans"], cwd=REPO, env=env)
        left = count_containers(project)
        remove_labelled(project)  # a failed run leaves its episodes' sandboxes: never leak them into later tests
    assert left == 0  # every episode's sandbox container was removed
    assert not docker.from_env().containers.list(
        all=True, filters={"label": f"com.docker.compose.project={project}"}
    )
