"""Attention backend contract and registry.

KV cache layout (one tensor for the whole model, allocated once by the model runner):

    kv_cache: (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)    # 2 = (key, value)

Block-major on purpose: one block's KV for every layer is one contiguous byte range, so a KV connector moves a block
as a single region (a NIXL descriptor, a Redis value, a file) and a block id means the same thing everywhere.
A layer's view is ``kv_cache[:, layer]`` -> (num_blocks, 2, block_size, num_kv_heads, head_dim), strided; backends take
strides from the tensor and never assume contiguity across blocks.

A cache *slot* is ``block_id * block_size + offset``. One forward pass handles a flattened batch of T new tokens that
belong to S sequences; sequence s owns tokens ``query_start_loc[s]:query_start_loc[s+1]``, which sit at positions
``seq_lens[s] - q_len_s ... seq_lens[s] - 1`` of that sequence (a prefill chunk, a whole prompt, or one decode token).
Attention is causal over each sequence's whole context (cached blocks + the new tokens).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step batch description shared by every layer. All tensors live on the model's device."""

    slot_mapping: torch.Tensor     # (T,) int64: the cache slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # (S+1,) int32: cumulative new-token counts, query_start_loc[0] == 0
    seq_lens: torch.Tensor         # (S,) int32: context length of each sequence after this step (cached + new)
    block_tables: torch.Tensor     # (S, max_blocks_per_seq) int32: block ids, padded with 0 past each sequence's end
    max_query_len: int             # max new tokens of one sequence in this batch
    max_seq_len: int               # max of seq_lens
    # Host copies, so CPU paths and launch-shape decisions avoid device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Writes the new tokens' K/V into the paged cache, then attends each query over its sequence's whole context."""

    name: str = "base"

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,         # (T, num_heads, head_dim)
        k: torch.Tensor,         # (T, num_kv_heads, head_dim)
        v: torch.Tensor,         # (T, num_kv_heads, head_dim)
        kv_layer: torch.Tensor,  # (num_blocks, 2, block_size, num_kv_heads, head_dim), a view of the model's cache
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:           # (T, num_heads, head_dim)
        ...

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter new K/V into the cache at ``slot_mapping`` (shared by backends without a fused write)."""
        rows = kv_token_rows(kv_layer)
        if rows is not None:
            write_kv_rows(k, v, rows, kv_write_rows(kv_layer, slot_mapping))
            return
        block_size = kv_layer.shape[2]   # any other strides: advanced-index assignment, still correct
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        kv_layer[blocks, 0, offsets] = k.to(kv_layer.dtype)
        kv_layer[blocks, 1, offsets] = v.to(kv_layer.dtype)


def kv_token_rows(kv_layer: torch.Tensor) -> torch.Tensor | None:
    """The layer's cache as rows of one token's (Hkv * D) keys or values -> (R, Hkv * D), a view: the K of slot
    ``b * bs + o`` is row ``b * s0 + o`` and its V row ``b * s0 + s1``, with ``s0, s1`` the layer's block and K/V
    strides in rows (see :func:`kv_write_rows`). None when the strides do not allow such a view."""
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    row = num_kv_heads * head_dim
    s0, s1, s2 = kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2)
    if not (kv_layer[0, 0, 0].is_contiguous() and s2 == row and s0 % row == 0 and s1 % row == 0):
        return None
    num_rows = (num_blocks - 1) * (s0 // row) + s1 // row + block_size
    return kv_layer.as_strided((num_rows, row), (row, 1), kv_layer.storage_offset())


def kv_write_rows(kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The rows of :func:`kv_token_rows` that take the K then the V of every slot in ``slot_mapping`` -> (2T,) int64.
    They depend only on the layout, not on the layer: a caller may compute them once per step for every layer.

    Why: one ``index_copy_`` into the 2-D row view writes K and V of all tokens (whole-row copies), where advanced-index
    assignment into the 5-D strided layer view costs two slower scatters per layer.
    """
    block_size, row = kv_layer.shape[2], kv_layer.shape[3] * kv_layer.shape[4]
    block_step, kv_step = kv_layer.stride(0) // row, kv_layer.stride(1) // row
    k_idx = torch.div(slot_mapping, block_size, rounding_mode="floor") * block_step + slot_mapping % block_size
    return torch.cat((k_idx, k_idx + kv_step))


def write_kv_rows(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor) -> None:
    """``rows[idx] = [k; v]`` in one op: k/v (T, Hkv, D), ``rows`` from :func:`kv_token_rows`, ``idx`` from
    :func:`kv_write_rows`."""
    rows.index_copy_(0, idx, torch.cat((k, v)).view(len(idx), -1).to(rows.dtype))


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str) -> Callable:
    """Class decorator: ``@register_backend("triton")`` makes a backend selectable by name."""

    def deco(factory: Callable[[], AttentionBackend]) -> Callable[[], AttentionBackend]:
        _REGISTRY[name] = factory
        return factory

    return deco


# the built-in backends: name -> the module whose import registers it
_BUILTIN = {"torch": "torch_ref", "triton": "triton_paged", "flash": "flash"}


def available_backends() -> list[str]:
    _load_builtin_backends(_BUILTIN)
    return sorted(_REGISTRY)


def create_backend(name: str) -> AttentionBackend:
    _load_builtin_backends([name] if name in _BUILTIN else _BUILTIN)
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def _load_builtin_backends(names: Iterable[str]) -> None:
    """Imports the modules of the built-in backends ``names`` (importing registers); one that cannot import on this
    host stays unregistered. Only those asked for: importing triton alone cost a CPU server ~0.2 s of its start-up."""
    import importlib

    for name in names:
        try:
            importlib.import_module(f"pdserve.kernels.{_BUILTIN[name]}")
        except ImportError:
            pass
