"""Unit tests for learners.objectives.advantages: hand-computed values, naive references, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from learners.objectives.advantages import gae_advantages, kl_shaped_rewards

from tests.unit.masks import B, T, ragged_mask

F64 = dict(dtype=torch.float64)


def rand(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*(shape or (B, T)), generator=g, **F64) * scale


# ------------------------------------------------------------------- naive --


def naive_kl(d: float, kind: str) -> float:
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return math.exp(-d) - 1 + d
    return abs(d)


def naive_kl_shaped(scores, lp, ref, mask, beta, kind, clip):
    rewards, kls = [], []
    for b in range(len(lp)):
        idx = [t for t in range(len(lp[b])) if mask[b][t] != 0]
        kl_row = [naive_kl(lp[b][t] - ref[b][t], kind) if mask[b][t] != 0 else 0.0 for t in range(len(lp[b]))]
        r_row = [-beta * k for k in kl_row]
        if idx:
            s = scores[b] if clip is None else min(max(scores[b], -clip), clip)
            r_row[idx[-1]] += s
        rewards.append(r_row)
        kls.append(kl_row)
    return rewards, kls


def naive_gae(rewards, values, mask, gamma, lam):
    """Compress each row to its valid tokens, run textbook GAE, scatter back."""
    advs, rets = [], []
    for b in range(len(rewards)):
        n = len(rewards[b])
        adv, ret = [0.0] * n, [0.0] * n
        next_v, next_a = 0.0, 0.0
        for t in reversed([t for t in range(n) if mask[b][t] != 0]):
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            a = delta + gamma * lam * next_a
            adv[t], ret[t] = a, a + values[b][t]
            next_v, next_a = values[b][t], a
        advs.append(adv)
        rets.append(ret)
    return advs, rets


# ------------------------------------------------------- kl_shaped_rewards --


def test_kl_shaped_rewards_hand() -> None:
    # row0 mask [0,1,1,0]: log_ratio at t1 = -1 - (-1.5) = 0.5, t2 = -2 - (-1) = -1
    # k1, beta=0.1: rewards = [0, -0.05, +0.1 + clip(2.0, 1.5)=1.6, 0]
    # row1 all-zero mask: no KL, no score.  -inf at masked t3 must not leak.
    lp = torch.tensor([[9.0, -1.0, -2.0, float("-inf")], [1.0, 2.0, 3.0, 4.0]], **F64)
    ref = torch.tensor([[9.0, -1.5, -1.0, 9.0], [0.0, 0.0, 0.0, 0.0]], **F64)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    scores = torch.tensor([2.0, 7.0], **F64)
    rewards, kl = kl_shaped_rewards(scores, lp, ref, mask, beta=0.1, score_clip=1.5)
    assert_close(kl, torch.tensor([[0.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], **F64))
    assert_close(rewards, torch.tensor([[0.0, -0.05, 1.6, 0.0], [0.0, 0.0, 0.0, 0.0]], **F64))
    # no clip, k2: kl = [0.125, 0.5] -> rewards [-0.0125, -0.05 + 2.0]
    rewards, kl = kl_shaped_rewards(scores, lp, ref, mask.float(), beta=0.1, kl_kind="k2")
    assert_close(rewards[0], torch.tensor([0.0, -0.0125, 1.95, 0.0], **F64))
    assert_close(kl[0], torch.tensor([0.0, 0.125, 0.5, 0.0], **F64))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_kl_shaped_rewards_vs_naive(kind: str, clip: float | None) -> None:
    mask = ragged_mask(0)
    ref = rand(1) - 2.0
    lp = ref + rand(2, scale=0.5)
    scores = rand(3, B)
    beta = 0.05
    rewards, kl = kl_shaped_rewards(scores, lp, ref, mask, beta=beta, kl_kind=kind, score_clip=clip)
    exp_r, exp_kl = naive_kl_shaped(scores.tolist(), lp.tolist(), ref.tolist(), mask.tolist(), beta, kind, clip)
    assert_close(rewards, torch.tensor(exp_r, **F64))
    assert_close(kl, torch.tensor(exp_kl, **F64))
    if clip is not None:
        assert (scores.abs() > clip).any()  # clipping actually exercised


def test_kl_shaped_rewards_score_lands_on_last_valid_token() -> None:
    mask = ragged_mask(4)
    z = torch.zeros(B, T, **F64)
    scores = torch.arange(1.0, B + 1, **F64)
    rewards, _ = kl_shaped_rewards(scores, z, z, mask, beta=1.0)
    for b in range(B):
        last = max(t for t in range(T) if mask[b, t] != 0)
        assert rewards[b, last] == scores[b]
        assert rewards[b].sum() == scores[b]


def test_kl_shaped_rewards_bad_kind_and_shapes() -> None:
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="k3"):
        kl_shaped_rewards(torch.zeros(2), z, z, z, beta=0.1, kl_kind="nope")
    with pytest.raises(ValueError):
        kl_shaped_rewards(torch.zeros(3), z, z, z, beta=0.1)


# ------------------------------------------------------------ gae_advantages --


def test_gae_hand_full_mask() -> None:
    # r = [1, 2, 3], v = [0.5, 0.5, 0.5], gamma = 0.9, lam = 0.8 (gamma*lam = 0.72)
    # t2: delta = 3 + 0 - 0.5 = 2.5                      A2 = 2.5
    # t1: delta = 2 + 0.9*0.5 - 0.5 = 1.95                A1 = 1.95 + 0.72*2.5  = 3.75
    # t0: delta = 1 + 0.45 - 0.5 = 0.95                   A0 = 0.95 + 0.72*3.75 = 3.65
    # returns = A + v = [4.15, 4.25, 3.0]
    r = torch.tensor([[1.0, 2.0, 3.0]], **F64)
    v = torch.full((1, 3), 0.5, **F64)
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert_close(adv, torch.tensor([[3.65, 3.75, 2.5]], **F64))
    assert_close(ret, torch.tensor([[4.15, 4.25, 3.0]], **F64))


def test_gae_hand_interior_mask_is_skipped() -> None:
    # mask [1, 0, 1, 0]: t1 and t3 are transparent (their 9s / 100s must be ignored)
    # t2: delta = 2 + 0 - 1 = 1                            A2 = 1
    # t0: next valid is t2 (v=1, A=1): delta = 1 + 0.9*1 - 0.5 = 1.4
    #                                                      A0 = 1.4 + 0.72*1 = 2.12
    # returns = [2.62, 0, 2.0, 0]
    r = torch.tensor([[1.0, 9.0, 2.0, 100.0]], **F64)
    v = torch.tensor([[0.5, 9.0, 1.0, 100.0]], **F64)
    mask = torch.tensor([[True, False, True, False]])
    adv, ret = gae_advantages(r, v, mask, gamma=0.9, lam=0.8)
    assert_close(adv, torch.tensor([[2.12, 0.0, 1.0, 0.0]], **F64))
    assert_close(ret, torch.tensor([[2.62, 0.0, 2.0, 0.0]], **F64))


@pytest.mark.parametrize("seed,gamma,lam", [(0, 1.0, 0.95), (1, 0.9, 0.8), (2, 0.99, 1.0)])
def test_gae_vs_naive(seed: int, gamma: float, lam: float) -> None:
    mask = ragged_mask(seed)
    r, v = rand(seed + 100), rand(seed + 200)
    adv, ret = gae_advantages(r, v, mask, gamma=gamma, lam=lam)
    exp_adv, exp_ret = naive_gae(r.tolist(), v.tolist(), mask.tolist(), gamma, lam)
    assert_close(adv, torch.tensor(exp_adv, **F64))
    assert_close(ret, torch.tensor(exp_ret, **F64))
    # garbage (incl. inf/NaN) at masked positions changes nothing
    junk = torch.where(mask != 0, torch.zeros_like(r), torch.full_like(r, float("nan")))
    adv2, ret2 = gae_advantages(r + junk, v - junk.nan_to_num(nan=float("inf")), mask.bool(), gamma, lam)
    assert_close(adv2, adv)
    assert_close(ret2, ret)


def test_gae_gamma_lam_one_is_reward_to_go() -> None:
    # gamma = lam = 1: returns_t = sum of rewards at valid positions >= t
    mask = ragged_mask(7)
    r, v = rand(8), rand(9)
    _, ret = gae_advantages(r, v, mask, gamma=1.0, lam=1.0)
    rm = r * mask
    rtg = rm.flip(1).cumsum(1).flip(1) * mask
    assert_close(ret, rtg)


def test_gae_edge_cases() -> None:
    r = rand(10).requires_grad_(True)
    v = rand(11).requires_grad_(True)
    adv, ret = gae_advantages(r, v, torch.zeros(B, T))
    assert (adv == 0).all() and (ret == 0).all()
    assert not adv.requires_grad and not ret.requires_grad
    # bf16 inputs are computed (and returned) in float32
    adv16, _ = gae_advantages(r.detach().bfloat16(), v.detach().bfloat16(), ragged_mask(1))
    assert adv16.dtype == torch.float32 and torch.isfinite(adv16).all()
    with pytest.raises(ValueError):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3))
