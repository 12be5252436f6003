"""Chaos runs: kill and restart random processes of every kind (stage workers, the inference engine,
the broker) on a seeded schedule while a job runs, then judge the run from ground truth the stages do
not write themselves: the topics (what the scheduler issued, what ended, what was given up) read by
an independent consumer, and the manifests of the optimiser steps inside the learner's checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rollway.config.run import RunConfig
from rollway.runners.up import Job
from rollway.runtime.broker import EmbeddedBroker
from rollway.topics.topology import STAGE_NAMES

STAGE_KINDS = STAGE_NAMES
FAULT_POINTS = "checkpoint.write=0.15,checkpoint.rename=0.15,agent.after_tools=0.02,reward.after_grade=0.02," \
               "rebalance.revoked=0.1,scheduler.after_issue=0.01,learner.after_update=0.05"
"""The bad moments a chaos run arms by default (base/faults.py): a process dies exactly there."""


@dataclass
class ChaosMonkey:
    """Called on every tick of the job loop; kills one process at each scheduled time, cycling
    through every kind present before repeating one, and restarts the broker on its own plan."""

    seed: int
    min_gap_s: float = 1.0
    max_gap_s: float = 3.0
    broker: EmbeddedBroker | None = None
    broker_restarts: int = 0
    max_kills: int = 50
    ledger: Ledger | None = None
    kinds: tuple[str, ...] | None = None
    """Kinds to kill (None: every kind present)."""
    harness: bool = False
    """Harness episodes: an agent worker is killed only while it runs at least one agent program (a
    jail it started, or a docker container whose gateway socket it serves), and the processes and
    containers it ran them in are remembered so `lingering` can say whether any outlived it."""
    gateway_root: str | None = None
    """Docker sandboxes: the host folder of the containers' gateway sockets (`sandbox.gateway_root`)."""
    events: list[dict] = field(default_factory=list)
    orphans: list[tuple[int, int]] = field(default_factory=list)
    """(pid, start time) of every process that descended from a killed agent worker at its kill."""
    orphan_boxes: dict[str, float] = field(default_factory=dict)
    """Docker: sandbox name -> when (monotonic) the agent worker serving its program was killed. The
    program is no child of the worker: it runs on in its container until the container is removed."""
    orphan_box_seconds: dict[str, float] = field(default_factory=dict)
    """Docker: sandbox name -> seconds from its worker's kill until its container was gone (as polled)."""
    fleet: FleetKiller | None = None
    """Sandbox engines of scripts/fleet-up.sh to kill (kind `sandbox-engine`): one holding sandboxes of the run."""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.started = time.monotonic()
        self.next_at = self.started + self.rng.uniform(self.min_gap_s, self.max_gap_s)
        self.broker_plan = sorted(self.rng.uniform(3.0, 12.0) for _ in range(self.broker_restarts))
        self._round: list[str] = []
        self._boxes_polled = 0.0

    def __call__(self, job: Job) -> None:
        now = time.monotonic()
        if self.ledger is not None:
            self.ledger.maybe_poll()
        self._watch_orphan_boxes(now)
        if self.broker_plan and now - self.started >= self.broker_plan[0]:
            self.broker_plan.pop(0)
            self._restart_broker(now)
        if now < self.next_at or self.kills >= self.max_kills:
            return
        self.next_at = now + self.rng.uniform(self.min_gap_s, self.max_gap_s)
        picked = self._next_kind(job)
        if picked is None:
            return
        kind, live = picked
        if kind == "sandbox-engine":
            engine, boxes = self.rng.choice(live)
            self.fleet.kill(engine)
            self.events.append({"t": round(now - self.started, 2), "kill": f"sandbox-engine-{engine}",
                                "at": time.time(), "sandboxes": boxes})
            return
        if kind == "engine":
            index = self.rng.choice(live)
            job.engine.kill(index)
            self.events.append({"t": round(now - self.started, 2), "kill": f"engine-{index}"})
            return
        victim = self.rng.choice(live)
        event = {"t": round(now - self.started, 2), "kill": f"{kind}-{victim.index}"}
        if self.harness and kind == "agent":
            tree = descendants(victim.proc.pid)
            self.orphans += [(pid, started) for pid, started, _ in tree]
            served, before = served_sockets(victim.proc.pid), dead_sockets(self.gateway_root)
            event["programs"] = jails_of(victim.proc.pid) + (served if self.gateway_root else 0)
        victim.proc.kill()  # SIGKILL to its whole process group (its jails have sessions of their own); waits
        if self.harness and kind == "agent" and self.gateway_root:
            boxes = sorted(dead_sockets(self.gateway_root) - before)  # sockets it served, now refusing
            self.orphan_boxes |= dict.fromkeys(boxes, now)
            event["containers"] = boxes
        self.events.append(event)

    @property
    def kills(self) -> int:
        return sum("kill" in e for e in self.events)

    def _ready(self, p: Any) -> bool:
        """Alive, and (an agent worker of a harness job) running at least one agent program, once the
        log holds calls of an attempt not graded yet (so kills tend to hit acknowledged calls)."""
        if not p.alive:
            return False
        if not (self.harness and p.stage == "agent"):
            return True
        programs = jails_of(p.proc.pid) + (served_sockets(p.proc.pid) if self.gateway_root else 0)
        return programs > 0 and (self.ledger is None or self.ledger.calls_in_flight())

    def lingering(self, timeout_s: float = 10.0) -> int:
        """Processes that descended from a killed agent worker (its programs' jails) and still run, plus
        (docker) containers whose program it served that still run: polled until none is left or
        `timeout_s` passes (the kernel's parent-death signal is prompt; the run's reaper has run)."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [o for o in self.orphans if _running(*o)]
            boxes = _running_boxes(self.orphan_boxes) if self.orphan_boxes else set()
            if not (alive or boxes) or time.monotonic() >= deadline:
                return len(alive) + len(boxes)
            time.sleep(0.1)

    def _watch_orphan_boxes(self, now: float) -> None:
        """Note when each orphaned container is gone (polled about once a second while any is left)."""
        pending = [n for n in self.orphan_boxes if n not in self.orphan_box_seconds]
        if not pending or now - self._boxes_polled < 1.0:
            return
        self._boxes_polled = now
        try:
            present = _present_boxes()
        except Exception:  # noqa: BLE001 - engine busy or away: the next tick asks again
            return
        for name in pending:
            if name not in present:
                self.orphan_box_seconds[name] = round(now - self.orphan_boxes[name], 1)

    def _next_kind(self, job: Job) -> tuple[str, list] | None:
        """Kinds in a shuffled round, so every kind is hit before any is hit twice; a kind with no
        live process now (restarting) keeps its place in the round. The kind with its candidates
        (engine indexes or processes), judged once: a harness worker's readiness can end between two
        looks (its program exited), so the victim is drawn from this very list. None when nothing is
        alive."""
        if not self._round:
            kinds = [k for k in STAGE_KINDS if any(p.stage == k for p in job.procs)]
            if job.engine is not None:
                kinds.append("engine")
            if self.fleet is not None:
                kinds.append("sandbox-engine")
            if self.kinds is not None:
                kinds = [k for k in kinds if k in self.kinds]
            self._round = self.rng.sample(kinds, len(kinds))
        for kind in reversed(self._round):
            if kind == "sandbox-engine":
                live = sorted(self.fleet.busy().items())
            else:
                live = list(job.engine.alive()) if kind == "engine" else [p for p in job.procs
                                                                          if p.stage == kind and self._ready(p)]
            if live:
                self._round.remove(kind)
                return kind, live
        return None

    def _restart_broker(self, now: float) -> None:
        if self.broker is None:
            return
        if self.ledger is not None:
            self.ledger.poll()  # the in-memory log is about to go: read what it holds first
        self.broker.stop()
        time.sleep(1.0)
        self.broker.start()
        if self.ledger is not None:
            self.ledger.reset()
        self.events.append({"t": round(now - self.started, 2), "restart": "broker"})


@dataclass
class FleetKiller:
    """The Docker engines of scripts/fleet-up.sh, run from `folder`: engine `fleet-K` of the run's
    `sandbox.engines` is the daemon whose pid is in `folder/eK/dockerd.pid`. A killed daemon (SIGKILL: its
    host gone, as far as the API can tell) is started again by fleet-up.sh after `restart_after_s`
    (None: left down), which keeps the engines that still answer."""

    folder: Path
    engines: list[Any]
    """The run's `sandbox.engines` (EngineConfig)."""
    run_id: str
    restart_after_s: float | None = 5.0
    restarts: list[threading.Thread] = field(default_factory=list)
    restarted: list[dict[str, Any]] = field(default_factory=list)
    """Each restart's outcome: fleet-up.sh's exit code and the end of what it said."""
    _fleet: Any = None

    def _pid_file(self, engine_id: str) -> Path | None:
        k = engine_id.removeprefix("fleet-")
        path = self.folder / f"e{k}" / "dockerd.pid"
        return path if engine_id.startswith("fleet-") and k.isdigit() and path.exists() else None

    def busy(self) -> dict[str, list[str]]:
        """Engine id -> the run's sandboxes it holds, for the fleet's engines that answer and hold some (the
        reaper's listing: a restarted engine's stopped ones count until the run's init workers reap them)."""
        from rollway.sandboxes.config import DockerSandboxConfig
        from rollway.sandboxes.fleet import FleetSandboxProvider
        from rollway.sandboxes.reaper import names_by_engine, run_prefix

        if self._fleet is None:  # a short time limit: a daemon being killed must not stall the monkey
            engines = [e.model_copy(update={"timeout_s": 5.0}) for e in self.engines if self._pid_file(e.id)]
            self._fleet = FleetSandboxProvider(DockerSandboxConfig(engines=engines))
        return {e: names for e, names in names_by_engine(self._fleet, run_prefix(self.run_id), skip_down=True).items()
                if names}

    def kill(self, engine_id: str) -> None:
        path = self._pid_file(engine_id)
        if path is None:
            return
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(path.read_text().strip()), signal.SIGKILL)
        if self.restart_after_s is not None:
            thread = threading.Thread(target=self._restart, daemon=True)
            thread.start()
            self.restarts.append(thread)

    def _restart(self) -> None:
        time.sleep(self.restart_after_s or 0.0)
        first = urlsplit(next(e.endpoint for e in self.engines if e.id == "fleet-1"))
        # fleet-up.sh reads the base image from this host's own engine: not the DOCKER_HOST a run may point elsewhere.
        env = {**{k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}, "ROLLWAY_FLEET_DIR": str(self.folder),
               "ROLLWAY_FLEET_PORT": str((first.port or 1) - 1)}
        registry = (self.folder / "fleet.args").read_text() if (self.folder / "fleet.args").exists() else ""
        if "image_registry=" in registry:
            env["ROLLWAY_REGISTRY_PORT"] = registry.split("image_registry=", 1)[1].split()[0].rsplit(":", 1)[1]
        count = (self.folder / "engines").read_text().strip()
        script = Path(__file__).resolve().parents[1] / "scripts" / "fleet-up.sh"
        for _ in range(3):  # a daemon cleaning up after a kill can take past fleet-up.sh's 60 s on a loaded host
            try:
                out = subprocess.run(["bash", str(script), count], env=env, capture_output=True, text=True, timeout=600)
                self.restarted.append({"exit": out.returncode, "said": out.stderr[-1500:]})
            except (OSError, subprocess.TimeoutExpired) as exc:
                self.restarted.append({"exit": None, "said": f"{type(exc).__name__}: {exc}"[:1500]})
            if self.restarted[-1]["exit"] == 0:
                return

    def wait(self) -> None:
        for thread in self.restarts:
            thread.join(timeout=600)


