"""Unit tests for learners.objectives.losses.agg_loss and the loss_agg option of the PPO losses."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from learners.objectives.losses import LOSS_AGG_MODES, agg_loss, masked_mean, policy_loss_clipped, value_loss_clipped

F64 = dict(dtype=torch.float64)
NAN = float("nan")


def hand_example() -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged 3x5: row 0 has 3 tokens, row 1 two (interior), row 2 five.

    Masked-out positions hold NaN / inf: they must never leak into the result.
    """
    x = torch.tensor(
        [[1.0, 2.0, 3.0, NAN, float("inf")], [NAN, 7.0, 8.0, 9.0, NAN], [11.0, 12.0, 13.0, 14.0, 15.0]], **F64
    )
    m = torch.tensor(
        [
            [1.0, 1.0, 1.0, 0.0, 0.0],  # 1+2+3 = 6, n=3, mean 2
            [0.0, 0.0, 1.0, 1.0, 0.0],  # 8+9 = 17, n=2, mean 8.5
            [1.0, 1.0, 1.0, 1.0, 1.0],  # 11+..+15 = 65, n=5, mean 13
        ],
        **F64,
    )
    return x, m


def test_agg_loss_hand_values() -> None:
    x, m = hand_example()
    # token_mean: (6 + 17 + 65) / (3 + 2 + 5) = 88 / 10
    assert_close(agg_loss(x, m), torch.tensor(8.8, **F64))  # default mode
    assert_close(agg_loss(x, m, "token_mean"), torch.tensor(8.8, **F64))
    # seq_mean_token_mean: (2 + 8.5 + 13) / 3 = 23.5 / 3
    assert_close(agg_loss(x, m, "seq_mean_token_mean"), torch.tensor(23.5 / 3, **F64))
    # seq_mean_token_sum_norm, constant 5: (6/5 + 17/5 + 65/5) / 3 = 88 / 15
    assert_close(agg_loss(x, m, "seq_mean_token_sum_norm", constant=5.0), torch.tensor(88.0 / 15, **F64))
    # constant 10: (0.6 + 1.7 + 6.5) / 3 = 8.8 / 3
    assert_close(agg_loss(x, m, "seq_mean_token_sum_norm", constant=10), torch.tensor(8.8 / 3, **F64))
    # bool mask gives the same values
    for mode in LOSS_AGG_MODES:
        assert_close(agg_loss(x, m.bool(), mode, 5.0), agg_loss(x, m, mode, 5.0))


def test_agg_loss_hand_values_with_empty_row() -> None:
    # Row 1 emptied: it is excluded from the sequence means (no dilution by 0).
    x, m = hand_example()
    m[1] = 0.0
    # token_mean: (6 + 65) / (3 + 5) = 71 / 8
    assert_close(agg_loss(x, m, "token_mean"), torch.tensor(71.0 / 8, **F64))
    # seq_mean_token_mean: (2 + 13) / 2 = 7.5
    assert_close(agg_loss(x, m, "seq_mean_token_mean"), torch.tensor(7.5, **F64))
    # seq_mean_token_sum_norm, constant 5: (6/5 + 65/5) / 2 = 14.2 / 2 = 7.1
    assert_close(agg_loss(x, m, "seq_mean_token_sum_norm", constant=5.0), torch.tensor(7.1, **F64))


def test_agg_loss_gradients_hand() -> None:
    x, m = hand_example()
    x = torch.where(m != 0, x, torch.zeros_like(x)).requires_grad_(True)
    n_b = torch.tensor([3.0, 2.0, 5.0], **F64)
    expected = {
        # d/dx of sum / 10 = 1/10 at every masked token
        "token_mean": torch.full((3, 1), 0.1, **F64),
        # (1/3) * (1/n_b): 1/9, 1/6, 1/15
        "seq_mean_token_mean": (1.0 / (3.0 * n_b)).unsqueeze(1),
        # (1/3) * (1/5) = 1/15 for every token, whatever the row length
        "seq_mean_token_sum_norm": torch.full((3, 1), 1.0 / 15, **F64),
    }
    for mode, g in expected.items():
        x.grad = None
        agg_loss(x, m, mode, constant=5.0).backward()
        assert_close(x.grad, g * m, msg=mode)


