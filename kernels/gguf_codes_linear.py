"""Float32 steps of 1-4 rows on the GGUF codes a dense model was dequantized from (CPUs without AVX-512).

Why: the default model ships as a Q4_1 GGUF and runs dense float32 on CPUs without native bf16 (``--dtype auto``).
A decode step of one sequence then reads 424 MB of float32 decoder weights and the 113 MB tied LM head, which is
what kept one running sequence at 0.25x llama.cpp on a 2-core AMD EPYC (Zen 3, AVX2). The same values as their GGUF
blocks (Q4_1: 4-bit codes, a float32 scale and minimum per 32) are 80 MB, and the f32_cpu kernel's AVX2 path
(kernels/linear_f32_cpu.py) reads them in place, converting codes in registers. The model's 120 decoder linears, 2
threads: 21 -> 10 ms at one row, 21 -> 12 at 2, 22 -> 18 at 4 against the small-rows kernel on the dense weight
(kernels/small_rows_linear.py, which prefetches the weight), but slower from 5 rows on (27 vs 22 ms at 5, 34 vs 23
at 8). So each linear keeps its dense weight for steps of more rows (prefill, busy decode) and runs steps of 1-4 rows
on the codes; the tied LM head the same on the Q8_0 embedding's (1.4 vs 5.1 ms at one row, 2.9 vs 5.0 at 4).

Exactness: attached only where the codes dequantize to the dense weight bit for bit (checked in full when the codes
are first read from the GGUF file and cached, and on their first and last rows at every start-up), so the weights are
the same numbers; the products differ from the dense GEMM's by float32 summation order (~1e-6 of an
output), as batched rows already differ from a single row's GEMV. Greedy float32 output keeps transformers' tokens
(tests/kernels/test_gguf_codes_linear.py and the engine parity tests, which run on it on such CPUs).

Cost: the codes sit next to the dense weights (+21% weight memory for the default model). Only where measured: float32
on CPUs without AVX-512, with the small-rows linears on (an AVX-512 host runs bf16 by default, with its own kernels).
``PDSERVE_CPU_GGUF_CODES=0`` keeps the dense weights alone. ``CodesLinear.served`` counts the calls it served.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import nn

from pdserve.kernels import small_rows_linear
from pdserve.kernels.linear_base import QuantizedWeight
from pdserve.kernels.small_rows_linear import SmallRowsLinear

log = logging.getLogger(__name__)

ROWS = range(1, 5)   # the row counts served on the codes; elsewhere the dense weight


def product(codes: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` times the dense ``weight`` (and ``bias``): 1-4 rows on ``codes`` (the same values, bias included), else
    the small-rows path on ``weight``. A tied LM head's ``head_gemm`` is this with its codes bound."""
    if small_rows_linear.rows_of(x) in ROWS:
        CodesLinear.served += 1
        return codes(x)
    return small_rows_linear.linear(x, weight, bias)


