"""Real PEFT adapters on the default model, built once per test session, and their transformers + PEFT references.

Two adapters with different ranks and target-module sets; lora_B is randomly initialised (PEFT starts it at zero,
which would make an adapter equal to the base model) so every adapter really changes the greedy output.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

ADAPTERS = {  # name -> (rank, alpha, target modules, use_rslora)
    "attn8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "mlp16": (16, 8, ["gate_proj", "up_proj", "down_proj", "q_proj"], True),
}
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):\n", "Q: Why is the sky blue?\nA:"]
MAX_NEW = 12


def base_model_path() -> Path:
    from pdserve.runtime.model_loader import resolve_model_path

    return resolve_model_path(None)


@functools.lru_cache(maxsize=1)
def hf_base_model():
    """The default model in transformers, float32, loaded once per process (adapters are added and removed again)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base_model_path()), dtype=torch.float32).eval()


def make_adapter(out: Path, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int,
                 b_std: float = 0.15) -> Path:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(hf_base_model(), LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                               lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    peft_model.unload()  # the shared base model gets its plain projections back
    return out


def hf_greedy(adapter_dir: Path | None, prompts: list[list[int]], eos: int, max_new: int = MAX_NEW) -> list[list[int]]:
    """transformers (+ PEFT when ``adapter_dir``) greedy continuations, one generate call per prompt."""
    model = hf_base_model()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    refs = []
    try:
        with torch.inference_mode():
            for ids in prompts:
                out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
                refs.append(out[0, len(ids):].tolist())
    finally:
        if adapter_dir is not None:
            model.unload()
    return refs


def broken_adapters(good: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Adapters that must be refused, each with a phrase of the reason, derived from the good adapter ``good``."""
    import shutil

    from safetensors.torch import load_file, save_file

    out: dict[str, tuple[Path, str]] = {}

    def variant(name: str, tensors: dict | None = None, config: dict | None = None) -> Path:
        d = root / name
        shutil.copytree(good, d)
        if tensors is not None:
            save_file(tensors, str(d / "adapter_model.safetensors"))
        if config is not None:
            import json

            cfg = json.loads((d / "adapter_config.json").read_text())
            (d / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
        return d

    weights = load_file(str(good / "adapter_model.safetensors"))
    pickle = variant("pickle")
    (pickle / "adapter_model.safetensors").unlink()
    (pickle / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    out["pickle"] = (pickle, "pickled")
    out["shapes"] = (variant("shapes", {k: (v[:, :100].contiguous() if "lora_A" in k else v) for k, v in weights.items()}),
                     "another base model")
    out["rank"] = (variant("rank", {k: torch.cat([v] * 4, dim=0 if "lora_A" in k else 1) for k, v in weights.items()},
                           {"r": 32}), "max-lora-rank")
    corrupt = variant("corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"garbage" * 10)
    out["corrupt"] = (corrupt, "corrupt")
    key = next(iter(weights))
    out["lm_head"] = (variant("lm_head", {**weights, "base_model.model.lm_head.lora_A.weight": weights[key].clone()}),
                      "unsupported")
    missing = variant("missing")
    (missing / "adapter_config.json").unlink()
    out["missing"] = (missing, "adapter_config.json")
    out["dora"] = (variant("dora", config={"use_dora": True}), "DoRA")
    return out