SANDBOX_NAME = re.compile(r"^(?P<episode>.+)-a(?P<attempt>\d+)-[0-9a-f]{6}$")
"""actors/init.py's sandbox names: EPISODE-aATTEMPT-XXXXXX."""


def engine_kills(monkey: ChaosMonkey, ledger: Ledger) -> dict[str, Any]:
    """Per killed sandbox engine: the episodes whose sandboxes it held, how many were moved (a later
    attempt issued, and the episode completed), and the seconds from the kill to each later attempt's
    issue (from the InitRequests on the log)."""
    kills = []
    for event in (e for e in monkey.events if e.get("kill", "").startswith("sandbox-engine-")):
        held = [(m["episode"], int(m["attempt"])) for n in event["sandboxes"] if (m := SANDBOX_NAME.match(n))]
        later = {ep: ledger.issued_at[(ep, a + 1)] for ep, a in held if (ep, a + 1) in ledger.issued_at}
        kills.append({"engine": event["kill"].removeprefix("sandbox-engine-"), "episodes": len(held),
                      "moved": sum(1 for ep in later if ledger.completed.get(ep)),
                      "reissued_after_s": sorted(round(t - event["at"], 2) for t in later.values())})
    return {"sandbox_engine_kills": kills, "episodes_moved": sum(k["moved"] for k in kills),
            "sandbox_engine_restarts": monkey.fleet.restarted if monkey.fleet else []}


