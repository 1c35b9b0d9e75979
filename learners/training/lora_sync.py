"""Adapter-only weight syncs with LoRA (``lora.sync: adapter``): a sync sends the generators each
adapted weight's two LoRA factors instead of the merged weight, and each generator merges them
into the base weights it reads from the base model folder,

    W = W0 + (s B) A        (Hu et al. 2021, eq. 3; s = alpha / r),

so a sync moves r (in + out) numbers per adapted weight instead of in x out (SmolLM2-135M, r = 8
on every linear layer: 9.8 MB in fp32 against 538 MB merged), and the engine still serves plain
dense weights: no LoRA kernels in the decoding loop, in-flight weight updates and the
verified-sync probe work as with merged weights.

The factors travel under the adapted weight's checkpoint name with a suffix (``<name>::lora_A``,
``<name>::lora_B``; B already scaled by s), in the transports' usual framing. LoRA on a mixture of
experts' fused expert tensors (peft's ``target_parameters``: one rank-r factor pair per expert)
travels as the same pairs per expert under the per-expert checkpoint names. ``merge_into_base``
turns them back into dense weights, one at a time.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

SUFFIX_A = "::lora_A"
SUFFIX_B = "::lora_B"


def unsupported_adapters(peft_model: Any) -> list[str]:
    """Adapted modules whose update is not ``s B A`` on a linear weight (an embedding's adapter,
    DoRA's magnitudes): factors cannot carry them, so such a policy syncs merged weights."""
    from peft.tuners.lora import LoraLayer

    adapter = peft_model.active_adapter
    return [
        name
        for name, module in peft_model.get_base_model().named_modules()
        if isinstance(module, LoraLayer)
        and (adapter not in module.lora_A or adapter in getattr(module, "lora_magnitude_vector", {}))
    ]


@torch.no_grad()
def adapter_factors(peft_model: Any) -> dict[str, torch.Tensor]:
    """``{<weight>::lora_A: A (r, in), <weight>::lora_B: s B (out, r)}`` of every adapted linear
    layer of a peft model, in checkpoint naming (A before B). Sharded factors stay shards: the
    packer gathers each. Raises on adapters factors cannot carry (``unsupported_adapters``)."""
    from peft.tuners.lora import LoraLayer

    unsupported = unsupported_adapters(peft_model)
    if unsupported:
        raise ValueError(f"adapter sync cannot carry the adapters of {unsupported[:3]} (not plain linear LoRA)")
    adapter = peft_model.active_adapter
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, int], list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for name, module in peft_model.get_base_model().named_modules():
        if not (isinstance(module, LoraLayer) and adapter in module.lora_A):
            continue
        if hasattr(module, "parameter_name"):  # peft's ParamWrapper: LoRA on fused expert tensors
            for key, entries in _expert_factors(model_name(name), module, adapter).items():
                experts.setdefault(key, []).extend(entries)
            continue
        out[f"{name}.weight{SUFFIX_A}"] = module.lora_A[adapter].weight
        out[f"{name}.weight{SUFFIX_B}"] = module.lora_B[adapter].weight * module.scaling[adapter]
    # An expert's projections one after another: the generator merges a module's weights together.
    for key in sorted(experts):
        for weight, a, b in sorted(experts[key], key=lambda entry: entry[0]):
            out[f"{weight}{SUFFIX_A}"], out[f"{weight}{SUFFIX_B}"] = a, b
    return out


