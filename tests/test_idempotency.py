"""Durable, bounded idempotency of the reward stage and the sink: a restarted reward actor that gets a
graded request again emits the recorded trajectory (its sandbox is gone), the sink writes it once,
and the ledgers behind both stay bounded. Real bubblewrap sandboxes, scripted policy, no broker."""

from __future__ import annotations

import json
import time
from pathlib import Path

from conftest import run
from test_actors import meta, services

from rollway.actors.agent import AgentActor
from rollway.actors.init import InitActor
from rollway.actors.ledger import Ledger
from rollway.actors.reward import RewardActor
from rollway.actors.sink import SinkActor
from rollway.runtime.actor import MessageMeta
from rollway.schemas import EpisodeKey, InitRequest, RewardRequest
from rollway.topics import AGENT_STEPS, REWARD_REQUESTS, TRAJECTORIES


async def reward_request(s, episode_id: str) -> RewardRequest:
    """init and agent turns of one episode: the request the reward stage gets."""
    init, agent = InitActor(s), AgentActor(s)
    for actor in (init, agent):
        await actor.setup()
    req = InitRequest(episode=EpisodeKey(episode_id=episode_id, group_id="rR-g0", task_id="toy-001"), issued_at=time.time(),
                      deadline=time.time() + 60)
    [out] = await init.handle(req, MessageMeta("init-requests", 0, 0))
    offset = 0
    while out.topic is AGENT_STEPS:
        [out] = await agent.handle(out.value, meta(offset))
        offset += 1
    assert out.topic is REWARD_REQUESTS
    return out.value


def test_restarted_reward_actor_re_emits_a_redelivered_attempt_instead_of_failing(tmp_path):
    """The reward worker grades, tears the sandbox down and is killed before its trajectory reaches
    the broker (the offset stays uncommitted). The restarted worker gets the request again: with a
    memory-only dedup it graded a sandbox that no longer exists (a spurious failure); now it emits
    the recorded trajectory, and a duplicate copy of the request at a later offset (a re-run agent
    turn) changes nothing downstream."""
    s = services(tmp_path, "run.id=rR")
    at = MessageMeta("reward-requests", 2, 17)

    async def scenario():
        req = await reward_request(s, "rR-g0-s0")
        first = RewardActor(s)
        await first.setup()
        [graded] = await first.handle(req, at)
        assert not Path(req.sandbox["path"]).exists()
        del first  # killed: its output never produced, offset 17 never committed
        restarted = RewardActor(s)
        await restarted.setup()
        redelivered = await restarted.handle(req, at)
        duplicate = await restarted.handle(req, MessageMeta("reward-requests", 2, 18))
        sink = SinkActor(s)
        await sink.setup()
        for n, out in enumerate([graded, *redelivered, *duplicate]):
            await sink.handle(out.value, MessageMeta("trajectories", 0, n))
        return graded, redelivered, duplicate, restarted

    graded, redelivered, duplicate, restarted = run(scenario())
    assert graded.topic is TRAJECTORIES and graded.value.reward == 1.0
    assert [o.topic for o in redelivered] == [TRAJECTORIES], "the redelivery must not fail or vanish"
    assert redelivered[0].value == graded.value  # the same trajectory, not a second grading
    assert restarted.stats == {"graded": 0, "replayed": 2}
    lines = (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    assert [json.loads(x)["episode"]["episode_id"] for x in lines] == ["rR-g0-s0"]
    assert not (tmp_path / "run" / "failures.jsonl").exists()


def test_sink_restart_keeps_one_line_per_episode_and_failure(tmp_path):
    s = services(tmp_path, "run.id=rS")

    async def scenario():
        req = await reward_request(s, "rS-g0-s0")
        [out] = await (RewardActor(s)).handle(req, MessageMeta("reward-requests", 0, 0))
        from rollway.schemas import EpisodeFailure

        failure = EpisodeFailure(episode=EpisodeKey(episode_id="rS-g0-s1", group_id="rS-g0", task_id="toy-000", attempt=0,
                                 sample_index=1), stage="agent", reason="boom", retryable=True, at=time.time())
        a = SinkActor(s)
        await a.setup()
        await a.handle(out.value, MessageMeta("trajectories", 1, 5))
        await a.handle(failure, MessageMeta("episode-failures", 0, 3))
        b = SinkActor(s)  # restarted: both redelivered
        await b.setup()
        await b.handle(out.value, MessageMeta("trajectories", 1, 5))
        await b.handle(failure, MessageMeta("episode-failures", 0, 3))
        return b

    b = run(scenario())
    run_dir = tmp_path / "run"
    assert len((run_dir / "trajectories.jsonl").read_text().splitlines()) == 1
    assert len((run_dir / "failures.jsonl").read_text().splitlines()) == 1
    assert json.loads((run_dir / "sink-status.json").read_text())["episodes_written"] == 1 == b.written


def test_ledger_is_compacted_to_a_window_and_a_watermark_and_survives_restart(tmp_path):
    folder = tmp_path / "ledger"
    ledger = Ledger(folder, window=4)
    for offset in range(20):
        ledger.record(f"k{offset}", MessageMeta("t", 0, offset), result=f"r{offset}".encode())
    ledger.record("other", MessageMeta("t", 1, 0))
    assert ledger.size() <= 2 * 4 + 1, "memory must stay bounded by the window"
    lines = (folder / "t-0.jsonl").read_text().splitlines()
    assert len(lines) <= 2 * 4 + 1
    restarted = Ledger(folder, window=4)  # another process, or this one after a restart
    assert restarted.seen("k19", MessageMeta("t", 0, 19)).result == b"r19"
    old = restarted.seen("k2", MessageMeta("t", 0, 2))  # compacted away: known by the watermark
    assert old is not None and old.result is None
    assert restarted.seen("k20", MessageMeta("t", 0, 20)) is None
    assert restarted.seen("other", MessageMeta("t", 1, 0)) is not None
    assert restarted.seen("k3", MessageMeta("t", 1, 3)) is None, "watermarks are per partition"
    # What one process appends, another owner of the partition sees on its next look.
    ledger.record("k21", MessageMeta("t", 0, 21))
    assert restarted.seen("k21", MessageMeta("t", 0, 21)) is not None
    # A line cut short by a kill is ignored, the lines before it count.
    with open(folder / "t-1.jsonl", "ab") as f:
        f.write(b'{"k": "half')
    assert Ledger(folder, window=4).seen("other", MessageMeta("t", 1, 0)) is not None
