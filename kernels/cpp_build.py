"""Builds and loads pdserve's small CPU torch C++ extensions (``f32_cpu`` linears, paged decode attention).

Compiled on first use with ``torch.utils.cpp_extension.load`` (gcc + ninja) into
``$PDSERVE_CACHE_DIR/torch_extensions/<name>``, the name keyed by a hash of the source, the torch version, the compiler
flags and the CPU's flags, so a stale or foreign build is never loaded; later processes only load it. A failed build
(no compiler, no headers) returns its reason instead of raising: the caller falls back to a torch path and start-up
never fails on it.
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch

log = logging.getLogger(__name__)


def simd_cflags(extra: tuple[str, ...] = ()) -> list[str]:
    """``-O3 -fopenmp`` plus AVX-512 (F, BW, FMA and ``extra`` flags the CPU has) where the CPU has AVX-512 F and BW,
    else AVX2 and FMA where it has those (the kernels' 8-lane paths).

    ``-fopenmp``: ``at::parallel_for`` is a header template over OpenMP pragmas (torch's PyPI builds), so without it
    the loop runs on the calling thread alone."""
    from pdserve.runtime.cpu_features import cpu_flags

    flags, base = cpu_flags(), ["-O3", "-fopenmp"]
    if not {"avx512f", "avx512bw"} <= flags:
        return [*base, "-mavx2", "-mfma"] if {"avx2", "fma"} <= flags else base
    gcc = {"amx_tile": "-mamx-tile", "amx_bf16": "-mamx-bf16", "amx_int8": "-mamx-int8"}  # else the flag's name without underscores
    return [*base, "-mavx512f", "-mavx512bw", "-mfma",
            *(gcc.get(f, f"-m{f.replace('_', '')}") for f in extra if f in flags)]


def build(prefix: str, source: str, cflags: list[str], what: str) -> str | None:
    """Compiles ``source`` into the cache dir (unless already built) and loads it; None, or the reason it failed."""
    from torch.utils import cpp_extension

    from pdserve.runtime import envs
    from pdserve.runtime.cpu_features import cpu_flags

    key = "\0".join([source, torch.__version__, " ".join(cflags), " ".join(sorted(cpu_flags()))])
    name = f"{prefix}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    build_dir = envs.cache_dir() / "torch_extensions" / name
    built = {p: p.stat().st_mtime for p in build_dir.glob("*.so")}
    t0 = time.perf_counter()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        src = build_dir / f"{name}.cpp"  # load(), not load_inline(): that prepends torch/extension.h (pybind: 2x slower)
        if not src.is_file() or src.read_text() != source:
            src.write_text(source)
        cpp_extension.load(name, [str(src)], extra_cflags=cflags, build_directory=str(build_dir),
                           extra_ldflags=["-fopenmp"] if "-fopenmp" in cflags else [],
                           is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler / headers / ninja: the caller falls back, start-up never fails
        return f"{what} could not be built ({type(exc).__name__}: {str(exc).strip()[:300]})"
    if {p: p.stat().st_mtime for p in build_dir.glob("*.so")} != built:  # compiled now, not just loaded
        isa = "AVX-512" if "-mavx512f" in cflags else "AVX2" if "-mavx2" in cflags else "portable C++"
        log.info("built %s (%s) in %.1f s into %s", what, isa, time.perf_counter() - t0, build_dir)
    return None


def build_for(prefix: str, source: str, needs: tuple[str, ...], what: str) -> str | None:
    """:func:`build` for a source that needs the CPU flags ``needs`` (compiled with them), whose library defines an
    ``available()`` op saying whether this process can run it; None, or the reason it cannot be used."""
    from pdserve.runtime.cpu_features import cpu_flags

    if missing := sorted(set(needs) - cpu_flags()):
        return f"{what} needs CPU flags this CPU lacks: {', '.join(missing)}"
    reason = build(prefix, source, simd_cflags(needs), what)
    if reason is None and not getattr(torch.ops, prefix).available():
        reason = f"{what} cannot run in this process (built without {', '.join(needs)}, or not granted by the OS)"
    return reason