def _expert_factors(prefix: str, module: Any, adapter: str) -> dict[tuple[str, int], list]:
    """Per expert of a ParamWrapper's fused tensor ``<prefix>.<parameter_name>`` (E, rows, in) or
    (E, in, rows): (checkpoint weight, A (r, in), s B (out, r)) for each weight the expert's slice
    of it is in checkpoint naming (``expert_layout.expert_rows``), so that W_e = W0_e + (s B) A as
    for a linear layer. peft's factors give ``delta = s lhs @ rhs`` in the tensor's own layout."""
    from learners.training.expert_layout import expert_rows

    lhs, rhs, scale = module.get_delta_factors(adapter)
    if module._did_swap_in_out_features:  # stored (E, out, in): delta_e = s lhs_e rhs_e
        b_all, a_all = lhs * scale, rhs
    else:  # stored (E, in, out): the checkpoint's (out, in) is delta_e transposed
        b_all, a_all = rhs.transpose(-2, -1) * scale, lhs.transpose(-2, -1)
    out: dict[tuple[str, int], list] = {}
    for e in range(b_all.shape[0]):
        for weight, rows in expert_rows(prefix, module.parameter_name, e, b_all.shape[1]):
            out.setdefault((prefix, e), []).append((weight, a_all[e], b_all[e][rows]))
    return out


def model_name(peft_name: str) -> str:
    """A module or tensor of a peft model by its base model's name: every wrapper's
    ``.base_layer`` segment dropped (ParamWrappers nest one per adapted tensor of a module)."""
    return re.sub(r"(\.base_layer)+(?=\.|$)", "", peft_name)


def is_adapter_sync(names: Iterable[str]) -> bool:
    return any(n.endswith((SUFFIX_A, SUFFIX_B)) for n in names)


def merge_into_base(
    named: Iterable[tuple[str, torch.Tensor]], base: "BaseWeights"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Dense fp32 weights ``base(name) + B A`` from a stream of factors (each A followed by its B,
    as ``adapter_factors`` orders them); other tensors pass through. One merged weight exists at
    a time. Every other tensor of an adapted weight's module (``base.siblings``: a bias, the
    projections an engine fuses with it, such as k beside adapted q and v) follows from the base
    folder, so the engine reloads whole fused layers. Raises on a B without its A or an A left
    without its B."""
    pending: dict[str, torch.Tensor] = {}
    parent, merged = None, set()

    def rest_of(module: str | None) -> Iterator[tuple[str, torch.Tensor]]:
        for other in base.siblings(module) if module else ():
            if other not in merged:
                yield other, base(other)

    for name, t in named:
        if name.endswith(SUFFIX_A):
            pending[name[: -len(SUFFIX_A)]] = t
            continue
        if not name.endswith(SUFFIX_B):
            yield name, t
            continue
        weight = name[: -len(SUFFIX_B)]
        if weight not in pending:
            raise ValueError(f"adapter sync: {name} arrived without its lora_A")
        if module_of(weight) != parent:
            yield from rest_of(parent)
            parent = module_of(weight)
        merged.add(weight)
        yield weight, base(weight).float() + t.float() @ pending.pop(weight).float()
    yield from rest_of(parent)
    if pending:
        raise ValueError(f"adapter sync: lora_A without lora_B for {sorted(pending)[:3]}")


def module_of(weight: str) -> str:
    """The module holding a linear layer: ``model.layers.0.self_attn`` of ``model.layers.0.self_attn.q_proj.weight``."""
    return weight.rsplit(".", 2)[0]


class BaseWeights:
    """Tensors of a safetensors model folder by name, read on demand from memory-mapped files (no
    copy of the model kept in the process)."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder} (the base model of an adapter sync)")
        self._files = [safe_open(str(f), framework="pt") for f in files]
        self._where = {k: h for h in self._files for k in h.keys()}
        self._modules: dict[str, list[str]] = {}
        for k in self._where:
            self._modules.setdefault(module_of(k), []).append(k)

    def __call__(self, name: str) -> torch.Tensor:
        handle = self._where.get(name)
        if handle is None:
            raise KeyError(f"the base model has no weight {name!r} for an adapter sync")
        return handle.get_tensor(name)

    def siblings(self, module: str) -> list[str]:
        """Names of the tensors of ``module``'s linear layers (``module_of``)."""
        return self._modules.get(module, [])
