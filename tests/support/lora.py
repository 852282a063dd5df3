"""Real PEFT adapters on the default model, built once per test session, and their transformers + PEFT references.

Two adapters with different ranks and target-module sets; lora_B is randomly initialised (PEFT starts it at zero,
which would make an adapter equal to the base model) so every adapter really changes the greedy output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
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


def make_adapter(out: Path, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int,
                 b_std: float = 0.05) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(str(base_model_path()), dtype=torch.float32)
    peft_model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                               lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out


def hf_greedy(adapter_dir: Path | None, prompts: list[list[int]], eos: int, max_new: int = MAX_NEW) -> list[list[int]]:
    """transformers (+ PEFT when ``adapter_dir``) greedy continuations, one generate call per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_model_path()), dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            refs.append(out[0, len(ids):].tolist())
    return refs
