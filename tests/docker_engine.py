"""The Docker engine for tests: the one scripts/setup-docker.sh starts (it is run again here if no
engine answers, e.g. after a reboot with the virtual environment already built)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import docker

from rollway.sandboxes.docker import LABEL

REPO = Path(__file__).resolve().parent.parent


def ensure_engine() -> docker.DockerClient:
    """A client of a running engine that has the base image; fails (never skips) without one."""
    try:
        client = docker.from_env()
        client.ping()
        client.images.get("rollway-sandbox:bookworm")
        return client
    except Exception:
        pass
    proc = subprocess.run(["bash", str(REPO / "scripts" / "setup-docker.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, f"scripts/setup-docker.sh failed:\n{proc.stderr[-3000:]}"
    client = docker.from_env()
    client.ping()
    return client


def count_containers(prefix: str) -> int:
    """Containers (running or not) and volumes the docker sandbox labelled with a name starting with `prefix`."""
    client = docker.from_env()
    # sparse: labels from the list answer itself. A full list inspects each container after listing it,
    # and fails when another process (a concurrent test run on the same engine) removes one in between.
    containers = client.containers.list(all=True, filters={"label": LABEL}, sparse=True)
    volumes = client.volumes.list(filters={"label": LABEL})
    return sum((c.attrs.get("Labels") or {}).get(LABEL, "").startswith(prefix) for c in containers) + sum(
        (v.attrs.get("Labels") or {}).get(LABEL, "").startswith(prefix) for v in volumes
    )


def remove_labelled(prefix: str) -> None:
    """Remove what `count_containers(prefix)` counts (a failed test's sandboxes), ignoring ones gone already."""
    client = docker.from_env()
    for c in client.containers.list(all=True, filters={"label": LABEL}, sparse=True):
        if (c.attrs.get("Labels") or {}).get(LABEL, "").startswith(prefix):
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                client.api.remove_container(c.id, force=True, v=True)
    for v in client.volumes.list(filters={"label": LABEL}):
        if (v.attrs.get("Labels") or {}).get(LABEL, "").startswith(prefix):
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                v.remove(force=True)



def pooled_containers_of(pids: set[int]) -> list[str]:
    """Names of the pooled containers (idle or handed out) that processes `pids` of this host started, by
    the pool-owner label: another test's pool running on the same engine is not counted."""
    import socket

    from rollway.sandboxes.docker import POOL_OWNER_LABEL

    owners = {f"{socket.gethostname()}:{pid}" for pid in pids}
    found = docker.from_env().containers.list(all=True, filters={"label": POOL_OWNER_LABEL}, sparse=True)
    return [(c.attrs.get("Labels") or {}).get(LABEL, "") for c in found
            if (c.attrs.get("Labels") or {}).get(POOL_OWNER_LABEL) in owners]
