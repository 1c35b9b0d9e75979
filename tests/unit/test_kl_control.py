"""Unit tests for learners.objectives.kl_control: hand-computed updates, clipping, NaN, state round-trip."""

from __future__ import annotations

import json
import math

import pytest
import torch

from learners.objectives.kl_control import (
    KL_CONTROLLER_KINDS,
    AdaptiveKLController,
    FixedKLController,
    make_kl_controller,
)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


def test_adaptive_hand_sequence() -> None:
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    assert ctl.value == 0.1
    # kl 12: 12/6 - 1 = 1 -> clipped to 0.2; mult = 1 + 0.2 * 256/10000 = 1.00512
    # value = 0.1 * 1.00512 = 0.100512
    assert close(ctl.update(12.0, 256), 0.100512)
    assert close(ctl.value, 0.100512)
    # kl 3: 3/6 - 1 = -0.5 -> clipped to -0.2; mult = 1 - 0.00512 = 0.99488
    # value = 0.100512 * 0.99488 = 0.100512 - 0.00051462144 = 0.09999737856
    assert close(ctl.update(3.0, 256), 0.09999737856)
    # kl 6.6: 6.6/6 - 1 = 0.1 (inside the clip); mult = 1 + 0.1 * 0.0256 = 1.00256
    # value = 0.09999737856 * 1.00256 = 0.09999737856 + 0.000255993289114 = 0.100253371849114
    assert close(ctl.update(6.6, 256), 0.100253371849114)
    # kl == target: no change
    assert close(ctl.update(6.0, 256), 0.100253371849114)


def test_adaptive_direction_and_clipping() -> None:
    up = 1.0 + 0.2 * 100 / 1000  # 1.02
    down = 1.0 - 0.2 * 100 / 1000  # 0.98
    # everything with |KL/target - 1| >= 0.2 gives exactly the +-20% error
    for kl, mult in ((1.2, up), (2.0, up), (1e9, up), (0.8, down), (0.0, down), (-5.0, down)):
        ctl = AdaptiveKLController(0.5, target=1.0, horizon=1000)
        assert close(ctl.update(kl, 100), 0.5 * mult), kl
    # just inside the clip: 1.1/1 - 1 = 0.1 -> mult 1.01
    ctl = AdaptiveKLController(0.5, target=1.0, horizon=1000)
    assert close(ctl.update(1.1, 100), 0.5 * (1.0 + 0.1 * 0.1))
    # n_steps = 0: gain 0, no change
    assert ctl.update(100.0, 0) == ctl.value
    # gain scales linearly with n_steps / horizon
    a = AdaptiveKLController(1.0, target=1.0, horizon=1000)
    b = AdaptiveKLController(1.0, target=1.0, horizon=2000)
    assert close(a.update(5.0, 50), b.update(5.0, 100))


def test_adaptive_ignores_nonfinite_kl() -> None:
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, 256)
    before = ctl.value
    for bad in (float("nan"), float("inf"), float("-inf"), torch.tensor(float("nan"))):
        assert ctl.update(bad, 256) == before
        assert ctl.value == before
    # subsequent finite updates proceed normally: 0.100512 * 0.99488
    assert close(ctl.update(3.0, 256), 0.09999737856)


def test_adaptive_accepts_tensor_kl() -> None:
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    out = ctl.update(torch.tensor(12.0, dtype=torch.float64), 256)
    assert isinstance(out, float) and close(out, 0.100512)


def test_adaptive_rejects_negative_n_steps() -> None:
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    with pytest.raises(ValueError, match="n_steps"):
        ctl.update(1.0, -1)
    assert ctl.value == 0.1


def test_fixed_never_changes() -> None:
    ctl = FixedKLController(0.05)
    for kl, n in ((12.0, 256), (0.0, 1), (-3.0, 10**6), (float("nan"), 256), (float("inf"), 1), (1e9, 0)):
        assert ctl.update(kl, n) == 0.05
    assert ctl.value == 0.05
    assert FixedKLController(0.0).update(100.0, 256) == 0.0  # beta = 0 is a valid "no KL penalty"


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_fixed_rejects_bad_coef(bad: float) -> None:
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(bad)


def test_state_round_trip_through_json() -> None:
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, 256)
    ctl.update(7.0, 128)
    state = json.loads(json.dumps(ctl.state_dict()))
    assert state == ctl.state_dict()
    assert all(type(v) is float for v in state.values())
    restored = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    restored.load_state_dict(state)
    assert restored.value == ctl.value  # bit-exact: JSON round-trips doubles
    # both continue identically
    for kl in (3.0, 9.0, 6.1):
        assert ctl.update(kl, 256) == restored.update(kl, 256)

    fixed = FixedKLController(0.05)
    state = json.loads(json.dumps(fixed.state_dict()))
    other = FixedKLController(1.0)
    other.load_state_dict(state)
    assert other.value == 0.05 and other.state_dict() == {"value": 0.05}


def test_state_dict_tensor_kl_still_json_serialisable() -> None:
    # a tensor KL must not turn the stored value into a tensor
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(torch.tensor(12.0), 256)
    json.dumps(ctl.state_dict())
    assert type(ctl.value) is float


def test_load_state_dict_rejects_bad_values() -> None:
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    for bad in ({"value": float("nan")}, {"value": 0.0}, {"value": -1.0}):
        with pytest.raises(ValueError):
            ctl.load_state_dict(bad)
    assert ctl.value == 0.1
    with pytest.raises(KeyError):
        ctl.load_state_dict({})
    with pytest.raises(ValueError):
        FixedKLController(0.1).load_state_dict({"value": float("inf")})


def test_make_kl_controller() -> None:
    assert KL_CONTROLLER_KINDS == ("fixed", "adaptive")
    fixed = make_kl_controller("fixed", 0.05, None, 10000)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    adaptive = make_kl_controller("adaptive", 0.1, 6.0, 10000)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.1, 6.0, 10000)
    assert close(adaptive.update(12.0, 256), 0.100512)


@pytest.mark.parametrize(
    "kind,init,target,horizon,match",
    [
        ("pid", 0.1, 6.0, 10000, "fixed.*adaptive"),
        ("adaptive", 0.1, None, 10000, "target"),
        ("adaptive", 0.1, 0.0, 10000, "target"),
        ("adaptive", 0.1, -1.0, 10000, "target"),
        ("adaptive", 0.1, float("nan"), 10000, "target"),
        ("adaptive", 0.1, 6.0, 0, "horizon"),
        ("adaptive", 0.1, 6.0, -5, "horizon"),
        ("adaptive", 0.0, 6.0, 10000, "init_kl_coef"),
        ("fixed", -0.1, None, 10000, "kl_coef"),
    ],
)
def test_make_kl_controller_errors(kind: str, init: float, target: float | None, horizon: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_kl_controller(kind, init, target, horizon)
