"""One request inside the engine: token ids, counters and status. No phases: ``num_computed_tokens`` chases
``num_tokens``; a prefill chunk, a prefix-cache hit, a remote-KV load and a recompute after a failed load all just
move that counter."""

from __future__ import annotations

import enum
import time
from typing import Any

from pdserve.runtime.block_hash import BlockHash, hash_token_blocks
from pdserve.runtime.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1    # blocks allocated, an async connector load is in flight
    RUNNING = 2
    PREEMPTED = 3                 # blocks freed; recomputes from scratch when rescheduled
    FINISHED_STOPPED = 10         # every status >= FINISHED_STOPPED is final
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {10: "stop", 11: "length", 12: "abort", 13: "error"}.get(int(self))


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        block_size: int,
        eos_token_id: int | None = None,
        prompt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        max_tokens: int | None = None,
        lora: Any = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params
        self.kv_leader: Request | None = None   # n > 1 sibling: admitted once this one's remote KV landed (fan_out)
        self.handoff_pending = False       # finished, its handoff params not ready yet: the response waits for them
        self.block_size = block_size
        self.lora = lora                   # the LoRAAdapter it runs with (runtime/lora_manager.py), None = base model

        self.all_token_ids: list[int] = list(prompt_token_ids)   # prompt + output; the tokens KV is computed for
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1        # prefix-cache + remote tokens found at first scheduling (-1: not yet)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.kv_transfer: dict[str, Any] = {}   # the connector's record of a remote-KV load (for tracing)
        self.spec_token_ids: list[int] = []     # draft tokens to verify next step (runtime/spec_propose.py)
        # Chained hashes of every full block of all_token_ids, extended as tokens are appended.
        self._block_hashes: list[BlockHash] = hash_token_blocks(self.all_token_ids, block_size, cache_salt,
                                                                    lora_digest=self.lora_digest)

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora.name

    @property
    def lora_digest(self) -> str | None:
        return None if self.lora is None else self.lora.digest

    # ---- counters ----------------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Hashes of the prompt's full blocks (the connector contract)."""
        return self._block_hashes[: self.num_prompt_tokens // self.block_size]

    @property
    def all_block_hashes(self) -> list[BlockHash]:
        """Hashes of every full block of prompt + output (the prefix cache keys)."""
        return self._block_hashes

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            start = len(self._block_hashes)
            parent = self._block_hashes[-1] if self._block_hashes else None
            self._block_hashes += hash_token_blocks(
                self.all_token_ids[start * self.block_size:], self.block_size, self.cache_salt, parent, start,
                self.lora_digest)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"status={self.status.name})")
