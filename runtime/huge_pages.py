"""Zeroed CPU tensors on transparent huge pages (2 MiB), where the OS gives them on request.

Why: a decode step reads each running sequence's K/V blocks scattered over the whole KV cache, every layer; on 4 KiB
pages most blocks cost TLB misses. The float32 paged decode attention of the default model, 32 sequences of 400
tokens, 30 layers: 31 -> 27 ms with the cache on huge pages (benchmarks/RESULTS.md). Linux's default THP mode,
``madvise``, gives huge pages only to memory advised with ``madvise(MADV_HUGEPAGE)`` before it is first touched, so
the buffer is over-allocated, cut at a 2 MiB boundary, advised, then zeroed. Where the OS refuses (THP ``never``, not
Linux) the tensor is the same, on small pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys

import torch

HUGE = 1 << 21         # bytes in a huge page (x86-64, arm64 with 4 KiB base pages)
MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def _madvise():
    if sys.platform != "linux":   # MADV_HUGEPAGE is Linux's number
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advise(addr: int, nbytes: int) -> bool:
    """Asks the OS to back ``[addr, addr + nbytes)`` (``addr`` page-aligned) with huge pages; whether it accepted."""
    fn = _madvise()
    return fn is not None and fn(addr, nbytes, MADV_HUGEPAGE) == 0


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on CPU, when at least one huge page, starting at a 2 MiB
    boundary and advised onto huge pages before it is zeroed."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < HUGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)        # untouched: large allocations are fresh mappings
    start = -raw.data_ptr() % HUGE
    buf = raw[start:start + nbytes]
    advise(buf.data_ptr(), nbytes)
    return buf.view(dtype).view(shape).zero_()
