import math

import pytest
import torch

from tether.algo import (
    aggregate,
    clipped_surrogate,
    entropy_bonus,
    entropy_from_logits,
    importance_ratio,
    logprobs_from_logits,
    loss_denominator,
)


def close(t, expected, tol=1e-5):
    expected = torch.tensor(expected, dtype=torch.float64)
    return torch.allclose(torch.as_tensor(t, dtype=torch.float64), expected, atol=tol)


def surrogate_inputs(deltas, advantages, mask):
    old = torch.full((1, len(deltas)), -1.0)
    logp = (old + torch.tensor([deltas])).requires_grad_(True)
    return logp, old, torch.tensor([advantages]), torch.tensor([mask])


# ---------------------------------------------------------------------------------------------- clipped surrogate


def test_clipped_surrogate_hand_computed():
    # ε_low = 0.2, ε_high = 0.28 (DAPO) → ratio clipped to [0.8, 1.28]
    logp, old, adv, mask = surrogate_inputs(
        deltas=[0.1, 0.5, -0.5, -0.5, 0.5, 3.0], advantages=[1.0, 1.0, -1.0, 1.0, -2.0, 1.0], mask=[1, 1, 1, 1, 1, 0]
    )
    loss, m = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # t0: r = e^0.1 = 1.105171, A>0, inside          → -A·r = -1.105171
    # t1: r = e^0.5 = 1.648721, A>0, above 1.28      → max(-1.648721, -1.28) = -1.28      (clipped high)
    # t2: r = e^-0.5 = 0.606531, A<0, below 0.8      → max(0.606531, 0.8) = 0.8           (clipped low)
    # t3: r = 0.606531, A>0: PPO does not clip here  → max(-0.606531, -0.8) = -0.606531
    # t4: r = 1.648721, A=-2: not clipped either     → max(3.297443, 2.56) = 3.297443
    # t5: masked                                      → 0
    assert close(loss, [[-1.105171, -1.28, 0.8, -0.606531, 3.297443, 0.0]])
    assert close(m["clip_ratio_high"], 1 / 5)  # t1 of the 5 unmasked tokens
    assert close(m["clip_ratio_low"], 1 / 5)  # t2
    assert close(m["dual_clip_ratio"], 0.0)
    # ratio_mean = (1.105171 + 1.648721 + 0.606531 + 0.606531 + 1.648721) / 5 = 5.615675 / 5
    assert close(m["ratio_mean"], 1.123135)
    assert close(m["ppo_kl"], -(0.1 + 0.5 - 0.5 - 0.5 + 0.5) / 5)  # mean(old − logp) = -0.02
    loss.sum().backward()
    # ∂ℓ/∂logp = -A·r where unclipped, 0 where clipped or masked
    assert close(logp.grad, [[-1.105171, 0.0, 0.0, -0.606531, 3.297443, 0.0]])


def test_ratio_exactly_on_a_clip_bound_is_not_clipped():
    logp, old, adv, mask = surrogate_inputs(deltas=[0.2, -0.2], advantages=[1.0, -1.0], mask=[1, 1])
    r = importance_ratio(logp, old).detach()[0]  # the very float32 ratios the loss will see
    clip_high, clip_low = r[0].item() - 1.0, 1.0 - r[1].item()  # 1 + ε_high = r0 and 1 − ε_low = r1, exactly
    loss, m = clipped_surrogate(logp, old, adv, mask, clip_low=clip_low, clip_high=clip_high)
    assert m["clip_ratio_high"].item() == 0 and m["clip_ratio_low"].item() == 0
    # ℓ = -A·r: [-1.221403, 0.818731] (e^0.2, e^-0.2), and the gradient -A·r still flows
    assert close(loss, [[-r[0].item(), r[1].item()]])
    loss.sum().backward()
    assert close(logp.grad, [[-1.221403, 0.818731]])


def test_dual_clip_bounds_negative_advantage_loss():
    ln4, ln2 = math.log(4.0), math.log(2.0)
    logp, old, adv, mask = surrogate_inputs(deltas=[ln4, ln2, ln4], advantages=[-1.0, -1.0, 1.0], mask=[1, 1, 1])
    loss, m = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # t0: A=-1, r=4: PPO gives max(4, 1.28) = 4; dual clip min(4, 3·|A|) = 3      (dual clip active)
    # t1: A=-1, r=2: max(2, 1.28) = 2 < 3                                           (inactive)
    # t2: A=+1, r=4: max(-4, -1.28) = -1.28; dual clip only applies to A < 0
    assert close(loss, [[3.0, 2.0, -1.28]])
    assert close(m["dual_clip_ratio"], 1 / 3)
    assert close(m["clip_ratio_high"], 1 / 3)
    loss.sum().backward()
    assert close(logp.grad, [[0.0, 2.0, 0.0]])  # bounded and clipped tokens carry no gradient
    plain, _ = clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert close(plain, [[4.0, 2.0, -1.28]])
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_surrogate(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=1.0)


