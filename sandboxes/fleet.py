"""A fleet of Docker engines behind `sandbox.type: docker`: places each new sandbox on an engine with free
capacity, reattaches to a sandbox by the engine id its handle names, and marks an engine that stops
answering down (probed again with back-off) so placements avoid it and its episodes fail as infrastructure.

Each engine is driven by its own `DockerSandboxProvider` (its own client, warm pool and image cache); the
fleet only chooses among them. The default fleet is the local engine alone, which behaves exactly like a
single provider (no capacity: no counting, no waiting).

Placement bound: a worker counts an engine's sandboxes from the engine's own list (rollway-labelled
containers that are created or running, warm-pool ones included) plus its own placements whose container
does not exist yet, under one lock per process. Another init process's placements are invisible to it until
their containers exist, so with W init processes each creating at most F sandboxes at once, an engine holds
at most `capacity + (W - 1) * F` sandboxes (the bound stated in docs/deployment.md).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog

from rollway.runtime import metrics
from rollway.sandboxes.base import (
    EngineOutOfDisk,
    EngineUnreachable,
    Sandbox,
    SandboxError,
    SandboxProvider,
    SandboxSpec,
)
from rollway.sandboxes.config import DockerSandboxConfig, EngineConfig
from rollway.sandboxes.docker import _UNREACHABLE, LABEL, DockerSandbox, DockerSandboxProvider, engine_errors

log = structlog.get_logger()

PROBE_BACKOFF_S = (1.0, 30.0)
"""First and longest wait between probes of an engine that is down (doubling in between)."""
FULL_WAIT_S = (0.2, 2.0)
"""First and longest wait of an init worker while every engine is full or down (back-pressure)."""
ALL_DOWN_WAIT_S = 60.0
"""How long an init worker waits while no engine answers at all before it fails the attempt as
infrastructure (EngineUnreachable: re-issued by the scheduler); a full fleet is waited on without limit."""
_LIVE_STATES = ("created", "running", "restarting", "paused")
_RUN_OF = re.compile(r"^(?P<run>.+?)-g\d+-")


_TUNNEL_STARTER = ThreadPoolExecutor(1, thread_name_prefix="ssh-tunnels")
"""Starts every ssh tunnel: a thread that lasts as long as this process, so the kernel's parent-death signal
ends the tunnels with the process (a SIGKILLed worker's too) and never with a short-lived caller thread."""


class SshTunnel:
    """An `ssh://` engine's unix socket forwarded to a private socket of this host (a 0700 folder) by the
    system's ssh client, which docker-py then reaches like a local engine: real sockets, so command streams
    keep their deadlines. Host keys are checked strictly (an unknown or changed key is refused), only
    `ssh_key` is offered, and no prompt can block. The key stays in its file: ssh is given its path. The ssh
    process dies with this process; the engine's provider starts a new one when it has ended."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.folder = tempfile.mkdtemp(prefix="rollway-ssh-")
        self.socket = os.path.join(self.folder, "docker.sock")
        self.proc: subprocess.Popen | None = None

    def open(self) -> str:
        """Start ssh and wait for the forwarded socket (made once ssh has logged in); its base_url."""
        from rollway.base.process import _die_with_parent

        parts = urlsplit(self.cfg.endpoint or "")
        remote = parts.path if parts.path not in ("", "/") else "/var/run/docker.sock"
        options = {"BatchMode": "yes", "StrictHostKeyChecking": "yes", "ExitOnForwardFailure": "yes",
                   "ConnectTimeout": int(self.cfg.timeout_s), "ServerAliveInterval": 10, "ServerAliveCountMax": 3,
                   **({"IdentityFile": self.cfg.ssh_key, "IdentitiesOnly": "yes"} if self.cfg.ssh_key else {}),
                   **({"UserKnownHostsFile": self.cfg.ssh_known_hosts} if self.cfg.ssh_known_hosts else {})}
        argv = ["ssh", "-N", "-T", *[a for k, v in options.items() for a in ("-o", f"{k}={v}")],
                *(["-p", str(parts.port)] if parts.port else []), *(["-l", parts.username] if parts.username else []),
                "-L", f"{self.socket}:{remote}", "--", parts.hostname or ""]
        with open(os.path.join(self.folder, "ssh.err"), "wb") as err:
            self.proc = _TUNNEL_STARTER.submit(subprocess.Popen, argv, stdin=subprocess.DEVNULL, stderr=err,
                                               stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent).result()
        deadline = time.monotonic() + self.cfg.timeout_s + 5
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                said = [x for x in Path(self.folder, "ssh.err").read_text(errors="replace").split("\n") if x.strip()]
                self.close()  # its last two lines: the reason (above them, a changed host key's banner)
                raise ConnectionError(f"ssh to {parts.hostname} ended: " + "; ".join(said[-2:] or ["timed out"]))
            time.sleep(0.05)
        return f"unix://{self.socket}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def engine_client(cfg: EngineConfig) -> Any:
    """A docker-py client of engine `cfg` (connects: raises when it does not answer). An `ssh://` engine's
    client holds its SshTunnel (`client.tunnel`), closed with the client."""
    import docker

    if cfg.endpoint is None:
        return docker.from_env(timeout=int(cfg.timeout_s))
    tls: Any = None
    if cfg.tls_cert or cfg.tls_ca:
        tls = docker.tls.TLSConfig(client_cert=(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None,
                                   ca_cert=cfg.tls_ca, verify=cfg.tls_ca or True)
    tunnel = SshTunnel(cfg) if cfg.endpoint.startswith("ssh://") else None
    try:
        client = docker.DockerClient(base_url=tunnel.open() if tunnel else cfg.endpoint, tls=tls,
                                     timeout=int(cfg.timeout_s), version="1.24")
        # requests lets REQUESTS_CA_BUNDLE (and proxy variables) override a session's own CA: the engine's CA
        # must be the one that verifies it, and its API is never reached through a proxy.
        client.api.trust_env = False
        client.api._version = client.api._retrieve_server_version()  # what "auto" does, after the line above
    except BaseException:
        if tunnel is not None:
            tunnel.close()
        raise
    if tunnel is not None:
        client.tunnel = tunnel
        weakref.finalize(client, tunnel.close)
    return client


class EngineProvider(DockerSandboxProvider):
    """The docker provider of one fleet engine: its client is built from the engine's settings, and an
    engine that does not answer raises EngineUnreachable naming the engine (never its credentials)."""

    def __init__(self, config: DockerSandboxConfig, engine: EngineConfig) -> None:
        super().__init__(config)
        self.engine = engine
        self.engine_id = engine.id
        self.shares_host_folders = engine.endpoint is None or engine.endpoint.startswith("unix://")

    @property
    def client(self) -> Any:
        tunnel = getattr(self._client, "tunnel", None)
        if self._connected and tunnel is not None and not tunnel.alive:  # ssh ended (its host gone): a new tunnel
            self._client.close()
            tunnel.close()
            self._connected = False
        if not self._connected:
            try:
                client = engine_client(self.engine)
                client.ping()
            except Exception as exc:  # DockerException, requests' errors, ssl errors, FileNotFoundError
                fix = (_UNREACHABLE if self.engine.endpoint is None else
                       "check that its daemon runs and listens there and "
                       + ("that ssh_key is authorized for that user, ssh_known_hosts holds the host's key and the "
                          "user may open the engine's socket" if self.engine.endpoint.startswith("ssh://") else
                          "that the tls_* files are its certificates")
                       + ' (docs/deployment.md, "Sandboxes on several hosts")')
                raise EngineUnreachable(f"engine {self.engine.id!r} ({self.engine.endpoint or 'local socket'}) "
                                        f"does not answer: {_reason(exc)}; {fix}") from exc
            self._client, self._connected = client, True
        return self._client


def _reason(exc: BaseException) -> str:
    """The last line of an error's text, cut short (an SSL error's chain says which check failed)."""
    text = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
    return f"{type(exc).__name__}: {text[0][:300]}"


@dataclass
class Engine:
    """One engine's provider and what this process knows of its health."""

    provider: EngineProvider
    down_reason: str = ""
    """Why it was marked down ('' while up)."""
    failures: int = 0
    next_probe: float = 0.0
    pending: int = 0
    """Placements of this process whose container may not be in the engine's list yet."""
    no_image: dict[str, float] = field(default_factory=dict)
    """image -> until when this engine is skipped for it (it lacks the image and could not get it)."""
    out_of_disk: float = 0.0
    """Until when placements skip this engine: a creation failed for want of disk (its sandboxes still run)."""

    @property
    def id(self) -> str:
        return self.provider.engine_id or ""

    @property
    def capacity(self) -> int | None:
        return self.provider.engine.capacity


