"""The Trainer on a tiny random Llama: update direction, masking, staleness, checkpoint + resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollway.learning.checkpoint import load_state
from rollway.learning.config import LearnerConfig
from rollway.learning.staleness import lag_histogram, policy_lag, stale_weight
from rollway.learning.testing import make_trajectory, tiny_model_factory
from rollway.learning.trainer import Trainer

PROMPT = [1, 2, 3, 4]
GOOD, BAD = [10, 11, 12], [20, 21, 22]


def _cfg(**kw) -> LearnerConfig:
    base = {"type": "grpo", "group_size": 2, "lr": 1e-2, "tensorboard": False}
    return LearnerConfig(**{**base, **kw})


def _pair(group: str, **kw) -> list:
    return [make_trajectory(f"{group}-good", group, PROMPT, GOOD, 1.0, sample_index=0, **kw),
            make_trajectory(f"{group}-bad", group, PROMPT, BAD, 0.0, sample_index=1, **kw)]


def _seq_logprob(model, completion: list[int]) -> float:
    ids = torch.tensor([PROMPT + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
    targets = ids[0, 1:]
    return float(logp[torch.arange(len(targets)), targets][len(PROMPT) - 1:].sum())


def test_update_raises_rewarded_and_lowers_unrewarded(tmp_path: Path) -> None:
    before, _ = tiny_model_factory()(None)
    trainer = Trainer(_cfg(tensorboard=True), tmp_path, model_factory=tiny_model_factory())
    a, b = _pair("g0")
    assert trainer.add(a) == []
    [result] = trainer.add(b)
    assert (result.version, result.step, result.episodes_trained) == (1, 1, 2)
    assert _seq_logprob(trainer.model, GOOD) > _seq_logprob(before, GOOD)
    assert _seq_logprob(trainer.model, BAD) < _seq_logprob(before, BAD)
    m = result.metrics
    assert m["reward_mean"] == 0.5 and m["pass_rate"] == 0.5 and m["ratio_mean"] == pytest.approx(1.0)
    assert m["train_tokens"] == 14 and m["tokens_per_second"] > 0 and m["grad_norm"] > 0
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
    assert any((tmp_path / "tb").iterdir())


def test_checkpoint_is_loadable_and_resume_never_retrains(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    first = Trainer(_cfg(), tmp_path, model_factory=tiny_model_factory())
    [r1] = [r for t in _pair("g0") for r in first.add(t)]
    assert r1.checkpoint_path == tmp_path / "checkpoints" / "step_000001"
    assert {"model.safetensors", "config.json", "trainer_state.json", "optimizer.pt"} <= {
        p.name for p in r1.checkpoint_path.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(r1.checkpoint_path)
    assert _seq_logprob(loaded, GOOD) == pytest.approx(_seq_logprob(first.model, GOOD), abs=1e-5)

    asked: list[str | None] = []

    def recording_factory(path: str | None):
        asked.append(path)
        return tiny_model_factory()(path)

    second = Trainer(_cfg(), tmp_path, model_factory=recording_factory)
    assert (second.state.version, second.state.step) == (1, 1)
    assert set(second.state.recent_episode_ids) == {"g0-good", "g0-bad"}
    assert [sorted(e["episode_ids"]) for e in load_state(r1.checkpoint_path).manifest] == [["g0-bad", "g0-good"]]
    assert second.add(_pair("g0")[0]) == [] and second.duplicates == 1
    assert second.pending_episode_ids() == set()
    [r2] = [r for t in _pair("g1") for r in second.add(t)]
    assert (r2.version, r2.episodes_trained) == (2, 4)
    # weights came from checkpoint 1 (not the initial model) and AdamW resumed its state
    assert asked == [str(r1.checkpoint_path)]
    assert second.optimizer.state_dict()["state"][0]["step"].item() == 2


def test_masked_and_stale_episodes_get_no_loss(tmp_path: Path) -> None:
    trainer = Trainer(_cfg(max_policy_lag=1, group_size=3), tmp_path, model_factory=tiny_model_factory())
    trainer.state.version = 3
    group = [make_trajectory("fresh", "g", PROMPT, GOOD, 1.0, versions=[3], sample_index=0),
             make_trajectory("stale", "g", PROMPT, BAD, 0.0, versions=[1], sample_index=1),
             make_trajectory("cut", "g", PROMPT, BAD, 0.0, versions=[3], stop_reason="length", sample_index=2)]
    [result] = [r for t in group for r in trainer.add(t)]
    m = result.metrics
    assert m["episodes_masked"] == 1 and m["episodes_dropped_stale"] == 1
    assert m["train_tokens"] == len(PROMPT) + len(GOOD)  # only "fresh" reached the loss
    assert m["staleness/lag_0"] == pytest.approx(2 / 3) and m["staleness/lag_2"] == pytest.approx(1 / 3)


def test_degenerate_group_is_consumed_without_update(tmp_path: Path) -> None:
    trainer = Trainer(_cfg(), tmp_path, model_factory=tiny_model_factory())
    same = [make_trajectory(f"e{i}", "g", PROMPT, GOOD, 1.0, sample_index=i) for i in range(2)]
    assert [r for t in same for r in trainer.add(t)] == []
    assert trainer.state.version == 0 and trainer.uncheckpointed_episode_ids() == {"e0", "e1"}
    assert trainer.knows("e0") and trainer.state.manifest[0]["updated"] is False


def test_micro_batching_does_not_change_the_loss(tmp_path: Path) -> None:
    metrics = []
    for budget in (8, 4096):
        trainer = Trainer(_cfg(micro_batch_tokens=budget), tmp_path / str(budget), model_factory=tiny_model_factory())
        trajs = _pair("g") + [make_trajectory("long", "h", PROMPT, GOOD + GOOD, 1.0, sample_index=0),
                              make_trajectory("short", "h", PROMPT, BAD[:1], 0.0, sample_index=1)]
        trainer.cfg.groups_per_step = 2
        [result] = [r for t in trajs for r in trainer.add(t)]
        metrics.append(result.metrics)
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], abs=1e-6)
    assert metrics[0]["grad_norm"] == pytest.approx(metrics[1]["grad_norm"], rel=1e-4)


def test_multi_step_update_with_kl_and_entropy(tmp_path: Path) -> None:
    cfg = _cfg(mini_batches=2, ppo_epochs=2, kl_coef=0.1, entropy_coef=0.01, group_size=4)
    trainer = Trainer(cfg, tmp_path, model_factory=tiny_model_factory())
    trajs = [make_trajectory(f"e{i}", "g", PROMPT, [10 + i, 11, 12], float(i % 2), sample_index=i)
             for i in range(4)]
    [result] = [r for t in trajs for r in trainer.add(t)]
    m = result.metrics
    assert m["optimizer_steps"] == 4 and trainer.state.optimizer_steps == 4
    assert m["ratio_max"] != pytest.approx(1.0) and m["kl_ref_mean"] >= 0 and m["entropy_mean"] > 0


def test_group_timeout_trains_partial_group(tmp_path: Path) -> None:
    trainer = Trainer(_cfg(group_size=3, group_timeout_s=5.0), tmp_path, model_factory=tiny_model_factory())
    for t in _pair("g"):
        assert trainer.add(t) == []
    assert trainer.tick(now=1e12)[0].episodes_trained == 2


class _Clock:
    """A fake monotonic clock (the group timeout is measured on it), moved by hand or by the model's forward."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _slow_model_factory(clock: _Clock, seconds: float):
    """The tiny model, whose every forward pass moves the fake clock by `seconds`: an update that takes
    longer than the group timeout, as a 135M model's update on a busy CPU does (16 minutes), without waiting."""
    inner = tiny_model_factory()

    def factory(path):
        model, tok = inner(path)
        model.register_forward_pre_hook(lambda *_: setattr(clock, "now", clock.now + seconds))
        return model, tok

    return factory


