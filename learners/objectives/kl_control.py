"""KL-penalty coefficient controllers (Ziegler et al. 2019, "Fine-Tuning
Language Models from Human Preferences", sec. 2.2).

The reward is shaped as ``r - beta * KL(pi || ref)``. ``beta`` is either fixed,
or adapted so that the measured KL tracks a target: sec. 2.2 gives

    e_t = clip((KL_t - KL_target) / KL_target, -0.2, 0.2)
    beta_{t+1} = beta_t * (1 + K_beta * e_t)

and the reference implementation (openai/lm-human-preferences,
``AdaptiveKLController``) sets the gain per update to
``K_beta = n_steps / horizon``, so the coefficient moves at a rate that does
not depend on how many samples one update covers. Both controllers here follow
that implementation.

Controller state is plain Python floats (``state_dict``) so it can be written
into a checkpoint as JSON.
"""

from __future__ import annotations

import math
from typing import Any, Union

__all__ = ["FixedKLController", "AdaptiveKLController", "KLController", "KL_CONTROLLER_KINDS", "make_kl_controller"]

KL_CONTROLLER_KINDS: tuple[str, ...] = ("fixed", "adaptive")

# Ziegler et al. 2019, sec. 2.2: the proportional error is clipped to +-20% so
# a single wild KL measurement can move the coefficient only a little.
_PROPORTIONAL_ERROR_CLIP: float = 0.2


def _finite_nonneg(name: str, x: Any) -> float:
    v = float(x)
    # `not (v >= 0)` also rejects NaN, which compares False to everything.
    if not (v >= 0.0) or math.isinf(v):
        raise ValueError(f"{name} must be finite and >= 0, got {x!r}")
    return v


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op that returns it.

    Args:
        kl_coef: beta, finite and >= 0.
    """

    def __init__(self, kl_coef: float) -> None:
        self.value: float = _finite_nonneg("kl_coef", kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Return the (unchanged) coefficient; arguments are ignored."""
        return self.value

    def state_dict(self) -> dict[str, float]:
        """``{"value": beta}`` -- JSON-serialisable."""
        return {"value": float(self.value)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``value`` from ``state_dict()`` output (e.g. after ``json.loads``)."""
        self.value = _finite_nonneg("value", state["value"])

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value!r})"


class AdaptiveKLController:
    """Proportional controller driving the measured KL towards ``target``
    (Ziegler et al. 2019, sec. 2.2).

    ``update(current_kl, n_steps)``::

        proportional_error = clip(current_kl / target - 1, -0.2, 0.2)
        mult = 1 + proportional_error * n_steps / horizon
        value *= mult

    KL above target raises beta (stronger pull to the reference), below target
    lowers it. Because the update is multiplicative, beta stays > 0 as long as
    ``n_steps < 5 * horizon`` (``mult >= 1 - 0.2 * n_steps / horizon``); one
    update normally covers far fewer steps than ``horizon``.

    A non-finite ``current_kl`` (NaN / inf, e.g. from a diverged batch or an
    empty mask upstream) is ignored: the coefficient is returned unchanged, so
    one bad measurement cannot poison every later reward. A negative KL (the
    unbiased k1 estimator can go negative) is a valid input; it just clips to
    the -20% error.

    Args:
        init_kl_coef: initial beta, finite and > 0 (a multiplicative update
            could never move it away from 0).
        target: KL_target, the KL per sample to aim for; finite and > 0.
        horizon: number of steps over which a sustained +-20% error changes
            beta by about +-20% (``n_steps / horizon`` is the gain K_beta); > 0.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        init = float(init_kl_coef)
        if not (init > 0.0) or math.isinf(init):
            raise ValueError(f"init_kl_coef must be finite and > 0 for the adaptive controller, got {init_kl_coef!r}")
        tgt = float(target)
        if not (tgt > 0.0) or math.isinf(tgt):
            raise ValueError(f"target must be finite and > 0, got {target!r}")
        if not (float(horizon) > 0.0) or math.isinf(float(horizon)):
            raise ValueError(f"horizon must be finite and > 0, got {horizon!r}")
        self.value: float = init
        self.target: float = tgt
        self.horizon: int = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt beta to the KL measured over the last ``n_steps`` samples.

        Args:
            current_kl: measured KL(pi || ref) per sample (float or 0-dim
                tensor). Non-finite values are ignored (no update).
            n_steps: samples (or steps) the measurement covers; >= 0.

        Returns:
            The new coefficient (also stored in ``self.value``).

        Raises:
            ValueError: for a negative ``n_steps``.
        """
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps!r}")
        kl = float(current_kl)
        if not math.isfinite(kl):
            # Skip rather than raise: the training step already happened, and
            # a NaN/inf here would otherwise make beta NaN/0/inf for good.
            return self.value
        proportional_error = min(max(kl / self.target - 1.0, -_PROPORTIONAL_ERROR_CLIP), _PROPORTIONAL_ERROR_CLIP)
        mult = 1.0 + proportional_error * n_steps / self.horizon
        self.value *= mult
        return self.value

    def state_dict(self) -> dict[str, float]:
        """``{"value": beta}`` -- JSON-serialisable.

        Only beta is state; ``target`` and ``horizon`` are hyperparameters and
        come from the config the controller is rebuilt with on resume (so a
        changed target takes effect from the restored beta).
        """
        return {"value": float(self.value)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``value`` from ``state_dict()`` output (e.g. after ``json.loads``)."""
        v = float(state["value"])
        if not (v > 0.0) or math.isinf(v):
            raise ValueError(f"value must be finite and > 0 for the adaptive controller, got {state['value']!r}")
        self.value = v

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value!r}, target={self.target!r}, horizon={self.horizon!r})"


KLController = Union[FixedKLController, AdaptiveKLController]


def make_kl_controller(kind: str, init: float, target: float | None, horizon: int) -> KLController:
    """Build a KL coefficient controller.

    Args:
        kind: ``"fixed"`` or ``"adaptive"`` (``KL_CONTROLLER_KINDS``).
        init: initial (for ``"fixed"``: constant) coefficient beta.
        target: KL target; required (> 0) for ``"adaptive"``, ignored for
            ``"fixed"``.
        horizon: adaptation horizon (> 0) for ``"adaptive"``; ignored for
            ``"fixed"``. Ziegler et al. 2019 use 10000.

    Raises:
        ValueError: for an unknown ``kind`` or invalid parameters.
    """
    if kind == "fixed":
        return FixedKLController(init)
    if kind == "adaptive":
        if target is None:
            raise ValueError("the adaptive KL controller needs a target > 0, got None")
        return AdaptiveKLController(init, target, horizon)
    raise ValueError(f"Unknown KL controller kind {kind!r}; expected one of {KL_CONTROLLER_KINDS}")