class Ledger:
    """What happened, read from the topics by a consumer of its own (no group, nothing committed):
    episodes issued on init-requests, graded on trajectories, given up on episode-failures."""

    def __init__(self, cfg: RunConfig, bootstrap: str, poll_every_s: float = 2.0):
        self.cfg, self.bootstrap = cfg, bootstrap
        self.run_id = cfg.run.id
        self.poll_every_s = poll_every_s
        self.positions: dict[tuple[str, int], int] = {}
        self.scheduled: set[str] = set()
        self.attempts: Counter[str] = Counter()
        self.issued_at: dict[tuple[str, int], float] = {}
        """(episode, attempt) -> when the scheduler issued it (unix seconds, its InitRequest's own time)."""
        self.completed: Counter[str] = Counter()
        self.failed: dict[str, str] = {}
        self.harness = cfg.agent.harness is not None
        self.calls: dict[tuple[str, int], dict[int, tuple[int | None, tuple[int, ...], tuple[float, ...]]]] = {}
        """Harness jobs: (episode, attempt) -> call index -> (retry_of, output ids, logprobs), from gateway-calls."""
        self.graded: list[tuple[str, int, list[tuple[Any, tuple[int, ...], tuple[float, ...]]]]] = []
        """Harness jobs: (episode, attempt, [(call named, sampled ids, logprobs) of each turn span]) per
        trajectory message."""
        self._last_poll = 0.0

    def maybe_poll(self) -> None:
        if time.monotonic() - self._last_poll >= self.poll_every_s:
            self.poll()

    def reset(self) -> None:
        """The broker came back empty: read its new log from the start."""
        self.positions.clear()

    def poll(self) -> None:
        self._last_poll = time.monotonic()
        try:
            asyncio.run(self._read())
        except Exception:  # noqa: BLE001 - broker away (restart); the next poll catches up
            pass

    async def _read(self) -> None:

        from rollway.actors.scheduler import GIVE_UP_STAGE
        from rollway.runtime.kafka import make_consumer, read_to_end, topic_name, topic_partitions
        from rollway.schemas.codec import DecodeError, decode
        from rollway.topics import EPISODE_FAILURES, GATEWAY_CALLS, INIT_REQUESTS, TRAJECTORIES

        read = (INIT_REQUESTS, TRAJECTORIES, EPISODE_FAILURES, *((GATEWAY_CALLS,) if self.harness else ()))
        specs = {topic_name(s, self.cfg.topics): s for s in read}
        consumer = await make_consumer(self.cfg.broker, self.bootstrap, group_id=None)
        try:
            tps = await topic_partitions(consumer, specs)
            ends = await consumer.end_offsets(tps)
            starts = {tp: self.positions.get((tp.topic, tp.partition), 0) for tp in tps}
            async for tp, r in read_to_end(consumer, starts, ends, timeout_s=30.0):
                self.positions[(tp.topic, tp.partition)] = r.offset + 1
                try:
                    msg = decode(r.value, specs[tp.topic].value)
                except DecodeError:
                    continue
                if not msg.episode_id.startswith(f"{self.run_id}-"):
                    continue
                name = specs[tp.topic].name
                if name == INIT_REQUESTS.name:
                    self.scheduled.add(msg.episode_id)
                    self.attempts[msg.episode_id] += 1
                    self.issued_at.setdefault((msg.episode_id, msg.attempt), msg.issued_at)
                elif name == TRAJECTORIES.name:
                    self.completed[msg.episode_id] += 1
                    if self.harness:
                        self.graded.append((msg.episode_id, msg.episode.attempt, _sampled_spans(msg)))
                elif name == GATEWAY_CALLS.name:
                    self.calls.setdefault((msg.episode_id, msg.episode.attempt), {}).setdefault(
                        msg.call_index, (msg.retry_of, tuple(msg.output_ids), tuple(msg.logprobs)))
                elif msg.stage == GIVE_UP_STAGE:
                    self.failed[msg.episode_id] = msg.reason
        finally:
            await consumer.stop()

    def judge(self, run_dir: Path, trains: bool) -> dict[str, Any]:
        """The outcome counts. With a training learner, `trained` comes from the checkpoints'
        step manifests: `duplicated` counts episodes inside more than one step, `lost` episodes
        issued but neither given up nor trained. Without one, an episode is done when graded."""
        from rollway.learning.checkpoint import read_manifests

        steps = read_manifests(run_dir) if trains else []
        trained = Counter(e for s in steps for e in s["episode_ids"])
        abandoned = {e for s in steps for e in s.get("abandoned_ids", [])}
        completed = set(self.completed)
        failed = set(self.failed)
        done = (set(trained) | abandoned) if trains else completed
        reasons = Counter(r.split(":")[0] for r in self.failed.values())
        return {"scheduled": len(self.scheduled), "completed": len(completed), "failed": len(failed),
                "failure_reasons": dict(reasons), "lost": len(self.scheduled - failed - done),
                "duplicated": sum(1 for c in trained.values() if c > 1), "trained": len(trained) if trains else None,
                "completed_not_trained": len(completed - failed - set(trained)) if trains else None,
                "trained_not_completed": len(set(trained) - completed) if trains else None,
                "graded_twice": sum(1 for c in self.completed.values() if c > 1),
                "attempts": sum(self.attempts.values()), "optimizer_steps": sum(s["updated"] for s in steps)}

    def calls_in_flight(self) -> bool:
        """Some attempt has recorded calls on gateway-calls and no trajectory yet (as last polled)."""
        graded = {(e, a) for e, a, _ in self.graded}
        return any(key not in graded for key in self.calls)

    def judge_calls(self, run_dir: Path, trains: bool) -> dict[str, int]:
        """Harness jobs: each trajectory (of a trained episode, with a training learner) against the calls
        its own attempt recorded on gateway-calls. A sampled span of the trajectory (what the learner
        trains) names its call (`TurnRecord.call_attempt` and `call_index`) and must hold that call's output
        ids and logprobs. `calls_lost`: a recorded call of the attempt (not superseded by a retry) no span
        holds; `calls_duplicated`: a call held by a second span; `calls_foreign`: a span that is no
        recorded call of the trajectory's own attempt (another attempt's, or other tokens);
        `calls_out_of_order`: trajectories whose calls are out of call order. `dead_attempts`: attempts
        that recorded calls and were never graded (their worker was killed mid-episode)."""
        from rollway.learning.checkpoint import read_manifests

        trained = {e for s in read_manifests(run_dir) for e in s["episode_ids"]} if trains else None
        graded = {(e, a) for e, a, _ in self.graded}
        dead = [calls for key, calls in self.calls.items() if key not in graded]
        lost = duplicated = foreign = out_of_order = checked = 0
        for episode_id, attempt, spans in self.graded:
            if trained is not None and episode_id not in trained:
                continue
            recorded = self.calls.get((episode_id, attempt), {})
            held = Counter(ref[1] for ref, ids, lps in spans if ref is not None and ref[0] == attempt
                           and ref[1] in recorded and recorded[ref[1]][1:] == (ids, lps))
            foreign += len(spans) - sum(held.values())
            duplicated += sum(n - 1 for n in held.values())
            lost += sum(1 for i in _kept_calls(recorded) if i not in held)
            order = [ref[1] for ref, _, _ in spans if ref is not None]
            out_of_order += int(order != sorted(order))
            checked += len(spans)
        return {"calls_recorded": sum(len(c) for c in self.calls.values()), "calls_in_trajectories": checked,
                "calls_lost": lost, "calls_duplicated": duplicated, "calls_foreign": foreign,
                "calls_out_of_order": out_of_order, "dead_attempts": len(dead),
                "dead_attempt_calls": sum(len(c) for c in dead)}


