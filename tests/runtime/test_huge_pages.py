"""runtime/huge_pages.py: the KV cache is zeroed, 2 MiB-aligned and advised onto transparent huge pages on CPU (the
mapping's ``hg`` flag in /proc/self/smaps), where this kernel offers THP on request; the engine's cache is made so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.runtime import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.is_file() or "[never]" in THP.read_text(),
                               reason="no transparent huge pages on this host (not Linux, or THP set to never)")


def vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds ``addr``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


@needs_thp
def test_cache_is_advised_onto_huge_pages_and_zeroed():
    t = huge_pages.zeros((64, 30, 2, 16, 3, 64), torch.float32, torch.device("cpu"))   # 94 MiB, like a small KV cache
    assert t.shape == (64, 30, 2, 16, 3, 64) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE == 0
    assert "hg" in vm_flags(t.data_ptr()) and "hg" in vm_flags(t.data_ptr() + t.nbytes - 1)
    assert not t.any()
    t[-1] = 1.0                                 # the whole range is the tensor's own memory
    assert t.sum() == t[-1].numel()


def test_small_and_non_cpu_tensors_are_plain_zeros():
    t = huge_pages.zeros((4, 5), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (4, 5) and t.dtype == torch.bfloat16 and not t.any()
    m = huge_pages.zeros((1 << 20,), torch.float32, torch.device("meta"))   # another device: torch.zeros there
    assert m.device.type == "meta" and m.shape == (1 << 20,)


@needs_thp
def test_engine_kv_cache_is_on_huge_pages():
    from pdserve.runtime.llm import LLM

    llm = LLM(dtype="float32", max_model_len=256, num_gpu_blocks=64)
    cache = llm.engine.runner.kv_cache
    assert cache.data_ptr() % huge_pages.HUGE == 0 and "hg" in vm_flags(cache.data_ptr())
