"""Model registry: Hugging Face ``architectures[0]`` -> our model class. A new family is one file plus one line here."""

from __future__ import annotations

from typing import Any

from pdserve.runtime.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def get_model_class(hf_config: Any) -> type:
    """The class implementing ``hf_config.architectures[0]``; raises ValueError naming the supported ones."""
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    if not archs and getattr(hf_config, "model_type", None) in _BY_MODEL_TYPE:  # e.g. configs written from a GGUF
        return MODEL_REGISTRY[_BY_MODEL_TYPE[hf_config.model_type]]
    raise ValueError(f"unsupported model architecture {archs or '(none in config.json)'}; "
                     f"supported: {sorted(MODEL_REGISTRY)}")
