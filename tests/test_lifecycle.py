"""Issue 25, the policy is an adversary: no sandbox outlives its episode, and nothing is lost beyond
kills. Each hostile case runs the real actors with real bubblewrap sandboxes (in a sandbox root of the
test's own, so jail folders and tmpfs mounts can be counted), the real ledger files, the real sink
files and the embedded broker; only the model (and, where a docstring says so, one hook) is faked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run, wait_until
from jobs import run_with_progress
from test_actors import services

from rollway.actors.agent import AgentActor
from rollway.actors.init import InitActor
from rollway.actors.ledger import Ledger
from rollway.actors.reward import RewardActor
from rollway.actors.sink import SinkActor
from rollway.runtime.actor import FatalActorError, MessageMeta, Output
from rollway.runtime.worker import OffsetTracker, handle_or_dead_letter
from rollway.sandboxes.base import SandboxSpec
from rollway.schemas import EpisodeKey, InitRequest, RewardRequest, Trajectory
from rollway.topics import (
    AGENT_STEPS,
    DEAD_LETTERS,
    EPISODE_FAILURES,
    INIT_REQUESTS,
    REWARD_REQUESTS,
    TRAJECTORIES,
)


# -- counting what a sandbox leaves behind ------------------------------------------------------
def jail_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below `root` in this process's mount table (a workspace tmpfs)."""
    prefix = str(root.resolve())
    with open("/proc/self/mountinfo") as info:
        points = [line.split()[4] for line in info]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


def left_behind(root: Path) -> tuple[list[str], list[str]]:
    return jail_folders(root), mounts_under(root)


def hostile(tmp_path: Path, *overrides: str):
    """Services of run `rH` whose local sandboxes live under tmp_path/boxes."""
    root = tmp_path / "boxes"
    return services(tmp_path, "run.id=rH", f"sandbox.root={root}", *overrides), root


def init_request(episode_id: str = "rH-g0-s0", task_id: str = "toy-001") -> InitRequest:
    return InitRequest(episode=EpisodeKey(episode_id=episode_id, group_id="rH-g0", task_id=task_id),
                       issued_at=time.time(), deadline=time.time() + 60)


def dead_letter_for(reason: str) -> Output:
    return Output(DEAD_LETTERS, None, reason)  # what the runtime would produce (not inspected here)


# -- init ----------------------------------------------------------------------------------------
def test_init_that_fails_after_create_destroys_the_sandbox(tmp_path, monkeypatch):
    """The sandbox is built, then rendering the first prompt fails (faked: the chat format raises).
    The old init left the jail folder and its tmpfs mount behind on every such failure."""
    s, root = hostile(tmp_path)

    def broken(*_a, **_k):
        raise ValueError("the prompt cannot be rendered")

    async def scenario():
        init = InitActor(s)
        await init.setup()
        monkeypatch.setattr(s.chat, "initial", broken)
        outs = await handle_or_dead_letter(init, init_request(), MessageMeta("init-requests", 0, 0), dead_letter_for)
        assert [o.topic for o in outs] == [DEAD_LETTERS, EPISODE_FAILURES]

    run(scenario())
    assert left_behind(root) == ([], [])


def test_init_with_a_task_file_outside_the_workspace_leaves_no_folder_or_mount(tmp_path, monkeypatch):
    """A hostile task names a file `../../escape`: the provider refuses it half way through building
    the workspace (after the folder and its tmpfs exist) and the create raises with no sandbox to
    destroy. The task set's spec is faked to carry that file."""
    s, root = hostile(tmp_path)

    async def scenario():
        init = InitActor(s)
        await init.setup()
        monkeypatch.setattr(s.taskset, "sandbox_spec", lambda task: SandboxSpec(files={"../../escape": "x"}))
        outs = await handle_or_dead_letter(init, init_request(), MessageMeta("init-requests", 0, 0), dead_letter_for)
        assert [o.topic for o in outs] == [DEAD_LETTERS, EPISODE_FAILURES]
        assert "escape" in outs[1].value.reason

    run(scenario())
    assert left_behind(root) == ([], [])
    assert not (tmp_path / "escape").exists()


