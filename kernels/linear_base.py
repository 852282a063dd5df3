"""Quantized linear layers: the weight representation every format is read into, the method contract, the registry.

A checkpoint format (GGUF blocks, compressed-tensors, a float checkpoint quantized at load) is decoded ONCE into a
:class:`QuantizedWeight`, a format-neutral affine group-wise code::

    w[n, k] = scale[n, k // group_size] * q[n, k] + zero[n, k // group_size]      (zero = 0 when None)

with integer codes ``q`` one per element (not yet packed), so that the loader can fuse shards (q/k/v, gate/up) by
concatenating rows and undo GGUF's q/k row permutation before any kernel-specific packing. A :class:`LinearMethod`
then turns it into an ``nn.Module`` computing ``x @ w.T (+ bias)`` with its own packed layout: one file per method
(``linear_dequant.py``, ``linear_f32_cpu.py``, ``linear_int4_cpu.py``, ``linear_int8_cpu.py``), registered by name like
the attention backends. A GPU kernel
(torch's CUDA int4, a Marlin-style kernel) is one more file plus one registration line.

Every module a method returns has ``weight_bytes()``: what its tensors really occupy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class QuantizedWeight:
    """An (N, K) weight as integer codes plus per-(row, group) float32 scale and zero; see the module docstring."""

    q: torch.Tensor            # (N, K) integer codes (uint8 for unsigned formats, int8 for signed)
    scale: torch.Tensor        # (N, K // group_size) float32
    zero: torch.Tensor | None  # (N, K // group_size) float32, additive after scaling; None = symmetric
    group_size: int            # K for per-channel
    bits: int                  # 4 or 8: the range of q ([0, 15] or [-8, 7] for 4; [-128, 127] for 8)
    fmt: str                   # human name of the source format, for error messages ("GGUF Q4_1", ...)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight (N, K) this code stands for, computed in float32 as ``scale * q + zero``."""
        n, k = self.q.shape
        w = self.q.float().view(n, k // self.group_size, self.group_size) * self.scale[..., None]
        if self.zero is not None:
            w = w + self.zero[..., None]
        return w.view(n, k).to(dtype)

    def rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """The weight restricted to rows ``index`` (a row permutation or selection)."""
        return QuantizedWeight(self.q[index], self.scale[index], None if self.zero is None else self.zero[index],
                               self.group_size, self.bits, self.fmt)

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Row-wise concatenation (fused q/k/v, gate/up); parts must share group size, bits and zero presence."""
        first = parts[0]
        if any(p.group_size != first.group_size or p.bits != first.bits or (p.zero is None) != (first.zero is None)
               or p.q.dtype != first.q.dtype for p in parts):
            raise ValueError(f"cannot fuse shards with different quantization: {[p.fmt for p in parts]}")
        zero = None if first.zero is None else torch.cat([p.zero for p in parts])
        return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), zero,
                               first.group_size, first.bits, first.fmt)


class QuantLinearModule(nn.Module):
    """What a :class:`LinearMethod` returns: ``forward(x (..., K)) -> (..., N)`` in x's dtype."""

    in_features: int
    out_features: int

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in list(self.parameters()) + list(self.buffers()))


class KernelLinear(QuantLinearModule):
    """A linear over a kernel that takes 2-D activations in one dtype (``self.dtype``) and returns that dtype:
    flattens the leading dimensions, casts in and out, adds the bias (stored in ``self.dtype``)."""

    dtype: torch.dtype
    bias: torch.Tensor | None

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """(T, K) contiguous activations in ``self.dtype`` -> (T, N)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (..., K) -> (..., N)
        lead = x.shape[:-1]
        y = self.matmul(x.reshape(-1, self.in_features).to(self.dtype).contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*lead, self.out_features)


class LinearMethod(ABC):
    """Builds the layer for one weight. ``dtype`` is the activation (compute) dtype; the method may refuse it."""

    name: str = "base"
    priority: int = 100  # automatic selection tries methods by (priority, name)

    @abstractmethod
    def supports(self, weight: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when this method can run ``weight`` on ``device`` with ``dtype`` activations, else the reason it
        cannot (shown to the user when no method can)."""

    @abstractmethod
    def create(self, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
               dtype: torch.dtype) -> QuantLinearModule:
        ...


class DeviceLinearMethod(LinearMethod):
    """A method for one device type: ``supports`` checks the device, then :meth:`check` the weight; ``create`` builds
    :meth:`module_class` of the weight."""

    device_type: str = "cpu"

    @abstractmethod
    def check(self, weight: QuantizedWeight) -> str | None:
        """None when the weight fits this method's kernel, else why not."""

    @abstractmethod
    def module_class(self, weight: QuantizedWeight) -> type[QuantLinearModule]:
        ...

    def supports(self, weight: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != self.device_type:
            return f"runs on {self.device_type.upper()} only"
        return self.check(weight)

    def create(self, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
               dtype: torch.dtype) -> QuantLinearModule:
        return self.module_class(weight)(weight, bias, device, dtype)


_REGISTRY: dict[str, Callable[[], LinearMethod]] = {}


def register_linear_method(name: str) -> Callable:
    """Class decorator: ``@register_linear_method("int4_cpu")`` makes a quantized linear method selectable by name."""

    def deco(factory: Callable[[], LinearMethod]) -> Callable[[], LinearMethod]:
        _REGISTRY[name] = factory
        return factory

    return deco


def available_linear_methods() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def create_linear_method(name: str) -> LinearMethod:
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown quantized linear method {name!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def quantized_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
                     dtype: torch.dtype, name: str) -> QuantLinearModule:
    """The first registered method (by priority, then name) that runs ``weight`` on ``device``: on CPU, ``f32_cpu``
    for float32 activations (fused float32 kernel; ``dequant``, exact by construction, where it cannot build),
    ``int4_cpu`` / ``int8_cpu`` for bfloat16. ``PDSERVE_LINEAR_METHOD`` names one method to use instead (an error
    when it cannot run the weight).

    ``name`` names the tensor in the error raised when no method can run it."""
    from pdserve.runtime import envs

    _load_builtin()
    forced = envs.linear_method()
    if forced is not None:
        candidates = [(forced, create_linear_method(forced))]
    else:
        candidates = sorted(((n, f()) for n, f in _REGISTRY.items()), key=lambda nm: (nm[1].priority, nm[0]))
    reasons = []
    for method_name, method in candidates:
        reason = method.supports(weight, device, dtype)
        if reason is None:
            return method.create(weight, bias, device, dtype)
        reasons.append(f"{method_name}: {reason}")
    raise ValueError(f"tensor {name!r} ({weight.fmt}, {weight.bits}-bit, group size {weight.group_size}, shape "
                     f"{weight.shape}) has no quantized linear kernel on {device.type}: {'; '.join(reasons)}")


def _load_builtin() -> None:
    import importlib

    for mod in ("linear_dequant", "linear_f32_cpu", "linear_int4_cpu", "linear_int8_cpu"):
        try:
            importlib.import_module(f"pdserve.kernels.{mod}")
        except ImportError:
            pass
