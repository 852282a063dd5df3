"""Every ``PDSERVE_*`` environment variable, read here and nowhere else (torch-free)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where pdserve caches converted model weights and test binaries (PDSERVE_CACHE_DIR, default ~/.cache/pdserve)."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def hash_seed() -> str:
    """Seed of the block-hash chain (PDSERVE_HASH_SEED); every process of one deployment must share it."""
    return os.environ.get("PDSERVE_HASH_SEED", "pdserve")


def log_level() -> str:
    return os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper()


def api_key() -> str | None:
    """API key required on the runtime's inference endpoints (PDSERVE_API_KEY; ``pdserve serve --api-key`` wins)."""
    return os.environ.get("PDSERVE_API_KEY") or None


def pod_otlp_traces_endpoint() -> str | None:
    """The operator's PDSERVE_POD_OTLP_TRACES_ENDPOINT: the OTLP collector it tells every pod and router to export
    traces to (as OTEL_EXPORTER_OTLP_TRACES_ENDPOINT in their ConfigMap); unset: no tracing."""
    return os.environ.get("PDSERVE_POD_OTLP_TRACES_ENDPOINT") or None


def pod_otlp_traces_protocol() -> str | None:
    """PDSERVE_POD_OTLP_TRACES_PROTOCOL: ``http/protobuf`` (default) or ``grpc``, passed on like the endpoint."""
    return os.environ.get("PDSERVE_POD_OTLP_TRACES_PROTOCOL") or None


def kv_transfer_token() -> str | None:
    """Shared secret that authenticates KV-transfer side channels between pods (PDSERVE_KV_TOKEN)."""
    return os.environ.get("PDSERVE_KV_TOKEN") or None


def upstream_api_key() -> str | None:
    """Key the router presents to the runtime pods (PDSERVE_UPSTREAM_API_KEY; ``--upstream-api-key`` wins)."""
    return os.environ.get("PDSERVE_UPSTREAM_API_KEY") or None


def cache_salt_secret() -> str | None:
    """Router secret that derives tenant cache salts (PDSERVE_CACHE_SALT_SECRET; ``--cache-salt-secret`` wins)."""
    return os.environ.get("PDSERVE_CACHE_SALT_SECRET") or None


def allow_runtime_lora_updating() -> bool:
    """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter exist (PDSERVE_ALLOW_RUNTIME_LORA_UPDATING, or vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING): off by default, as in vLLM."""
    value = os.environ.get("PDSERVE_ALLOW_RUNTIME_LORA_UPDATING") or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _switched_on(name: str) -> bool:
    """A default-on switch: off for ``0``, ``false``, ``no`` or ``off``."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def cpu_packed_gemm() -> bool:
    """Whether bf16/fp16 dense linears on CPU run oneDNN's packed kernel (PDSERVE_CPU_PACKED_GEMM, default on; ``0``
    falls back to ``F.linear``, e.g. to compare the two: kernels/packed_linear.py)."""
    return _switched_on("PDSERVE_CPU_PACKED_GEMM")


def cpu_small_rows_gemm() -> bool:
    """Whether float32 dense linears (and the LM head) of 1-256 rows on CPUs without AVX-512 run on pdserve's
    small-rows kernel (PDSERVE_CPU_SMALL_ROWS_GEMM, default on; ``0`` keeps ``F.linear``:
    kernels/small_rows_linear.py)."""
    return _switched_on("PDSERVE_CPU_SMALL_ROWS_GEMM")


def cpu_gguf_codes() -> bool:
    """Whether float32 dense linears loaded from GGUF blocks run steps of 1-8 rows on those blocks' codes on CPUs
    without AVX-512 (PDSERVE_CPU_GGUF_CODES, default on; ``0`` keeps the dense weights alone:
    kernels/gguf_codes_linear.py)."""
    return _switched_on("PDSERVE_CPU_GGUF_CODES")


def cpu_amx_linear() -> bool:
    """Whether bf16 dense linears on CPUs with AMX run pdserve's AMX kernel rather than oneDNN's packed one
    (PDSERVE_CPU_AMX_LINEAR, default on; ``0`` keeps oneDNN: kernels/amx_linear.py)."""
    return _switched_on("PDSERVE_CPU_AMX_LINEAR")


def cpu_amx_lossless() -> bool:
    """Whether the AMX kernel holds decode's bf16 weights in their lossless 12-bit form, read 1/4 faster with the
    same bits (PDSERVE_CPU_AMX_LOSSLESS, default on; ``0`` keeps the plain bf16 tiles: kernels/bf16_codec.py)."""
    return _switched_on("PDSERVE_CPU_AMX_LOSSLESS")


def cpu_decode_attention() -> str:
    """PDSERVE_CPU_DECODE_ATTENTION: ``paged`` (default: the C++ kernel reading K/V blocks in place,
    kernels/paged_decode_cpu.py) or ``torch`` (padded gathers and GEMMs, kernels/torch_ref.py)."""
    value = os.environ.get("PDSERVE_CPU_DECODE_ATTENTION", "paged").strip().lower() or "paged"
    if value not in ("paged", "torch"):
        raise ValueError(f"PDSERVE_CPU_DECODE_ATTENTION must be 'paged' or 'torch', not {value!r}")
    return value


def cpu_prefill_attention() -> str:
    """PDSERVE_CPU_PREFILL_ATTENTION: ``paged`` (default: the bf16 C++ kernel reading K/V blocks in place,
    kernels/paged_prefill_cpu.py, where the CPU has AVX512-BF16) or ``torch`` (SDPA per sequence, kernels/torch_ref.py)."""
    value = os.environ.get("PDSERVE_CPU_PREFILL_ATTENTION", "paged").strip().lower() or "paged"
    if value not in ("paged", "torch"):
        raise ValueError(f"PDSERVE_CPU_PREFILL_ATTENTION must be 'paged' or 'torch', not {value!r}")
    return value


def cpu_fused_elementwise() -> bool:
    """Whether RMSNorm, RoPE and SiLU * up on CPU run the fused C++ ops (PDSERVE_CPU_FUSED_ELEMENTWISE, default on;
    ``0`` runs the eager torch ops: kernels/fused_cpu.py for bf16, kernels/fused_f32_cpu.py for float32)."""
    return _switched_on("PDSERVE_CPU_FUSED_ELEMENTWISE")


def cpu_greedy_head() -> bool:
    """Whether plain greedy rows of a bf16 AMX LM head take their tokens from the int8 screen and the blocks it keeps
    (PDSERVE_CPU_GREEDY_HEAD, default on; ``0`` computes every logit: kernels/greedy_head_cpu.py)."""
    return _switched_on("PDSERVE_CPU_GREEDY_HEAD")


def cpu_layer_stack() -> bool:
    """Whether a bf16 CPU step of at most 32 tokens, or a float32 CPU decode step, runs its decoder layers as one C++
    call (PDSERVE_CPU_LAYER_STACK, default on; ``0`` calls the modules: kernels/layer_stack_cpu.py,
    kernels/layer_stack_f32_cpu.py)."""
    return _switched_on("PDSERVE_CPU_LAYER_STACK")


def linear_method() -> str | None:
    """PDSERVE_LINEAR_METHOD: the quantized linear method every quantized weight must use (``dequant``, ``f32_cpu``,
    ``int4_cpu``, ``int8_cpu``; kernels/linear_*.py); unset: the registry picks per weight, device and dtype."""
    return os.environ.get("PDSERVE_LINEAR_METHOD") or None
