"""Session fixtures: the test adapters (tests/support/lora.py) and their transformers + PEFT greedy references."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.lora import ADAPTERS, PROMPTS, base_model_path, hf_greedy, make_adapter


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
    """Greedy references per adapter name (None = the base model)."""
    from transformers import AutoConfig

    eos = AutoConfig.from_pretrained(str(base_model_path())).eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    return {name: hf_greedy(None if name is None else adapter_dirs[name], prompt_ids, eos)
            for name in [None, *ADAPTERS]}