def test_init_cancelled_while_its_sandbox_is_being_set_up_leaves_nothing(tmp_path, monkeypatch):
    """The worker is stopped (the handler cancelled) while the task's setup command runs in the new
    sandbox; the request is redelivered and builds a sandbox of its own, so this one must go."""
    s, root = hostile(tmp_path)
    spec = SandboxSpec(files={"a.txt": "1"}, setup_commands=["touch started; sleep 30"])

    async def scenario():
        init = InitActor(s)
        await init.setup()
        monkeypatch.setattr(s.taskset, "sandbox_spec", lambda task: spec)
        handler = asyncio.ensure_future(init.handle(init_request(), MessageMeta("init-requests", 0, 0)))
        deadline = time.monotonic() + 30
        while not list(root.glob("*/workspace/started")):
            assert time.monotonic() < deadline and not handler.done(), "setup never started"
            await asyncio.sleep(0.02)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler

    run(scenario())
    assert left_behind(root) == ([], [])


# -- agent ---------------------------------------------------------------------------------------
async def first_step(s) -> Output:
    init = InitActor(s)
    await init.setup()
    [out] = await init.handle(init_request(), MessageMeta("init-requests", 0, 0))
    assert out.topic is AGENT_STEPS
    return out


def test_agent_turn_that_raises_destroys_the_sandbox(tmp_path, monkeypatch):
    """The model call fails mid-episode (the fake model raises). The runtime dead-letters the turn
    and the agent reports the failure; the scheduler re-issues the episode in a fresh sandbox, so
    this one must not stay (on_error never destroyed it)."""
    s, root = hostile(tmp_path)

    async def boom(*_a, **_k):
        raise ConnectionError("inference engine went away")

    async def scenario():
        step = await first_step(s)
        assert len(jail_folders(root)) == 1
        agent = AgentActor(s)
        await agent.setup()
        monkeypatch.setattr(s.inference, "generate", boom)
        outs = await handle_or_dead_letter(agent, step.value, MessageMeta("agent-steps", 0, 0), dead_letter_for)
        assert [o.topic for o in outs] == [DEAD_LETTERS, EPISODE_FAILURES]

    run(scenario())
    assert left_behind(root) == ([], [])


def test_agent_turn_replayed_after_a_crash_destroys_the_sandbox(tmp_path):
    """A turn whose tool calls already ran once (a worker killed before its produce) is refused and
    the attempt fails, its sandbox destroyed (the handled-failure path)."""
    s, root = hostile(tmp_path)

    async def scenario():
        step = await first_step(s)
        box = await s.sandboxes.attach(step.value.sandbox)
        assert await box.claim_turn("a0-t0")  # the first run of turn 0 got this far, then died
        outs = await AgentActor(s).handle(step.value, MessageMeta("agent-steps", 0, 0))
        assert [o.topic for o in outs] == [EPISODE_FAILURES]

    run(scenario())
    assert left_behind(root) == ([], [])


# -- reward --------------------------------------------------------------------------------------
async def finished_episode(s) -> RewardRequest:
    out = await first_step(s)
    agent = AgentActor(s)
    await agent.setup()
    offset = 0
    while out.topic is AGENT_STEPS:
        [out] = await agent.handle(out.value, MessageMeta("agent-steps", 0, offset))
        offset += 1
    assert out.topic is REWARD_REQUESTS
    return out.value


def test_reward_that_cannot_record_its_grade_still_destroys_the_sandbox(tmp_path):
    """The reward stage's ledger in the run folder cannot be used (here a file stands where its
    folder should be), so the attempt fails and is re-issued. The old reward stage guarded only the
    grading call and left the sandbox."""
    s, root = hostile(tmp_path)

    async def scenario():
        req = await finished_episode(s)
        reward = RewardActor(s)
        await reward.setup()
        (s.run_dir / "ledger").mkdir(parents=True, exist_ok=True)
        (s.run_dir / "ledger" / "reward").write_text("not a folder")
        outs = await handle_or_dead_letter(reward, req, MessageMeta("reward-requests", 0, 0), dead_letter_for)
        assert [o.topic for o in outs] == [DEAD_LETTERS, EPISODE_FAILURES]

    run(scenario())
    assert left_behind(root) == ([], [])


# -- the reaper ----------------------------------------------------------------------------------
def make_boxes(s, names: list[str]) -> None:
    async def create():
        for name in names:
            await s.sandboxes.create(SandboxSpec(files={"a.txt": "1"}), name)

    run(create())


