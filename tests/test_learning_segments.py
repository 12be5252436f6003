"""Multi-segment trajectories (harness episodes whose program rewrote its history) train as one sequence
per segment: each segment's tokens are conditioned on that segment's own prefix only, as the model saw
them, with the episode's advantage on every segment and the episode counted once by the loss's
normalisation. The reference gradients are computed here with plain torch on the tiny Llama of
learning/testing.py (tests/segmented.py), independently of the trainer's batching, packing and weighting code."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from segmented import make_segmented_trajectory

from rollway.learning.advantages import build_advantage_estimator, group_advantages
from rollway.learning.config import LearnerConfig
from rollway.learning.losses import sequence_loss_weights
from rollway.learning.testing import make_trajectory, tiny_model_factory
from rollway.learning.trainer import Trainer
from rollway.schemas.tokens import check_token_arrays, segment_bounds

# Episode "a": a first stream of two turns, then the program compacted its history (second stream).
A_FIRST = [[1, 2, 3, 4], [10, 11, 12], [5, 6], [13, 14]]
A_SECOND = [[1, 2, 7, 8, 9], [15, 16, 17]]
B_ONLY = [[1, 2, 3, 4], [20, 21, 22, 23]]


def _cfg(**kw) -> LearnerConfig:
    base = {"type": "grpo", "group_size": 2, "lr": 1e-2, "tensorboard": False, "max_grad_norm": None,
            "tis_cap": None, "device": "cpu"}
    return LearnerConfig(**{**base, **kw})


def _group() -> list:
    return [make_segmented_trajectory("a", "g", [A_FIRST, A_SECOND], 1.0, sample_index=0),
            make_segmented_trajectory("b", "g", [B_ONLY], 0.0, sample_index=1)]


def _flat(segment: list[list[int]]) -> tuple[list[int], list[int]]:
    """A segment's tokens and loss mask: its prompt and observations 0, its completions 1."""
    ids, mask = [], []
    for k, part in enumerate(segment):
        ids += part
        mask += [k % 2] * len(part)
    return ids, mask


def _trainer_gradient(cfg: LearnerConfig, tmp_path: Path, trajs: list) -> dict[str, torch.Tensor]:
    """The gradient the trainer's one optimizer step applies (read just before AdamW steps)."""
    trainer = Trainer(cfg, tmp_path, model_factory=tiny_model_factory())
    trainer._ensure_model()
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    results = [r for t in trajs for r in trainer.add(t)]
    assert len(results) == 1 and grads
    return grads


def _reference_gradient(cfg: LearnerConfig, sequences: list[tuple[str, list[int], list[int]]],
                        advantages: dict[str, float]) -> dict[str, torch.Tensor]:
    """Plain torch: each (episode, ids, mask) sequence through the model on its own, the on-policy PPO
    token loss -A * pi/sg(pi) on its mask-1 tokens, weighted as `learner.loss_agg` documents: token-mean
    divides by every loss token of the batch, seq-mean-token-mean by the episode's loss tokens times
    the number of episodes (an episode's sequences together are one episode)."""
    model, _ = tiny_model_factory()(None)
    model.eval()
    per_episode: dict[str, int] = {}
    for episode, _, mask in sequences:
        per_episode[episode] = per_episode.get(episode, 0) + sum(mask)
    total = sum(per_episode.values())
    loss = torch.zeros(())
    for episode, ids, mask in sequences:
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
        on = torch.tensor(mask[1:], dtype=torch.bool)
        token_loss = -advantages[episode] * torch.exp(lp - lp.detach())
        if cfg.effective_loss_agg == "token-mean":
            weight = 1.0 / total
        else:
            weight = 1.0 / (per_episode[episode] * len(per_episode))
        loss = loss + (token_loss[on] * weight).sum()
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _advantages(cfg: LearnerConfig, trajs: list) -> dict[str, float]:
    ga = group_advantages(build_advantage_estimator(cfg), [t.reward for t in trajs], [t.stop_reason for t in trajs], cfg)
    return {t.episode_id: float(a) for t, a in zip(trajs, ga.advantages, strict=True)}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[k], b[k], atol=1e-6, rtol=1e-4) for k in b)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_a_two_segment_episode_trains_like_two_separate_sequences_not_like_their_concatenation(
        tmp_path: Path, loss_agg: str, pack: bool) -> None:
    cfg = _cfg(loss_agg=loss_agg, pack_sequences=pack, micro_batch_tokens=64)
    trajs = _group()
    adv = _advantages(cfg, trajs)
    assert adv["a"] > 0 > adv["b"]
    got = _trainer_gradient(cfg, tmp_path, trajs)

    separate = [("a", *_flat(A_FIRST)), ("a", *_flat(A_SECOND)), ("b", *_flat(B_ONLY))]
    expected = _reference_gradient(cfg, separate, adv)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-4, msg=k)

    # The old computation: episode a's streams as one sequence (segment 2 conditioned on segment 1).
    a = trajs[0]
    concatenated = [("a", a.token_ids, a.loss_mask), ("b", *_flat(B_ONLY))]
    assert not _close(got, _reference_gradient(cfg, concatenated, adv))


def test_an_episode_counts_once_whatever_its_segments_under_seq_mean_token_mean() -> None:
    """seq-mean-token-mean is documented as mean per episode, then over episodes: a 3-segment episode
    weighs what it would as one sequence with the same loss tokens, not 3x."""
    weights = sequence_loss_weights([2, 3, 5, 4], [1.0, 1.0, 1.0, 0.5], "seq-mean-token-mean", 10,
                                    episode_ids=["x", "x", "x", "y"])
    assert weights == pytest.approx([1 / (10 * 2)] * 3 + [0.5 / (4 * 2)])
    assert sequence_loss_weights([2, 3, 5, 4], [1.0] * 4, "token-sum-norm", 10,
                                 episode_ids=["x", "x", "x", "y"]) == pytest.approx([1 / 20] * 4)
    assert sequence_loss_weights([2, 3, 5, 4], [1.0] * 4, "token-mean", 10,
                                 episode_ids=["x", "x", "x", "y"]) == pytest.approx([1 / 14] * 4)


def test_a_one_segment_episode_trains_exactly_as_before(tmp_path: Path) -> None:
    """A built-in episode (no segment starts) is one sequence: its update is the plain trajectory's."""
    cfg = _cfg()
    built_in = [make_trajectory("a", "g", [1, 2, 3, 4], [10, 11, 12], 1.0, observation=[5, 6], second=[13, 14]),
                make_trajectory("b", "g", [1, 2, 3, 4], [20, 21, 22, 23], 0.0, sample_index=1)]
    got = _trainer_gradient(cfg, tmp_path, built_in)
    expected = _reference_gradient(cfg, [("a", *_flat(A_FIRST)), ("b", *_flat(B_ONLY))], _advantages(cfg, built_in))
    assert _close(got, expected)


def test_segment_bounds_and_the_token_check_refuse_a_segment_start_inside_a_turn() -> None:
    a = _group()[0]
    assert segment_bounds(a) == [(0, 11), (11, 19)]
    assert [a.token_ids[s:e] for s, e in segment_bounds(a)] == [_flat(A_FIRST)[0], _flat(A_SECOND)[0]]
    check_token_arrays(a)
    # inside a turn, at either end, repeated, at a model token (nothing of its own predicts it), unordered
    for starts in ([5], [0], [19], [11, 11], [16], [11, 3]):
        with pytest.raises(ValueError, match="segment"):
            check_token_arrays(msgspec.structs.replace(a, segment_starts=starts))
