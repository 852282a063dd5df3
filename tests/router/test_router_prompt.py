"""The router's fast prompt tokenization equals the tokenizer's own (chat template + encode), and its memoized block
hashes equal the shared ``hash_token_blocks``."""

from __future__ import annotations

import pytest

from pdserve.router.prompt import block_hashes, estimate_tokens
from pdserve.runtime.block_hash import hash_token_blocks

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse. " * 60}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "ünïcödé 🍵"}],
    [{"role": "user", "content": "text with <|im_start|> and <|im_end|> inside\n\n  spaces  "}],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}],
]


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("agp", [True, False])
def test_chat_tokens_equal_apply_chat_template(tokenizer, conv, agp):
    plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
              else "".join(p["text"] for p in m["content"])} for m in conv]
    ref = tokenizer.tok.apply_chat_template(plain, add_generation_prompt=agp, tokenize=True, return_dict=False)
    body = {"messages": conv, "add_generation_prompt": agp}
    assert tokenizer.token_ids("/v1/chat/completions", body) == list(ref)
    assert tokenizer.token_ids("/v1/chat/completions", body) == list(ref)  # again, from the piece cache


@pytest.mark.parametrize("prompt", ["Hello world", "x" * 3000, "<|endoftext|>tail", " leading space"])
def test_completion_tokens_equal_encode(tokenizer, prompt):
    ref = tokenizer.tok.encode(prompt, add_special_tokens=False)
    assert tokenizer.token_ids("/v1/completions", {"prompt": prompt}) == ref
    assert tokenizer.token_ids("/v1/completions", {"prompt": [prompt]}) == ref


def test_token_id_prompts_and_unusable_bodies(tokenizer):
    assert tokenizer.token_ids("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tokenizer.token_ids("/v1/completions", {"prompt": [[5, 6]]}) == [5, 6]
    assert tokenizer.token_ids("/v1/completions", {"prompt": ""}) is None
    assert tokenizer.token_ids("/v1/completions", {"prompt": ["a", "b"]}) is None
    assert tokenizer.token_ids("/v1/chat/completions", {"messages": "nope"}) is None
    assert estimate_tokens({"prompt": "x" * 400}) == 100
    assert estimate_tokens({"messages": [{"role": "user", "content": "y" * 80}]}) == 20


def test_memoized_block_hashes_equal_the_shared_module():
    ids = list(range(1000, 1100))
    for salt in (None, "tenant-a"):
        assert block_hashes(ids, 16, salt) == hash_token_blocks(ids, 16, salt)
        assert block_hashes(ids, 16, salt) == hash_token_blocks(ids, 16, salt)  # from the memo
    assert block_hashes(ids[:90], 16, None) == hash_token_blocks(ids, 16)[:5]


def test_piece_cache_stays_under_its_byte_bound(tokenizer):
    """Distinct long prompts (each piece ~1/20 of the bound) must not pile up: the memory the cache really holds,
    measured with tracemalloc, stays within the bound (the old cache kept 4,096 entries of any size)."""
    import gc
    import random
    import tracemalloc

    from pdserve.router.prompt import PromptTokenizer

    bound = 8 * 1024 * 1024
    tok = PromptTokenizer(tokenizer.path, cache_bytes=bound)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "tea", "dragon", "mountain", "village", "quiet", "loves"]
    prompts = [" ".join(rng.choice(words) for _ in range(20_000)) for _ in range(40)]  # ~110 KB, ~20k tokens each
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i, p in enumerate(prompts):
            assert tok.token_ids("/v1/completions", {"prompt": p}) == tok.fast.encode(p, add_special_tokens=False).ids
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - base
            assert held < bound * 1.25, f"after {i + 1} prompts the cache holds {held / 2**20:.1f} MiB"
        assert tok._pieces.nbytes <= bound and len(tok._pieces) >= 1
        # a piece larger than an eighth of the bound is never kept
        tok.token_ids("/v1/completions", {"prompt": " ".join(prompts[:12])})
        assert tok._pieces.nbytes <= bound
    finally:
        tracemalloc.stop()


def test_text_beyond_any_context_window_is_not_tokenized(tokenizer):
    """A 10 MB prompt used to cost the router seconds of tokenizing (and, holding the GIL, stalled its event loop); a
    prompt longer than ``max_chars`` is estimated instead (the pod will refuse it anyway)."""
    huge = "The quick brown fox jumps over the lazy dog. " * 50_000  # 2.25 MB
    assert tokenizer.token_ids("/v1/completions", {"prompt": huge}) is None
    assert tokenizer.token_ids("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}) is None
    assert estimate_tokens({"prompt": huge}) > 500_000
    # just below the cap: tokenized exactly, long pieces with the GIL released (encode_batch), same ids
    text = huge[:100_000]
    assert tokenizer.token_ids("/v1/completions", {"prompt": text}) == tokenizer.fast.encode(
        text, add_special_tokens=False).ids