def test_agg_loss_nonfinite_masked_positions_do_not_leak_into_grad() -> None:
    x, m = hand_example()
    x.requires_grad_(True)
    for mode in LOSS_AGG_MODES:
        x.grad = None
        out = agg_loss(x, m, mode, constant=5.0)
        assert torch.isfinite(out)
        out.backward()
        assert torch.isfinite(x.grad).all(), mode
        assert (x.grad[m == 0] == 0).all(), mode
        assert (x.grad[m != 0] > 0).all(), mode


def ragged_mask(seed: int, B: int = 6, T: int = 9) -> torch.Tensor:
    """(B, T) float mask: prompt zeros, random lengths, interior holes, one empty row."""
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(B, T, **F64)
    for b in range(B):
        p = int(torch.randint(0, 3, (1,), generator=g))
        end = int(torch.randint(p + 1, T + 1, (1,), generator=g))
        m[b, p:end] = 1.0
        if end - p > 2:
            m[b, int(torch.randint(p + 1, end - 1, (1,), generator=g))] = 0.0
    m[int(torch.randint(0, B, (1,), generator=g))] = 0.0  # one empty row
    return m


def naive_agg(x: torch.Tensor, m: torch.Tensor, mode: str, constant: float | None) -> float:
    rows = []
    for b in range(x.shape[0]):
        vals = [float(x[b, t]) for t in range(x.shape[1]) if m[b, t] != 0]
        if vals:
            rows.append(vals)
    if not rows:
        return 0.0
    if mode == "token_mean":
        flat = [v for r in rows for v in r]
        return sum(flat) / len(flat)
    if mode == "seq_mean_token_mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    assert constant is not None
    return sum(sum(r) / constant for r in rows) / len(rows)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_vs_naive(seed: int, mode: str) -> None:
    m = ragged_mask(seed)
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(m.shape, generator=g, **F64)
    constant = float(m.shape[1])
    expected = naive_agg(x, m, mode, constant)
    assert_close(agg_loss(x, m, mode, constant), torch.tensor(expected, **F64))
    assert_close(agg_loss(x, m.bool(), mode, constant), torch.tensor(expected, **F64))


def test_agg_loss_modes_differ_on_ragged_data() -> None:
    # Sanity: the example is ragged enough that the three reductions disagree.
    x, m = hand_example()
    vals = {float(agg_loss(x, m, mode, 5.0)) for mode in LOSS_AGG_MODES}
    assert len(vals) == 3


def test_agg_loss_equal_lengths_token_and_seq_mean_agree() -> None:
    # With every row fully masked, token mean == seq mean of token means, and
    # sum_norm with constant T equals them too.
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 6, generator=g, **F64)
    m = torch.ones(4, 6, dtype=torch.bool)
    ref = agg_loss(x, m, "token_mean")
    assert_close(agg_loss(x, m, "seq_mean_token_mean"), ref)
    assert_close(agg_loss(x, m, "seq_mean_token_sum_norm", constant=6), ref)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_empty_mask_is_zero(mode: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, generator=g, **F64).requires_grad_(True)
    for z in (torch.zeros(3, 5), torch.zeros(3, 5, dtype=torch.bool)):
        x.grad = None
        out = agg_loss(x, z, mode, constant=5.0)
        assert out.dim() == 0
        assert torch.isfinite(out) and out.item() == 0.0
        out.backward()
        assert (x.grad == 0).all()


def test_agg_loss_token_mean_is_masked_mean_exactly() -> None:
    m = ragged_mask(4)
    x = torch.randn(m.shape, generator=torch.Generator().manual_seed(5), **F64)
    assert torch.equal(agg_loss(x, m), masked_mean(x, m))