def test_sequence_advantages_weights_and_fully_masked_sequence():
    old = torch.zeros(3, 2)
    logp = torch.tensor([[0.1, 0.1], [0.1, 0.1], [50.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])  # row 2 fully masked, garbage logp there
    adv_seq = torch.tensor([1.0, -1.0, 5.0])  # [B]
    loss, m = clipped_surrogate(logp, old, adv_seq, mask, clip_low=0.2, clip_high=0.28)
    # r = e^0.1 = 1.105171 everywhere it counts; row 0: -1.105171, row 1: +1.105171, masked: 0
    assert close(loss, [[-1.105171, -1.105171], [1.105171, 0.0], [0.0, 0.0]])
    assert close(m["ratio_mean"], 1.105171)  # the masked row's huge ratios are not in the metric
    token_adv = adv_seq[:, None].expand(3, 2)
    loss2, _ = clipped_surrogate(logp, old, token_adv, mask, clip_low=0.2, clip_high=0.28)
    assert torch.equal(loss, loss2)

    weights = torch.tensor([[0.5, 2.0], [1.0, 1.0], [1.0, 1.0]], requires_grad=True)
    weighted, _ = clipped_surrogate(logp, old, adv_seq, mask, clip_low=0.2, clip_high=0.28, weights=weights)
    # w·ℓ: row 0 → [-0.552585, -2.210342]
    assert close(weighted[0], [-0.552585, -2.210342])
    weighted.sum().backward()
    assert weights.grad is None  # weights are constants (truncated-IS weights must not be differentiated)
    assert torch.isfinite(logp.grad).all()


# ---------------------------------------------------------------------------------------------------- aggregation

LOSS_2x3 = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK_2x3 = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_aggregation_modes_on_ragged_2x3():
    # token_mean: (1 + 2 + 4) / 3 = 2.333333
    assert close(aggregate(LOSS_2x3, MASK_2x3, "token_mean"), 7 / 3)
    # seq_mean_token_mean: ((1 + 2) / 2 + 4 / 1) / 2 = (1.5 + 4) / 2 = 2.75
    assert close(aggregate(LOSS_2x3, MASK_2x3, "seq_mean_token_mean"), 2.75)
    # seq_mean_token_sum_norm: (1 + 2 + 4) / (B · L) = 7 / 6 = 1.166667; with norm_len 4: 7 / 8
    assert close(aggregate(LOSS_2x3, MASK_2x3, "seq_mean_token_sum_norm"), 7 / 6)
    assert close(aggregate(LOSS_2x3, MASK_2x3, "seq_mean_token_sum_norm", norm_len=4), 0.875)
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        aggregate(LOSS_2x3, MASK_2x3, "token-mean")
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(LOSS_2x3, MASK_2x3, "token_mean", norm_len=4)


def test_aggregation_fully_masked_sequence_and_batch():
    loss = torch.cat([LOSS_2x3, torch.tensor([[float("inf"), float("nan"), 1.0]])]).requires_grad_(True)
    mask = torch.cat([MASK_2x3, torch.zeros(1, 3, dtype=torch.long)])
    assert close(aggregate(loss, mask, "token_mean"), 7 / 3)  # adds no tokens
    assert close(aggregate(loss, mask, "seq_mean_token_mean"), 2.75)  # left out of the sequence count
    assert close(aggregate(loss, mask, "seq_mean_token_sum_norm"), 7 / 9)  # counts in B = 3: 7 / (3 · 3)
    aggregate(loss, mask, "seq_mean_token_mean").backward()
    assert torch.isfinite(loss.grad).all() and (loss.grad[2] == 0).all()
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        assert aggregate(LOSS_2x3, torch.zeros(2, 3), mode).item() == 0.0  # nothing to train on → 0, not NaN


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_with_global_denominator_equal_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    B, L = 6, 5
    lengths = torch.tensor([5, 2, 0, 3, 1, 4])  # ragged, row 2 fully masked
    mask = (torch.arange(L)[None, :] < lengths[:, None]).long()  # [B, L]
    old = -torch.rand(B, L, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    theta = (old + 0.3 * torch.randn(B, L, generator=g, dtype=torch.float64)).requires_grad_(True)
    norm_len = L if mode == "seq_mean_token_sum_norm" else None

    def per_token(rows, width):
        logp, old_logp, m = theta[rows, :width], old[rows, :width], mask[rows, :width]
        loss, _ = clipped_surrogate(logp, old_logp, adv[rows], m, clip_low=0.2, clip_high=0.28)
        return loss

    full = aggregate(per_token(slice(0, B), L), mask, mode, norm_len=norm_len)
    (full_grad,) = torch.autograd.grad(full, theta)

    # micro-batches padded only to their own longest sequence, as a packer would
    micro = [slice(0, 2), slice(2, 3), slice(3, 6)]
    widths = [max(int(lengths[s].max()), 1) for s in micro]
    denom = sum(loss_denominator(mask[s, :w], mode) for s, w in zip(micro, widths))
    total = sum(
        aggregate(per_token(s, w), mask[s, :w], mode, norm_len=norm_len, denom=denom) for s, w in zip(micro, widths)
    )
    (micro_grad,) = torch.autograd.grad(total, theta)
    assert abs(total.item() - full.item()) < 1e-6
    assert torch.allclose(micro_grad, full_grad, atol=1e-6, rtol=0)

    # the naive mean of per-micro-batch losses is not the full-batch loss (so the test has teeth)
    naive = sum(aggregate(per_token(s, w), mask[s, :w], mode, norm_len=norm_len) for s, w in zip(micro, widths))
    naive = naive / len(micro)
    assert abs(naive.item() - full.item()) > 1e-3


# -------------------------------------------------------------------------------------------- logprobs and entropy


def test_logprobs_and_entropy_hand_computed():
    # probs [0.25, 0.75] from logits [0, ln 3]; at T = 2 the logits [0, 2 ln 3] give the same distribution
    logits = torch.tensor([[[0.0, 0.0], [0.0, 2 * math.log(3.0)]]])  # [1, 2, 2]
    ids = torch.tensor([[0, 1]])
    # token 0, T=2: logits [0, 0] → log 0.5 = -0.693147;  token 1: log 0.75 = -0.287682
    assert close(logprobs_from_logits(logits, ids, temperature=2.0), [[-0.693147, -0.287682]])
    # H = ln 2 = 0.693147;  H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335
    assert close(entropy_from_logits(logits, temperature=2.0), [[0.693147, 0.562335]])
    banned = torch.tensor([[[0.0, 0.0, -float("inf")]]])  # a token the sampler masked out: contributes 0
    assert close(entropy_from_logits(banned), [[0.693147]])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_categorical(temperature):
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 3, 11, generator=g)).requires_grad_(True)
    ids = torch.randint(0, 11, (2, 3), generator=g)
    dist = torch.distributions.Categorical(logits=logits / temperature)
    ref_logp, ref_h = dist.log_prob(ids), dist.entropy()
    logp = logprobs_from_logits(logits, ids, temperature, chunk_tokens=4)  # 6 positions → chunks of 4 and 2
    h = entropy_from_logits(logits, temperature, chunk_tokens=4)
    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(h, ref_h, atol=1e-5)
    (g1,) = torch.autograd.grad((logp + h).sum(), logits)
    (g2,) = torch.autograd.grad((ref_logp + ref_h).sum(), logits)
    assert torch.allclose(g1, g2, atol=1e-5)
    bf16 = logprobs_from_logits(logits.detach().bfloat16(), ids, temperature)
    assert bf16.dtype == torch.float32  # upcast before the softmax


def test_entropy_bonus_enters_with_minus_sign_and_same_aggregation():
    entropy = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    term, m = entropy_bonus(entropy, mask, coef=0.01, mode="token_mean")
    assert close(term, -0.01 * 2.0)  # token mean (1 + 2 + 3) / 3 = 2
    assert close(m["entropy"], 2.0) and close(m["entropy_coef"], 0.01)
    term, _ = entropy_bonus(entropy, mask, coef=0.01, mode="seq_mean_token_mean")
    assert close(term, -0.01 * 2.25)  # ((1 + 2) / 2 + 3 / 1) / 2 = 2.25
