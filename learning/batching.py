"""Trajectories to padded tensors: training samples, micro-batch planning, right-padded collation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollway.schemas.messages import Trajectory
from rollway.schemas.tokens import segment_bounds


@dataclass(frozen=True)
class Sample:
    """One episode ready for the loss. Per-token lists have the length of `token_ids`."""

    episode_id: str
    token_ids: list[int]
    loss_mask: list[int]
    """1 on model tokens that get loss; all 0 for a masked (truncated/failed/dropped) episode."""
    behaviour_logprobs: list[float | None]
    advantage: float
    sample_weight: float = 1.0
    """Staleness weight (1 unless down-weighted)."""

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class MicroBatch:
    """Right-padded tensors of a few samples; padding has attention 0 and loss mask False."""

    input_ids_B_T: torch.Tensor
    attention_mask_B_T: torch.Tensor
    loss_mask_B_T: torch.Tensor
    behaviour_B_T: torch.Tensor
    behaviour_valid_B_T: torch.Tensor
    advantages_B: torch.Tensor
    token_weights_B: torch.Tensor
    """Aggregation weight of each row's tokens (see `losses.sequence_loss_weights`)."""
    rows: list[int]
    """Indices of the samples (in the mini-batch) held by each row."""

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask_B_T.sum())

    def model_inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids_B_T, "attention_mask": self.attention_mask_B_T}

    def place(self, values: list[torch.Tensor] | None) -> torch.Tensor | None:
        """Per-sample values (indexed like the mini-batch, unpadded) right-padded into this batch's rows."""
        if values is None:
            return None
        out_B_T = torch.zeros(self.input_ids_B_T.shape, dtype=torch.float32)
        for r, i in enumerate(self.rows):
            out_B_T[r, : values[i].numel()] = values[i]
        return out_B_T.to(self.input_ids_B_T.device)

    def extract(self, values_B_T: torch.Tensor) -> dict[int, torch.Tensor]:
        """The inverse of `place`: each sample's unpadded values."""
        lengths = self.attention_mask_B_T.sum(-1).tolist()
        return {i: values_B_T[r, : int(lengths[r])] for r, i in enumerate(self.rows)}


def trajectory_samples(traj: Trajectory, advantage: float, sample_weight: float = 1.0) -> list[Sample]:
    """The trajectory's training sequences: one per token stream (`schemas.tokens.segment_bounds`), each
    from its own start, so a harness episode whose program rewrote its history trains each segment
    conditioned only on what the model saw with it. Every segment carries the episode's advantage and
    staleness weight; a segment without loss tokens is left out (it would train nothing)."""
    samples = []
    for start, end in segment_bounds(traj):
        mask = traj.loss_mask[start:end]
        if any(mask):
            samples.append(Sample(traj.episode_id, traj.token_ids[start:end], mask, traj.logprobs[start:end],
                                  advantage, sample_weight))
    return samples


def plan_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sample indices so that rows x longest row <= token_budget (a longer single sample
    gets a batch of its own). Sorting by length keeps padding small."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def collate(samples: list[Sample], rows: list[int], token_weights: list[float], device: torch.device,
            pad_id: int = 0) -> MicroBatch:
    """Right-pad the chosen samples into one micro-batch on `device`."""
    width = max(len(samples[i].token_ids) for i in rows)
    shape = (len(rows), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    attn = torch.zeros(shape, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.bool)
    behaviour = torch.zeros(shape, dtype=torch.float32)
    bvalid = torch.zeros(shape, dtype=torch.bool)
    for r, i in enumerate(rows):
        s = samples[i]
        n = len(s.token_ids)
        ids[r, :n] = torch.tensor(s.token_ids)
        attn[r, :n] = 1
        mask[r, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        behaviour[r, :n] = torch.tensor([0.0 if lp is None else lp for lp in s.behaviour_logprobs])
        bvalid[r, :n] = torch.tensor([lp is not None for lp in s.behaviour_logprobs])
    return MicroBatch(
        ids.to(device), attn.to(device), mask.to(device), behaviour.to(device), bvalid.to(device),
        torch.tensor([samples[i].advantage for i in rows], dtype=torch.float32, device=device),
        torch.tensor([token_weights[i] for i in rows], dtype=torch.float32, device=device),
        list(rows),
    )
