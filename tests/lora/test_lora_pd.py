"""Prefill -> decode with LoRA adapters through each real connector, in one process: the handoff carries the adapter's
identity (signed), decode with the same adapter equals the monolithic output and really loads the blocks, and a
decode running other weights (another adapter, or the base model) refuses the transfer (counted as
``kv_params_rejected{reason=lora_mismatch}``) and computes the prompt itself; a decode without the adapter refuses the
request (the server's 404)."""

from __future__ import annotations

import time

import pytest

from pdserve.runtime.llm import LLM
from pdserve.runtime.lora_manager import LoRANotFound
from pdserve.runtime.sampling_params import SamplingParams
from tests.support.redis import redis_server
from tests.support.stepping import step_until_finished

MAX_TOKENS = 8
# 48 tokens: block-aligned, so the decode loads every block, the last one (holding the final token) too.
TEXT = ("The history of the printing press begins in the fifteenth century in Mainz, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a screw press adapted from wine making.\nQ: Why is the sky blue?\nA:")
REJECTED = "kv_params_rejected{reason=lora_mismatch}"


def _run(engine, reqs, timeout=300.0):
    """reqs: [(id, token ids, max_tokens, kv_transfer_params, lora_name)] -> {id: RequestOutput}."""
    for rid, toks, n, params, lora in reqs:
        engine.add_request(rid, toks, SamplingParams(max_tokens=n, temperature=0.0), kv_transfer_params=params,
                           lora_name=lora)
    return step_until_finished(engine, len(reqs), timeout)


def _engine(adapter_dirs, name, cfg, role, extra=()):
    llm = LLM(dtype="float32", max_model_len=512, num_gpu_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=16,
              kv_connector=name, kv_role=role, kv_connector_config=cfg)
    for lora in ("attn8", "mlp16", *extra):
        llm.engine.add_lora(lora, str(adapter_dirs["attn8" if lora == "prefill-only" else lora]))
    return llm


@pytest.fixture(scope="module", params=["disk", "redis", "nixl"])
def pair(request, adapter_dirs, tmp_path_factory):
    def make(cfg):
        return (_engine(adapter_dirs, request.param, cfg, "prefill", ["prefill-only"]),
                _engine(adapter_dirs, request.param, cfg, "decode"))

    if request.param == "redis":
        with redis_server(password="pd-secret") as r:
            engines = make({"url": r.url, "socket_timeout_s": 1, "connect_timeout_s": 0.5})
            yield engines
    else:
        cfg = {"path": str(tmp_path_factory.mktemp("kvdisk"))} if request.param == "disk" else \
            {"token": "pd-secret", "handshake_timeout_s": 2, "load_timeout_s": 10}
        engines = make(cfg)
        yield engines
    for llm in engines:
        llm.shutdown()


def test_pd_with_adapters(pair, request):
    prefill, decode = pair
    tag = request.node.callspec.id
    prompt = prefill.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(prompt) % 16 == 0
    num_blocks = len(prompt) // 16                                             # every full block, the last one too
    assert num_blocks >= 2

    def handoff(rid):
        out = _run(prefill.engine, [(rid, prompt, 1, {"do_remote_decode": True}, "attn8")])[rid]
        params = out.kv_transfer_params
        assert params["lora_name"] == "attn8" and params["lora_digest"] == prefill.engine.lora.cpu["attn8"].digest
        return params

    conn = decode.engine.connector
    params = handoff(f"h1-{tag}")
    loaded = conn.metrics()["kv_blocks_loaded"]
    same = _run(decode.engine, [(f"d1-{tag}", prompt, MAX_TOKENS, params, "attn8")])[f"d1-{tag}"]
    assert conn.metrics()["kv_blocks_loaded"] - loaded == num_blocks          # the KV really came over

    outs = {"attn8": same}
    for lora in ("mlp16", None):                                                # other weights: refused, recomputed
        params = handoff(f"h-{lora}-{tag}")
        before, loaded = conn.metrics()[REJECTED], conn.metrics()["kv_blocks_loaded"]
        rid = f"d-{lora}-{tag}"
        outs[lora] = _run(decode.engine, [(rid, prompt, MAX_TOKENS, params, lora)])[rid]
        assert conn.metrics()[REJECTED] == before + 1
        assert conn.metrics()["kv_blocks_loaded"] == loaded

    # The monolithic references, computed last so that no store holds the other adapters' blocks before.
    mono = _run(prefill.engine, [(f"mono-{lora}-{tag}", prompt, MAX_TOKENS, None, lora)
                                 for lora in ("attn8", "mlp16", None)])
    expected = {lora: mono[f"mono-{lora}-{tag}"].outputs[0].token_ids for lora in ("attn8", "mlp16", None)}
    assert len({tuple(v) for v in expected.values()}) == 3

    for lora, out in outs.items():
        assert out.error is None and out.outputs[0].token_ids == expected[lora], lora

    with pytest.raises(LoRANotFound):                                          # the decode pod lacks the adapter
        decode.engine.add_request(f"d-missing-{tag}", prompt, SamplingParams(max_tokens=2),
                                  kv_transfer_params=params, lora_name="prefill-only")