def _sampled_spans(traj: Any) -> list[tuple[tuple[int, int] | None, tuple[int, ...], tuple[float, ...]]]:
    """(the call it names, sampled ids, logprobs) of each turn span of a trajectory: what the learner
    trains (loss mask 1). A harness episode without calls has one empty turn, which is no call."""
    return [((turn.call_attempt, turn.call_index) if turn.call_index is not None else None, tuple(traj.token_ids[s:e]), tuple(traj.logprobs[s:e]))
            for turn, (s, e) in zip(traj.turns, traj.turn_spans, strict=False) if e > s]


def _kept_calls(calls: dict[int, tuple[int | None, tuple[int, ...], tuple[float, ...]]]) -> list[int]:
    """Indices of an attempt's calls in call order, less those a later retry superseded."""
    superseded = {retry_of for retry_of, _, _ in calls.values() if retry_of is not None}
    return [i for i in sorted(calls) if i not in superseded]


def sink_check(run_dir: Path, ledger: Ledger) -> dict[str, int]:
    """The sink's file against the log: episodes graded but not written, and lines written twice."""

    from rollway.base.run_dir import read_trajectories

    written = [t["episode"]["episode_id"] for t in read_trajectories(run_dir)]
    return {"sink_missing": len(set(ledger.completed) - set(written)), "sink_written_twice": len(written) - len(set(written))}