def test_reaper_removes_a_runs_leftovers_and_nothing_of_another_run(tmp_path):
    """Sandboxes a killed worker left (made here directly, as a SIGKILLed init would leave them),
    of two runs: the reaper of run rA takes rA's folders and mounts only; `rollway sandbox reap
    --run rB` takes the rest."""
    from rollway.sandboxes.reaper import reap_run

    s, root = hostile(tmp_path)
    make_boxes(s, ["rA-g0-s0-a0-x1", "rA-g0-s1-a1-x2", "rB-g0-s0-a0-x3", "rAB-g0-s0-a0-x4"])
    report = run(reap_run(s.sandboxes, "rA"))
    assert sorted(report.removed) == ["rA-g0-s0-a0-x1", "rA-g0-s1-a1-x2"] and not report.failed
    assert jail_folders(root) == ["rAB-g0-s0-a0-x4", "rB-g0-s0-a0-x3"]
    assert all("/rA-" not in m for m in mounts_under(root))
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "sandbox", "reap", f"sandbox.root={root}",
                          "--run", "rB"], cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1])["removed"] == ["rB-g0-s0-a0-x3"]
    assert jail_folders(root) == ["rAB-g0-s0-a0-x4"]
    run(reap_run(s.sandboxes, "rAB"))
    assert left_behind(root) == ([], [])


def test_rollway_up_reaps_its_runs_sandboxes(tmp_path):
    """What `rollway up` calls at a run's start and end (runners/up.py: reap_sandboxes)."""
    from rollway.runners.up import reap_sandboxes

    s, root = hostile(tmp_path)
    make_boxes(s, ["rH-g3-s0-a0-k1", "rH-g3-s1-a2-k2"])
    assert reap_sandboxes(s.cfg, "end") == 2
    assert left_behind(root) == ([], [])


def test_reaper_removes_a_runs_docker_containers(tmp_path):
    """The docker sandbox: containers and volumes counted by rollway's label (the run id starts
    every episode sandbox's name)."""
    from docker_engine import count_containers, ensure_engine

    from rollway.sandboxes.config import SandboxConfig
    from rollway.sandboxes.docker import DockerSandboxProvider
    from rollway.sandboxes.reaper import reap_run

    ensure_engine()
    run_id = f"rD{time.time_ns() % 10**8}"
    provider = DockerSandboxProvider(SandboxConfig(type="docker", memory_mb=256, cpus=0.5))

    async def scenario():
        for i in range(2):
            await provider.create(SandboxSpec(files={"a.txt": "1"}), f"{run_id}-g0-s{i}-a0-z{i}")
        assert count_containers(f"{run_id}-") == 4  # two containers, two volumes
        report = await reap_run(provider, run_id)
        assert len(report.removed) == 2 and not report.failed

    run(scenario())
    assert count_containers(f"{run_id}-") == 0


def test_reaper_survives_another_runs_container_removed_while_it_lists(tmp_path):
    """Another run's worker removes its own container between the reaper's listing and anything it
    reads of it after (seen in CI: a full `containers.list` inspects each listed container and died of
    NotFound). The engine, the containers and the removal are real; only the order is staged, through
    a wrapper on the client's listing call."""
    import docker
    from docker_engine import count_containers, ensure_engine

    from rollway.sandboxes.config import SandboxConfig
    from rollway.sandboxes.docker import LABEL, DockerSandboxProvider
    from rollway.sandboxes.reaper import reap_run

    ensure_engine()
    run_id = f"rR{time.time_ns() % 10**8}"
    provider = DockerSandboxProvider(SandboxConfig(type="docker", memory_mb=256, cpus=0.5))
    client = docker.from_env()
    other = client.containers.run(provider.config.image, ["sleep", "60"], detach=True,
                                  name=f"rollway-o{run_id}-g0-s0-a0-q", labels={LABEL: f"o{run_id}-g0-s0-a0-q"})
    listing = provider.client.api.containers

    def list_then_lose_one(*args, **kwargs):
        found = listing(*args, **kwargs)
        with contextlib.suppress(docker.errors.NotFound):
            other.remove(force=True)  # its own worker removed it: gone before the reaper reads it
        return found

    provider.client.api.containers = list_then_lose_one

    async def scenario():
        await provider.create(SandboxSpec(files={"a.txt": "1"}), f"{run_id}-g0-s0-a0-z0")
        report = await reap_run(provider, run_id)
        assert report.removed == [f"{run_id}-g0-s0-a0-z0"] and not report.failed

    try:
        run(scenario())
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            other.remove(force=True)
    assert count_containers(f"{run_id}-") == 0


