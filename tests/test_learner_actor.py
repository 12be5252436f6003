"""The learner actor with a real (tiny) torch trainer: groups, policy versions, held offsets, resume."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
from conftest import ROOT, run
from jobs import run_with_progress
from test_actors import services

from rollway.actors.learner import LearnerActor
from rollway.learning.testing import make_trajectory, tiny_model_factory
from rollway.runtime.actor import MessageMeta


def learner_services(tmp_path, *extra: str):
    return services(tmp_path, "learner.type=ppo", "scheduler.group_size=2", "learner.groups_per_step=1",
                    "run.id=rL", *extra)


def traj(i: int, reward: float, group: str = "rL-g0"):
    return make_trajectory(f"{group}-s{i}", group, prompt=[1, 2, 3], completion=[10 + i, 11, 12], reward=reward,
                           sample_index=i)


def test_learner_trains_a_group_publishes_a_version_and_holds_offsets(tmp_path):
    s = learner_services(tmp_path)

    async def scenario():
        actor = LearnerActor(s, trainer_factory=tiny_model_factory())
        await actor.setup()
        assert await actor.handle(traj(0, 1.0), MessageMeta("trajectories", 0, 5)) == []
        assert actor.held_offsets() == {("trajectories", 0, 5)}, "a buffered episode's offset must be held"
        [out] = await actor.handle(traj(1, 0.0), MessageMeta("trajectories", 1, 9))
        assert out.value.version == 1 and out.value.episodes_trained == 2
        assert actor.held_offsets() == set()
        await actor.close()
        return out.value

    pv = run(scenario())
    assert (tmp_path / "run" / "checkpoints").is_dir() and pv.checkpoint and "step_" in pv.checkpoint
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["reward_mean"] == pytest.approx(0.5)

    async def restart():
        again = LearnerActor(s, trainer_factory=tiny_model_factory())
        await again.setup()
        assert again.version == 1  # resumed from the checkpoint
        # Redelivered after the restart: neither recorded nor trained again.
        assert await again.handle(traj(0, 1.0), MessageMeta("trajectories", 0, 5)) == []
        assert again.trainer.state.version == 1
        await again.close()

    run(restart())
    records = (tmp_path / "run" / "learner-records.jsonl").read_text().splitlines()
    assert len(records) == 2


def test_up_with_a_training_learner_publishes_policy_versions(tmp_path, broker):
    """The smoke job end to end with learner.type=ppo on a tiny model (byte-level vocab)."""
    from transformers import LlamaForCausalLM

    model_dir = tmp_path / "tiny"
    model, _ = tiny_model_factory()(None)
    assert isinstance(model, LlamaForCausalLM)
    model.save_pretrained(model_dir)
    # Half the episodes (by seed) write a wrong answer, so groups carry a learning signal.
    import yaml

    cfg = yaml.safe_load((ROOT / "examples" / "smoke.yaml").read_text())
    rule = cfg["policy"]["script"][0]
    rule["alternatives"] = [[*rule["turns"][:2], '<tool_call>{"name": "bash", "arguments": {"command": "echo 0 > '
                             'answer.txt"}}</tool_call>', rule["turns"][3]]]
    cfg["scheduler"]["group_size"] = 4
    config = tmp_path / "learn-smoke.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    out = run_with_progress(
        [sys.executable, "-m", "rollway.runners", "up", "--no-report", str(config), "--bootstrap", broker.bootstrap, "runtime.processes=one",
         "--run-dir", str(run_dir), "learner.type=ppo", f"learner.model_path={model_dir}", "learner.dtype=float32",
         "learner.groups_per_step=1", f"topics.prefix=tl{tmp_path.name[-6:]}-"],
        cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    status = json.loads((run_dir / "learner-status.json").read_text())
    assert status["episodes_received"] == 16 and status["policy_version"] >= 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 < summary["reward_mean"] < 1
    assert (run_dir / "metrics.jsonl").exists()


def test_learner_announces_progress_when_a_step_has_no_signal(tmp_path):
    """All-equal rewards give no update; the scheduler still has to learn the episodes were consumed."""
    s = learner_services(tmp_path)

    async def scenario():
        actor = LearnerActor(s, trainer_factory=tiny_model_factory())
        await actor.setup()
        await actor.handle(traj(0, 1.0), MessageMeta("trajectories", 0, 1))
        [out] = await actor.handle(traj(1, 1.0), MessageMeta("trajectories", 0, 2))
        await actor.close()
        return out.value

    pv = run(scenario())
    assert pv.version == 0 and pv.checkpoint is None and pv.episodes_trained == 2


def test_a_trajectory_from_a_text_only_endpoint_is_never_trained(tmp_path):
    """Turns labelled NOT_TRAINABLE_VERSION (policy.api: chat: zero logprobs) are left out of the
    update; the rest of the group trains without waiting for it."""
    from rollway.learning.checkpoint import read_manifests
    from rollway.policies.openai_chat import NOT_TRAINABLE_VERSION

    s = learner_services(tmp_path, "scheduler.group_size=3")
    chat = make_trajectory("rL-g0-s2", "rL-g0", prompt=[1, 2, 3], completion=[12, 11, 12], reward=1.0,
                           sample_index=2, versions=[NOT_TRAINABLE_VERSION])

    async def scenario():
        actor = LearnerActor(s, trainer_factory=tiny_model_factory())
        await actor.setup()
        await actor.handle(traj(0, 1.0), MessageMeta("trajectories", 0, 1))
        assert await actor.handle(chat, MessageMeta("trajectories", 0, 2)) == []
        [out] = await actor.handle(traj(1, 0.0), MessageMeta("trajectories", 0, 3))
        await actor.close()
        return out.value

    pv = run(scenario())
    assert pv.version == 1 and pv.episodes_trained == 2
    [step] = read_manifests(tmp_path / "run")
    assert sorted(step["episode_ids"]) == ["rL-g0-s0", "rL-g0-s1"] and step["abandoned_ids"] == ["rL-g0-s2"]


def _manifest_counts(run_dir) -> dict[str, int]:
    from collections import Counter

    from rollway.learning.checkpoint import read_manifests

    return Counter(e for step in read_manifests(run_dir) for e in step["episode_ids"])


def test_a_killed_learner_loses_no_buffered_or_uncheckpointed_episode(tmp_path):
    """The learner buffers half a group and trains a group no checkpoint holds yet (checkpoint_every
    2), then dies (no close). Its restart, fed everything from the lowest held offset as Kafka would
    redeliver it, trains every episode exactly once, as the checkpoints' step manifests show.
    (Before: the restart skipped every episode it had recorded, buffered ones included.)"""
    s = learner_services(tmp_path, "learner.checkpoint_every=2", "learner.tensorboard=false",
                         "learner.checkpoint_idle_s=null")
    stream = [traj(0, 1.0, "rL-g0"), traj(0, 1.0, "rL-g1"), traj(1, 0.0, "rL-g1")]  # g0 half, g1 whole

    async def crash():
        first = LearnerActor(s, trainer_factory=tiny_model_factory())
        await first.setup()
        for offset, t in enumerate(stream):
            await first.handle(t, MessageMeta("trajectories", 0, offset))
        assert first.version == 1 and first.trainer.latest_checkpoint is None
        return first.held_offsets()  # then kill -9: no close, nothing saved

    held = run(crash())
    assert held == {("trajectories", 0, o) for o in range(3)}, "buffered and uncheckpointed offsets are held"
    committed = min(o for _, _, o in held)
    rest = [traj(1, 0.0, "rL-g0"), traj(0, 1.0, "rL-g2"), traj(1, 0.0, "rL-g2")]

    async def resume():
        again = LearnerActor(s, trainer_factory=tiny_model_factory())
        await again.setup()
        for offset, t in enumerate([*stream, *rest][committed:], start=committed):
            await again.handle(t, MessageMeta("trajectories", 0, offset))
        await again.close()  # a clean stop checkpoints what is not yet held by one

    run(resume())
    counts = _manifest_counts(tmp_path / "run")
    assert counts == {f"rL-g{g}-s{i}": 1 for g in range(3) for i in range(2)}, counts


def test_offsets_of_the_update_in_progress_stay_held(tmp_path):
    """While an update runs in its worker thread, its groups are out of the buffer but not yet
    consumed: the held offsets must still cover them, or a commit in that window skips them."""
    import threading

    s = learner_services(tmp_path, "learner.tensorboard=false")

    async def scenario():
        actor = LearnerActor(s, trainer_factory=tiny_model_factory())
        await actor.setup()
        gate, inside = threading.Event(), threading.Event()
        optimise = actor.trainer._optimise

        def slow_optimise(samples):
            inside.set()
            gate.wait(30)
            return optimise(samples)

        actor.trainer._optimise = slow_optimise
        await actor.handle(traj(0, 1.0), MessageMeta("trajectories", 0, 7))
        update = asyncio.create_task(actor.handle(traj(1, 0.0), MessageMeta("trajectories", 0, 8)))
        await asyncio.to_thread(inside.wait, 30)
        held_during = actor.held_offsets()
        gate.set()
        await update
        await actor.close()
        return held_during

    assert run(scenario()) == {("trajectories", 0, 7), ("trajectories", 0, 8)}


def test_a_tick_running_beside_a_handle_never_drops_its_held_offset(tmp_path):
    """The runtime ticks the learner while a message waits for the trainer: the tick's cleanup of
    durable offsets must not forget the waiting message's offset (it was, and the chaos ledger saw
    the message's whole group lost after the next crash)."""
    import threading

    s = learner_services(tmp_path, "learner.tensorboard=false")

    async def scenario():
        actor = LearnerActor(s, trainer_factory=tiny_model_factory())
        await actor.setup()
        gate, inside = threading.Event(), threading.Event()
        tick = actor.trainer.tick

        def slow_tick(now=None):
            inside.set()
            gate.wait(30)
            return tick(now)

        actor.trainer.tick = slow_tick
        ticking = asyncio.create_task(actor.tick())
        await asyncio.to_thread(inside.wait, 30)
        handling = asyncio.create_task(actor.handle(traj(0, 1.0), MessageMeta("trajectories", 2, 40)))
        await asyncio.sleep(0.05)  # the handle now waits for the trainer
        actor.trainer.tick = tick
        gate.set()
        await ticking
        await handling
        held = actor.held_offsets()
        await actor.close()
        return held

    assert run(scenario()) == {("trajectories", 2, 40)}