def descendants(root: int) -> list[tuple[int, int, int]]:
    """(pid, start time, parent pid) of every live process below `root`, read from /proc."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = stat
    children: dict[int, list[int]] = {}
    for pid, (_, _, parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        _, state, parent, started = stats[pid]
        if state != "Z":
            found.append((pid, started, parent))
        todo += children.get(pid, [])
    return found


def jails_of(pid: int) -> int:
    """Local jails (`bwrap`, each in a session of its own) that the process `pid` started and that run:
    for an agent worker of a harness job, the agent programs it runs."""
    return sum(1 for child, _, parent in descendants(pid) if parent == pid and (_stat(child) or ("",))[0] == "bwrap")


def served_sockets(pid: int) -> int:
    """Gateway sockets (`.../gateway.sock`) on which the process `pid` (an agent worker) listens now:
    one per harness episode it runs. In a docker sandbox the program runs in the container, not under
    the worker, so this is how a worker is seen to run programs there."""
    mine = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                mine.add(target[8:-1])
        lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
    except OSError:
        return 0
    # Num RefCount Protocol Flags Type St Inode Path; flag __SO_ACCEPTCON: listening. The path is the
    # one bound (the gateway binds through /proc/self/fd/N/ of the folder: socket paths are short).
    return sum(1 for f in map(str.split, lines)
               if len(f) >= 8 and f[6] in mine and int(f[3], 16) & 0x10000 and f[7].endswith("/gateway.sock"))


def dead_sockets(gateway_root: str | None) -> set[str]:
    """Docker sandboxes (the socket folders under `gateway_root`) whose gateway socket file is there
    but refuses connections: its listener's process died (an ended episode's socket is removed)."""
    import socket

    dead = set()
    for sock_path in Path(gateway_root).glob("*/gateway.sock") if gateway_root else ():
        try:
            folder = os.open(sock_path.parent, os.O_PATH | os.O_DIRECTORY)
        except OSError:
            continue
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(2.0)
        try:
            probe.connect(f"/proc/self/fd/{folder}/gateway.sock")  # any length of path (see gateway/server.py)
        except ConnectionRefusedError:
            dead.add(sock_path.parent.name)
        except OSError:
            pass
        finally:
            probe.close()
            os.close(folder)
    return dead


def _present_boxes() -> dict[str, bool]:
    """Docker sandbox name -> running, for every container the docker sandbox labelled."""
    import docker

    from rollway.sandboxes.docker import LABEL

    client = docker.from_env()
    try:
        return {c.attrs["Names"][0].lstrip("/").removeprefix("rollway-"): c.attrs.get("State") == "running"
                for c in client.containers.list(all=True, filters={"label": LABEL}, sparse=True)}
    finally:
        client.close()


def _running_boxes(names: dict[str, float]) -> set[str]:
    """Those of the docker sandboxes `names` whose container still runs."""
    try:
        present = _present_boxes()
    except Exception:  # noqa: BLE001 - engine away: count them all as lingering rather than none
        return set(names)
    return {n for n in names if present.get(n)}


def sandboxes_left(cfg: RunConfig) -> int:
    """Sandboxes of the run still there after it (local jail folders; docker containers and volumes),
    found as the run's reaper finds them: by the run id their names start with."""
    from rollway.sandboxes.factory import build_sandbox_provider
    from rollway.sandboxes.reaper import leftover_names, run_prefix

    provider = build_sandbox_provider(cfg.sandbox)
    try:
        return len(leftover_names(provider, run_prefix(cfg.run.id)))
    finally:
        asyncio.run(provider.close())


def _stat(pid: int) -> tuple[str, str, int, int] | None:
    """(command name, state, parent pid, start time in clock ticks) of `pid`; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = text[text.find("(") + 1:].rsplit(")", 1)
    fields = rest.split()
    return name, fields[0], int(fields[1]), int(fields[19])


def _running(pid: int, started: int) -> bool:
    """The process `pid` that started at `started` still runs (not a zombie; not a reused pid)."""
    stat = _stat(pid)
    return stat is not None and stat[3] == started and stat[1] != "Z"