class FleetSandboxProvider(SandboxProvider):
    """`sandbox.type: docker`: docker sandboxes on the engines of `sandbox.engines`."""

    engine = None  # each creation counts on the engine chosen for it

    def __init__(self, config: DockerSandboxConfig | None = None) -> None:
        self.config = config or DockerSandboxConfig()
        self.engines = {e.id: Engine(EngineProvider(self.config, e)) for e in self.config.engines}
        self._lock = threading.Lock()  # placement: count + choose + reserve (a thread, so any event loop)
        self._image_problem: dict[str, str] = {}
        self._told = time.monotonic()

    # ------------------------------------------------------------------ health
    def mark_down(self, engine: Engine, err: BaseException) -> None:
        """Avoid `engine` until its next probe (1 s, doubling to 30 s)."""
        first = not engine.down_reason
        engine.failures += 1
        engine.down_reason = str(err)[:500]
        wait = min(PROBE_BACKOFF_S[0] * 2 ** (engine.failures - 1), PROBE_BACKOFF_S[1])
        engine.next_probe = time.monotonic() + wait
        if first:
            log.warning("sandbox engine down; placements avoid it, its episodes fail as infrastructure",
                        engine=engine.id, reason=engine.down_reason)

    def _mark_up(self, engine: Engine) -> None:
        if engine.down_reason:
            log.warning("sandbox engine answers again", engine=engine.id, down_for_probes=engine.failures)
            engine.down_reason, engine.failures = "", 0
            self._reap_dead(engine)

    def _reap_dead(self, engine: Engine) -> None:
        """What a returning engine holds of rollway that can never run again: stopped sandbox containers
        (a restarted daemon leaves them exited; their episodes were failed and re-issued) and their volumes."""
        try:
            for c in engine.provider.listed(LABEL):
                if c.get("State") in ("exited", "dead"):
                    engine.provider.remove(str(c["Id"]), (c.get("Labels") or {}).get(LABEL, ""))
        except SandboxError as err:
            log.warning("stopped sandboxes on a returning engine not reaped", engine=engine.id, error=str(err))

    def _usable(self, engine: Engine) -> bool:
        """Up, or down with its probe due (the caller's request is the probe)."""
        return not engine.down_reason or time.monotonic() >= engine.next_probe

    def _placeable(self, engine: Engine) -> bool:
        """Usable, and not skipped for want of disk (the next placement after PROBE_BACKOFF_S[1] is the probe)."""
        return self._usable(engine) and engine.out_of_disk <= time.monotonic()

    # ------------------------------------------------------------------ placement
    def used(self, engine: Engine) -> int:
        """Sandboxes `engine` holds now, by its own list (raises EngineUnreachable)."""
        return sum(c.get("State") in _LIVE_STATES for c in engine.provider.listed(LABEL))

    def _choose(self, image: str) -> Engine | None:
        """Reserve a place on the least loaded usable engine with room and the image; None: none has room."""
        with self._lock:
            candidates = []
            for engine in self.engines.values():
                if not self._placeable(engine) or engine.no_image.get(image, 0.0) > time.monotonic():
                    continue
                try:
                    count = self.used(engine) if (len(self.engines) > 1 or engine.capacity) else 0
                except EngineUnreachable as err:
                    self.mark_down(engine, err)
                    continue
                self._mark_up(engine)
                load = count + engine.pending
                if engine.capacity is None or load < engine.capacity:
                    candidates.append((load / (engine.capacity or 1 << 20), random.random(), engine))
            if not candidates:
                return None
            engine = min(candidates, key=lambda c: c[:2])[2]
            engine.pending += 1
            return engine

    def _has_image(self, engine: Engine, image: str) -> bool:
        """The engine has `image`, or got it from `sandbox.registry`; False (skipped for it a minute) if not."""
        provider = engine.provider
        if image in provider._images:
            return True
        try:
            provider._require_image(image)
            return True
        except EngineUnreachable:
            raise
        except SandboxError as err:
            reason = str(err)
        if self.config.image_registry:
            try:
                from docker.utils import parse_repository_tag

                repo, tag = parse_repository_tag(image)
                with engine_errors(f"pull {image} from {self.config.image_registry}"):
                    pulled = provider.client.images.pull(f"{self.config.image_registry}/{repo}", tag=tag or "latest")
                    pulled.tag(repo, tag or "latest")
                provider._images.add(image)
                log.info("image pulled from the registry", engine=engine.id, image=image)
                return True
            except EngineUnreachable:
                raise
            except SandboxError as err:
                reason = str(err)
        engine.no_image[image] = time.monotonic() + 60.0
        self._image_problem[image] = f"{engine.id}: {reason[:400]}"
        log.warning("engine lacks the image and cannot get it; skipped for it", engine=engine.id, image=image,
                    reason=reason[:300])
        return False

    async def _place(self, image: str) -> Engine:
        """An engine with room and the image, reserved (release with `engine.pending -= 1`). Waits while
        the whole fleet is full or down (back-pressure: the episode is not failed for it)."""
        wait, since = FULL_WAIT_S[0], time.monotonic()
        all_down_since = time.monotonic()
        while True:
            engine = await asyncio.to_thread(self._choose, image)
            if engine is not None:
                try:
                    if await asyncio.to_thread(self._has_image, engine, image):
                        return engine
                except EngineUnreachable as err:
                    self.mark_down(engine, err)
                engine.pending -= 1
                continue  # another engine, or (none left with room and the image) the checks below
            up = [e for e in self.engines.values() if not e.down_reason and e.out_of_disk <= time.monotonic()]
            if up and all(e.no_image.get(image, 0.0) > time.monotonic() for e in up):
                raise SandboxError(f"image {image!r} is on no engine of the fleet that answers, and none could "
                                   f"get it (sandbox.image_registry={self.config.image_registry!r}); last: "
                                   f"{self._image_problem.get(image, '')}")
            if not up:
                if time.monotonic() - all_down_since > ALL_DOWN_WAIT_S:
                    raise EngineUnreachable(f"no engine of the fleet answered for {ALL_DOWN_WAIT_S:.0f} s: "
                                            + "; ".join(e.down_reason for e in self.engines.values()))
            else:
                all_down_since = time.monotonic()
            if time.monotonic() - self._told > 30.0:  # one line per fleet, not per waiting placement
                self._told = time.monotonic()
                log.warning("every sandbox engine is full or down; init waits", waited_s=round(self._told - since),
                            engines=self.states())
            await asyncio.sleep(wait)
            wait = min(wait * 2, FULL_WAIT_S[1])

    def states(self) -> dict[str, str]:
        return {e.id: ("down: " + e.down_reason[:80]) if e.down_reason else "out of disk"
                if e.out_of_disk > time.monotonic() else "up" for e in self.engines.values()}

    # ------------------------------------------------------------------ the provider interface
    async def create(self, spec: SandboxSpec, name: str) -> DockerSandbox:
        while True:
            engine = await self._place(spec.image or self.config.image)
            try:
                with metrics.SANDBOXES_CREATING.labels("init", engine.id).track_inprogress():
                    return await engine.provider.create(spec, name)  # removes what it made when it fails
            except EngineOutOfDisk as err:  # the engine's problem: placed again, on another engine
                engine.out_of_disk = time.monotonic() + PROBE_BACKOFF_S[1]
                log.warning("sandbox engine out of disk; placements skip it", engine=engine.id, error=str(err)[:300])
            except EngineUnreachable as err:
                self.mark_down(engine, err)
                raise EngineUnreachable(f"engine {engine.id!r}: {err}") from err
            finally:
                engine.pending -= 1

    def engine_of(self, handle: dict[str, Any]) -> Engine:
        """The engine a handle names; EngineUnreachable when this worker does not know it or it is down."""
        engine_id = handle.get("engine")
        if engine_id is None and len(self.engines) == 1:
            return next(iter(self.engines.values()))  # a handle of a single-engine run (before fleets)
        engine = self.engines.get(str(engine_id))
        if engine is None:
            raise EngineUnreachable(f"sandbox {handle.get('name')!r} is on engine {engine_id!r}, which this worker's "
                                    f"sandbox.engines does not list ({sorted(self.engines)}): every worker of a run "
                                    "needs the same fleet; the attempt fails and is re-issued on a listed engine")
        if not self._usable(engine):
            raise EngineUnreachable(f"sandbox {handle.get('name')!r} is on engine {engine.id!r}, which is down "
                                    f"({engine.down_reason[:200]}); the attempt fails and is re-issued elsewhere")
        return engine

    async def attach(self, handle: dict[str, Any]) -> DockerSandbox:
        if handle.get("kind") != "docker":
            raise SandboxError(f"handle {handle!r} is not a docker sandbox; set sandbox.type to match its kind")
        engine = self.engine_of(handle)
        try:
            sandbox = await engine.provider.attach(handle)
        except EngineUnreachable as err:
            self.mark_down(engine, err)
            raise EngineUnreachable(f"engine {engine.id!r}: {err}") from err
        self._mark_up(engine)
        return sandbox

    def limits(self, spec: SandboxSpec | None = None) -> tuple[int, float, int]:
        return next(iter(self.engines.values())).provider.limits(spec)

    def providers(self) -> list[EngineProvider]:
        return [e.provider for e in self.engines.values()]

    async def close(self) -> None:
        for engine in self.engines.values():
            if engine.provider._connected:
                await engine.provider.close()

    async def check(self) -> dict[str, Any]:
        """The containment suite on the first engine that answers, with every engine's state."""
        report: dict[str, Any] = {}
        for engine in self.engines.values():
            try:
                await asyncio.to_thread(getattr, engine.provider, "client")
            except EngineUnreachable as err:  # reported in the answer (a log line would precede --json's)
                engine.down_reason = str(err)
                continue
            report = await engine.provider.check()
            report["engine"] = engine.id
            break
        else:
            raise EngineUnreachable("no engine of the fleet answers: "
                                    + "; ".join(e.down_reason for e in self.engines.values()))
        report["engines"] = self.states()
        return report

    # ------------------------------------------------------------------ status
    def status(self) -> list[dict[str, Any]]:
        """Each engine's state: up/down, round-trip latency, sandboxes by run, capacity, images."""
        rows = []
        for engine in self.engines.values():
            row: dict[str, Any] = {"id": engine.id, "endpoint": engine.provider.engine.endpoint or "local",
                                   "capacity": engine.capacity}
            try:
                start = time.monotonic()
                engine.provider.client.ping()
                row["latency_ms"] = round((time.monotonic() - start) * 1000, 2)
                listed = engine.provider.listed(LABEL)
                with engine_errors("list images"):
                    images = engine.provider.client.api.images()
                disk = _disk_problem(engine.provider, images)
            except EngineUnreachable as err:
                row.update(state="down", reason=str(err)[:300])
                rows.append(row)
                continue
            live = [c for c in listed if c.get("State") in _LIVE_STATES]
            by_run: dict[str, int] = {}
            for c in live:
                name = (c.get("Labels") or {}).get(LABEL, "")
                run = "(warm pool)" if name.startswith("pool-") else (m.group("run") if (m := _RUN_OF.match(name))
                                                                       else "(other)")
                by_run[run] = by_run.get(run, 0) + 1
            row.update(state="out of disk" if disk else "up", **({"reason": disk} if disk else {}),
                       sandboxes=len(live), stopped=len(listed) - len(live), by_run=by_run,
                       full=engine.capacity is not None and len(live) >= engine.capacity,
                       images=sorted(t for i in images for t in (i.get("RepoTags") or []) if t != "<none>:<none>"))
            rows.append(row)
        return rows


