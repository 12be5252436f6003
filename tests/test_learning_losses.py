"""PPO loss branches, truncated IS, aggregation weights and logprob alignment, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rollway.learning.losses import (
    ClipParams,
    TokenStats,
    ppo_token_loss,
    sequence_loss_weights,
    token_entropy,
    token_logprobs,
)

PARAMS = ClipParams(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, tis_cap=None)


def _loss(ratios: list[float], advs: list[float], params: ClipParams = PARAMS, mask: list[bool] | None = None,
          behaviour: list[float] | None = None, valid: list[bool] | None = None, stats: TokenStats | None = None):
    """One row per token (B=n, T=1) so each token has its own advantage; old logprob 0."""
    n = len(ratios)
    logp = torch.log(torch.tensor(ratios)).reshape(n, 1).requires_grad_(True)
    old = torch.zeros(n, 1)
    beh = torch.tensor(behaviour or [0.0] * n).reshape(n, 1)
    bvalid = torch.tensor(valid or [True] * n).reshape(n, 1)
    m = torch.tensor(mask or [True] * n).reshape(n, 1)
    loss = ppo_token_loss(logp, old, torch.tensor(advs), beh, bvalid, m, params, stats)
    return loss, logp


def test_clip_higher_and_dual_clip_branches() -> None:
    ratios = [1.5, 1.1, 0.5, 5.0, 2.0, 1.5]
    advs = [1.0, 1.0, -1.0, -1.0, -1.0, 1.0]
    stats = TokenStats()
    loss, logp = _loss(ratios, advs, mask=[True] * 5 + [False], stats=stats)
    expected = [
        -1.28,  # r above 1 + eps_high with A > 0: clipped at 1.28
        -1.1,   # inside the band: -r A
        0.8,    # r below 1 - eps_low with A < 0: -(0.8 x -1)
        3.0,    # A < 0, r = 5: PPO gives 5, dual-clip caps at c |A| = 3
        2.0,    # A < 0, r = 2 < c: unclipped -r A
        0.0,    # masked token
    ]
    assert loss.squeeze(1).tolist() == pytest.approx(expected)
    loss.sum().backward()
    # d(-r A)/dlogp = -r A on unclipped tokens; clipped/capped/masked tokens have no gradient
    assert logp.grad.squeeze(1).tolist() == pytest.approx([0.0, -1.1, 0.0, 0.0, 2.0, 0.0])
    s = stats.summary()
    assert stats.tokens == 5
    assert s["clip_frac_high_mean"] == pytest.approx(1 / 5)
    assert s["clip_frac_low_mean"] == pytest.approx(1 / 5)
    assert s["dual_clip_frac_mean"] == pytest.approx(1 / 5)
    assert s["ratio_max"] == pytest.approx(5.0) and s["ratio_min"] == pytest.approx(0.5)
    assert s["ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 5.0 + 2.0) / 5)


def test_without_dual_clip_negative_advantage_is_unbounded() -> None:
    params = ClipParams(eps_low=0.2, eps_high=0.2, dual_clip_c=None, tis_cap=None)
    loss, _ = _loss([5.0], [-1.0], params)
    assert loss.item() == pytest.approx(5.0)


def test_truncated_importance_weights() -> None:
    params = ClipParams(eps_low=0.2, eps_high=0.28, dual_clip_c=None, tis_cap=2.0)
    # old logprob 0: pi_old/mu = exp(0 - behaviour)
    behaviour = [-math.log(3.0), math.log(2.0), 5.0]
    stats = TokenStats()
    loss, _ = _loss([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], params, behaviour=behaviour, valid=[True, True, False],
                    stats=stats)
    # weights: min(3, 2) = 2; 0.5; no behaviour logprob -> 1. Ratio 1 -> per-token loss -w.
    assert loss.squeeze(1).tolist() == pytest.approx([-2.0, -0.5, -1.0])
    assert stats.summary()["tis_weight_max"] == pytest.approx(2.0)


def test_sequence_loss_weights_modes() -> None:
    counts, w = [2, 0, 3], [1.0, 1.0, 0.5]
    assert sequence_loss_weights(counts, w, "token-mean", 10) == pytest.approx([1 / 5, 0.0, 0.5 / 5])
    assert sequence_loss_weights(counts, w, "seq-mean-token-mean", 10) == pytest.approx([1 / 4, 0.0, 0.5 / 6])
    assert sequence_loss_weights(counts, w, "token-sum-norm", 10) == pytest.approx([1 / 20, 0.0, 0.5 / 20])


def test_logprob_of_token_comes_from_previous_position() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 7)
    ids = torch.tensor([[3, 1, 6, 2]])
    lp = token_logprobs(logits, ids, temperature=2.0)
    assert lp[0, 0].item() == 0.0
    for t in range(1, 4):
        expected = torch.log_softmax(logits[0, t - 1] / 2.0, -1)[ids[0, t]]
        assert lp[0, t].item() == pytest.approx(expected.item(), abs=1e-6)


def test_entropy_of_uniform_is_log_vocab() -> None:
    ent = token_entropy(torch.zeros(1, 3, 11))
    assert ent[0, 1:].tolist() == pytest.approx([math.log(11)] * 2, abs=1e-6)


def test_entropy_measured_in_chunks_equals_the_direct_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    """The metric path (no gradient) splits the tokens into chunks; a bonus path (gradient) does not.
    Both must give -sum p log p of the predicting position, masked like the logprobs."""
    import rollway.learning.losses as losses

    monkeypatch.setattr(losses, "ENTROPY_CHUNK_TOKENS", 3)  # 7 selected tokens -> chunks of 3, 3, 1
    torch.manual_seed(2)
    logits = torch.randn(2, 6, 13, dtype=torch.bfloat16) * 4
    mask = torch.tensor([[0, 1, 1, 1, 0, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    logp = torch.log_softmax(logits.float()[:, :-1] / 0.7, -1)
    expected = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0)) * mask
    chunked = token_entropy(logits, temperature=0.7, mask_B_T=mask)
    assert chunked.dtype == torch.float32
    assert torch.allclose(chunked, expected, atol=1e-5)
    with_grad = logits.float().requires_grad_()
    direct = token_entropy(with_grad, temperature=0.7, mask_B_T=mask)
    assert torch.allclose(direct, expected, atol=1e-5)
    direct.sum().backward()
    assert with_grad.grad is not None and with_grad.grad.abs().sum() > 0


def test_masked_logprobs_match_full_computation_and_carry_gradient() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 9, requires_grad=True)
    ids = torch.randint(0, 9, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 1, 1]], dtype=torch.bool)
    full = token_logprobs(logits, ids)
    masked = token_logprobs(logits, ids, mask_B_T=mask)
    assert torch.allclose(masked[mask], full[mask]) and (masked[~mask] == 0).all()
    masked.sum().backward()
    assert logits.grad[0, 0].abs().sum() == 0 and logits.grad[0, 1].abs().sum() > 0  # position 1 predicts token 2


# -- the Loss seam: cispo and gspo by hand ------------------------------------------------------
def _seam(name: str, logp_rows: list[list[float]], old_rows: list[list[float]], advs: list[float], **cfg):
    from rollway.learning.config import LearnerConfig
    from rollway.learning.losses import build_loss

    loss = build_loss(LearnerConfig(type="ppo", loss=name, tis_cap=None, **cfg))
    logp = torch.tensor(logp_rows).requires_grad_(True)
    old = torch.tensor(old_rows)
    ones = torch.ones_like(old, dtype=torch.bool)
    out = loss.token_loss(logp, old, torch.tensor(advs), torch.zeros_like(old), ones, ones, TokenStats())
    return out, logp


def test_loss_is_chosen_by_config_and_ppo_matches_the_old_function() -> None:
    from rollway.learning.config import LearnerConfig
    from rollway.learning.losses import CISPOLoss, GSPOLoss, PPOClipLoss, build_loss

    kinds = {name: type(build_loss(LearnerConfig(type="ppo", loss=name))) for name in ("ppo", "cispo", "gspo")}
    assert kinds == {"ppo": PPOClipLoss, "cispo": CISPOLoss, "gspo": GSPOLoss}
    out, _ = _seam("ppo", [[math.log(1.5)], [math.log(0.5)]], [[0.0], [0.0]], [1.0, -1.0],
                   clip_eps_low=0.2, clip_eps_high=0.28)
    assert out.flatten().tolist() == pytest.approx([-1.28, 0.8])


def test_cispo_clips_the_weight_not_the_gradient() -> None:
    # r = 1.5 (above 1 + 0.28): weight 1.28, loss -1.28 x A x logp; r = 0.5 (below 0.8): weight 0.8.
    logps = [math.log(0.3), math.log(0.2)]
    olds = [math.log(0.2), math.log(0.4)]
    out, logp = _seam("cispo", [[logps[0]], [logps[1]]], [[olds[0]], [olds[1]]], [2.0, -1.0],
                      clip_eps_low=0.2, clip_eps_high=0.28)
    assert out.flatten().tolist() == pytest.approx([-1.28 * 2.0 * logps[0], -0.8 * -1.0 * logps[1]], rel=1e-5)
    out.sum().backward()
    # PPO would give these clipped tokens no gradient; CISPO gives -weight x A to each.
    assert logp.grad.flatten().tolist() == pytest.approx([-1.28 * 2.0, 0.8 * 1.0], rel=1e-5)


def test_gspo_uses_one_clipped_ratio_per_sequence() -> None:
    # One sequence of two tokens with log-ratios 0.2 and 0.0: s = exp(0.1) = 1.10517.
    # With eps 0.05/0.05 and A = 1: min(s, 1.05) = 1.05 on both tokens (clipped: no gradient).
    out, logp = _seam("gspo", [[0.2, 0.0]], [[0.0, 0.0]], [1.0], clip_eps_low=0.05, clip_eps_high=0.05)
    assert out.flatten().tolist() == pytest.approx([-1.05, -1.05])
    out.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0])
    # Inside the band (eps 0.2): the value is s on every token, the gradient s x (-A) per token.
    out, logp = _seam("gspo", [[0.2, 0.0]], [[0.0, 0.0]], [1.0], clip_eps_low=0.2, clip_eps_high=0.2)
    s = math.exp(0.1)
    assert out.flatten().tolist() == pytest.approx([-s, -s], rel=1e-6)
    out.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-s, -s], rel=1e-6)
