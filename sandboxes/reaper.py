"""The sandbox reaper: removes the sandboxes a killed worker could not (a SIGKILLed init, agent or
reward worker never reaches its cleanup), found by the run id their names start with.

Every episode sandbox is named `<episode id>-a<attempt>-<suffix>` (actors/init.py) and every episode
id starts with `<run id>-`, so a run's sandboxes are the local jail folders under `sandbox.root`,
the docker containers (name `rollway-<sandbox name>`, label `rollway.sandbox`) and their volumes
whose names start with the run id. `rollway up` reaps its run's sandboxes when the run ends (every
episode is then finished or unknown) and at start (a run folder being resumed keeps its run id);
`rollway sandbox reap [--run RUN]` does it by hand.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from rollway.sandboxes.base import EngineUnreachable, SandboxError, SandboxProvider

log = structlog.get_logger()


@dataclass
class ReapReport:
    """What one reap removed, by sandbox name."""

    removed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """Sandbox name -> why it could not be removed (the next reap tries again)."""


def run_prefix(run_id: str | None) -> str:
    """The name prefix of a run's sandboxes ('' for every episode sandbox of any run)."""
    if run_id is not None and (not run_id or "/" in run_id):
        raise ValueError(f"run id {run_id!r} cannot name sandboxes; pass the run.id of summary.json or config.json")
    return f"{run_id}-" if run_id else ""


async def reap_run(provider: SandboxProvider, run_id: str | None) -> ReapReport:
    """Remove every sandbox of run `run_id` (every episode sandbox when None) that `provider` can
    see. Call it only when no worker of that run is running: a live episode's sandbox goes too."""
    from rollway.sandboxes.fleet import FleetSandboxProvider

    prefix = run_prefix(run_id)
    report = ReapReport()
    if isinstance(provider, FleetSandboxProvider):  # every engine; one that does not answer is reported
        for engine in provider.engines.values():
            try:
                part = await reap_run(engine.provider, run_id)
            except SandboxError as err:
                report.failed[f"engine:{engine.id}"] = str(err)
                log.warning("engine not reaped", engine=engine.id, error=str(err)[:300])
                continue
            report.removed += part.removed
            report.failed.update(part.failed)
        return report
    for name in await asyncio.to_thread(leftover_names, provider, prefix):
        try:
            await remove_named(provider, name)
        except Exception as err:  # noqa: BLE001 - deliberate: one stuck sandbox must not stop the rest
            report.failed[name] = f"{type(err).__name__}: {err}"
            log.warning("sandbox not reaped", sandbox=name, error=report.failed[name])
        else:
            report.removed.append(name)
    if report.removed:
        log.info("leftover sandboxes reaped", run_id=run_id, count=len(report.removed))
    return report


def leftover_names(provider: SandboxProvider, prefix: str) -> list[str]:
    """Names of `provider`'s sandboxes starting with `prefix` (pooled warm containers excluded:
    they belong to a live init worker's pool, and the pool reaps its own orphans)."""
    from rollway.sandboxes.docker import DockerSandboxProvider
    from rollway.sandboxes.fleet import FleetSandboxProvider
    from rollway.sandboxes.local import LocalSandboxProvider

    if isinstance(provider, LocalSandboxProvider):
        return _local_names(provider.root, prefix)
    if isinstance(provider, DockerSandboxProvider):
        return _docker_names(provider, prefix)
    if isinstance(provider, FleetSandboxProvider):
        return sorted({n for names in names_by_engine(provider, prefix).values() for n in names})
    log.warning("this sandbox type has no reaper; leftovers stay", provider=type(provider).__name__)
    return []


def names_by_engine(provider: SandboxProvider, prefix: str, skip_down: bool = False) -> dict[str, list[str]]:
    """`leftover_names` per engine: a fleet's engine ids, else `local`. An engine that does not answer
    raises EngineUnreachable, or (`skip_down`) is left out."""
    from rollway.sandboxes.fleet import FleetSandboxProvider

    if not isinstance(provider, FleetSandboxProvider):
        return {"local": leftover_names(provider, prefix)}
    found = {}
    for engine in provider.engines.values():
        try:
            found[engine.id] = _docker_names(engine.provider, prefix)
        except EngineUnreachable:
            if not skip_down:
                raise
    return found


async def remove_named(provider: SandboxProvider, name: str) -> None:
    """Remove sandbox `name` with everything it holds (folder, tmpfs mount, cgroup; container and
    volume); nothing when it is gone. Works without a handle, so it also removes a sandbox whose
    creation failed or was cancelled half way."""
    from rollway.sandboxes.docker import DockerSandboxProvider
    from rollway.sandboxes.fleet import FleetSandboxProvider
    from rollway.sandboxes.local import LocalSandboxProvider, remove_tree

    if isinstance(provider, LocalSandboxProvider):
        box_dir = provider._box_dir(name)  # refuses a name that is not one folder under the root
        cgroup = provider.cgroup(name, create=False)
        if cgroup is not None:
            await asyncio.to_thread(cgroup.remove)
        provider._limits.pop(str(box_dir), None)
        await asyncio.to_thread(remove_tree, box_dir)
    elif isinstance(provider, DockerSandboxProvider):
        await asyncio.to_thread(_remove_docker, provider, name)
    elif isinstance(provider, FleetSandboxProvider):  # placed on one engine, which only that engine knows
        for engine in provider.engines.values():
            if not engine.down_reason:
                await asyncio.to_thread(_remove_docker, engine.provider, name)


def _local_names(root: Path, prefix: str) -> list[str]:
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    return [e.name for e in entries if e.is_dir(follow_symlinks=False) and e.name.startswith(prefix)]


def _docker_names(provider, prefix: str) -> list[str]:
    """Sandbox names of the episode containers named `rollway-<prefix>...` and of the workspace
    volumes left without their container."""
    from rollway.sandboxes.docker import LABEL

    want = f"rollway-{prefix}"
    listed = [n.lstrip("/") for c in provider.listed(LABEL) for n in (c.get("Names") or [])]
    names = {n.removeprefix("rollway-") for n in listed if n.startswith(want) and not n.startswith("rollway-pool-")}
    names |= {v.name.removeprefix("rollway-") for v in provider.client.volumes.list(filters={"label": LABEL})
              if v.name.startswith(want) and not v.name.startswith("rollway-pool-")}
    return sorted(names)


def _remove_docker(provider, name: str) -> None:
    """The container `rollway-<name>` with its volume (a pooled container taken by an episode was
    renamed after it; its label still names its volume), then a volume `rollway-<name>` left alone."""
    from rollway.sandboxes.docker import LABEL

    for container in provider.listed(LABEL):
        if f"/rollway-{name}" in (container.get("Names") or []):
            provider.remove(str(container["Id"]), (container.get("Labels") or {}).get(LABEL, name))
    provider.remove(f"rollway-{name}", name)
