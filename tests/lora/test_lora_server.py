"""The LoRA server surface through the official openai client: adapters in /v1/models, a request selects its adapter
by ``model`` (parity with transformers + PEFT), load/unload at run time, 404 for unknown adapters, 400 with the
reason for adapters that cannot be served (and the server keeps serving), the API key, the LoRA metrics."""

from __future__ import annotations

import functools
import json

import httpx
import openai
import pytest

from tests.support.lora import broken_adapters
from tests.support.server import launch_server

KEY = "lora-test-key"


@pytest.fixture(scope="module")
def server(adapter_dirs):
    spec = json.dumps({"name": "mlp16", "path": str(adapter_dirs["mlp16"]), "base_model_name": "my-base"})
    with launch_server("--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks", "256", "--enable-lora",
                       "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "2", "--api-key", KEY,
                       "--lora-modules", f"attn8={adapter_dirs['attn8']}", spec,
                       env={"PDSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from transformers import AutoTokenizer

    from tests.support.lora import base_model_path

    return AutoTokenizer.from_pretrained(str(base_model_path()))


def _text(_, ref) -> str:
    return _tokenizer().decode(ref, skip_special_tokens=True)


def _complete(client, model, prompt_ids):
    out = client.completions.create(model=model, prompt=prompt_ids, max_tokens=12, temperature=0)
    return out.choices[0].text


def test_models_list_adapters_with_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert models["attn8"].parent == next(m.id for m in models.values() if m.parent is None)
    assert models["mlp16"].parent == "my-base"
    assert models["mlp16"].root.endswith("mlp16")


def test_adapter_selected_by_model_matches_peft(client, prompt_ids, hf_refs):
    base = next(m.id for m in client.models.list().data if m.parent is None)
    for name in (None, "attn8", "mlp16"):
        got = _complete(client, base if name is None else name, prompt_ids[0])
        assert got == _text(None, hf_refs[name][0]), name


def test_unknown_adapter_is_404(client, prompt_ids):
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "no-such-adapter", prompt_ids[0])
    assert e.value.status_code == 404 and "does not exist" in str(e.value)


def test_load_use_unload_at_run_time(client, server, adapter_dirs, prompt_ids, hf_refs, tmp_path):
    client.post("/load_lora_adapter", body={"lora_name": "late", "lora_path": str(adapter_dirs["mlp16"])},
                cast_to=httpx.Response)
    assert "late" in {m.id for m in client.models.list().data}
    assert _complete(client, "late", prompt_ids[0]) == _text(None, hf_refs["mlp16"][0])
    with pytest.raises(openai.BadRequestError, match="already been loaded"):
        client.post("/load_lora_adapter", body={"lora_name": "late", "lora_path": str(adapter_dirs["attn8"])},
                    cast_to=httpx.Response)
    for kind, (path, phrase) in broken_adapters(adapter_dirs["attn8"], tmp_path).items():
        with pytest.raises(openai.BadRequestError, match=phrase):
            client.post("/load_lora_adapter", body={"lora_name": f"bad-{kind}", "lora_path": str(path)},
                        cast_to=httpx.Response)
    client.post("/unload_lora_adapter", body={"lora_name": "late"}, cast_to=httpx.Response)
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late", prompt_ids[0])
    with pytest.raises(openai.NotFoundError):
        client.post("/unload_lora_adapter", body={"lora_name": "late"}, cast_to=httpx.Response)
    # still serving, and the refused adapters never became models
    assert not {m.id for m in client.models.list().data} & {f"bad-{k}" for k in ("pickle", "shapes", "rank")}
    assert _complete(client, "attn8", prompt_ids[0]) == _text(None, hf_refs["attn8"][0])


def test_management_routes_need_the_api_key(server, adapter_dirs):
    r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=30,
                   json={"lora_name": "sneaky", "lora_path": str(adapter_dirs["attn8"])})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_lora_metrics(client, server, prompt_ids):
    from pdserve.router.plugins.lora_affinity import parse_lora_info

    stream = client.completions.create(model="attn8", prompt=prompt_ids[1], max_tokens=60, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))      # running now: the router's scrape sees the adapter resident
        info = parse_lora_info(httpx.get(server.url + "/metrics", timeout=30).text)
    finally:
        stream.close()
    assert info["lora_running"] == {"attn8"} and info["max_loras"] == 2
    # every registered adapter with its weight digest (the router keys prefix hashes with it)
    assert set(info["lora_digests"]) >= {"attn8", "mlp16"}
    assert len({info["lora_digests"][n] for n in ("attn8", "mlp16")}) == 2
    assert all(len(d) == 64 and int(d, 16) >= 0 for d in info["lora_digests"].values())
    assert info["base_model"] == next(m.id for m in client.models.list().data if m.parent is None)
    _complete(client, "attn8", prompt_ids[1])
    text = httpx.get(server.url + "/metrics", timeout=30).text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0], info
    assert 'running_lora_adapters=""' in info[0]   # idle now
    counts = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("pdserve:lora_requests_total{")}
    assert any('lora_name="attn8"' in k and v >= 2 for k, v in counts.items()), counts
