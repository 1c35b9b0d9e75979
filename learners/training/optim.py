"""Learning-rate schedules (linear warm-up, then constant, linear or cosine decay) and the
exponential moving average of a target network."""

from __future__ import annotations

import math

import torch

SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")


def lr_multiplier(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Factor on the peak learning rate at optimiser step ``step`` (0-based).

    Warm-up: ``(step + 1) / warmup_steps`` for ``step < warmup_steps`` (the first step already
    moves, as in transformers' schedules shifted by one). After it, with progress
    ``p = (step - warmup) / max(1, total - warmup)`` clamped to [0, 1]:

    * ``constant``: 1;
    * ``linear``: ``1 - (1 - min_ratio) * p``;
    * ``cosine``: ``min_ratio + (1 - min_ratio) * 0.5 * (1 + cos(pi * p))`` (Loshchilov & Hutter
      2017, SGDR eq. 5 without restarts).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; expected one of {SCHEDULES}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    p = min(max((step - warmup_steps) / max(1, total_steps - warmup_steps), 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * p
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def make_scheduler(
    optimizer: torch.optim.Optimizer, *, schedule: str, warmup_steps: int, total_steps: int, min_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over every parameter group (each keeps its own peak rate); its state
    (the step count) goes into checkpoints."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_multiplier(
            s, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps, min_ratio=min_ratio
        ),
    )


@torch.no_grad()
def ema_update_(target: list[torch.Tensor], online: list[torch.Tensor], decay: float) -> None:
    """In place, ``target <- decay * target + (1 - decay) * online`` for every pair (Polyak
    averaging of a target network, Lillicrap et al. 2016, alg. 1): each update moves the target
    by exactly ``(1 - decay)`` of its gap to the online weights; ``decay = 0`` copies them."""
    if len(target) != len(online):
        raise ValueError(f"{len(target)} target tensors for {len(online)} online ones")
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    for t, o in zip(target, online):
        t.lerp_(o.detach().to(t.dtype), 1.0 - decay)
