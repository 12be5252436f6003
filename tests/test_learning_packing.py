"""Sequence packing: rows hold several episodes without one seeing another (positions and attention
restart per episode), the loss mask stays exact across boundaries, and a packed update equals the
right-padded one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rollway.learning.batching import Sample, collate
from rollway.learning.config import LearnerConfig
from rollway.learning.losses import token_logprobs
from rollway.learning.packing import collate_packed, pack_rows
from rollway.learning.testing import make_trajectory, tiny_model_factory
from rollway.learning.trainer import Trainer


def _samples() -> list[Sample]:
    specs = [([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 0, 1]), ([11, 12, 13], [1, 1, 1]), ([14, 15, 16, 17], [0, 1, 1, 1]),
             ([18, 19], [0, 1])]
    return [Sample(f"e{i}", ids, mask, [-1.0 if m else None for m in mask], float(i) - 1.5)
            for i, (ids, mask) in enumerate(specs)]


def test_pack_rows_fills_rows_and_never_splits_an_episode() -> None:
    rows = pack_rows([6, 3, 4, 2, 12], row_tokens=8)
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3, 4]
    assert rows[0] == [4]  # longer than a row: a row of its own
    assert all(sum([6, 3, 4, 2, 12][i] for i in r) <= 8 for r in rows[1:])
    assert len(rows) == 3


def test_packed_row_matches_each_episode_alone_and_keeps_the_loss_mask_exact() -> None:
    model, _ = tiny_model_factory(3)(None)
    samples = _samples()
    mb = collate_packed(samples, [0, 1, 2, 3], [0.1, 0.2, 0.3, 0.4], torch.device("cpu"), row_tokens=20)
    assert mb.input_ids_B_T.shape == (1, 20) and mb.real_tokens == 15
    assert mb.position_ids_B_T[0, :15].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 0, 1]
    # the mask is each episode's own mask, except the first token of every episode (nothing predicts it)
    expected = [0, 0, 1, 1, 0, 1] + [0, 1, 1] + [0, 1, 1, 1] + [0, 1] + [0] * 5
    assert mb.loss_mask_B_T[0].int().tolist() == expected
    assert mb.advantages_B[0, :15].tolist() == [-1.5] * 6 + [-0.5] * 3 + [0.5] * 4 + [1.5] * 2
    assert torch.allclose(mb.token_weights_B[0, 6:9], torch.tensor(0.2))
    with torch.no_grad():
        packed = token_logprobs(model(**mb.model_inputs()).logits, mb.input_ids_B_T, mask_B_T=mb.loss_mask_B_T)
        for i in range(len(samples)):
            alone = collate(samples, [i], [1.0] * 4, torch.device("cpu"))
            lp = token_logprobs(model(**alone.model_inputs()).logits, alone.input_ids_B_T,
                                mask_B_T=alone.loss_mask_B_T)[0]
            torch.testing.assert_close(mb.extract(packed)[i], lp, atol=1e-5, rtol=1e-5)
            assert float(lp.abs().sum()) > 0  # the comparison covers real loss tokens


def _trained(tmp_path: Path, **kw):
    cfg = LearnerConfig(type="grpo", group_size=3, lr=1e-2, tensorboard=False, micro_batch_tokens=16, **kw)
    trainer = Trainer(cfg, tmp_path, model_factory=tiny_model_factory())
    prompt = [1, 2, 3]
    trajs = [make_trajectory("a", "g", prompt, [10, 11, 12, 13], 1.0, sample_index=0),
             make_trajectory("b", "g", prompt, [20, 21], 0.0, sample_index=1, observation=[7, 7], second=[22]),
             make_trajectory("c", "g", prompt, [30, 31, 32, 33, 34, 35], 0.5, sample_index=2)]
    [result] = [r for t in trajs for r in trainer.add(t)]
    return result, trainer.model.state_dict()


@pytest.mark.parametrize("loss", ["ppo", "cispo"])
def test_a_packed_update_equals_the_padded_update(tmp_path: Path, loss: str) -> None:
    """Every per-token objective takes the packed rows' per-token advantages (cispo used to crash on them)."""
    padded, padded_w = _trained(tmp_path / "padded", loss=loss)
    packed, packed_w = _trained(tmp_path / "packed", pack_sequences=True, loss=loss)
    assert abs(packed.metrics["loss"] - padded.metrics["loss"]) < 1e-6
    assert packed.metrics["train_tokens"] == padded.metrics["train_tokens"] == 24
    for k, v in padded_w.items():
        torch.testing.assert_close(packed_w[k], v, atol=1e-5, rtol=1e-5, msg=k)


def test_packing_with_several_minibatches_uses_packed_old_logprobs(tmp_path: Path) -> None:
    padded, padded_w = _trained(tmp_path / "padded", mini_batches=2, ppo_epochs=2)
    packed, packed_w = _trained(tmp_path / "packed", mini_batches=2, ppo_epochs=2, pack_sequences=True)
    assert abs(packed.metrics["loss"] - padded.metrics["loss"]) < 1e-6
    # four AdamW steps at lr 1e-2 amplify float32 rounding (Adam divides by tiny second moments)
    for k, v in padded_w.items():
        torch.testing.assert_close(packed_w[k], v, atol=1e-4, rtol=1e-4, msg=k)


def test_gspo_with_packing_is_refused_at_load_naming_both() -> None:
    """gspo's ratio is one per sequence, and a packed row holds several: refused when the config loads,
    not by a crash at the first update."""
    with pytest.raises(ValidationError, match="gspo") as err:
        LearnerConfig(type="grpo", loss="gspo", pack_sequences=True)
    assert "pack_sequences" in str(err.value)
    LearnerConfig(type="grpo", loss="gspo")
    LearnerConfig(type="grpo", loss="cispo", pack_sequences=True)
