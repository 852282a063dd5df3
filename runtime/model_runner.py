"""Runs the model on one scheduled step: owns the KV cache tensor and the persistent batch, builds AttentionMetadata,
runs the forward pass (``execute_model``) and, as a separate stage, samples (``sample``).

The cache is allocated once, ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)`` (pdserve.kernels.base),
and is the only KV storage: there are no per-request buffers. Metadata is built with a handful of torch ops per step
(not per token). The runner never touches the block pool or a scheduler request: block ids, token ids and counters
arrive in the ``SchedulerOutput`` diffs and live in its ``InputBatch``.
"""

from __future__ import annotations

import itertools
import logging
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from pdserve.kernels import greedy_head_cpu, gguf_codes_linear, small_rows_linear
from pdserve.kernels.base import AttentionMetadata
from pdserve.kernels.packed_linear import pack_linears
from pdserve.runtime import envs, huge_pages
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.kv_cache_manager import cdiv
from pdserve.runtime.input_batch import InputBatch
from pdserve.runtime.rejection_sampler import verify
from pdserve.runtime.sampler import Sampler
from pdserve.runtime.sched_output import ModelRunnerOutput, SampledToken, SchedulerOutput

log = logging.getLogger(__name__)

CPU_KV_BUDGET = 2 << 30  # bytes of KV on CPU when no budget is given


