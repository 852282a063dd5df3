"""Seam types between the scheduler, the model runner and the engine (the vLLM v1 shape).

``SchedulerOutput`` goes scheduler -> runner once per step. A request the runner has not seen arrives whole, once
(``NewRequestData``); a request it already holds arrives as a diff (``CachedRequestData``: the blocks allocated since
the last step, its counters, and its full token ids only after a preemption). ``finished_req_ids`` tells the runner
which states to drop, ``preempted_req_ids`` which rows leave the batch (their state, seeded generator included, stays
until they resume). ``ModelRunnerOutput`` comes back: per sampled request a LIST of token ids (speculative decoding may
accept several per step). Nothing here holds a scheduler ``Request``; everything is plain data.

Feature slots (empty until their feature lands):
- ``scheduled_spec_decode_tokens``: draft tokens per request, appended to its query tokens and verified in the same
  forward pass; the runner then samples ``len(drafts) + 1`` positions for it (issue 13).
- ``structured_output_request_ids`` / ``grammar_bitmask``: row ``i`` of the bitmask constrains the logits of
  ``structured_output_request_ids[i]``; the sampler applies it before any other processing (issue 11).
- ``NewRequestData.lora_id`` / ``lora_name``: the adapter a request runs with; 0 is the base model (issue 12).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.runtime.outputs import PositionLogprobs
from pdserve.runtime.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen: everything it needs to compute and sample it."""

    req_id: str
    token_ids: list[int]                  # prompt + output so far (the KV to compute)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None              # masked until ``min_tokens`` (stop checking itself is the scheduler's)
    block_ids: list[int]                  # the whole block table
    num_computed_tokens: int              # tokens whose KV is already in the cache (prefix hits, loaded KV)
    lora_id: int = 0                      # 0: no adapter
    lora_name: str | None = None


@dataclass
class CachedRequestData:
    """A request the runner holds: what changed since the step it was last scheduled in."""

    req_id: str
    resumed_from_preemption: bool         # True: block table and token ids are replaced, not extended
    new_block_ids: list[int]
    new_token_ids: list[int]              # all token ids when resumed; else empty (the runner appended its samples)
    num_computed_tokens: int
    num_output_tokens: int                # the scheduler's count: the runner drops samples the scheduler discarded


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)   # in batch order
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None           # (len(structured_output_request_ids), ceil(vocab / 32)) int32, or None
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)
    kv_connector_metadata: Any = None     # pdserve.kv_connectors.base.KVConnectorMetadata, for load/save
    # (source block, destination block, slots): KV the runner copies before the forward, a request's first new block
    # taking the leading tokens of a cached block (runtime/kv_cache_manager.py get_partial_hit)
    kv_block_copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def num_computed_tokens(self) -> dict[str, int]:
        """Scheduled request id -> tokens computed before this step (where its scheduled chunk starts)."""
        d = {r.req_id: r.num_computed_tokens for r in self.scheduled_new_reqs}
        d.update((r.req_id, r.num_computed_tokens) for r in self.scheduled_cached_reqs)
        return d


@dataclass
class SampledToken:
    """One sampled position of one request, as the sampler returns it."""

    token_id: int
    logprobs: PositionLogprobs | None = None  # sampled token + top-k alternatives, when requested
    logprob: float | None = None              # the sampled token's logprob, when requested


@dataclass
class ModelRunnerOutput:
    """Per request that reached the end of its tokens this step (in batch order): the accepted token ids, and their
    logprobs when requested (one dict per token)."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[PositionLogprobs] | None] = field(default_factory=list)
    # draft tokens proposed for the next step, per request (issue 13; the scheduler caps and schedules them)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    _index: dict[str, int] | None = field(default=None, init=False, repr=False, compare=False)

    def get(self, req_id: str) -> tuple[list[int], list[PositionLogprobs] | None] | None:
        """(token ids, logprobs) sampled for ``req_id``, or None if it sampled nothing this step."""
        if self._index is None:
            self._index = {r: i for i, r in enumerate(self.req_ids)}
        i = self._index.get(req_id)
        return None if i is None else (self.sampled_token_ids[i], self.logprobs[i])

    def extend(self, other: ModelRunnerOutput) -> None:
        self.req_ids += other.req_ids
        self.sampled_token_ids += other.sampled_token_ids
        self.logprobs += other.logprobs
        self.spec_token_ids.update(other.spec_token_ids)
        self._index = None
