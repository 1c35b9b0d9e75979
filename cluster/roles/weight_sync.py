"""Weight sync learner -> generators: one flat buffer, one ``ray.put`` per sync.

A dict of hundreds of tensors pickles slowly; one contiguous buffer, stored as a numpy array,
goes through the object store zero-copy (readers get a shared-memory view). The same
``pack``/``unpack`` pair frames the collective transport's broadcast too (gloo or NCCL): the
transport changes, the framing and the generator's ``load_weights`` do not.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from learners.training.sharding import full_tensor

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# numpy has no bfloat16: bf16 and fp16 travel as int16 bit patterns.
_CARRIER = {torch.bfloat16: np.int16, torch.float16: np.int16, torch.float32: np.float32}


@dataclass
class PackedWeights:
    # 1-D numpy array with every tensor's elements back to back (dtype: the carrier of `dtype`).
    buffer: np.ndarray
    # torch dtype name of the packed values ("bfloat16", "float32").
    dtype: str
    # (name, shape, offset in elements) of each tensor, in checkpoint (transformers) naming.
    layout: list[tuple[str, tuple[int, ...], int]]
    # Policy version these weights belong to.
    version: int

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)


def pack(state_dict: dict[str, torch.Tensor], dtype: str, version: int, out: np.ndarray | None = None) -> PackedWeights:
    """The tensors back to back in one flat buffer of ``dtype``. ``out``: a buffer of an earlier
    pack of the same weights to write into (a fresh 269 MB allocation page-faults on first touch,
    ~3x the copy itself); only safe once the earlier pack has left (``ray.put`` copies it).
    Shards of a sharded learner are gathered one tensor at a time (every rank packs)."""
    tdtype = _DTYPES[dtype]
    total = sum(t.numel() for t in state_dict.values())
    if out is not None and out.size == total and out.dtype == np.dtype(_CARRIER[tdtype]):
        flat = torch.from_numpy(out).view(tdtype)
    else:
        flat = torch.empty(total, dtype=tdtype)
    layout = []
    offset = 0
    for name, t in state_dict.items():
        n = t.numel()
        flat[offset : offset + n].copy_(full_tensor(t).detach().reshape(-1))
        layout.append((name, tuple(t.shape), offset))
        offset += n
    carrier = flat.view(torch.int16) if tdtype != torch.float32 else flat
    return PackedWeights(buffer=carrier.numpy(), dtype=dtype, layout=layout, version=version)


def layout_of(state_dict: dict[str, torch.Tensor]) -> tuple[list[tuple[str, tuple[int, ...], int]], int]:
    """``pack``'s layout and total element count, without copying anything."""
    layout, offset = [], 0
    for name, t in state_dict.items():
        layout.append((name, tuple(t.shape), offset))
        offset += t.numel()
    return layout, offset


def carrier_tensor_dtype(dtype: str) -> torch.dtype:
    """The torch dtype a packed buffer of ``dtype`` travels as (a receive buffer's)."""
    return torch.from_numpy(np.empty(0, dtype=_CARRIER[_DTYPES[dtype]])).dtype


def unpack(packed: PackedWeights) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into the buffer; no copy (the receiver's loader copies)."""
    with warnings.catch_warnings():
        # Object-store views are read-only; the loader only reads them, so no copy is needed.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(packed.buffer)
    return unpack_flat(flat, packed.dtype, packed.layout)


def unpack_flat(flat: torch.Tensor, dtype: str, layout: list) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a packed buffer held as a 1-D carrier tensor on any device (a
    collective transport's receive buffer)."""
    tdtype = _DTYPES[dtype]
    if tdtype != torch.float32:
        flat = flat.view(tdtype)
    for name, shape, offset in layout:
        n = int(np.prod(shape)) if shape else 1
        yield name, flat[offset : offset + n].view(shape)


# A fixed probe for verified syncs: text any tokenizer encodes to a few dozen tokens.
PROBE_TEXT = (
    "Verified sync probe: 12 + 30 = 42. The quick brown fox jumps over the lazy dog; "
    "weights in the engine should equal the learner's."
)


def probe_token_ids(tokenizer) -> list[int]:
    return list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])


def sync_tolerance(dtype: str, configured: float = 0.0) -> float:
    """Largest mean |log-prob difference| over the probe accepted between a generator and the
    learner: the precision gap of the generator's weights and kernels (fp32: about 1e-6 measured;
    bf16: about 1e-2) with a margin, or the configured value."""
    if configured > 0:
        return configured
    return 1e-3 if dtype == "float32" else 0.1


class SyncError(RuntimeError):
    """A generator does not serve the weights the learners sent."""


def probe_gaps(expected: list[float], served: list[list[float]]) -> list[float]:
    """Mean |log-prob difference| over the probe of each generator's answer vs the learner's."""
    e = torch.tensor(expected, dtype=torch.float64)
    return [
        float((torch.tensor(s, dtype=torch.float64) - e).abs().mean()) if len(s) == len(expected) else float("inf")
        for s in served
    ]