@dataclass
class ForwardOutput:
    """What one forward pass leaves for the sampler: the rows that reached the end of their tokens."""

    req_ids: list[str]            # requests to sample, in batch order
    logits: torch.Tensor | None   # (N, vocab) float32; N = len(req_ids) + the number of drafts being verified
    hidden_states: torch.Tensor   # (N, hidden): the hidden state at each of those positions (e.g. for a draft model)
    # request id -> drafts being verified: such a request has len(drafts) + 1 consecutive rows (its positions from
    # the last real token on), the others one row each
    spec: dict[str, list[int]] = field(default_factory=dict)
    grammar_bitmask: torch.Tensor | None = None   # (len(req_ids), ceil(vocab/32)) int32, all ones where free
    grammar_rows: list[int] | None = None         # rows (indices into req_ids) a grammar constrains
    greedy_ids: torch.Tensor | None = None        # (N,) the tokens of plain greedy rows, from the greedy head (no logits)


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
                 device: torch.device, seed: int | None = None) -> None:
        self.model = model
        self.device = device
        if envs.cpu_packed_gemm():
            pack_linears(model, device, dtype)   # bf16 on CPU: oneDNN-packed weights, bit-equal and faster at decode
        small_rows_linear.swap_linears(model, device, dtype)   # float32 on CPUs without AVX-512: faster at 1-256 rows
        gguf_codes_linear.attach(model, getattr(model, "gguf_source", None), device, dtype)   # and at 1-4 rows
        self.extra_weight_bytes = gguf_codes_linear.codes_bytes(model)   # codes held next to the dense weights
        self.block_size = block_size
        self.num_blocks = num_blocks
        # (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim): the engine's only KV storage
        self.kv_cache = huge_pages.zeros((num_blocks, model.num_layers, 2, block_size, model.num_kv_heads,
                                           model.head_dim), dtype, device)
        self.batch = InputBatch(device)
        self.sampler = Sampler(device, seed)
        self.proposer = None      # speculative decoding: proposes drafts after sampling (runtime/spec_propose.py)
        self.lora = None  # a LoRAManager when LoRA is enabled: gives the step's adapters slots (runtime/lora_manager.py)
        # plain greedy rows' tokens without every logit (kernels/greedy_head_cpu.py); None where it does not apply
        self.greedy_head = greedy_head_cpu.for_model(model) if device.type == "cpu" else None

    def update_states(self, out: SchedulerOutput) -> None:
        """Apply the step's diffs to the persistent batch (every step, also when nothing is scheduled), and make its
        KV block copies (every layer's K and V of the leading slots)."""
        for src, dst, slots in out.kv_block_copies:
            self.kv_cache[dst, :, :, :slots] = self.kv_cache[src, :, :, :slots]
        self.batch.update(out)
        if self.proposer is not None:
            self.proposer.forget(out.finished_req_ids.union(out.preempted_req_ids))

    def build_metadata(self, req_ids: list[str], num_scheduled: dict[str, int],
                       spec: dict[str, list[int]] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids (T,), positions (T,), metadata) for the rows ``req_ids``, on the model's device. A row's query
        tokens are its scheduled token ids, followed by its draft tokens (``spec``) when it has some."""
        states = [self.batch.requests[r] for r in req_ids]
        spec = spec or {}
        starts = [s.num_computed_tokens for s in states]
        tokens = [s.token_ids[a:a + num_scheduled[r] - len(spec.get(r, ()))] + spec.get(r, [])
                  for r, s, a in zip(req_ids, states, starts)]
        return attention_inputs(tokens, starts, [s.block_ids for s in states], self.block_size, self.device)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput, req_ids: list[str] | None = None) -> ForwardOutput | None:
        """Forward pass over the step's scheduled requests (or only ``req_ids``, for a per-request retry). Returns the
        logits of the rows whose chunk reached the end of their tokens (for a row verifying drafts: at its last real
        token and at every draft), or None when no row samples."""
        req_ids = list(out.num_scheduled_tokens) if req_ids is None else req_ids
        if not req_ids:
            return None
        spec = out.scheduled_spec_decode_tokens
        input_ids, positions, meta = self.build_metadata(req_ids, out.num_scheduled_tokens, spec)
        states = self.batch.requests
        lora = nullcontext() if self.lora is None else self.lora.step_context(
            [states[r].lora_id for r in req_ids], meta.query_lens_cpu, self.device)
        rows = [i for i, r in enumerate(req_ids)
                if states[r].num_computed_tokens + out.num_scheduled_tokens[r] - len(spec.get(r, ()))
                >= len(states[r].token_ids)]
        last = meta.query_start_loc[1:].to(torch.int64) - 1                                 # (S,)
        idx = torch.cat([torch.arange(-len(spec.get(req_ids[i], ())), 1, device=last.device) + last[i]
                         for i in rows]) if rows else last[:0]                               # (N,)
        keep = None if self.lora is not None or len(idx) == len(input_ids) else idx   # LoRA maps all T rows
        with lora:
            hidden = self.model(input_ids, positions, self.kv_cache, meta, keep)             # (T or N, hidden)
        if not rows:
            return None
        hidden = hidden if keep is not None else hidden[idx]                                 # (N, hidden)
        sampled = [req_ids[i] for i in rows]
        if self._screens(sampled, spec, out):
            return ForwardOutput(sampled, None, hidden, greedy_ids=self.greedy_head(hidden))
        logits = self.model.compute_logits(hidden)                                           # (N, vocab)
        fwd = ForwardOutput(sampled, logits.float(), hidden, {r: spec[r] for r in sampled if spec.get(r)})
        if out.grammar_bitmask is not None:
            self._attach_grammar(fwd, out)
        return fwd

    def _screens(self, sampled: list[str], spec: dict[str, list[int]], out: SchedulerOutput) -> bool:
        """Whether the greedy head gives this step's tokens: every row plain greedy (no penalties, logprobs, min_tokens
        mask, grammar or drafts to verify), the rows few enough for the screen to pay and the head still the one it
        screens (LoRA or quantization may replace it)."""
        head = self.greedy_head
        if (head is None or out.grammar_bitmask is not None or len(sampled) > greedy_head_cpu.MAX_ROWS
                or self.model.lm_head is not head.head or any(spec.get(r) for r in sampled)):
            return False
        for r in sampled:
            s = self.batch.requests[r]
            p = s.sampling_params
            if not p.greedy or p.has_penalties or p.logprobs is not None or p.held_back_token_ids(
                    s.eos_token_id, s.num_output_tokens):
                return False
        return True

    @staticmethod
    def _attach_grammar(fwd: ForwardOutput, out: SchedulerOutput) -> None:
        """Reorder the scheduler's bitmask (one row per ``structured_output_request_ids``) onto the sampling rows."""
        src = {rid: i for i, rid in enumerate(out.structured_output_request_ids)}
        rows = [i for i, rid in enumerate(fwd.req_ids) if rid in src]
        if not rows:
            return
        mask = out.grammar_bitmask
        full = torch.full((len(fwd.req_ids), mask.shape[1]), -1, dtype=mask.dtype)
        full[rows] = mask[[src[fwd.req_ids[i]] for i in rows]]
        fwd.grammar_bitmask, fwd.grammar_rows = full, rows

    @torch.inference_mode()
    def sample(self, fwd: ForwardOutput | None) -> ModelRunnerOutput:
        """Sample each row of ``fwd`` (one token, or for a row verifying drafts the accepted ones plus one) and append
        the tokens to the batch (only once the whole draw succeeded); then propose the next step's drafts."""
        if fwd is None:
            return ModelRunnerOutput()
        plain = [i for i, r in enumerate(fwd.req_ids) if r not in fwd.spec]
        tokens: dict[str, list[SampledToken]] = {}
        if fwd.greedy_ids is not None:   # plain greedy rows, their tokens already chosen
            plain = []
            tokens.update((r, [SampledToken(t)]) for r, t in zip(fwd.req_ids, fwd.greedy_ids.tolist()))
        elif not fwd.spec:
            rows = fwd.logits
        else:   # row offsets: a verifying request spans len(drafts) + 1 rows
            sizes = [len(fwd.spec.get(r, ())) + 1 for r in fwd.req_ids]
            offsets = [0, *itertools.accumulate(sizes)][:-1]
            rows = fwd.logits[[offsets[i] for i in plain]]
            spec_ids = [r for r in fwd.req_ids if r in fwd.spec]
            meta = self.batch.sampling_metadata(spec_ids)
            idx = [j for i, r in enumerate(fwd.req_ids) if r in fwd.spec for j in range(offsets[i], offsets[i] + sizes[i])]
            q = [self.proposer.draft_probs(r) if self.proposer is not None else None for r in spec_ids]
            verified = verify(fwd.logits[idx], meta.params, meta.generators, [fwd.spec[r] for r in spec_ids], q)
            tokens.update(zip(spec_ids, verified))
        if plain:
            ids = [fwd.req_ids[i] for i in plain]
            meta = self.batch.sampling_metadata(ids)
            if fwd.grammar_rows:   # grammar requests never verify drafts: all their rows are plain rows
                constrained = set(fwd.grammar_rows)
                meta.grammar_bitmask = fwd.grammar_bitmask[plain]
                meta.grammar_rows = [j for j, i in enumerate(plain) if i in constrained]
            tokens.update((r, [t]) for r, t in zip(ids, self.sampler(rows, meta)))
        out = ModelRunnerOutput()
        for rid in fwd.req_ids:
            toks = tokens[rid]
            self.batch.append_sampled(rid, [t.token_id for t in toks])
            out.req_ids.append(rid)
            out.sampled_token_ids.append([t.token_id for t in toks])
            out.logprobs.append(None if toks[0].logprobs is None else [t.logprobs for t in toks])
        if self.proposer is not None:
            # no drafts under a grammar: its bitmask constrains one position per step
            grammar = {fwd.req_ids[i] for i in fwd.grammar_rows or ()}
            states = [self.batch.requests[r] for r in fwd.req_ids if r not in grammar]
            out.spec_token_ids = self.proposer.propose(states, len(self.batch.req_ids))
        return out


