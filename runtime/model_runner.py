"""Runs the model on one scheduled step: owns the KV cache tensor and the persistent batch, builds AttentionMetadata,
runs the forward pass (``execute_model``) and, as a separate stage, samples (``sample``).

The cache is allocated once, ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)`` (pdserve.kernels.base),
and is the only KV storage: there are no per-request buffers. Metadata is built with a handful of torch ops per step
(not per token). The runner never touches the block pool or a scheduler request: block ids, token ids and counters
arrive in the ``SchedulerOutput`` diffs and live in its ``InputBatch``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.kernels.base import AttentionMetadata
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.kv_cache_manager import cdiv
from pdserve.runtime.input_batch import InputBatch
from pdserve.runtime.sampler import Sampler
from pdserve.runtime.sched_output import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)

CPU_KV_BUDGET = 2 << 30  # bytes of KV on CPU when no budget is given


@dataclass
class ForwardOutput:
    """What one forward pass leaves for the sampler: the rows that reached the end of their tokens."""

    req_ids: list[str]            # requests to sample, in batch order
    logits: torch.Tensor          # (N, vocab) float32
    hidden_states: torch.Tensor   # (N, hidden): the last position's hidden state per row (e.g. for a draft model)


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def determine_num_blocks(config: EngineConfig, block_bytes: int, max_model_len: int, device: torch.device) -> int:
    """Block count: explicit ``num_gpu_blocks`` wins; else the memory budget (2 GiB on CPU, 90% of free GPU memory)
    divided by one block's bytes, capped at what max_num_seqs full-length sequences could ever use."""
    cache = config.cache
    if cache.num_gpu_blocks is not None:
        return cache.num_gpu_blocks
    budget = cache.kv_cache_memory_bytes
    if budget is None:
        budget = int(torch.cuda.mem_get_info(device)[0] * 0.9) if device.type == "cuda" else CPU_KV_BUDGET
    cap = config.scheduler.max_num_seqs * cdiv(max_model_len, cache.block_size)
    num_blocks = min(budget // block_bytes, cap)
    if num_blocks < cdiv(max_model_len, cache.block_size):
        log.warning("KV cache holds %d blocks, less than one max_model_len sequence", num_blocks)
    return max(1, num_blocks)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim): the engine's only KV storage
        self.kv_cache = torch.zeros((num_blocks, model.num_layers, 2, block_size, model.num_kv_heads, model.head_dim),
                                    dtype=dtype, device=device)
        self.batch = InputBatch(device)
        self.sampler = Sampler(device)

    def update_states(self, out: SchedulerOutput) -> None:
        """Apply the step's diffs to the persistent batch (every step, also when nothing is scheduled)."""
        self.batch.update(out)

    def build_metadata(self, req_ids: list[str], num_scheduled: dict[str, int]
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids (T,), positions (T,), metadata) for the rows ``req_ids``, on the model's device."""
        states = [self.batch.requests[r] for r in req_ids]
        q_lens = [num_scheduled[r] for r in req_ids]
        starts = [s.num_computed_tokens for s in states]
        seq_lens = [a + b for a, b in zip(starts, q_lens)]
        max_blocks = max(cdiv(n, self.block_size) for n in seq_lens)
        rows = []
        for s, n in zip(states, seq_lens):
            ids = s.block_ids[: cdiv(n, self.block_size)]
            rows.append(ids + [0] * (max_blocks - len(ids)))
        table = torch.tensor(rows, dtype=torch.int32)                                      # (S, max_blocks)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        qsl = torch.zeros(len(states) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=qsl[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(states)), q_lens_t)                # (T,)
        positions = torch.arange(int(qsl[-1])) - qsl[:-1][seq_idx] + torch.tensor(starts)[seq_idx]
        slots = table[seq_idx, positions // self.block_size].to(torch.int64) * self.block_size \
            + positions % self.block_size
        input_ids = torch.tensor([t for s, a, n in zip(states, starts, seq_lens) for t in s.token_ids[a:n]],
                                 dtype=torch.int64)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev, non_blocking=True),
            query_start_loc=qsl.to(torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=table.to(dev, non_blocking=True),
            max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens, seq_lens_cpu=seq_lens)
        return input_ids.to(dev, non_blocking=True), positions.to(dev, non_blocking=True), meta

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput, req_ids: list[str] | None = None) -> ForwardOutput | None:
        """Forward pass over the step's scheduled requests (or only ``req_ids``, for a per-request retry). Returns the
        logits of the rows whose chunk reached the end of their tokens, or None when no row samples."""
        req_ids = list(out.num_scheduled_tokens) if req_ids is None else req_ids
        if not req_ids:
            return None
        input_ids, positions, meta = self.build_metadata(req_ids, out.num_scheduled_tokens)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)                       # (T, hidden)
        states = self.batch.requests
        rows = [i for i, r in enumerate(req_ids)
                if states[r].num_computed_tokens + out.num_scheduled_tokens[r] >= len(states[r].token_ids)]
        if not rows:
            return None
        last = meta.query_start_loc[1:].to(torch.int64) - 1                                 # (S,)
        hidden = hidden[last[rows]]                                                          # (N, hidden)
        logits = self.model.compute_logits(hidden)                                           # (N, vocab)
        return ForwardOutput([req_ids[i] for i in rows], logits.float(), hidden)

    @torch.inference_mode()
    def sample(self, fwd: ForwardOutput | None) -> ModelRunnerOutput:
        """Sample one token per row of ``fwd`` and append it to the batch (only once the whole draw succeeded)."""
        if fwd is None:
            return ModelRunnerOutput()
        sampled = self.sampler(fwd.logits, self.batch.sampling_metadata(fwd.req_ids))
        for rid, t in zip(fwd.req_ids, sampled):
            self.batch.append_sampled(rid, [t.token_id])
        return ModelRunnerOutput(req_ids=list(fwd.req_ids), sampled_token_ids=[[t.token_id] for t in sampled],
                                 logprobs=[None if t.logprobs is None else [t.logprobs] for t in sampled])