def _disk_problem(provider: EngineProvider, images: list[dict[str, Any]]) -> str:
    """Why the engine cannot write a container's files to its data root ('' when it can, or has no image to
    try with): a container created (never started) and removed, as a placement would."""
    tag = next((t for i in images for t in (i.get("RepoTags") or []) if t != "<none>:<none>"), None)
    if tag is None:
        return ""
    try:
        with engine_errors("create a container (disk probe)"):
            probe = provider.client.api.create_container(tag, ["true"], network_disabled=True,
                                                         name=f"rollway-disk-probe-{random.getrandbits(40):010x}")
            provider.client.api.remove_container(probe["Id"], force=True)
    except EngineOutOfDisk as err:
        return str(err)[:300]
    except EngineUnreachable:
        raise
    except SandboxError:  # another refusal: not the disk's (placements will say what it is)
        pass
    return ""


def check_engines(config: DockerSandboxConfig) -> dict[str, str]:
    """Ping every engine of the fleet once (at a run's start): engine id -> why it does not answer (empty
    when all do). EngineUnreachable when none answers: a run with nowhere to place a sandbox is refused."""
    fleet = FleetSandboxProvider(config)
    down = {}
    for engine in fleet.engines.values():
        try:
            engine.provider.client  # noqa: B018 - connects and pings
        except EngineUnreachable as err:
            down[engine.id] = str(err)
        else:
            engine.provider.client.close()
    if len(down) == len(fleet.engines):
        raise EngineUnreachable("no engine of sandbox.engines answers: " + "; ".join(down.values()))
    return down


__all__ = ["EngineProvider", "FleetSandboxProvider", "Sandbox", "check_engines", "engine_client"]
