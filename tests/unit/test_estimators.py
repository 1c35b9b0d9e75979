"""Unit tests for the critic-free estimators in learners.objectives.advantages.

group_baseline_advantages (GRPO, Dr. GRPO, RLOO) and reinforce_pp_advantages
(REINFORCE++): hand-computed values, naive pure-Python references, edge cases.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from learners.objectives.advantages import (
    ESTIMATORS,
    GROUP_ESTIMATORS,
    discounted_returns,
    group_baseline_advantages,
    kl_shaped_rewards,
    reinforce_pp_advantages,
)

F64 = dict(dtype=torch.float64)

# ------------------------------------------------------------ hand batch --

# Two groups with arbitrary, interleaved ids: group 7 = rows {0, 2, 3},
# group 3 = rows {1, 4}.
HAND_IDS = torch.tensor([7, 3, 7, 7, 3])
HAND_SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], **F64)
# Ragged: prompt zeros at the start, padding at the end, different response
# lengths, one interior masked token (row 4, t=2).
HAND_MASK = torch.tensor(
    [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0], [0, 1, 0, 1, 1, 0]],
    dtype=torch.bool,
)

SQRT3 = math.sqrt(3.0)
SQRT2 = math.sqrt(2.0)
HAND_EXPECTED = {
    # group 7: scores [1, 0, 1], mean 2/3, centered [1/3, -2/3, 1/3],
    #   unbiased var = (1/9 + 4/9 + 1/9) / (3 - 1) = 1/3, std = 1/sqrt(3)
    #   -> A = [1/3 * sqrt(3), -2/3 * sqrt(3), 1/3 * sqrt(3)] = [0.577, -1.155, 0.577]
    # group 3: scores [0, 1], mean 1/2, centered [-1/2, 1/2],
    #   unbiased var = (1/4 + 1/4) / (2 - 1) = 1/2, std = 1/sqrt(2)
    #   -> A = [-1/2 * sqrt(2), 1/2 * sqrt(2)] = [-0.707, 0.707]
    "grpo": [SQRT3 / 3, -SQRT2 / 2, -2 * SQRT3 / 3, SQRT3 / 3, SQRT2 / 2],
    # r - mean_g: group 7 -> [1 - 2/3, 0 - 2/3, 1 - 2/3]; group 3 -> [0 - 1/2, 1 - 1/2]
    "dr_grpo": [1 / 3, -1 / 2, -2 / 3, 1 / 3, 1 / 2],
    # r_i - mean of the OTHER members:
    #   row 0: 1 - (0 + 1)/2 = 0.5   row 2: 0 - (1 + 1)/2 = -1   row 3: 1 - (1 + 0)/2 = 0.5
    #   row 1: 0 - 1/1 = -1          row 4: 1 - 0/1 = 1
    "rloo": [0.5, -1.0, -1.0, 0.5, 1.0],
}


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_group_hand_computed(estimator: str, mask_dtype: torch.dtype) -> None:
    mask = HAND_MASK.to(mask_dtype)
    # eps=0 so the GRPO values are exactly the hand arithmetic above.
    adv = group_baseline_advantages(HAND_SCORES, HAND_IDS, mask, estimator=estimator, eps=0.0)
    per_seq = torch.tensor(HAND_EXPECTED[estimator], **F64)
    expected = torch.where(HAND_MASK, per_seq.unsqueeze(1), torch.zeros((), **F64))
    assert adv.shape == HAND_MASK.shape
    assert adv.dtype == torch.float64
    assert_close(adv, expected, rtol=1e-12, atol=1e-12)


def test_grpo_default_eps_is_in_denominator() -> None:
    adv = group_baseline_advantages(HAND_SCORES, HAND_IDS, HAND_MASK, estimator="grpo")
    # row 0: (1/3) / (1/sqrt(3) + 1e-6)
    expected = (1 / 3) / (1 / SQRT3 + 1e-6)
    assert adv[0, 1].item() == pytest.approx(expected, rel=1e-12)
    assert adv[0, 1].item() < SQRT3 / 3


# ----------------------------------------------------------- naive loops --


def naive_group(scores: list[float], ids: list[int], estimator: str, eps: float) -> list[float]:
    out = []
    for i, r in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if ids[j] == ids[i]]
        n = len(members)
        if n == 1:
            out.append(0.0)
            continue
        mean = sum(members) / n
        if estimator == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
            out.append((r - mean) / (std + eps) if std > 0 else 0.0)
        elif estimator == "dr_grpo":
            out.append(r - mean)
        else:  # rloo, literal leave-one-out form
            out.append(r - (sum(members) - r) / (n - 1))
    return out


def random_mask(seed: int, B: int, T: int, zero_rows: tuple[int, ...] = ()) -> torch.Tensor:
    """(B, T) float mask: 1-3 prompt zeros, ragged end, random interior holes."""
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(B, T, **F64)
    for b in range(B):
        if b in zero_rows:
            continue
        p = int(torch.randint(1, 4, (1,), generator=g))
        end = int(torch.randint(p + 1, T + 1, (1,), generator=g))
        m[b, p:end] = 1.0
        holes = torch.rand(T, generator=g) < 0.15
        holes[p] = False  # keep at least one valid token
        m[b][holes] = 0.0
    return m


def random_groups(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B=12: groups of sizes 4, 3, 2, 2, 1 with arbitrary ids, shuffled."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([11] * 4 + [-5] * 3 + [0] * 2 + [1000] * 2 + [42])
    ids = ids[torch.randperm(12, generator=g)]
    scores = torch.randn(12, generator=g, **F64)
    return ids, scores


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_matches_naive(estimator: str, seed: int) -> None:
    ids, scores = random_groups(seed)
    mask = random_mask(seed + 100, 12, 9, zero_rows=(5,))
    eps = 1e-6
    adv = group_baseline_advantages(scores, ids, mask, estimator=estimator, eps=eps)
    per_seq = naive_group(scores.tolist(), ids.tolist(), estimator, eps)
    expected = [[per_seq[b] if mask[b, t] != 0 else 0.0 for t in range(9)] for b in range(12)]
    assert_close(adv, torch.tensor(expected, **F64), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_matches_naive_binary_scores(estimator: str) -> None:
    # 0/1 verifier rewards, the common case; includes an all-0 and an all-1 group.
    ids = torch.tensor([4, 4, 4, 9, 9, 9, 2, 2, 2, 2, 8, 8])
    scores = torch.tensor([1, 0, 1, 0, 0, 0, 1, 1, 1, 0, 1, 1], **F64)
    mask = random_mask(7, 12, 6)
    adv = group_baseline_advantages(scores, ids, mask, estimator=estimator)
    per_seq = naive_group(scores.tolist(), ids.tolist(), estimator, 1e-6)
    first_valid = mask.argmax(dim=1)
    assert_close(adv[torch.arange(12), first_valid], torch.tensor(per_seq, **F64), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------- edge cases --


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_singleton_groups_give_zero(estimator: str) -> None:
    scores = torch.tensor([3.0, -2.0, 0.5])
    ids = torch.tensor([1, 2, 3])
    mask = torch.ones(3, 4)
    adv = group_baseline_advantages(scores, ids, mask, estimator=estimator, eps=0.0)
    assert torch.isfinite(adv).all()
    assert (adv == 0).all()


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_all_equal_scores_give_exact_zero(estimator: str, eps: float) -> None:
    # In float32 (0.9 + 0.9 + 0.9) / 3 != 0.9: without care the centred score
    # is ~6e-8 and GRPO's / (0 + eps) turns it into a spurious ~0.05 advantage.
    scores = torch.tensor([0.9, 0.9, 0.9, 0.7, 0.2], dtype=torch.float32)
    ids = torch.tensor([5, 5, 5, 6, 6])
    mask = torch.ones(5, 3, dtype=torch.bool)
    adv = group_baseline_advantages(scores, ids, mask, estimator=estimator, eps=eps)
    assert torch.isfinite(adv).all()
    assert (adv[:3] == 0).all()
    # The other group is untouched by the degenerate one.
    assert (adv[3] > 0).all() and (adv[4] < 0).all()


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_zero_mask_rows_and_outside_mask_are_zero(estimator: str) -> None:
    ids, scores = random_groups(3)
    mask = random_mask(4, 12, 8, zero_rows=(0, 7))
    adv = group_baseline_advantages(scores, ids, mask, estimator=estimator)
    assert torch.isfinite(adv).all()
    assert (adv[0] == 0).all() and (adv[7] == 0).all()
    assert (adv[mask == 0] == 0).all()
    # Inside the mask every token of a row carries the same per-sequence value,
    # nonzero for random scores unless the row is the singleton (id 42).
    for b in range(12):
        row = adv[b][mask[b] != 0]
        if row.numel():
            assert (row == row[0]).all()
            assert (row[0] == 0) == (ids[b] == 42)


def test_empty_mask_and_empty_batch() -> None:
    scores = torch.tensor([1.0, 2.0])
    ids = torch.tensor([0, 0])
    for est in GROUP_ESTIMATORS:
        adv = group_baseline_advantages(scores, ids, torch.zeros(2, 5), estimator=est)
        assert (adv == 0).all() and torch.isfinite(adv).all()
        empty = group_baseline_advantages(
            torch.zeros(0), torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4), estimator=est
        )
        assert empty.shape == (0, 4)


@pytest.mark.parametrize("estimator", ["dr_grpo", "rloo"])
def test_group_sums_are_zero(estimator: str) -> None:
    ids, scores = random_groups(5)
    mask = torch.ones(12, 2)
    per_seq = group_baseline_advantages(scores, ids, mask, estimator=estimator)[:, 0]
    for gid in ids.unique():
        in_group = ids == gid
        assert abs(per_seq[in_group].sum().item()) < 1e-12
        if in_group.sum() > 1:
            assert per_seq[in_group].abs().sum() > 0.1  # not trivially zero


def test_rloo_is_scaled_dr_grpo() -> None:
    ids, scores = random_groups(6)
    mask = torch.ones(12, 1)
    dr = group_baseline_advantages(scores, ids, mask, estimator="dr_grpo")[:, 0]
    rloo = group_baseline_advantages(scores, ids, mask, estimator="rloo")[:, 0]
    n = torch.tensor([(ids == i).sum().item() for i in ids], **F64)
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))
    assert_close(rloo, dr * scale, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_permutation_and_relabel_equivariance(estimator: str) -> None:
    ids, scores = random_groups(8)
    mask = random_mask(9, 12, 7)
    adv = group_baseline_advantages(scores, ids, mask, estimator=estimator)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(10))
    adv_p = group_baseline_advantages(scores[perm], ids[perm], mask[perm], estimator=estimator)
    assert_close(adv_p, adv[perm], rtol=1e-12, atol=1e-12)
    relabelled = ids * 37 - 1_000_003  # injective: same partition, different ids
    adv_r = group_baseline_advantages(scores, relabelled, mask, estimator=estimator)
    assert_close(adv_r, adv, rtol=0, atol=0)


def test_group_dtype_and_detached() -> None:
    scores = torch.tensor([1.0, 0.0, 0.5], dtype=torch.bfloat16, requires_grad=True)
    adv = group_baseline_advantages(scores, torch.tensor([1, 1, 1]), torch.ones(3, 2), estimator="grpo")
    assert adv.dtype == torch.float32
    assert not adv.requires_grad


def test_unknown_estimator_and_bad_inputs() -> None:
    s, ids, m = HAND_SCORES, HAND_IDS, HAND_MASK
    assert set(GROUP_ESTIMATORS) < set(ESTIMATORS)
    assert set(ESTIMATORS) == {"gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"}
    with pytest.raises(ValueError, match="grpo.*dr_grpo.*rloo"):
        group_baseline_advantages(s, ids, m, estimator="ppo")
    with pytest.raises(ValueError, match="gae_advantages"):
        group_baseline_advantages(s, ids, m, estimator="gae")
    with pytest.raises(ValueError, match="reinforce_pp_advantages"):
        group_baseline_advantages(s, ids, m, estimator="reinforce_pp")
    with pytest.raises(ValueError, match="scores"):
        group_baseline_advantages(s[:4], ids, m, estimator="rloo")
    with pytest.raises(ValueError, match="integer"):
        group_baseline_advantages(s, ids.double(), m, estimator="rloo")
    with pytest.raises(ValueError, match="eps"):
        group_baseline_advantages(s, ids, m, estimator="grpo", eps=-1.0)


# ----------------------------------------------------------- REINFORCE++ --


def naive_returns(rewards: list[list[float]], mask: list[list[float]], gamma: float) -> list[list[float]]:
    out = []
    for r_row, m_row in zip(rewards, mask):
        row = [0.0] * len(r_row)
        running = 0.0
        for t in range(len(r_row) - 1, -1, -1):
            if m_row[t] != 0:
                running = r_row[t] + gamma * running
                row[t] = running
        out.append(row)
    return out


def naive_whiten(values: list[list[float]], mask: list[list[float]], eps: float = 1e-8) -> list[list[float]]:
    flat = [v for vr, mr in zip(values, mask) for v, m in zip(vr, mr) if m != 0]
    n = len(flat)
    mean = sum(flat) / n if n else 0.0
    var = sum((v - mean) ** 2 for v in flat) / (n - 1) if n > 1 else 0.0
    return [
        [(v - mean) / math.sqrt(var + eps) if m != 0 else 0.0 for v, m in zip(vr, mr)] for vr, mr in zip(values, mask)
    ]


def test_returns_hand_computed_gamma_half() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0]], **F64)
    # G3 = 4; G2 = 3 + 0.5*4 = 5; G1 = 2 + 0.5*5 = 4.5; G0 = 1 + 0.5*4.5 = 3.25
    returns = discounted_returns(rewards, torch.ones(1, 4), gamma=0.5)
    assert_close(returns, torch.tensor([[3.25, 4.5, 5.0, 4.0]], **F64), rtol=0, atol=0)


def test_returns_carry_through_masked_tokens() -> None:
    # prompt, response, INTERIOR masked, response, response, padding. Rewards
    # at masked positions (even inf) must be ignored.
    rewards = torch.tensor([[5.0, 1.0, math.inf, 2.0, 4.0, math.nan]], **F64)
    mask = torch.tensor([[0, 1, 0, 1, 1, 0]], dtype=torch.bool)
    # G4 = 4; G3 = 2 + 0.5*4 = 4; t=2 skipped (carries 4, adds nothing, no
    # discount); G1 = 1 + 0.5*4 = 3 (not 1 + 0.5*(0.5*4) = 2).
    returns = discounted_returns(rewards, mask, gamma=0.5)
    assert_close(returns, torch.tensor([[0.0, 3.0, 0.0, 4.0, 4.0, 0.0]], **F64), rtol=0, atol=0)
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    assert torch.isfinite(adv).all()
    assert (adv[~mask] == 0).all()


def test_reinforce_pp_hand_computed_whitening() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0]], **F64)
    adv = reinforce_pp_advantages(rewards, torch.ones(1, 4), gamma=0.5)
    # returns [3.25, 4.5, 5, 4]; mean = 16.75/4 = 4.1875;
    # deviations [-0.9375, 0.3125, 0.8125, -0.1875];
    # unbiased var = (0.87890625 + 0.09765625 + 0.66015625 + 0.03515625)/3 = 1.671875/3
    std = math.sqrt(1.671875 / 3 + 1e-8)
    expected = torch.tensor([[-0.9375, 0.3125, 0.8125, -0.1875]], **F64) / std
    assert_close(adv, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_matches_naive(gamma: float, seed: int) -> None:
    B, T = 6, 10
    mask = random_mask(seed + 50, B, T, zero_rows=(2,))
    rewards = torch.randn(B, T, generator=torch.Generator().manual_seed(seed), **F64)
    adv = reinforce_pp_advantages(rewards, mask, gamma=gamma)
    expected = naive_whiten(naive_returns(rewards.tolist(), mask.tolist(), gamma), mask.tolist())
    assert_close(adv, torch.tensor(expected, **F64), rtol=1e-10, atol=1e-12)


def test_reinforce_pp_whitening_is_global_over_batch() -> None:
    B, T = 5, 12
    mask = random_mask(60, B, T)
    g = torch.Generator().manual_seed(61)
    # Rows with very different reward levels: per-row whitening would zero
    # every row mean, global whitening must not.
    rewards = torch.randn(B, T, generator=g, **F64) + torch.arange(B, **F64).unsqueeze(1) * 3
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.9)
    valid = mask != 0
    flat = adv[valid]
    assert abs(flat.mean().item()) < 1e-10
    assert flat.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-6)
    row_means = torch.stack([adv[b][valid[b]].mean() for b in range(B)])
    assert row_means.abs().max() > 0.5
    assert (adv[~valid] == 0).all()
    # Whitening one row on its own gives a different answer: the caller must
    # pass the whole batch.
    alone = reinforce_pp_advantages(rewards[:1], mask[:1], gamma=0.9)
    assert not torch.allclose(alone, adv[:1])


def test_reinforce_pp_degenerate_inputs_are_finite_zero() -> None:
    rewards = torch.randn(3, 5, generator=torch.Generator().manual_seed(70))
    for mask in (
        torch.zeros(3, 5),  # nothing valid
        torch.tensor([[0, 0, 1, 0, 0], [0] * 5, [0] * 5]),  # one valid token
    ):
        adv = reinforce_pp_advantages(rewards, mask)
        assert torch.isfinite(adv).all() and (adv == 0).all()
    # Constant returns (reward only at the last token, gamma=1): variance 0.
    const = torch.zeros(2, 4)
    const[:, -1] = 2.0
    adv = reinforce_pp_advantages(const, torch.ones(2, 4))
    assert torch.isfinite(adv).all() and (adv == 0).all()
    assert reinforce_pp_advantages(torch.zeros(2, 0), torch.zeros(2, 0)).shape == (2, 0)


def test_reinforce_pp_with_kl_shaped_rewards() -> None:
    # beta=0, gamma=1: every valid token's return is the sequence score, so
    # after whitening tokens of the higher-scored row are positive.
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)
    lp = torch.randn(2, 5, generator=torch.Generator().manual_seed(80))
    rewards, _ = kl_shaped_rewards(torch.tensor([2.0, -1.0]), lp, lp, mask, beta=0.0)
    returns = discounted_returns(rewards, mask, gamma=1.0)
    assert_close(returns, torch.tensor([[0, 2, 2, 2, 0], [0, 0, -1, -1, -1]], dtype=torch.float32))
    adv = reinforce_pp_advantages(rewards, mask)
    assert (adv[0][mask[0]] > 0).all() and (adv[1][mask[1]] < 0).all()
    assert adv.dtype == torch.float32 and not adv.requires_grad


def test_reinforce_pp_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="shapes"):
        reinforce_pp_advantages(torch.zeros(2, 3), torch.ones(2, 4))
