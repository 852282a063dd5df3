"""Session fixtures: the test adapters (tests/support/lora.py) and their transformers + PEFT greedy references."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from tests.support.lora import ADAPTERS, MAX_NEW, PROMPTS, base_model_path, hf_greedy, make_adapter


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(root / name, r, a, t, rs, seed=i + 1)
            for i, (name, (r, a, t, rs)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="session")
def prompt_ids() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_model_path()))
    return [tok.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="session")
def hf_refs(adapter_dirs, prompt_ids) -> dict[str | None, list[list[int]]]:
    """Greedy references per adapter name (None = the base model). Cached on disk under the pdserve cache dir, keyed by
    the adapters' and model's bytes, the library versions and the prompts, so only a machine's first run pays for
    transformers generation (as tests/runtime/test_engine_vs_hf.py does)."""
    import peft
    import transformers
    from transformers import AutoConfig

    from pdserve.runtime import envs

    eos = AutoConfig.from_pretrained(str(base_model_path())).eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    h = hashlib.sha256(json.dumps([transformers.__version__, peft.__version__, torch.__version__, prompt_ids, eos,
                                   MAX_NEW]).encode())
    for f in sorted(base_model_path().glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime}".encode())
    for name in ADAPTERS:
        h.update(name.encode() + (adapter_dirs[name] / "adapter_model.safetensors").read_bytes())
    cache = envs.cache_dir() / "test-refs" / f"peft-greedy-{h.hexdigest()[:24]}.json"
    if cache.is_file():
        refs = json.loads(cache.read_text())
        return {None if k == "" else k: v for k, v in refs.items()}
    refs = {name: hf_greedy(None if name is None else adapter_dirs[name], prompt_ids, eos) for name in [None, *ADAPTERS]}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"" if k is None else k: v for k, v in refs.items()}))
    tmp.replace(cache)
    return refs