def test_a_tick_after_a_failed_update_keeps_its_episodes_held(tmp_path):
    """An update fails (a rank died: FatalActorError) and the runtime ticks the learner once more
    before it stops. That tick cleared the failed update's episodes from the held set, the idle
    worker committed past them, and the restarted learner never saw them (a chaos run with two
    learner ranks lost a whole group this way). The failure is staged by making the optimizer step
    raise; the trainer, the actor and its held-offset bookkeeping are the real ones."""
    from rollway.runtime.actor import FatalActorError

    s = learner_services(tmp_path, "learner.tensorboard=false")

    async def scenario():
        actor = LearnerActor(s, trainer_factory=tiny_model_factory())
        await actor.setup()

        def dying_optimise(samples):
            raise RuntimeError("rank 1 went away mid-step")

        actor.trainer._optimise = dying_optimise
        await actor.handle(traj(0, 1.0), MessageMeta("trajectories", 0, 7))
        await actor.handle(traj(0, 1.0, group="rL-g1"), MessageMeta("trajectories", 1, 3))  # another group, buffered
        with pytest.raises(FatalActorError):
            await actor.handle(traj(1, 0.0), MessageMeta("trajectories", 0, 8))
        try:
            await actor.tick()  # the worker's loop may tick before it sees the fatal error
        except FatalActorError:
            pass
        held = actor.held_offsets()
        await actor.close()
        return held

    assert run(scenario()) == {("trajectories", 0, 7), ("trajectories", 0, 8), ("trajectories", 1, 3)}