def test_a_groups_wait_does_not_count_the_learners_own_update(tmp_path: Path) -> None:
    """Attack (found in a training run: an update of 7 episodes from 2 groups of 8): while an update runs, the
    learner reads nothing, so members of a buffered group wait in its inbox. The group timeout counted that
    time, and the tick after a long update trained the group with the members read before it: a partial
    group, its baseline wrong, and the rest of it arriving after as a fragment."""
    clock = _Clock()
    cfg = _cfg(group_size=2, group_timeout_s=5.0)
    trainer = Trainer(cfg, tmp_path, model_factory=_slow_model_factory(clock, 10.0), clock=clock)
    b_good, b_bad = _pair("b")
    assert trainer.add(b_good) == []  # group b waits for its second member
    a_good, a_bad = _pair("a")
    assert trainer.add(a_good) == []
    [first] = trainer.add(a_bad)  # group a's update: 10 s or more on the clock, past b's 5 s timeout
    assert clock.now > 5.0 and first.episodes_trained == 2
    assert trainer.pending_episode_ids() == {"b-good"}, "group b was taken before its second member was read"
    [second] = trainer.add(b_bad)
    assert second.metrics["episodes"] == 2 and second.episodes_trained == 4


def test_a_group_waits_its_timeout_only_while_the_learner_listens(tmp_path: Path) -> None:
    """The timeout still fires for a member that never comes: time the learner spends reading counts."""
    clock = _Clock()
    trainer = Trainer(_cfg(group_size=3, group_timeout_s=5.0), tmp_path, model_factory=tiny_model_factory(),
                      clock=clock)
    for t in _pair("g"):
        assert trainer.add(t) == []
    clock.now = 4.0
    assert trainer.tick() == []
    clock.now = 6.0
    [result] = trainer.tick()
    assert result.metrics["episodes"] == 2


