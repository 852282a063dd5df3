"""Attention backend selection: auto per device, explicit names, clear errors for what cannot run here."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pdserve.kernels import available_backends, select_backend

HAVE_CUDA_FLASH = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def test_auto_on_cpu_is_the_torch_reference():
    assert select_backend(None, "cpu").name == "torch"
    assert {"torch", "triton"} <= set(available_backends())


def test_explicit_names():
    assert select_backend("torch", "cpu").name == "torch"
    assert select_backend("triton", "cpu").name == "triton"  # the tests run Triton's interpreter (see conftest)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        select_backend("nope", "cpu")


def test_flash_unavailable_on_cpu_says_why():
    with pytest.raises(ValueError, match="needs a CUDA device and flash-attn"):
        select_backend("flash", "cpu")


def test_triton_without_interpreter_on_cpu_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("triton", "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_prefers_flash_then_triton():
    assert select_backend(None, "cuda", torch.bfloat16).name == ("flash" if HAVE_CUDA_FLASH else "triton")
    assert select_backend(None, "cuda", torch.float32).name == "triton"  # flash-attn has no float32 kernels
