"""What the HTTP server needs from an engine: the seam between ``LLMEngine`` and the server side
(``AsyncEngine``, routes, request mapping, drain, metrics, tracing).

``LLMEngine`` satisfies ``EngineClient`` structurally; a test double of the engine implements the same members. The
server touches nothing else of the engine (no scheduler, pool or runner), and only ``AsyncEngine``'s thread calls the
methods marked *engine thread*: the engine is single-threaded by contract. The attributes are fixed at construction
and may be read from any thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:   # types only: importing this module must not import torch
    from pdserve.kv_connectors.base import KVCacheSpec, KVConnectorBase
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.kv_events import KVEvent
    from pdserve.runtime.outputs import RequestOutput
    from pdserve.runtime.sampling_params import SamplingParams
    from pdserve.runtime.validation import RequestLimits


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the server uses (tokenize/detokenize endpoints, logprob token strings)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> Sequence[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class EngineClient(Protocol):
    """One engine as the server sees it. See ``LLMEngine`` for the semantics of each member."""

    config: EngineConfig               # what the engine was built from (block size, KV transfer role and connector)
    served_model_name: str             # the model's name in the API
    max_model_len: int
    limits: RequestLimits              # what ``validation.check_request`` checks a request against
    tokenizer: Tokenizer
    weight_bytes: int                  # bytes the weights occupy (``pdserve:model_weight_bytes``)
    kv_cache_spec: KVCacheSpec         # layout of the KV cache (its fingerprint pairs prefill and decode pods)
    connector: KVConnectorBase | None  # the KV connector, if any (its counters are exported on ``/metrics``)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation; ``ValueError``/``TypeError``/jinja ``TemplateError`` if the template refuses it.
        Pure (any thread)."""
        ...

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *, priority: int = 0,
                    cache_salt: str | None = None, kv_transfer_params: dict | None = None,
                    arrival_time: float | None = None) -> None:
        """*Engine thread.* Queue a request; ``ValueError`` (``InvalidParam``) for input the engine refuses."""
        ...

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """*Engine thread.* Abort requests, freeing their blocks; unknown ids are ignored."""
        ...

    def has_unfinished_requests(self) -> bool:
        """*Engine thread.* True while requests run or wait, or a KV transfer still holds blocks."""
        ...

    def step(self) -> list[RequestOutput]:
        """*Engine thread.* One engine step; the cumulative outputs of the requests that progressed."""
        ...

    def get_stats(self) -> Any:
        """*Engine thread.* A snapshot of the engine's counters (``EngineStats``) for ``/metrics``."""
        ...

    def take_kv_events(self) -> list[KVEvent]:
        """*Engine thread.* KV events since the last call, oldest first."""
        ...

    def shutdown(self) -> None:
        """Release the connector's sockets and threads (after the engine thread stopped)."""
        ...