# -- the ledgers ---------------------------------------------------------------------------------
def test_ledger_never_counts_an_offset_still_in_flight_as_handled(tmp_path):
    """Offset 10 is being graded (slowly) while 11..20 finish and the file is compacted many times.
    The old watermark (highest offset dropped) passed 10, so after a kill its redelivery was taken
    for a duplicate and the episode vanished until its deadline."""
    ledger = Ledger(tmp_path, window=2)
    assert ledger.seen("slow", MessageMeta("t", 0, 10)) is None  # its grading starts
    for offset in range(11, 21):
        ledger.record(f"fast{offset}", MessageMeta("t", 0, offset), b"r")
    restarted = Ledger(tmp_path, window=2)  # the worker was killed; 10 is redelivered
    assert restarted.seen("slow", MessageMeta("t", 0, 10)) is None, "offset 10 was never handled"
    assert restarted.seen("fast12", MessageMeta("t", 0, 12)) is not None, "a compacted, handled offset is known"
    assert restarted.seen("x", MessageMeta("t", 0, 21)) is None


def test_a_different_message_at_a_handled_offset_is_not_taken_for_a_redelivery(tmp_path):
    """A topic deleted and made again restarts its offsets: episode B arriving at the offset where the
    ledger recorded episode A is new work (skipping it lost B); A itself at that offset is a redelivery,
    and an offset compacted out of the window stays known handled."""
    ledger = Ledger(tmp_path, window=2)
    ledger.record("A", MessageMeta("t", 0, 0), b"a")
    assert ledger.seen("B", MessageMeta("t", 0, 0)) is None
    assert ledger.seen("A", MessageMeta("t", 0, 0)).result == b"a"
    for offset in range(1, 8):
        ledger.record(f"k{offset}", MessageMeta("t", 0, offset), b"r")
    assert Ledger(tmp_path, window=2).seen("unknown-key", MessageMeta("t", 0, 0)) is not None


def test_slow_grading_is_graded_after_a_kill_not_lost(tmp_path, monkeypatch):
    """Reward requests at offsets 0 (its grading hangs: the hook is faked to wait) and 1..4 (graded
    for real, fast). The runtime's commit position stays at 0; the worker is killed (the hung
    handler cancelled, its sandbox kept for the redelivery); the restarted worker gets offset 0 again
    and must grade it, not skip it as handled."""
    s, root = hostile(tmp_path)
    reqs = []

    async def scenario():
        for i in range(5):
            reqs.append(await finished_episode_named(s, f"rH-g0-s{i}"))
        first = RewardActor(s)
        first.ledger = Ledger(s.run_dir / "ledger" / "reward", window=1)
        await first.setup()
        real_grade, hung = first._grade, asyncio.Event()

        async def hang_on_zero(msg, sandbox):
            if msg.episode_id == "rH-g0-s0":
                await hung.wait()
            return await real_grade(msg, sandbox)

        monkeypatch.setattr(first, "_grade", hang_on_zero)
        tracker, tp = OffsetTracker(), ("reward-requests", 0)
        for offset in range(5):
            tracker.start(tp, offset)
        slow = asyncio.ensure_future(first.handle(reqs[0], MessageMeta("reward-requests", 0, 0)))
        for offset in range(1, 5):
            [out] = await first.handle(reqs[offset], MessageMeta("reward-requests", 0, offset))
            assert out.topic is TRAJECTORIES
            tracker.finish(tp, offset)
        assert tracker.to_commit() == {tp: 0}, "the fast gradings must not commit past the slow one"
        slow.cancel()  # killed
        with pytest.raises(asyncio.CancelledError):
            await slow
        restarted = RewardActor(s)
        restarted.ledger = Ledger(s.run_dir / "ledger" / "reward", window=1)
        await restarted.setup()
        return await restarted.handle(reqs[0], MessageMeta("reward-requests", 0, 0)), restarted

    outs, restarted = run(scenario())
    assert [o.topic for o in outs] == [TRAJECTORIES] and outs[0].value.episode_id == "rH-g0-s0"
    assert restarted.stats == {"graded": 1, "replayed": 0}
    assert left_behind(root) == ([], [])


