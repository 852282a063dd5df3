"""Runs the model on one scheduled step: owns the KV cache tensor, builds AttentionMetadata, samples.

The cache is allocated once, ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)`` (pdserve.kernels.base),
and is the only KV storage: there are no per-request buffers. Metadata is built with a handful of torch ops per step
(not per token). The runner never touches the block pool: block ids arrive in the scheduler output.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from pdserve.kernels.base import AttentionMetadata
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.kv_cache_manager import cdiv
from pdserve.runtime.rejection_sampler import verify
from pdserve.runtime.request import Request
from pdserve.runtime.sampler import Sampler
from pdserve.runtime.scheduler import SampledToken, SchedulerOutput

log = logging.getLogger(__name__)

CPU_KV_BUDGET = 2 << 30  # bytes of KV on CPU when no budget is given


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
        self.sampler = Sampler(device)

    def build_metadata(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids (T,), positions (T,), metadata) for the step, on the model's device."""
        seqs = out.scheduled
        q_lens = [len(s.token_ids) for s in seqs]
        starts = [s.start_pos for s in seqs]
        seq_lens = [a + b for a, b in zip(starts, q_lens)]
        max_blocks = max(cdiv(n, self.block_size) for n in seq_lens)
        rows = []
        for s, n in zip(seqs, seq_lens):
            ids = s.block_ids[: cdiv(n, self.block_size)]
            rows.append(ids + [0] * (max_blocks - len(ids)))
        table = torch.tensor(rows, dtype=torch.int32)                                      # (S, max_blocks)
        q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
        qsl = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        torch.cumsum(q_lens_t, 0, out=qsl[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(seqs)), q_lens_t)                  # (T,)
        positions = torch.arange(int(qsl[-1])) - qsl[:-1][seq_idx] + torch.tensor(starts)[seq_idx]
        slots = table[seq_idx, positions // self.block_size].to(torch.int64) * self.block_size \
            + positions % self.block_size
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64)
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
    def execute(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> dict[str, list[SampledToken]]:
        """Run the step's forward pass and sample for every sequence whose chunk reached its end: one token, or, for a
        sequence with drafts to verify, the accepted drafts plus one (pdserve.runtime.rejection_sampler)."""
        if not out.scheduled:
            return {}
        input_ids, positions, meta = self.build_metadata(out)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)                       # (T, hidden)
        spec = out.scheduled_spec_decode_tokens
        rows = [i for i, s in enumerate(out.scheduled) if s.sample and not spec.get(s.request_id)]
        spec_rows = [i for i, s in enumerate(out.scheduled) if s.sample and spec.get(s.request_id)]
        last = meta.query_start_loc[1:].to(torch.int64) - 1                                 # (S,)
        result: dict[str, list[SampledToken]] = {}
        if rows:
            logits = self.model.compute_logits(hidden[last[rows]])                           # (N, vocab) float32
            reqs = [requests[out.scheduled[i].request_id] for i in rows]
            sampled = self.sampler(logits.float(), reqs)
            result.update({r.request_id: [t] for r, t in zip(reqs, sampled)})
        if spec_rows:
            drafts = [spec[out.scheduled[i].request_id] for i in spec_rows]
            # logits at the last real token and at every draft: k + 1 rows per sequence
            idx = torch.cat([torch.arange(-len(d), 1, device=last.device) + last[i] for i, d in zip(spec_rows, drafts)])
            logits = self.model.compute_logits(hidden[idx]).float()                          # (sum(k+1), vocab)
            reqs = [requests[out.scheduled[i].request_id] for i in spec_rows]
            q = [getattr(r, "spec_draft_probs", None) for r in reqs]    # a draft model's q (sampling requests)
            result.update({r.request_id: t for r, t in zip(reqs, verify(logits, reqs, drafts, q))})
        return result
