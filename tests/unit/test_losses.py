"""Unit tests for learners.objectives.losses: hand-computed values, naive references, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from learners.objectives.losses import (
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss_clipped,
    value_loss_clipped,
)

from tests.unit.masks import B, T, ragged_mask


def rand(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, generator=g, dtype=torch.float64) * scale


def valid_values(x: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [float(x[b, t]) for b in range(x.shape[0]) for t in range(x.shape[1]) if mask[b, t] != 0]


# ---------------------------------------------------------------- masked_* --


def test_masked_sum_mean_hand() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    assert_close(masked_sum(x, m), torch.tensor(8.0))  # 1 + 2 + 5
    assert_close(masked_mean(x, m), torch.tensor(8.0 / 3.0))  # (1+2+5)/3
    assert_close(masked_sum(x, m, dim=1), torch.tensor([3.0, 5.0]))
    assert_close(masked_mean(x, m, dim=1), torch.tensor([1.5, 5.0]))  # (1+2)/2, 5/1
    assert_close(masked_mean(x, m, dim=0), torch.tensor([1.0, 3.5, 0.0]))  # col 2 empty -> 0
    assert_close(masked_mean(x, m.bool()), torch.tensor(8.0 / 3.0))  # bool mask accepted


def test_masked_var_hand() -> None:
    # valid values 1, 2, 5: mean 8/3, squared deviations 25/9 + 4/9 + 49/9 = 26/3
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    assert_close(masked_var(x, m, unbiased=False), torch.tensor(26.0 / 9.0))  # /3
    assert_close(masked_var(x, m, unbiased=True), torch.tensor(13.0 / 3.0))  # /2
    # n == 1: no Bessel correction (would be 0/0), variance is 0
    one = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(masked_var(x, one, unbiased=True), torch.tensor(0.0))


def test_masked_whiten_hand() -> None:
    # valid 2, 4, 6: mean 4, unbiased var (4 + 0 + 4)/2 = 4, std 2.
    # Masked-out 100 is still transformed: (100 - 4)/2 = 48 (callers mask it).
    x = torch.tensor([[2.0, 4.0, 6.0, 100.0]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    assert_close(masked_whiten(x, m), torch.tensor([[-1.0, 0.0, 1.0, 48.0]], dtype=torch.float64))
    # shift_mean=False adds the mean (4) back
    assert_close(masked_whiten(x, m, shift_mean=False), torch.tensor([[3.0, 4.0, 5.0, 52.0]], dtype=torch.float64))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_stats_vs_naive(seed: int) -> None:
    x, m = rand(seed), ragged_mask(seed)
    vals = valid_values(x, m)
    n = len(vals)
    mean = sum(vals) / n
    ss = sum((v - mean) ** 2 for v in vals)
    var_b, var_u = ss / n, ss / (n - 1)
    assert_close(masked_sum(x, m), torch.tensor(sum(vals), dtype=torch.float64))
    assert_close(masked_mean(x, m), torch.tensor(mean, dtype=torch.float64))
    assert_close(masked_var(x, m, unbiased=False), torch.tensor(var_b, dtype=torch.float64))
    assert_close(masked_var(x, m.bool()), torch.tensor(var_u, dtype=torch.float64))
    # per-row mean
    row_means = []
    for b in range(B):
        rv = valid_values(x[b : b + 1], m[b : b + 1])
        row_means.append(sum(rv) / len(rv))
    assert_close(masked_mean(x, m, dim=1), torch.tensor(row_means, dtype=torch.float64))
    # whiten, compared on valid positions only
    eps = 1e-8
    w = masked_whiten(x, m, eps=eps)
    expected = [(v - mean) / math.sqrt(var_u + eps) for v in vals]
    assert_close(torch.tensor(valid_values(w, m), dtype=torch.float64), torch.tensor(expected, dtype=torch.float64))
    w2 = masked_whiten(x, m, shift_mean=False, eps=eps)
    assert_close(
        torch.tensor(valid_values(w2, m), dtype=torch.float64),
        torch.tensor([e + mean for e in expected], dtype=torch.float64),
    )


def test_masked_reductions_all_zero_mask_give_zero() -> None:
    x = rand(3)
    z = torch.zeros(B, T, dtype=torch.float64)
    for out in (
        masked_sum(x, z),
        masked_mean(x, z),
        masked_var(x, z),
        masked_var(x, z, unbiased=False),
        masked_mean(x, z, dim=1),
        masked_mean(x, z.bool(), dim=0),
    ):
        assert torch.isfinite(out).all()
        assert (out == 0).all()
    assert torch.isfinite(masked_whiten(x, z)).all()


def test_masked_mean_ignores_nonfinite_at_masked_positions() -> None:
    x = torch.tensor([[1.0, float("nan"), float("-inf"), 3.0]], requires_grad=True)
    m = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    out = masked_mean(x, m)
    assert_close(out, torch.tensor(2.0))
    out.backward()
    assert_close(x.grad, torch.tensor([[0.5, 0.0, 0.0, 0.5]]))


# -------------------------------------------------------------- kl_penalty --


def test_kl_penalty_hand() -> None:
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    # log_ratio = [0.5, -1.0]
    f64 = dict(dtype=torch.float64)
    assert_close(kl_penalty(lp, ref), torch.tensor([[0.5, -1.0]], **f64))  # default k1
    assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([[0.125, 0.5]], **f64))  # 0.5*lr^2
    # k3: exp(-0.5) - 1 + 0.5 = 0.1065306597; exp(1) - 1 - 1 = 0.7182818285
    assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([[0.1065306597, 0.7182818285]], **f64))
    assert_close(kl_penalty(lp, ref, "abs"), torch.tensor([[0.5, 1.0]], **f64))


def test_kl_penalty_k3_k2_abs_nonnegative_and_finite() -> None:
    g = torch.Generator().manual_seed(0)
    lr = torch.cat(
        [
            torch.randn(1000, generator=g) * 5,
            torch.tensor([0.0, 1e-8, -1e-8, 1e-4, -1e-4, 19.9, -19.9, 50.0, -50.0, 1e4, -1e4]),
        ]
    ).reshape(1, -1)
    ref = torch.zeros_like(lr)
    for kind in ("k2", "k3", "abs"):
        out = kl_penalty(lr, ref, kind)
        assert torch.isfinite(out).all(), kind
        assert (out >= 0).all(), kind
    assert kl_penalty(torch.zeros(1, 3), torch.zeros(1, 3), "k3").abs().max() == 0


def test_kl_penalty_k3_unbiased_for_true_kl() -> None:
    # Sample a ~ p, k3 with log_ratio = log p(a) - log q(a) averages to KL(p||q).
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    true_kl = float((p * (p / q).log()).sum())
    # exact expectation over the 3 outcomes instead of Monte Carlo
    k3 = kl_penalty(p.log().unsqueeze(0), q.log().unsqueeze(0), "k3")[0]
    k1 = kl_penalty(p.log().unsqueeze(0), q.log().unsqueeze(0), "k1")[0]
    assert_close((p * k3).sum(), torch.tensor(true_kl, dtype=torch.float64))
    assert_close((p * k1).sum(), torch.tensor(true_kl, dtype=torch.float64))


def test_kl_penalty_unknown_kind() -> None:
    with pytest.raises(ValueError, match="k1.*k2.*k3.*abs"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "k4")


# ----------------------------------------------------- policy_loss_clipped --


def test_policy_loss_clipped_hand() -> None:
    # log_ratio -> ratio [1.5, 0.5, 0.5, 1.5, masked], A = [1, -1, 1, -1, 5], eps = 0.2
    # t0: ratio 1.5 clipped 1.2: max(-1.5, -1.2) = -1.2 (clipped branch)
    # t1: ratio 0.5 clipped 0.8: max( 0.5,  0.8) =  0.8 (clipped branch)
    # t2: ratio 0.5 clipped 0.8: max(-0.5, -0.8) = -0.5 (unclipped)
    # t3: ratio 1.5 clipped 1.2: max( 1.5,  1.2) =  1.5 (unclipped)
    # loss = (-1.2 + 0.8 - 0.5 + 1.5)/4 = 0.15; clip_frac = 2/4
    # ratio_mean = (1.5+0.5+0.5+1.5)/4 = 1; approx_kl = 0.5*(2 ln1.5^2 + 2 ln2^2)/4
    f64 = dict(dtype=torch.float64)
    lr = torch.tensor([[math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.5), 3.0]], **f64)
    old = torch.full_like(lr, -2.0)
    lp = old + lr
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 5.0]], **f64)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    loss, stats = policy_loss_clipped(lp, old, adv, mask, clip_eps=0.2)
    assert_close(loss, torch.tensor(0.15, **f64))
    assert_close(stats["clip_frac"], torch.tensor(0.5, **f64))
    assert_close(stats["ratio_mean"], torch.tensor(1.0, **f64))
    approx_kl = 0.25 * (math.log(1.5) ** 2 + math.log(2.0) ** 2)  # = 0.1612137
    assert_close(stats["approx_kl"], torch.tensor(approx_kl, **f64))

    # clip-higher: upper bound 1.6 -> t0 unclipped (-1.5); others unchanged
    # loss = (-1.5 + 0.8 - 0.5 + 1.5)/4 = 0.075, clip_frac = 1/4
    loss_h, stats_h = policy_loss_clipped(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.6)
    assert_close(loss_h, torch.tensor(0.075, **f64))
    assert_close(stats_h["clip_frac"], torch.tensor(0.25, **f64))


def naive_policy_loss(lp, old, adv, mask, eps, eps_high):
    losses, clipped, kls, ratios = [], [], [], []
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[b, t] == 0:
                continue
            d = float(lp[b, t]) - float(old[b, t])
            a = float(adv[b, t])
            r = math.exp(d)
            rc = min(max(r, 1 - eps), 1 + eps_high)
            losses.append(max(-a * r, -a * rc))
            clipped.append(1.0 if -a * rc > -a * r else 0.0)
            kls.append(0.5 * d * d)
            ratios.append(r)
    n = len(losses)
    return sum(losses) / n, sum(clipped) / n, sum(kls) / n, sum(ratios) / n


@pytest.mark.parametrize("seed,eps_high", [(0, None), (1, None), (2, 0.28)])
def test_policy_loss_clipped_vs_naive(seed: int, eps_high: float | None) -> None:
    mask = ragged_mask(seed)
    old = rand(seed + 10) - 2.0
    lp = old + rand(seed + 20, scale=0.3)
    adv = rand(seed + 30)
    loss, stats = policy_loss_clipped(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=eps_high)
    ref = naive_policy_loss(lp, old, adv, mask, 0.2, 0.2 if eps_high is None else eps_high)
    f64 = dict(dtype=torch.float64)
    assert_close(loss, torch.tensor(ref[0], **f64))
    assert_close(stats["clip_frac"], torch.tensor(ref[1], **f64))
    assert_close(stats["approx_kl"], torch.tensor(ref[2], **f64))
    assert_close(stats["ratio_mean"], torch.tensor(ref[3], **f64))
    assert 0.0 < ref[1] < 1.0  # the random data exercises both branches


def test_policy_loss_clip_frac_edges() -> None:
    mask = ragged_mask(5)
    adv = rand(6)
    lp = rand(7)
    _, stats = policy_loss_clipped(lp, lp.clone(), adv, mask)  # ratio == 1
    assert stats["clip_frac"] == 0
    assert stats["approx_kl"] == 0
    assert_close(stats["ratio_mean"], torch.tensor(1.0, dtype=torch.float64))
    # far off in the direction the advantage favours -> clipped branch everywhere
    _, stats = policy_loss_clipped(lp + 2.0 * adv.sign(), lp, adv, mask)
    assert_close(stats["clip_frac"], torch.tensor(1.0, dtype=torch.float64))


def test_policy_loss_gradient_flows_and_is_masked() -> None:
    mask = ragged_mask(8)
    old = rand(9) - 2.0
    # garbage at masked positions must not leak NaN into loss or grads
    old = torch.where(mask != 0, old, torch.full_like(old, float("-inf")))
    lp = torch.where(mask != 0, old + rand(10, scale=0.05), torch.full_like(old, float("nan")))
    lp.requires_grad_(True)
    adv = torch.where(mask != 0, rand(11), torch.full_like(old, float("nan")))
    loss, stats = policy_loss_clipped(lp, old, adv, mask)
    assert loss.requires_grad and loss.dim() == 0
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())
    loss.backward()
    assert lp.grad is not None
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[mask == 0] == 0).all()
    assert (lp.grad[mask != 0] != 0).any()
    # unclipped tokens: d loss / d logprob_t = -A_t * ratio_t / n
    n = mask.sum()
    ratio = (lp.detach() - old).exp()
    expected = torch.where(mask != 0, -adv * ratio / n, torch.zeros_like(ratio))
    unclipped = (mask != 0) & (ratio > 0.8) & (ratio < 1.2)
    assert unclipped.any()
    assert_close(lp.grad[unclipped], expected[unclipped])


def test_policy_loss_all_zero_mask() -> None:
    lp = rand(12).requires_grad_(True)
    loss, stats = policy_loss_clipped(lp, rand(13), rand(14), torch.zeros(B, T))
    assert loss.item() == 0.0
    assert all(torch.isfinite(v) and v.item() == 0.0 for v in stats.values())
    loss.backward()
    assert (lp.grad == 0).all()


# ------------------------------------------------------ value_loss_clipped --


def test_value_loss_clipped_hand() -> None:
    # t0: v=1, old=0.5 -> clipped 0.5+0.2 = 0.7; (1-2)^2 = 1, (0.7-2)^2 = 1.69 -> 1.69 (clipped larger)
    # t1: v=old=0 -> both (0-1)^2 = 1, not strictly larger
    # t2 masked. loss = 0.5 * (1.69 + 1)/2 = 0.6725; vf_clip_frac = 1/2
    values = torch.tensor([[1.0, 0.0, 3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 0.0, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = value_loss_clipped(values, old, ret, mask, clip_eps=0.2)
    assert_close(loss, torch.tensor(0.6725, dtype=torch.float64))
    assert_close(stats["vf_clip_frac"], torch.tensor(0.5, dtype=torch.float64))
    assert not stats["vf_clip_frac"].requires_grad
    loss.backward()
    # t0: clipped branch active and saturated -> no gradient; t1: 0.5*2*(0-1)/2 = -0.5; t2 masked
    assert_close(values.grad, torch.tensor([[0.0, -0.5, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_loss_clipped_vs_naive(seed: int) -> None:
    mask = ragged_mask(seed)
    old = rand(seed + 40)
    values = old + rand(seed + 50, scale=0.5)
    ret = rand(seed + 60)
    eps = 0.2
    losses, fracs = [], []
    for b in range(B):
        for t in range(T):
            if mask[b, t] == 0:
                continue
            v, o, r = float(values[b, t]), float(old[b, t]), float(ret[b, t])
            vc = o + min(max(v - o, -eps), eps)
            lu, lc = (v - r) ** 2, (vc - r) ** 2
            losses.append(max(lu, lc))
            fracs.append(1.0 if lc > lu else 0.0)
    loss, stats = value_loss_clipped(values, old, ret, mask.bool(), clip_eps=eps)
    assert_close(loss, torch.tensor(0.5 * sum(losses) / len(losses), dtype=torch.float64))
    assert_close(stats["vf_clip_frac"], torch.tensor(sum(fracs) / len(fracs), dtype=torch.float64))
    assert 0.0 < sum(fracs) / len(fracs) < 1.0


def test_value_loss_all_zero_mask() -> None:
    loss, stats = value_loss_clipped(rand(1), rand(2), rand(3), torch.zeros(B, T))
    assert loss.item() == 0.0 and stats["vf_clip_frac"].item() == 0.0


# ------------------------------------------------------------ logits utils --


def test_entropy_from_logits() -> None:
    # uniform over V -> log V, independent of the constant
    for V in (1, 7, 50257):
        logits = torch.full((2, 3, V), 3.7, dtype=torch.float64)
        assert_close(entropy_from_logits(logits), torch.full((2, 3), math.log(V), dtype=torch.float64))
    # p = [1/4, 3/4]: H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351446
    z = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)
    assert_close(entropy_from_logits(z), torch.tensor([0.5623351446], dtype=torch.float64))
    # shift-invariant and stable for huge logits (naive exp would overflow)
    assert_close(entropy_from_logits(z.float() + 1e4), torch.tensor([0.5623351446], dtype=torch.float32))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert_close(entropy_from_logits(logits), expected)


def test_logprobs_from_logits() -> None:
    # p = [1/4, 3/4] -> log p(label=1) = ln 0.75, log p(label=0) = ln 0.25
    z = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]], dtype=torch.float64)
    out = logprobs_from_logits(z, torch.tensor([1, 0]))
    assert_close(out, torch.tensor([math.log(0.75), math.log(0.25)], dtype=torch.float64))
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 13, generator=g) * 3 + 100.0
    labels = torch.randint(0, 13, (2, 5), generator=g)
    expected = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    got = logprobs_from_logits(logits, labels)
    assert got.shape == (2, 5)
    assert_close(got, expected)
