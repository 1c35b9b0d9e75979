"""Which floating-point format a role computes in when its config says ``auto``.

bf16 halves memory and, where the hardware multiplies bf16 natively, runs matrix multiplies
about twice as fast as fp32. Where it does not, bf16 is emulated and far slower: on a 2-core AMD
EPYC with AVX2 only, a (2048 x 576) @ (576 x 1536) matmul runs at 111-127 GFLOP/s in fp32 and
15-17 GFLOP/s in bf16, with or without autocast (docs/benchmarks.md, "Precision"). So ``auto``
means bf16 on GPUs that support it and on CPUs with native bf16 (AVX512-BF16, AMX, or Arm's BF16
extension), fp32 everywhere else.

Reads ``/proc/cpuinfo`` rather than importing torch for the CPU case, so the driver can resolve
a config without loading torch.
"""

from __future__ import annotations

import functools
from pathlib import Path

# x86 flags (``flags`` line) and Arm features (``Features`` line) of native bf16 arithmetic.
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags listed in a ``/proc/cpuinfo`` text (first processor's)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


@functools.lru_cache(maxsize=None)
def cpu_has_native_bf16() -> bool:
    """True where this machine's CPU multiplies bf16 natively; False if it cannot tell."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(cpu_flags(text) & _BF16_CPU_FLAGS)


def native_bf16(device_type: str) -> bool:
    """True where ``device_type`` ("cpu", "cuda", "cuda:0") computes bf16 natively."""
    if device_type.split(":")[0] == "cuda":
        import torch

        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()


def resolve_bf16(bf16: bool | str, device_type: str) -> bool:
    """``train.bf16`` (True, False or "auto") as the bool a learner on ``device_type`` uses."""
    if isinstance(bf16, bool):
        return bf16
    if bf16 != "auto":
        raise ValueError(f"bf16 must be true, false or 'auto', got {bf16!r}")
    return native_bf16(device_type)


def resolve_engine_dtype(dtype: str, uses_gpu: bool) -> str:
    """A vLLM weight dtype ("bfloat16", "float32" or "auto") as the one an engine loads.

    ``auto`` on GPUs is bfloat16 (vLLM's own default there); on CPUs bfloat16 only with native bf16.
    The caller resolves it once, on the driver, because the learners pack the weights they sync
    in this dtype and the sync check's tolerance depends on it.
    """
    if dtype != "auto":
        return dtype
    return "bfloat16" if uses_gpu or cpu_has_native_bf16() else "float32"
