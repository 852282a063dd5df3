"""Our Llama-family model vs Hugging Face transformers on tiny random checkpoints, one per architecture.

Each checkpoint is written as safetensors by HF itself, loaded by our loader, and run over a paged KV cache with permuted
block ids: once as a single whole-prompt prefill, once as a multi-step mixed batch (prefill chunks on top of cached
context + decodes in the same step). Every new token's logits must equal HF's full-sequence forward at that position.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.kernels import select_backend
from pdserve.runtime.model_loader import build_model
from tests.kernels.paged_batch import run_model_steps

BLOCK = 16
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

FAMILIES = {
    "llama3": (transformers.LlamaConfig, dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-linear": (transformers.LlamaConfig, dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, attention_bias=True,
        num_key_value_heads=1)),
    # dynamic NTK equals plain RoPE within max_position_embeddings, in HF and here (max_model_len = 256)
    "llama-dynamic": (transformers.LlamaConfig, dict(
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, head_dim=16)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=True)),
}
ARCH = {"llama3": "LlamaForCausalLM", "llama-linear": "LlamaForCausalLM", "llama-dynamic": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _save_tiny(family: str, path) -> transformers.PreTrainedModel:
    config_cls, extra = FAMILIES[family]
    config = config_cls(**{**TINY, **extra})
    config.architectures = [ARCH[family]]
    torch.manual_seed(0)
    hf = getattr(transformers, ARCH[family])(config).float().eval()
    with torch.no_grad():  # HF zero-inits biases and one-inits norms: randomize all so every weight matters
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _save_tiny(request.param, path)
    config = transformers.AutoConfig.from_pretrained(path)
    ours = build_model(path, config, torch.device("cpu"), torch.float32, select_backend("torch", "cpu"), 256)
    return hf, ours


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def _run_steps(model, seqs: dict[int, torch.Tensor], schedule: list[dict[int, int]]) -> dict[int, list[torch.Tensor]]:
    return run_model_steps(model, seqs, schedule, num_blocks=64, block_size=BLOCK, seed=1)


def test_tied_embeddings_and_biases_follow_config(pair):
    hf, ours = pair
    assert (ours.lm_head is None) == bool(hf.config.tie_word_embeddings)
    assert ours.num_layers == 2 and ours.num_kv_heads == hf.config.num_key_value_heads


def test_single_prefill_matches_hf(pair):
    hf, ours = pair
    ids = torch.randint(0, TINY["vocab_size"], (45,), generator=torch.Generator().manual_seed(2))
    got = torch.cat(_run_steps(ours, {0: ids}, [{0: 45}])[0])
    torch.testing.assert_close(got, _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_mixed_chunked_prefill_and_decode_match_hf(pair):
    hf, ours = pair
    gen = torch.Generator().manual_seed(3)
    seqs = {s: torch.randint(0, TINY["vocab_size"], (n,), generator=gen) for s, n in [(0, 40), (1, 9), (2, 37)]}
    schedule = [
        {0: 20, 1: 7},            # two prefills (seq 0 chunked)
        {1: 1, 0: 13, 2: 33},     # a decode, a chunk over cached context, a fresh prefill
        {0: 7, 1: 1, 2: 1},       # a last chunk crossing block boundaries, two decodes
        {2: 1}, {2: 1}, {2: 1},   # decodes alone (the batched decode path)
    ]
    rows = _run_steps(ours, seqs, schedule)
    for s, ids in seqs.items():
        torch.testing.assert_close(torch.cat(rows[s]), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_sliding_window_beyond_max_model_len_is_refused(tmp_path):
    config = transformers.MistralConfig(**{**TINY, "sliding_window": 64})
    config.architectures = ["MistralForCausalLM"]
    from pdserve.runtime.models.llama import LlamaArgs

    with pytest.raises(ValueError, match="sliding-window"):
        LlamaArgs.from_hf(config, max_model_len=128)
    assert LlamaArgs.from_hf(config, max_model_len=64).num_layers == 2


@pytest.mark.parametrize("family", ["llama3", "llama-linear", "llama-dynamic"])
def test_rope_frequencies_match_hf(family):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pdserve.runtime.models.llama import LlamaArgs, rope_inv_freq

    config_cls, extra = FAMILIES[family]
    config = config_cls(**{**TINY, **extra})
    rope_type = config.rope_parameters["rope_type"]
    # 512 > max_position_embeddings: dynamic NTK is fixed at max_model_len (HF's value at that length)
    want, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=512)
    assert scaling == 1.0
    torch.testing.assert_close(rope_inv_freq(LlamaArgs.from_hf(config, 512), 512), want)


def test_incomplete_or_foreign_checkpoints_are_refused(tmp_path):
    from safetensors.torch import load_file

    from pdserve.runtime.models.llama import LlamaForCausalLM

    _save_tiny("qwen2", tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    backend = select_backend("torch", "cpu")
    for broken, error in [({k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}, "missing weights"),
                          ({**weights, "model.layers.0.extra.weight": torch.zeros(1)}, "unexpected weight"),
                          ({**weights, "model.norm.weight": torch.zeros(3)}, "has shape")]:
        with torch.device("meta"):
            model = LlamaForCausalLM(config, backend)
        with pytest.raises(ValueError, match=error):
            model.load_weights(broken.items(), torch.device("cpu"), torch.float32)
