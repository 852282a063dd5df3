"""LLMEngine: one step = schedule -> load (connector) -> forward -> sample -> save (connector) -> update -> postprocess.

Single-threaded by contract: the server wraps it in one thread (pdserve.runtime.async_engine). Every call below is
cheap except ``step()``. ``n > 1`` fans a request out into child requests (pdserve.runtime.fan_out); requests with a
grammar wait for its compile outside the scheduler (pdserve.runtime.structured_output.engine_hooks); outputs are
built by pdserve.runtime.output_processor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from pdserve.kv_connectors.base import KVCacheSpec, create_connector
from pdserve.runtime.config import EngineConfig
from pdserve.runtime.detokenizer import IncrementalDetokenizer
from pdserve.runtime.fan_out import FanOut
from pdserve.runtime.kv_events import KVEvent
from pdserve.runtime.model_runner import ModelRunner, determine_num_blocks, kv_block_bytes
from pdserve.runtime.outputs import EngineStats, RequestOutput
from pdserve.runtime.output_processor import OutputProcessor
from pdserve.runtime.quantization import weight_bytes
from pdserve.runtime.request import Request
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sched_output import ModelRunnerOutput, SchedulerOutput
from pdserve.runtime.scheduler import Scheduler
from pdserve.runtime.spec_propose import create_proposer, load_draft_model
from pdserve.runtime.structured_output.engine_hooks import StructuredOutputHooks
from pdserve.runtime.structured_output.manager import StructuredOutputManager
from pdserve.runtime.validation import RequestLimits, check_request

log = logging.getLogger(__name__)


def _is_device_fault(e: BaseException) -> bool:
    """Errors that mean the device (not one request) is broken: the engine must die and report unhealthy."""
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(e, accel)) or "CUDA error" in str(e)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from pdserve.runtime.model_loader import load_model

        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        loaded = load_model(config.model, self.device, config.attention_backend)
        self.model = loaded.model
        self.weight_bytes = weight_bytes(loaded.model)  # what the weights really take, quantized or not
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.hf_config
        self.served_model_name = loaded.served_model_name
        self.max_model_len = loaded.max_model_len
        self.dtype = loaded.dtype
        self.model_path = loaded.model_path
        block_size = config.cache.block_size
        m = self.model
        self.kv_cache_spec = KVCacheSpec(model=self.served_model_name, dtype=str(self.dtype).removeprefix("torch."),
                                         num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                         block_size=block_size)
        spec = config.speculative_config
        draft = load_draft_model(spec, config, loaded, self.device) if spec and spec.method == "draft_model" else None
        block_bytes = kv_block_bytes(m.num_layers, block_size, m.num_kv_heads, m.head_dim, self.dtype)
        if draft is not None:   # the draft's KV blocks share the target's block ids: one block costs both
            block_bytes += kv_block_bytes(draft.num_layers, block_size, draft.num_kv_heads, draft.head_dim, self.dtype)
        num_blocks = determine_num_blocks(config, block_bytes, self.max_model_len, self.device)
        self.runner = ModelRunner(m, num_blocks, block_size, self.dtype, self.device, config.model.seed)
        self.weight_bytes += self.runner.extra_weight_bytes
        self.lora = None
        if config.lora.enable_lora:
            from pdserve.runtime.lora_manager import LoRAManager

            self.lora = self.runner.lora = LoRAManager(m, config.lora, self.device, self.dtype)
            for mod in config.lora.lora_modules:
                self.lora.add(mod.name, mod.path, mod.base_model_name)
        self.connector = None
        kvt = config.kv_transfer
        if kvt.connector:
            self.connector = create_connector(kvt.connector, kvt.role, dict(kvt.config), self.kv_cache_spec)
            self.connector.register_kv_caches(self.runner.kv_cache)
        self._detok: dict[str, IncrementalDetokenizer] = {}   # per unfinished request: its text and stop strings
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, self.max_model_len, self.connector,
                                   kvt.load_failure_policy,
                                   config.lora.max_loras if config.lora.enable_lora else None,
                                   detokenizers=self._detok)
        if spec is not None:
            self.runner.proposer = create_proposer(spec, self.scheduler.max_len, draft, num_blocks, block_size,
                                                   self.dtype, self.device)
            if draft is not None:
                self.scheduler.num_lookahead_tokens = spec.num_speculative_tokens
        sched = config.scheduler
        self.limits = RequestLimits(vocab_size=int(self.hf_config.vocab_size), max_model_len=self.max_model_len,
                                    block_size=block_size, num_blocks=num_blocks,
                                    max_unchunked_prompt=None if sched.enable_chunked_prefill
                                    else sched.max_num_batched_tokens)
        eos = getattr(loaded.hf_config, "eos_token_id", None)
        self.eos_token_id: int | None = eos[0] if isinstance(eos, list) else eos
        if self.eos_token_id is None:
            self.eos_token_id = self.tokenizer.eos_token_id
        so = config.structured_outputs
        self.structured = StructuredOutputManager(
            self.tokenizer, int(self.hf_config.vocab_size), [t for t in (eos if isinstance(eos, list) else
                                                                      [self.eos_token_id]) if t is not None],
            backend=so.backend, cache_size=so.grammar_cache_size, compile_timeout_s=so.grammar_compile_timeout_s)
        self._grammar = StructuredOutputHooks(self.structured, self.scheduler)
        self._requests: dict[str, Request] = {}          # unfinished engine requests (children included)
        self._fan_out = FanOut()                         # n > 1: client id <-> child requests
        self.outputs = OutputProcessor(self._detok, self._fan_out, self.scheduler.finish_request, self._forget)
        log.info("engine ready: %s on %s, %s, %d KV blocks of %d tokens (%.1f MiB)", self.served_model_name,
                 self.device, self.dtype, num_blocks, block_size, self.runner.kv_cache.nbytes / 2**20)

    # ---- requests --------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *, priority: int = 0,
                    cache_salt: str | None = None, kv_transfer_params: dict | None = None,
                    arrival_time: float | None = None, lora_name: str | None = None) -> None:
        """Queue a request. Raises ValueError for a duplicate id or anything ``validation.check_request`` refuses
        (an ``InvalidParam`` naming the field); ``LoRANotFound`` (a KeyError) for an unknown ``lora_name``."""
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if request_id in self._requests or self._fan_out.in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            prompt_text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            prompt_text, token_ids = None, list(prompt)
        max_tokens = check_request(token_ids, params, self.limits, priority=priority)
        children = self._fan_out.children(request_id, params, kv_transfer_params)
        if len(children) > 1 and any(cid in self._requests for cid, _, _ in children):
            raise ValueError(f"request id {request_id!r} is already in use by a child of another request")
        if params.structured_outputs is not None:   # starts its compile; bad JSON text raises here, before any trace
            self.structured.compile(params.structured_outputs)
        # Build everything before registering anything: a failure must leave no trace.
        adapters = self._acquire_loras(lora_name, len(children))
        try:
            reqs = [Request(rid, token_ids, p, block_size=self.config.cache.block_size,
                            eos_token_id=self.eos_token_id, prompt=prompt_text, priority=priority,
                            arrival_time=arrival_time, cache_salt=cache_salt, kv_transfer_params=kv,
                            max_tokens=max_tokens, lora=a)
                    for (rid, p, kv), a in zip(children, adapters)]
            detoks = [IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, p.stop_strings,
                                             p.include_stop_str_in_output) for _, p, _ in children]
        except BaseException:
            for a in adapters:
                if a is not None:
                    self.lora.release(a)
            raise
        if len(reqs) > 1:
            self._fan_out.register(request_id, [req.request_id for req in reqs])
            self._fan_out.share_remote_kv(reqs)
        for req, detok in zip(reqs, detoks):
            self._requests[req.request_id] = req
            self._detok[req.request_id] = detok
            if req.sampling_params.structured_outputs is not None:   # scheduled once its grammar is compiled
                self._grammar.add(req)
            else:
                self.scheduler.add_request(req)

    def _acquire_loras(self, lora_name: str | None, n: int) -> list:
        """The adapter of each of ``n`` child requests (pinned until they are forgotten); Nones for the base model."""
        if lora_name is None:
            return [None] * n
        if self.lora is None:
            from pdserve.runtime.lora_manager import LoRANotFound

            raise LoRANotFound(f"The model `{lora_name}` does not exist (LoRA is not enabled: --enable-lora).")
        return [self.lora.acquire(lora_name) for _ in range(n)]

    def add_lora(self, name: str, path: str, base_model_name: str | None = None):
        """Register (and load) a LoRA adapter; LoRAError with the reason if it cannot be served."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (start with --enable-lora)")
        return self.lora.add(name, path, base_model_name)

    def remove_lora(self, name: str) -> None:
        if self.lora is None:
            raise ValueError("LoRA is not enabled (start with --enable-lora)")
        self.lora.remove(name)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests now (their blocks are freed at once); unknown or finished ids are ignored."""
        engine_ids = self._fan_out.engine_ids([request_ids] if isinstance(request_ids, str) else list(request_ids))
        for req in self.scheduler.abort_requests(engine_ids) + self._grammar.abort(engine_ids):
            self._forget(req.request_id)

    def has_unfinished_requests(self) -> bool:
        """True while requests run or wait, or a KV transfer still holds blocks (keep stepping to release them)."""
        return (self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_kv_transfers()
                or self._grammar.has_waiting())

    # ---- step ------------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. Returns outputs of requests that progressed or finished this step."""
        self._grammar.admit_compiled()                                      # grammars compiled -> schedulable
        sched_out = self.scheduler.schedule()                               # schedule
        self._grammar.add_bitmask(sched_out, self._requests)
        meta = sched_out.kv_connector_metadata
        if self.connector is not None and meta is not None:
            self.connector.start_load_kv(meta)                              # load
        self.runner.update_states(sched_out)
        runner_out = self._execute(sched_out)                               # forward + sample (isolated on failure)
        if self.connector is not None and meta is not None:
            self.connector.save_kv(meta)                                    # save
        progressed = self.scheduler.update_from_output(sched_out, runner_out)   # update
        self._grammar.advance(progressed)
        if not sched_out.num_scheduled_tokens and not progressed:
            time.sleep(0.001)  # only KV transfers in flight (or nothing at all): do not spin a core polling them
        return self.outputs.process(progressed)                             # postprocess

    def _forward_and_sample(self, sched_out: SchedulerOutput, req_ids: list[str] | None = None) -> ModelRunnerOutput:
        fwd = self.runner.execute_model(sched_out, req_ids)                 # forward
        return self.runner.sample(fwd)                                      # sample

    def _execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step. If it raises, run each sequence alone and fail only those that still raise: no counter has
        moved yet and recomputing a sequence writes the same KV to the same slots, so the retry is exact (a seeded
        generator may have advanced, which only changes that request's draw). A device fault stays fatal."""
        try:
            return self._forward_and_sample(sched_out)
        except Exception as e:  # noqa: BLE001
            if _is_device_fault(e) or not sched_out.num_scheduled_tokens:
                raise
            log.exception("step over %d sequences failed; retrying them one by one",
                          len(sched_out.num_scheduled_tokens))
        out = ModelRunnerOutput()
        for rid in sched_out.num_scheduled_tokens:
            try:
                out.extend(self._forward_and_sample(sched_out, [rid]))
            except Exception as e:  # noqa: BLE001
                if _is_device_fault(e):
                    raise
                log.exception("request %s failed in its step", rid)
                req = self._requests.get(rid)
                if req is not None and not req.is_finished:
                    self.scheduler.fail_request(req, f"{type(e).__name__}: {e}"[:500])
        return out

    def _forget(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and req.lora is not None and self.lora is not None:
            self.lora.release(req.lora)
        self._detok.pop(request_id, None)
        self.structured.remove(request_id)

    # ---- introspection (what the server and metrics read; nothing reaches through the engine) ----------------------
    def get_stats(self) -> EngineStats:
        s, kv = self.scheduler, self.scheduler.kv
        return EngineStats(num_running=len(s.running), num_waiting=len(s.waiting), kv_cache_usage=kv.usage(),
                           prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
                           num_preemptions=s.num_preemptions, prompt_tokens=s.prompt_tokens,
                           generation_tokens=s.generation_tokens, kv_load_failures=s.kv_load_failures,
                           recomputed_tokens=s.recomputed_tokens, num_blocks=kv.num_blocks,
                           prefix_cache_partial_hits=kv.partial_block_hits,
                           running_lora_adapters=sorted({r.lora_name for r in s.running if r.lora is not None}),
                           waiting_lora_adapters=sorted({r.lora_name for r in s.waiting if r.lora is not None}),
                           spec_decode=s.spec_stats.snapshot() if self.runner.proposer is not None else None)

    def take_kv_events(self) -> list[KVEvent]:
        """KV events (BlockStored / BlockRemoved / AllBlocksCleared) since the last call, oldest first."""
        return self.scheduler.take_kv_events()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def has_pending_kv_transfers(self) -> bool:
        """Finished requests whose blocks a KV transfer still holds."""
        return self.scheduler.has_pending_kv_transfers()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` under the model's chat template. ValueError if the model has none."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.served_model_name!r} has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def shutdown(self) -> None:
        self.structured.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
            self.connector = None
