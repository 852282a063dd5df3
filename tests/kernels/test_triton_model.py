"""A tiny random Qwen3 (GQA, q/k norm) through the Triton backend (CPU interpreter) vs Hugging Face, mixed batch."""

from __future__ import annotations

import torch
import transformers

from pdserve.kernels import select_backend
from pdserve.runtime.model_loader import build_model
from tests.kernels.paged_batch import run_model_steps


def test_tiny_model_on_triton_matches_hf(tmp_path):
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128, tie_word_embeddings=True)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    hf.save_pretrained(tmp_path)
    model = build_model(tmp_path, transformers.AutoConfig.from_pretrained(tmp_path), torch.device("cpu"),
                        torch.float32, select_backend("triton", "cpu"), 128)

    seqs = {0: torch.randint(0, 64, (21,)), 1: torch.randint(0, 64, (6,))}
    # a chunk over cached context next to a decode
    rows = run_model_steps(model, seqs, [{0: 12, 1: 5}, {1: 1, 0: 9}], num_blocks=8, block_size=16, seed=4)
    for s, ids in seqs.items():
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        torch.testing.assert_close(torch.cat(rows[s]), ref, atol=1e-4, rtol=1e-4)