async def finished_episode_named(s, episode_id: str) -> RewardRequest:
    init, agent = InitActor(s), AgentActor(s)
    await init.setup()
    await agent.setup()
    [out] = await init.handle(init_request(episode_id), MessageMeta("init-requests", 0, 0))
    offset = 0
    while out.topic is AGENT_STEPS:
        [out] = await agent.handle(out.value, MessageMeta("agent-steps", 0, offset))
        offset += 1
    return out.value


# -- the sink ------------------------------------------------------------------------------------
def trajectory(episode_id: str, reward: float = 1.0) -> Trajectory:
    return Trajectory(episode=EpisodeKey(episode_id=episode_id, group_id="rH-g0", task_id="toy-000"),
                      token_ids=[1, 2], loss_mask=[0, 1], logprobs=[None, -0.1], turn_policy_versions=[0],
                      turn_spans=[(1, 2)], reward=reward, resolved=True, stop_reason="finish", num_turns=1,
                      prompt_length=1)


def test_sink_io_error_stops_the_sink_instead_of_dead_lettering(tmp_path):
    """The sink cannot write its file (here a folder stands in its place). The old sink dead-lettered
    the trajectory and committed it: the episode was gone from the run's record. Now the worker
    stops (FatalActorError: not dead-lettered, not committed) and its restart, once the folder is
    fixed, writes the episode."""
    s, _ = hostile(tmp_path)
    at = MessageMeta("trajectories", 0, 7)

    async def scenario():
        sink = SinkActor(s)
        await sink.setup()
        (s.run_dir / "trajectories.jsonl").mkdir()
        with pytest.raises(FatalActorError, match="restart the sink"):
            await handle_or_dead_letter(sink, trajectory("rH-g0-s0"), at, dead_letter_for)
        (s.run_dir / "trajectories.jsonl").rmdir()
        restarted = SinkActor(s)
        await restarted.setup()
        await restarted.handle(trajectory("rH-g0-s0"), at)  # redelivered: it was never committed

    run(scenario())
    rows = [json.loads(x) for x in (s.run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert [r["episode"]["episode_id"] for r in rows] == ["rH-g0-s0"]


def test_readers_of_trajectories_survive_a_torn_last_line(tmp_path):
    """A sink killed mid-write leaves half a line. Every reader of trajectories.jsonl skips it with a
    warning instead of crashing, and the restarted sink cuts it off before appending."""
    from rollway.actors.sink import export_parquet
    from rollway.base.run_dir import read_records, read_trajectories
    from rollway.reports.episodes import load_run_dir
    from rollway.runners.progress import RewardTail
    from rollway.schemas.codec import to_builtins

    s, _ = hostile(tmp_path)
    path = s.run_dir / "trajectories.jsonl"
    path.parent.mkdir(parents=True)
    good = [json.dumps(to_builtins(trajectory(f"rH-g0-s{i}"))) for i in range(2)]
    path.write_text("\n".join(good) + "\n" + good[0][: len(good[0]) // 2])
    assert [t["episode"]["episode_id"] for t in read_trajectories(s.run_dir)] == ["rH-g0-s0", "rH-g0-s1"]
    assert len(load_run_dir(s.run_dir)) == 2 and len(read_records(path)) == 2
    assert export_parquet(path, tmp_path / "t.parquet") == 2
    tail = RewardTail(path)
    tail.poll()
    assert tail.episodes == 2

    async def restart_and_write():
        sink = SinkActor(s)
        await sink.setup()
        await sink.handle(trajectory("rH-g0-s2"), MessageMeta("trajectories", 0, 3))

    run(restart_and_write())
    lines = path.read_text().splitlines()
    assert [json.loads(x)["episode"]["episode_id"] for x in lines] == ["rH-g0-s0", "rH-g0-s1", "rH-g0-s2"]


# -- consumer groups -----------------------------------------------------------------------------
@pytest.mark.broker
def test_two_runs_on_one_broker_keep_their_own_episodes(broker, topic_prefix, tmp_path):
    """Two runs share a broker and its topics (one topic prefix). With one group per stage
    (`rollway-sink`) their sinks split the partitions and each dropped the other's episodes as
    not its run's; with a group per run, each sink writes all of its own run's episodes."""
    from test_stage_runtime import produce

    from rollway.actors.services import Services
    from rollway.config.run import load_config
    from rollway.runners.stage import group_id
    from rollway.runtime.kafka import ensure_topics
    from rollway.runtime.worker import StageWorker
    from rollway.schemas import encode

    cfgs = {r: load_config(ROOT / "examples" / "smoke.yaml", [f"run.id={r}", f"topics.prefix={topic_prefix}"])
            for r in ("rA", "rB")}
    assert group_id("sink", cfgs["rA"]) != group_id("sink", cfgs["rB"])

    async def scenario():
        await ensure_topics(cfgs["rA"].broker, cfgs["rA"].topics, broker.bootstrap)
        stop = asyncio.Event()
        workers = {r: StageWorker(SinkActor(Services(cfg, tmp_path / r)), cfg, broker.bootstrap, 1,
                                  group_id("sink", cfg)) for r, cfg in cfgs.items()}
        tasks = [asyncio.ensure_future(w.run(stop)) for w in workers.values()]
        deadline = time.monotonic() + 30
        while not all(w.consumer is not None and w.consumer.assignment() for w in workers.values()):
            assert time.monotonic() < deadline, "the sinks never got partitions"
            await asyncio.sleep(0.05)
        items = [(f"{r}-g0-s{i}".encode(), encode(trajectory(f"{r}-g0-s{i}"))) for r in cfgs for i in range(8)]
        await produce(cfgs["rA"], broker.bootstrap, TRAJECTORIES, items)
        written = lambda r: len(read_lines(tmp_path / r / "trajectories.jsonl"))  # noqa: E731
        try:
            await asyncio.to_thread(wait_until, lambda: written("rA") == 8 and written("rB") == 8, 30.0, 0.1,
                                    "each run's sink to write its 8 episodes")
        finally:
            stop.set()
            await asyncio.gather(*tasks)

    run(scenario())


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# -- checkpoints ---------------------------------------------------------------------------------
def test_checkpoint_is_fsynced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """A crashed machine (not just a killed process) must not come back with a checkpoint whose name
    says complete and whose files are empty: every file and folder of it is fsynced before the
    rename, and the folder holding it after. The model is faked (it writes one weights file)."""
    import os

    from rollway.learning import checkpoint

    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst, *a, **k):
        events.append(("rename", f"{src} -> {dst}"))
        return real_rename(src, dst, *a, **k)

    class Model:
        def save_pretrained(self, folder: Path) -> None:
            (Path(folder) / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    state = checkpoint.TrainerState(version=3)
    final = checkpoint.save_checkpoint(tmp_path, state, Model(), None, None, keep=None)
    renames = [i for i, e in enumerate(events) if e[0] == "rename" and e[1].endswith(str(final))]
    assert renames, events
    synced_before = {path for kind, path in events[: renames[0]] if kind == "fsync"}
    tmp = str(final) + ".tmp"
    for name in ("model.safetensors", checkpoint.STATE_FILE, ""):
        assert str(Path(tmp) / name).rstrip("/") in synced_before, (name, events)
    assert ("fsync", str(final.parent)) in events[renames[0]:], "the rename itself must be made durable"


# -- the scheduler's rebuild ---------------------------------------------------------------------
def scheduler_config(prefix: str, *extra: str):
    from rollway.config.run import load_config

    return load_config(ROOT / "examples" / "smoke.yaml", ["run.id=rS", f"topics.prefix={prefix}",
                                                          "scheduler.max_inflight_episodes=4", *extra])


@pytest.mark.broker
def test_restarted_scheduler_rebuilds_from_a_streamed_log(broker, topic_prefix, tmp_path):
    """The first scheduler issues two groups (4 episodes) and is killed; two episodes finished. Its
    restart reads the log back one message at a time and goes on where it stopped: nothing issued
    again, the finished episodes counted, the next group issued next."""
    from test_stage_runtime import produce

    from rollway.actors.scheduler import SchedulerActor
    from rollway.actors.services import Services
    from rollway.runtime.kafka import ensure_topics
    from rollway.runtime.scan import StreamingTopicScanner
    from rollway.schemas import encode

    cfg = scheduler_config(topic_prefix)

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        first = SchedulerActor(Services(cfg, tmp_path / "run"))
        await first.setup()
        issued = await first.tick()
        assert len(issued) == 4
        done = [trajectory(o.value.episode_id) for o in issued[:2]]
        await produce(cfg, broker.bootstrap, INIT_REQUESTS,
                      [(o.key.encode(), encode(o.value)) for o in issued])
        await produce(cfg, broker.bootstrap, TRAJECTORIES, [(t.episode_id.encode(), encode(t)) for t in done])
        restarted = SchedulerActor(Services(cfg, tmp_path / "run"), StreamingTopicScanner(cfg, broker.bootstrap))
        await restarted.setup()
        counts = restarted.counts()
        assert (counts["episodes_scheduled"], counts["episodes_completed"]) == (4, 2)
        assert restarted.next_group == 2
        again = await restarted.tick()
        assert {o.value.group_id for o in again} == {"rS-g00002"}, "only the next group, nothing twice"

    run(scenario())





@pytest.mark.broker
def test_scheduler_rebuild_that_cannot_finish_its_scan_fails_loudly(broker, topic_prefix, tmp_path):
    """The broker stops serving (here: no record can arrive within a zero stall allowance). The old
    scan gave up after 60 s with a warning and the scheduler went on from part of the log, issuing
    again what it had issued; now setup raises, naming the topic and what to do."""
    from rollway.actors.scheduler import SchedulerActor
    from rollway.actors.services import Services
    from rollway.runtime.kafka import ensure_topics
    from rollway.runtime.scan import ScanIncomplete, StreamingTopicScanner

    cfg = scheduler_config(topic_prefix)

    async def scenario():
        await ensure_topics(cfg.broker, cfg.topics, broker.bootstrap)
        sched = SchedulerActor(Services(cfg, tmp_path / "run"), StreamingTopicScanner(cfg, broker.bootstrap, stall_s=0))
        with pytest.raises(ScanIncomplete, match="init-requests.*restart this stage"):
            await sched.setup()

    run(scenario())


def test_scheduler_of_a_run_older_than_retention_refuses_to_rebuild(tmp_path):
    """A run restarted after the topics' 7-day retention: the log may have lost its early groups,
    and the old rebuild issued them again as new work. Now setup refuses, naming the way out."""
    from rollway.actors.scheduler import SchedulerActor
    from rollway.actors.services import Services
    from rollway.base.run_dir import RunDir

    cfg = scheduler_config("unused-")
    RunDir(tmp_path / "run").write(RunDir.SCHEDULER_STATUS, {"run_id": "rS", "started_at": time.time() - 8 * 86400})

    async def nothing(spec):  # the log as retention left it: empty (faked scan, no broker needed)
        return
        yield

    sched = SchedulerActor(Services(cfg, tmp_path / "run"), nothing)
    with pytest.raises(RuntimeError, match="retention.*new run.id"):
        run(sched.setup())


@pytest.mark.broker
def test_rollway_up_removes_sandboxes_a_killed_run_left(broker, topic_prefix, tmp_path):
    """Sandboxes of run rE that its killed workers left (made directly, as a SIGKILLed init leaves
    them) are gone after `rollway up` runs that run again, and the run itself leaves none."""
    root = tmp_path / "boxes"
    s = services(tmp_path, "run.id=rE", f"sandbox.root={root}")
    make_boxes(s, ["rE-g0-s0-a0-old1", "rE-g1-s1-a1-old2"])
    assert len(mounts_under(root)) == 2
    out = run_with_progress([sys.executable, "-m", "rollway.runners", "up", "--no-report", "examples/smoke.yaml", "--bootstrap",
                          broker.bootstrap, "runtime.processes=one", "--run-dir", str(tmp_path / "run"), f"topics.prefix={topic_prefix}",
                          "run.id=rE", f"sandbox.root={root}"], cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["trajectories_written"] == 8
    assert left_behind(root) == ([], [])
    # --no-report: no drawer started, nothing drawn.
    assert not [p.name for p in (tmp_path / "run").rglob("*") if p.name in ("report.html", "plots", "report.out")]
