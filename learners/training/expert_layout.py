"""Expert tensors between the layouts of training and of checkpoints.

transformers 5 holds a mixture-of-experts layer's experts fused, as 3-D parameters
(``mlp.experts.gate_up_proj`` (E, 2I, H), ``mlp.experts.down_proj`` (E, H, I)), and converts them to
the per-expert checkpoint names (``mlp.experts.<e>.gate_proj.weight`` ...) only inside
``save_pretrained``. A weight sync sends the state dict itself, and vLLM's loaders read checkpoint
names, so the sync converts the same way (``checkpoint_layout``). Pure torch.
"""

from __future__ import annotations

import re

import torch

_FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def checkpoint_layout(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``named`` with every fused expert tensor split into per-expert checkpoint weights (views,
    no copies; a sharded tensor is gathered whole first); other entries as they are. The gate
    projection is the first half of ``gate_up_proj``'s rows (transformers' ``chunk(2)``)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        match = _FUSED.match(name)
        if match is None or tensor.dim() != 3:
            out[name] = tensor
            continue
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        for e in range(tensor.shape[0]):
            for weight, rows in expert_rows(match["prefix"], match["kind"], e, tensor.shape[1]):
                out[weight] = tensor[e][rows]
    return out


def expert_rows(prefix: str, kind: str, e: int, rows: int) -> list[tuple[str, slice]]:
    """The checkpoint weights of expert ``e`` of the fused tensor ``<prefix>.<kind>`` and the rows
    of its (rows, in) matrix that each one is: ``down_proj`` whole, ``gate_up_proj`` halved into
    the gate projection, then the up projection (transformers' ``chunk(2)``)."""
    if kind == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", slice(0, rows))]
    half = rows // 2
    return [(f"{prefix}.{e}.gate_proj.weight", slice(0, half)), (f"{prefix}.{e}.up_proj.weight", slice(half, rows))]


_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$")


def training_layout(named: dict[str, torch.Tensor], model_keys) -> dict[str, torch.Tensor]:
    """The inverse of ``checkpoint_layout`` for a model whose state dict (``model_keys``) holds
    fused experts: per-expert checkpoint weights stacked into ``gate_up_proj`` / ``down_proj``."""
    keys = set(model_keys)
    groups: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        match = _PER_EXPERT.match(name)
        if match is None or f"{match['prefix']}.down_proj" not in keys:
            out[name] = tensor
            continue
        groups.setdefault(match["prefix"], {})[(match["kind"], int(match["e"]))] = tensor
    for prefix, parts in groups.items():
        n = 1 + max(e for _, e in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[("gate_proj", e)], parts[("up_proj", e)]], 0) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([parts[("down_proj", e)] for e in range(n)])
    return out
