"""What the host CPU can do fast, for the defaults that depend on it (dtype, threads).

bf16 matmuls on CPU are fast only with native bf16 dot products (AVX512-BF16, AMX-BF16): oneDNN then runs them at
~2-4x float32's FLOP rate and moves half the bytes. Without them torch emulates bf16 through float32 conversions and is
slower than float32, so ``--dtype auto`` picks bf16 on CPU only where the flags say so.
"""

from __future__ import annotations

import functools
from pathlib import Path

FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU in ``/proc/cpuinfo`` (empty where there is none: macOS, Windows)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def fast_bf16_flag(flags: frozenset[str] | None = None) -> str | None:
    """The flag that makes bf16 matmuls fast on this CPU (``avx512_bf16`` / ``amx_bf16``), or None."""
    flags = cpu_flags() if flags is None else flags
    return next((f for f in FAST_BF16_FLAGS if f in flags), None)
