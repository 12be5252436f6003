"""Top-p masking of the batching engine's sampler (pure tensor maths, no model)."""

from __future__ import annotations

import torch
from rollway.policies.batching import BatchEngine


def test_nucleus_keeps_the_smallest_set_reaching_top_p_per_row():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])
    masked = BatchEngine._nucleus(probs.log(), torch.tensor([0.75, 0.81]))
    kept = torch.isfinite(masked)
    assert kept.tolist() == [[True, True, False, False], [False, True, True, True]]
    renormalised = torch.log_softmax(masked, -1)[0, :2].exp()
    assert abs(renormalised[0].item() - 0.5 / 0.8) < 1e-6


def test_nucleus_always_keeps_the_most_likely_token():
    masked = BatchEngine._nucleus(torch.tensor([[2.0, 1.0, 0.0]]), torch.tensor([1e-6]))
    assert torch.isfinite(masked).tolist() == [[True, False, False]]