class CodesLinear(SmallRowsLinear):
    """A dense float32 linear (its own parameters) that runs products of 1-4 rows on ``codes``, an f32_cpu linear
    over the same values."""

    served = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(self.codes, x, self.weight, self.bias)


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Where the small-rows linears apply (float32 on CPUs without AVX-512), the f32_cpu kernel builds, and not
    switched off."""
    from pdserve.kernels import linear_f32_cpu
    from pdserve.runtime import envs

    return (envs.cpu_gguf_codes() and small_rows_linear.applies(device, dtype)
            and linear_f32_cpu.load_extension() is None)


def attach(model: nn.Module, gguf: Path | None, device: torch.device, dtype: torch.dtype) -> int:
    """Gives each dense float32 linear of ``model`` (and its tied LM head) the codes of its GGUF blocks in ``gguf``,
    where :func:`applies` and they dequantize to its weight bit for bit; returns how many linears."""
    if gguf is None or not applies(device, dtype) or not hasattr(model, "quantized_twins"):
        return 0
    from pdserve.kernels.linear_f32_cpu import F32Linear

    twins = _twins(model, gguf)
    count = 0
    for name, qw in twins.items():
        module = model.get_submodule(name)
        if not _exact(module, qw, rows=[0, qw.shape[0] - 1]):   # checked in full when the twins were cached
            continue
        if isinstance(module, nn.Embedding):
            if model.lm_head is None:   # tied: the head's product on the embedding's codes
                model.head_codes = F32Linear(qw, None, device, dtype)
                model.head_gemm = functools.partial(product, model.head_codes)
            continue
        new = CodesLinear.of(module)
        new.codes = F32Linear(qw, module.bias, device, dtype)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        count += 1
    if count:
        log.info("GGUF codes: %d float32 linears%s run 1-4 rows on their GGUF blocks", count,
                 " and the LM head" if isinstance(model.head_gemm, functools.partial) else "")
    return count


def _exact(module: nn.Module, qw: QuantizedWeight, rows: list[int] | None = None) -> bool:
    """Whether ``qw`` dequantizes to ``module``'s float32 weight bit for bit (only ``rows`` of it, if given)."""
    if not (isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.dtype == torch.float32
            and tuple(module.weight.shape) == qw.shape):
        return False
    if rows is None:
        return torch.equal(qw.dequantize(), module.weight)
    idx = torch.tensor(rows)
    return torch.equal(qw.rows(idx).dequantize(), module.weight[idx])


def _twins(model: nn.Module, gguf: Path) -> dict[str, QuantizedWeight]:
    """``model.quantized_twins`` of the GGUF file's tensors that dequantize to the model's weights bit for bit, read
    and checked once, then kept in a safetensors file in the cache dir (the GGUF reader parses every metadata field,
    the tokenizer's 49,152 strings included: ~3 s a start-up; the cached codes load in ~0.02 s)."""
    import json
    import os
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    from pdserve.runtime import envs
    from pdserve.runtime.gguf_weights import iter_gguf_weights
    from pdserve.runtime.model_loader import gguf_cache_key

    path = envs.cache_dir() / "models" / f"{gguf_cache_key(gguf)}.codes.safetensors"
    if path.is_file():
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                kinds = json.loads(f.metadata()["twins"])
                return {name: QuantizedWeight(f.get_tensor(f"{name}:q"), f.get_tensor(f"{name}:scale"),
                                              f.get_tensor(f"{name}:zero") if f"{name}:zero" in f.keys() else None,
                                              group, bits, fmt) for name, (group, bits, fmt) in kinds.items()}
        except Exception as e:  # noqa: BLE001 - a damaged cache file: read the GGUF file again
            log.warning("GGUF codes: cannot read %s (%s: %s); reading %s again", path, type(e).__name__, e, gguf)
    try:
        found = model.quantized_twins(iter_gguf_weights(gguf, model.args.num_heads, model.args.num_kv_heads))
    except Exception as e:  # noqa: BLE001 - blocks pdserve cannot keep (K-quants, ...): the dense weights alone
        log.info("GGUF codes: %s cannot be kept quantized (%s); dense weights alone", gguf, e)
        found = {}
    twins = {name: qw for name, qw in found.items() if _exact(model.get_submodule(name), qw)}
    tensors = {f"{name}:{part}": t.contiguous() for name, qw in twins.items()
               for part, t in (("q", qw.q), ("scale", qw.scale), ("zero", qw.zero)) if t is not None}
    kinds = {name: (qw.group_size, qw.bits, qw.fmt) for name, qw in twins.items()}
    try:   # kept even when empty, so that a file without twins is not read again at every start-up
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"twins": json.dumps(kinds)})
            os.replace(tmp, path)   # atomic: a concurrent start-up reads the whole file or none
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:   # a read-only cache dir: the codes still serve this process
        log.warning("GGUF codes: cannot cache them in %s (%s)", path.parent, e)
    return twins

def codes_bytes(model: nn.Module) -> int:
    """Bytes the attached codes take (next to the dense weights)."""
    held = [m.codes for m in model.modules() if isinstance(m, CodesLinear)] + [getattr(model, "head_codes", None)]
    return sum(t.nbytes for m in held if m is not None for t in m.buffers())