def test_agg_loss_value_errors() -> None:
    x, m = hand_example()
    with pytest.raises(ValueError, match="token_mean.*seq_mean_token_mean.*seq_mean_token_sum_norm"):
        agg_loss(x, m, "seq_mean")
    for bad in (None, 0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="constant"):
            agg_loss(x, m, "seq_mean_token_sum_norm", constant=bad)
    # the constant is only needed (and only checked) by the sum_norm mode
    agg_loss(x, m, "token_mean", constant=None)
    agg_loss(x, m, "seq_mean_token_mean", constant=-1.0)


def test_agg_loss_gradient_flows_random() -> None:
    m = ragged_mask(9)
    x = torch.randn(m.shape, generator=torch.Generator().manual_seed(9), **F64).requires_grad_(True)
    for mode in LOSS_AGG_MODES:
        x.grad = None
        out = agg_loss(x, m, mode, constant=9.0)
        assert out.requires_grad
        out.backward()
        assert (x.grad[m != 0] != 0).all(), mode
        assert (x.grad[m == 0] == 0).all(), mode
    # float32 works as well
    agg_loss(x.detach().float().requires_grad_(True), m.float(), "seq_mean_token_mean").backward()


# ----------------------------------------------- loss_agg in the PPO losses --


def ppo_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    m = ragged_mask(seed)
    g = torch.Generator().manual_seed(200 + seed)
    old = torch.randn(m.shape, generator=g, **F64) - 2.0
    lp = old + 0.3 * torch.randn(m.shape, generator=g, **F64)
    adv = torch.randn(m.shape, generator=g, **F64)
    return lp, old, adv, m


@pytest.mark.parametrize("seed", [0, 1])
def test_policy_loss_default_agg_is_unchanged(seed: int) -> None:
    lp, old, adv, m = ppo_inputs(seed)
    loss_default, stats_default = policy_loss_clipped(lp, old, adv, m)
    loss_tm, stats_tm = policy_loss_clipped(lp, old, adv, m, loss_agg="token_mean")
    assert torch.equal(loss_default, loss_tm)
    for k in stats_default:
        assert torch.equal(stats_default[k], stats_tm[k])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_agg_modes(seed: int, mode: str) -> None:
    lp, old, adv, m = ppo_inputs(seed)
    eps = 0.2
    ratio = (lp - old).exp()
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    T = float(m.shape[1])
    loss, stats = policy_loss_clipped(lp, old, adv, m, clip_eps=eps, loss_agg=mode, loss_agg_constant=T)
    assert_close(loss, torch.tensor(naive_agg(per_token, m, mode, T), **F64))
    # stats stay token means regardless of the aggregation mode
    _, stats_tm = policy_loss_clipped(lp, old, adv, m, clip_eps=eps)
    for k in stats_tm:
        assert torch.equal(stats[k], stats_tm[k]), k


def test_policy_loss_agg_errors() -> None:
    lp, old, adv, m = ppo_inputs(0)
    with pytest.raises(ValueError, match="token_mean"):
        policy_loss_clipped(lp, old, adv, m, loss_agg="sum")
    with pytest.raises(ValueError, match="constant"):
        policy_loss_clipped(lp, old, adv, m, loss_agg="seq_mean_token_sum_norm")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_agg_modes(mode: str) -> None:
    m = ragged_mask(11)
    g = torch.Generator().manual_seed(11)
    old = torch.randn(m.shape, generator=g, **F64)
    values = old + 0.5 * torch.randn(m.shape, generator=g, **F64)
    ret = torch.randn(m.shape, generator=g, **F64)
    eps = 0.2
    vc = old + (values - old).clamp(-eps, eps)
    per_token = torch.maximum((values - ret).square(), (vc - ret).square())
    loss, stats = value_loss_clipped(values, old, ret, m, clip_eps=eps, loss_agg=mode, loss_agg_constant=9)
    assert_close(loss, torch.tensor(0.5 * naive_agg(per_token, m, mode, 9.0), **F64))
    loss_d, stats_d = value_loss_clipped(values, old, ret, m, clip_eps=eps)
    assert torch.equal(stats["vf_clip_frac"], stats_d["vf_clip_frac"])
    if mode == "token_mean":
        assert torch.equal(loss, loss_d)
