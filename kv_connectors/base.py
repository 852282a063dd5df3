"""The KV connector contract: how an engine hands KV blocks to, and takes them from, other pods or storage.

In the spirit of vLLM's v1 connector API, split into the duties the *scheduler* calls (deciding what to load, when a
request may be freed) and the duties the *worker* calls (moving bytes in and out of the registered cache). pdserve runs
both in one process, so one object implements both halves; the engine calls them at these points of `step()`:

    schedule():   for a waiting request, after the local prefix-cache lookup
                    n, is_async = get_num_new_matched_tokens(req, num_local_computed_tokens)
                  after allocating its blocks
                    update_state_after_alloc(req, block_ids, n)
                  is_async -> the request waits (WAITING_FOR_REMOTE_KVS) until get_finished() reports it received
                  at the end of scheduling
                    meta = build_connector_meta()
    load:         start_load_kv(meta) before the forward pass (loads for synchronous requests finish inside it)
    save:         save_kv(meta) after the forward pass
    update():     sending, recving = get_finished()
                  bad = get_block_ids_with_load_errors()  -> the scheduler cuts each affected request back to its first
                  bad block (recompute) or fails it (policy "fail"); bad blocks never enter the prefix cache
                  then, for each request that ran: request_scheduled_for_save(req, block_ids, num_computed_tokens)
    finish:       delay_free, params, pending = start_request_finished(req, block_ids)
                  delay_free -> blocks stay allocated until get_finished() lists the request in `sending`
                  params     -> returned to the client as `kv_transfer_params` (the P/D handoff, anchors.md §1)
                  pending    -> the handoff's blocking part (a store write, checksums) runs on the connector's own
                  thread under a deadline (params None, delay_free True); the engine holds the response until
                  get_finished_handoffs() returns its params (at the latest at the deadline: then the params of a
                  failed handoff, which make the decode side recompute what it cannot find)
                  (request_finished(req, block_ids) is the same call waiting for the params: tests, tools)

Ownership: the engine owns the cache tensor and every block id; a connector never frees or allocates blocks, it only
reads blocks it was told to save and writes blocks it was told to load. A load that fails in any way (missing, corrupt,
truncated, wrong fingerprint, timed out, peer gone) must still be reported finished, with its blocks listed by
`get_block_ids_with_load_errors()`; a connector never leaves a request waiting forever (every wait has a timeout),
with one exception: a load whose reads write straight into its blocks (disk, on a CPU cache) is reported, past its
deadline, only once no read of it is in flight, since until then the kernel may still write the blocks (see
``loading``).
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from pdserve import __version__


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the engine's cache, as the connector sees it. See pdserve.kernels.base for the layout."""

    model: str
    dtype: str            # torch dtype name, e.g. "float32"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = "block,layer,kv,token,head,dim"

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * torch.empty(
            (), dtype=getattr(torch, self.dtype)).element_size()

    def fingerprint(self) -> str:
        """Compatibility hash: two engines may exchange KV only when their fingerprints are equal."""
        blob = json.dumps({**asdict(self), "pdserve": __version__}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


class ConnectorRequest(Protocol):
    """What a connector may read of an engine request."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[bytes]            # chained hashes of the prompt's full blocks (pdserve.runtime.block_hash)
    kv_transfer_params: dict[str, Any] | None
    cache_salt: str | None


@dataclass
class PromptRequest:
    """A ``ConnectorRequest`` without an engine, for tools that drive a connector directly (benchmarks, tests): the
    prompt's block hashes are computed here, as the engine computes them."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    block_size: int = 16
    block_hashes: list[bytes] = field(init=False)

    def __post_init__(self) -> None:
        from pdserve.runtime.block_hash import hash_token_blocks

        self.block_hashes = hash_token_blocks(self.prompt_token_ids, self.block_size, self.cache_salt)


@dataclass
class KVConnectorMetadata:
    """What the scheduler decided this step; built by the scheduler half, consumed by the worker half."""

    loads: dict[str, list[tuple[int, int]]] = field(default_factory=dict)   # request_id -> [(block_index, block_id)]


class KVConnectorBase(ABC):
    """Base class for KV connectors. Subclasses implement both halves; see the module docstring for the call order."""

    def __init__(self, role: str, config: dict[str, Any], spec: KVCacheSpec) -> None:
        self.role = role        # "prefill" | "decode" | "both"
        self.config = config
        self.spec = spec

    # ---- scheduler side -------------------------------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that can be loaded from outside (whole blocks; never the prompt's last
        token, which must be computed locally to produce logits) and whether the load is asynchronous."""

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's blocks are allocated (``block_ids`` covers the whole prompt); remember where to load into."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """Collect the loads and saves decided since the last call."""

    @abstractmethod
    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request finished: (keep its blocks until get_finished() says sent, kv_transfer_params for the response)."""

    def start_request_finished(self, request: ConnectorRequest,
                               block_ids: list[int]) -> tuple[bool, dict[str, Any] | None, bool]:
        """``request_finished`` without blocking the engine thread: (delay_free, params, pending); see the module
        docstring. Default: ``request_finished``, never pending."""
        delay, params = self.request_finished(request, block_ids)
        return delay, params, False

    def get_finished_handoffs(self) -> dict[str, dict[str, Any]]:
        """Request id -> params of each pending handoff that settled since the last call (each reported once)."""
        return {}

    def request_scheduled_for_save(self, request: ConnectorRequest, block_ids: list[int], num_computed_tokens: int) -> None:
        """Optional: called after each step a request ran, with its blocks and how many tokens are now computed."""

    # ---- worker side ----------------------------------------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """The engine's cache tensor, laid out as ``self.spec`` says."""

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Start (or, for synchronous connectors, do) the loads in ``meta``."""

    @abstractmethod
    def save_kv(self, meta: KVConnectorMetadata) -> None:
        """Called after the step's forward pass (the KV of the blocks computed in it is final). Which blocks to store
        was announced by ``request_scheduled_for_save`` / ``request_finished``; pdserve's connectors write there."""

    @abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """(request ids whose blocks may now be freed after sending, request ids whose loads completed or failed)."""

    @abstractmethod
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call; each is reported once."""

    def metrics(self) -> dict[str, float]:
        """Counters for /metrics (failure kinds, bytes moved...), name -> value."""
        return {}

    def shutdown(self) -> None:
        """Release sockets, agents and threads."""


_REGISTRY: dict[str, Callable[..., KVConnectorBase]] = {}


def register_connector(name: str) -> Callable:
    """Class decorator: ``@register_connector("redis")`` makes a connector selectable with ``--kv-connector redis``."""

    def deco(cls: Callable[..., KVConnectorBase]) -> Callable[..., KVConnectorBase]:
        _REGISTRY[name] = cls
        return cls

    return deco


def create_connector(name: str, role: str, config: dict[str, Any], spec: KVCacheSpec) -> KVConnectorBase:
    import importlib

    if name not in _REGISTRY:
        try:
            importlib.import_module(f"pdserve.kv_connectors.{name}_connector")
        except ImportError as e:
            raise ValueError(f"KV connector {name!r} is unavailable: {e}") from e
    if name not in _REGISTRY:
        raise ValueError(f"unknown KV connector {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name](role, config, spec)