def test_a_late_member_of_a_trained_group_is_consumed_not_trained_as_a_group_of_its_own(tmp_path: Path) -> None:
    """Attack: a group trained at its timeout with half its members; the other half arrives after. Buffered
    anew under the same group id, it made a second group that its own timeout trained: the same task's
    episodes twice, the late ones against a baseline of themselves. A late member is consumed without
    training (the scheduler still sees it consumed), and a restart remembers which groups were trained."""
    clock = _Clock()
    cfg = _cfg(group_size=4, group_timeout_s=5.0)
    trainer = Trainer(cfg, tmp_path, model_factory=tiny_model_factory(), clock=clock)
    early = _pair("g")
    late = [make_trajectory("g-late-good", "g", PROMPT, GOOD, 1.0, sample_index=2),
            make_trajectory("g-late-bad", "g", PROMPT, BAD, 0.0, sample_index=3)]
    for t in early:
        assert trainer.add(t) == []
    clock.now = 10.0
    [partial] = trainer.tick()
    assert partial.episodes_trained == 2 and trainer.state.step == 1
    assert trainer.add(late[0]) == []
    assert trainer.pending_episode_ids() == set() and trainer.state.episodes_trained == 3
    clock.now = 100.0
    assert trainer.tick() == [] and trainer.state.step == 1
    trainer.save()
    restarted = Trainer(cfg, tmp_path, model_factory=tiny_model_factory(), clock=clock)
    assert restarted.add(late[1]) == [] and restarted.pending_episode_ids() == set()
    clock.now = 200.0
    assert restarted.tick() == [] and restarted.state.step == 1 and restarted.state.episodes_trained == 4
    restarted.save()
    entries = [e for e in load_state(tmp_path / "checkpoints" / "step_000001").manifest if e.get("late")]
    assert [e["episode_ids"] for e in entries] == [["g-late-good"], ["g-late-bad"]]


def test_staleness_rules() -> None:
    assert policy_lag(5, [3, 4]) == 2 and policy_lag(5, []) == 0
    drop = LearnerConfig(max_policy_lag=2)
    down = LearnerConfig(max_policy_lag=2, stale_policy="downweight", stale_weight=0.25)
    assert stale_weight(2, drop) == 1.0 and stale_weight(3, drop) == 0.0
    assert stale_weight(3, down) == 0.25 and stale_weight(9, LearnerConfig()) == 1.0
    hist = lag_histogram([0, 0, 1, 5, 20])
    assert hist == {"staleness/lag_0": 0.4, "staleness/lag_1": 0.2, "staleness/lag_4-7": 0.2,
                    "staleness/lag_16+": 0.2, "staleness/lag_max": 20.0}


def test_buffer_gives_groups_that_started_under_the_oldest_policy_first() -> None:
    """Under a lag bound the oldest groups are the next to go over it: a step takes them before
    newer ones that completed earlier; among equal versions, completion order."""
    from rollway.learning.groups import GroupBuffer

    buffer = GroupBuffer(group_size=2)
    for group, versions in (("new", [3]), ("old", [1, 3]), ("mid", [2]), ("mid2", [2])):
        for t in _pair(group, versions=versions):
            buffer.add(t)
    assert buffer.complete_groups == 4
    assert [g[0].group_id for g in buffer.pop_complete(2)] == ["old", "mid"]
    assert [g[0].group_id for g in buffer.pop_complete(2)] == ["mid2", "new"]
    assert buffer.pop_complete(1) == [] and buffer.pending_episode_ids() == set()


def test_record_config_is_not_a_trainer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="record"):
        Trainer(LearnerConfig(), tmp_path)


def test_bench_learner_refuses_a_group_of_one_with_a_reason(capsys) -> None:
    """A one-episode group has no advantage, so no update runs: the bench said IndexError."""
    import argparse

    from rollway.learning import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--batch", "1", "--json"])) == 2
    assert "--batch must be at least 2" in capsys.readouterr().err
