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


def test_inverse_cdf_sampling_follows_the_distribution_and_skips_masked_tokens():
    import asyncio

    from rollway.policies.base import SamplingParams
    from rollway.policies.batching import EngineRequest, _Seq

    logprobs = torch.log_softmax(torch.tensor([1.0, 2.0, -float("inf"), 0.5]), -1)
    loop = asyncio.new_event_loop()
    seq = _Seq(EngineRequest([1], SamplingParams()), loop.create_future(), loop, torch.Generator().manual_seed(0))
    engine = BatchEngine.__new__(BatchEngine)
    for _ in range(4000):
        engine._sample_one(seq, logprobs, logprobs.exp().cumsum(-1))
    loop.close()
    freq = torch.bincount(torch.tensor(seq.token_ids), minlength=4) / 4000
    assert freq[2] == 0 and torch.allclose(freq, logprobs.exp(), atol=0.03)
    assert seq.logprobs[:3] == [logprobs[t].item() for t in seq.token_ids[:3]]
