"""The model runner's own per-request state (the persistent batch), updated in place from each ``SchedulerOutput``.

``requests`` holds a ``CachedRequestState`` for every request the runner has seen and not yet been told is finished:
token ids (the runner appends what it samples), block table, counters, sampling parameters and the seeded generator.
A preempted request leaves the batch rows but keeps its state, so its seeded generator continues where it stopped when
it resumes (as it did when the generator lived on the scheduler's request). ``req_ids`` are the batch rows: the
requests currently running, in the order they joined. The scheduler stays the source of truth for counters: each
step's diff sets ``num_computed_tokens`` and trims samples the scheduler discarded (a failed KV load).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.runtime.sampler import SamplingMetadata
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sched_output import SchedulerOutput


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]                   # prompt + output, as far as the runner knows
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    generator: torch.Generator | None = None   # created on first use from sampling_params.seed
    lora_id: int = 0                       # adapter slot (issue 12); 0: base model

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def build_sampling_metadata(states: list[CachedRequestState], device: torch.device) -> SamplingMetadata:
    """The sampler's view of ``states`` (one per logits row). Creates a seeded row's generator on first use."""
    for s in states:
        if s.sampling_params.seed is not None and s.generator is None:
            s.generator = torch.Generator(device=device).manual_seed(s.sampling_params.seed)
    banned = [s.sampling_params.held_back_token_ids(s.eos_token_id, s.num_output_tokens) for s in states]
    return SamplingMetadata(
        req_ids=[s.req_id for s in states], params=[s.sampling_params for s in states],
        generators=[s.generator for s in states], all_token_ids=[s.token_ids for s in states],
        output_token_ids=[s.output_token_ids if s.sampling_params.has_penalties else [] for s in states],
        banned_token_ids=banned)


class InputBatch:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}   # every unfinished request the runner has seen
        self.req_ids: list[str] = []                         # batch rows: the running ones

    def update(self, out: SchedulerOutput) -> None:
        """Apply one step's diff: drop finished states, take preempted rows out, add new requests, extend the rest."""
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
        gone = out.finished_req_ids.union(out.preempted_req_ids)
        if gone:
            self.req_ids = [r for r in self.req_ids if r not in gone]
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params, new.eos_token_id,
                list(new.block_ids), new.num_computed_tokens, lora_id=new.lora_id)
            self.req_ids.append(new.req_id)
        for diff in out.scheduled_cached_reqs:
            s = self.requests[diff.req_id]
            if diff.resumed_from_preemption:
                s.token_ids = list(diff.new_token_ids)
                s.block_ids = list(diff.new_block_ids)
                self.req_ids.append(diff.req_id)
            else:
                s.token_ids += diff.new_token_ids
                s.block_ids += diff.new_block_ids
                del s.token_ids[s.num_prompt_tokens + diff.num_output_tokens:]
            s.num_computed_tokens = diff.num_computed_tokens

    def sampling_metadata(self, req_ids: list[str]) -> SamplingMetadata:
        return build_sampling_metadata([self.requests[r] for r in req_ids], self.device)

    def append_sampled(self, req_id: str, token_ids: list[int]) -> None:
        self.requests[req_id].token_ids += token_ids