def attention_inputs(tokens: list[list[int]], starts: list[int], block_ids: list[list[int]], block_size: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids (T,), positions (T,), metadata) for sequences whose query ``tokens[i]`` start at position
    ``starts[i]``, addressed through ``block_ids[i]`` (the runner's rows, and a draft model on its own KV tensor)."""
    q_lens = [len(t) for t in tokens]
    seq_lens = [a + b for a, b in zip(starts, q_lens)]
    max_blocks = max(cdiv(n, block_size) for n in seq_lens)
    rows = []
    for ids, n in zip(block_ids, seq_lens):
        ids = ids[: cdiv(n, block_size)]
        rows.append(ids + [0] * (max_blocks - len(ids)))
    table = torch.tensor(rows, dtype=torch.int32)                                          # (S, max_blocks)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    qsl = torch.zeros(len(tokens) + 1, dtype=torch.int64)
    torch.cumsum(q_lens_t, 0, out=qsl[1:])
    seq_idx = torch.repeat_interleave(torch.arange(len(tokens)), q_lens_t)                    # (T,)
    positions = torch.arange(int(qsl[-1])) - qsl[:-1][seq_idx] + torch.tensor(starts)[seq_idx]
    slots = table[seq_idx, positions // block_size].to(torch.int64) * block_size + positions % block_size
    input_ids = torch.tensor([t for row in tokens for t in row], dtype=torch.int64)
    meta = AttentionMetadata(
        slot_mapping=slots.to(device, non_blocking=True),
        query_start_loc=qsl.to(torch.int32).to(device, non_blocking=True),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
        block_tables=table.to(device, non_blocking=True),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens)
    return input_ids.to(device, non_blocking=True), positions.to(device, non_blocking=True), meta
