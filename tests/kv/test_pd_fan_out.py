"""``n > 1`` through prefill -> decode over real NIXL agents (two engines in one process): one copy of the prompt's KV
moves once. The prefill engine hands the prompt off under one lease (not one per child), the decode engine loads it
once (child 0) and its siblings hit the local prefix cache, so nothing expires, nothing is recomputed, the prefill's
lease is released as soon as the decode read ends, and the n outputs (greedy and seeded) equal the monolithic
engine's."""

from __future__ import annotations

import time

import pytest

from pdserve.runtime.llm import LLM
from pdserve.runtime.sampling_params import SamplingParams
from tests.support.stepping import step_until_finished

pytestmark = pytest.mark.slow

N, MAX_TOKENS, BLOCKS, DTYPE = 4, 4, 64, "float32"   # float32: exact tokens across differently batched runs
CFG = {"token": "pd-secret", "handshake_timeout_s": 2, "load_timeout_s": 10}
PROMPTS = {
    "greedy": "Once upon a time in a small village by the sea, there lived an old fisherman who told stories about "
              "the storms he had seen and the strange lights that danced over the water at night.",
    "seeded": "Shopping list: apples, bananas, carrots, dates, eggs, flour, grapes, honey, ice cream, jam, kale, "
              "lemons, mangoes, nuts, oranges, pears, quinoa, rice, spinach, tomatoes.",
}
PARAMS = {"greedy": SamplingParams(n=N, max_tokens=MAX_TOKENS, temperature=0.0),
          "seeded": SamplingParams(n=N, max_tokens=MAX_TOKENS, temperature=0.8, seed=1234)}


def _run(engine, reqs):
    for rid, toks, params, kv in reqs:
        engine.add_request(rid, toks, params, kv_transfer_params=kv)
    return step_until_finished(engine, len(reqs), 300.0)


def _texts(out):
    assert out.error is None and [c.index for c in out.outputs] == list(range(len(out.outputs)))
    return [c.token_ids for c in out.outputs]


@pytest.fixture(scope="module")
def engines():
    mono = LLM(num_gpu_blocks=BLOCKS, dtype=DTYPE)
    toks = {k: mono.tokenizer.encode(v, add_special_tokens=False) for k, v in PROMPTS.items()}
    expected = {k: _texts(o) for k, o in _run(mono.engine, [(k, toks[k], PARAMS[k], None) for k in toks]).items()}
    mono.shutdown()
    prefill = LLM(num_gpu_blocks=BLOCKS, dtype=DTYPE, kv_connector="nixl", kv_role="prefill", kv_connector_config=CFG)
    decode = LLM(num_gpu_blocks=BLOCKS, dtype=DTYPE, kv_connector="nixl", kv_role="decode", kv_connector_config=CFG)
    yield prefill.engine, decode.engine, toks, expected
    prefill.shutdown()
    decode.shutdown()


def test_n_children_share_one_handoff_and_one_load(engines):
    prefill, decode, toks, expected = engines
    assert len(set(map(tuple, expected["greedy"]))) == 1
    assert len(set(map(tuple, expected["seeded"]))) > 1        # the seeded children really sample differently
    # Prefill: a handoff request asking for n (a client or another router may send it) computes the prompt once.
    handoff = {"do_remote_decode": True, "do_remote_prefill": False}
    outs = _run(prefill, [(k, toks[k], SamplingParams(n=N, max_tokens=1, temperature=PARAMS[k].temperature,
                                                      seed=PARAMS[k].seed), handoff) for k in toks])
    params = {k: o.kv_transfer_params for k, o in outs.items()}
    assert all(p["do_remote_prefill"] and p["lease_id"] for p in params.values())
    assert prefill.connector.metrics()["kv_leases_active"] == len(toks)   # one lease per prompt, not n

    before, stats0 = decode.connector.metrics(), decode.get_stats()
    got = _run(decode, [(f"d-{k}", toks[k], PARAMS[k], params[k]) for k in toks])
    m, stats = decode.connector.metrics(), decode.get_stats()
    for k in toks:
        assert _texts(got[f"d-{k}"]) == expected[k], k
    assert m["kv_loads"] - before.get("kv_loads", 0) == len(toks)            # child 0 only; siblings hit the cache
    assert m["kv_blocks_loaded"] - before.get("kv_blocks_loaded", 0) == sum(len(t) // 16 for t in toks.values())
    # Each child computes only the prompt's tail: child 0 past its loaded full blocks (at least the last token), the
    # siblings past the last full block before the final token, as they waited for child 0's load and found it in the
    # prefix cache (computing the prompt themselves, or a failed read, would count more).
    tails = sum(len(t) - min(len(t) // 16 * 16, len(t) - 1) + (N - 1) * (len(t) - (len(t) - 1) // 16 * 16)
                for t in toks.values())
    assert stats.prompt_tokens - stats0.prompt_tokens == tails
    assert stats.kv_load_failures == stats0.kv_load_failures
    assert stats.recomputed_tokens == stats0.recomputed_tokens
    assert not any(k.startswith("kv_load_failures") and v != before.get(k, 0) for k, v in m.items()), m

    # The decode reader releases each lease when its one read ends: the prefill holds none well before expiry.
    deadline = time.monotonic() + 10
    while prefill.connector.metrics()["kv_leases_active"] and time.monotonic() < deadline:
        prefill.step()
        time.sleep(0.01)
    pm = prefill.connector.metrics()
    assert pm["kv_leases_active"] == 0 and pm["kv_leases_expired"] == 0
    assert not prefill.has_unfinished_requests()
