"""Continuous-batching scheduler: decides, each step, which requests compute how many new tokens.

Every request has ``num_computed_tokens`` chasing ``num_tokens`` (prompt + output). One step spends a token budget
(``max_num_batched_tokens``) first on running requests (decodes and unfinished prefill chunks, in order), then admits
waiting ones (prefix-cache hits and KV-connector tokens count as already computed), up to ``max_num_seqs`` running.
When the pool runs dry, a running request (pdserve.runtime.sched_policy picks which) is preempted by recompute: its blocks are
freed, its counter reset to 0, and it goes back to the front of the queue (its cached blocks usually make the redo cheap).

KV connector hooks follow pdserve.kv_connectors.base exactly; the transfer bookkeeping (async loads, blocks held for a
remote reader, recovery from failed loads) is the ``KVTransferTracker``'s. Whether a request stops after a token is
the ``StopChecker``'s decision. Each step's ``SchedulerOutput`` sends a request to the model runner whole the first
time and as a diff afterwards (pdserve.runtime.runner_view, pdserve.runtime.sched_output). Who is admitted or
preempted next is pdserve.runtime.sched_policy's choice. The scheduler never touches tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

from pdserve.kv_connectors.base import KVConnectorBase
from pdserve.runtime.config import CacheConfig, SchedulerConfig
from pdserve.runtime.detokenizer import IncrementalDetokenizer
from pdserve.runtime.kv_cache_manager import KVCacheManager
from pdserve.runtime.kv_events import KVEvent
from pdserve.runtime.kv_transfer_tracker import KVTransferTracker, waits_for_kv_leader
from pdserve.runtime.request import Request, RequestStatus
from pdserve.runtime.runner_view import RunnerView
from pdserve.runtime.sched_output import ModelRunnerOutput, SchedulerOutput
from pdserve.runtime.sched_policy import lora_fits, pick_victim, pop_waiting
from pdserve.runtime.spec_stats import SpecDecodingStats
from pdserve.runtime.stop_checker import StopChecker


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int, max_model_len: int,
                 connector: KVConnectorBase | None = None, load_failure_policy: str = "recompute",
                 max_loras: int | None = None,
                 detokenizers: Mapping[str, IncrementalDetokenizer] | None = None) -> None:
        self.config = config
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        # A request can never outgrow the whole pool (it would wait forever): cap it there too.
        self.max_len = min(max_model_len, num_blocks * cache.block_size)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.connector = connector
        self.kv_transfers = None if connector is None else KVTransferTracker(
            connector, self.kv, load_failure_policy, self.fail_request, lambda req: self.finished_out.append(req))
        self.stop_checker = StopChecker(self.max_len, detokenizers)
        self.max_loras = max_loras                    # distinct LoRA adapters among running requests (device slots)
        self.requests: dict[str, Request] = {}        # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_out: list[Request] = []         # finished outside update() (e.g. failed loads), to report
        self.runner_view = RunnerView()               # what the model runner holds: whole once, then diffs
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_lookahead_tokens = 0                 # extra slots a draft model writes its drafts' KV into
        self.spec_stats = SpecDecodingStats()

    # ---- queue -----------------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_kv_transfers(self) -> bool:
        return self.kv_transfers is not None and self.kv_transfers.has_pending()

    @property
    def kv_load_failures(self) -> int:
        return 0 if self.kv_transfers is None else self.kv_transfers.kv_load_failures

    @property
    def recomputed_tokens(self) -> int:
        return 0 if self.kv_transfers is None else self.kv_transfers.recomputed_tokens

    def take_kv_events(self) -> list[KVEvent]:
        return self.kv.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def abort_requests(self, request_ids) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish_request(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
        return aborted

    def finish_request(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Finish now and free its blocks (unless a connector holds them, or an async load is still writing them)."""
        req.status, req.stop_reason = status, stop_reason
        self.requests.pop(req.request_id, None)
        self.runner_view.finished(req.request_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.kv_transfers is not None:
            self.kv_transfers.on_finish(req)
        else:
            self.kv.free(req)

    def fail_request(self, req: Request, error: str) -> None:
        """Finish ``req`` with an error now; the next ``update_from_output`` reports it."""
        req.error = error
        self.finish_request(req, RequestStatus.FINISHED_ERROR)
        self.finished_out.append(req)

    # ---- schedule --------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        out = SchedulerOutput()

        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._drafts(req, budget)
            if drafts and (self.kv.allocate_slots(req, num_new + len(drafts) + self.num_lookahead_tokens) is not None
                           or self.kv.allocate_slots(req, num_new + len(drafts)) is not None):
                num_new += len(drafts)                  # drafts are extra query tokens of this step
                out.scheduled_spec_decode_tokens[req.request_id] = drafts
            while self.kv.allocate_slots(req, num_new) is None:
                victim = pick_victim(self.running, self.config.policy)
                vidx = self.running.index(victim)
                for j, (r, n) in enumerate(chosen):
                    if r is victim:
                        del chosen[j]
                        budget += n
                        break
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                out.scheduled_spec_decode_tokens.pop(victim.request_id, None)
                if vidx < idx:
                    idx -= 1
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            chosen.append((req, num_new))
            budget -= num_new
            idx += 1

        if not out.preempted_req_ids:
            budget = self._admit_waiting(chosen, budget)

        for req, n in chosen:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            out.num_scheduled_tokens[req.request_id] = n
            self.runner_view.add(out, req, self.kv.get_block_ids(req.request_id))
        out.finished_req_ids = self.runner_view.take_finished()
        out.kv_block_copies = self.kv.take_copies()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta()
        return out

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """The request's proposed drafts that fit this step: only at its decode point, within the token budget and
        never more than can be emitted before max_tokens / max_len (a step emits at most drafts + 1 tokens)."""
        if not req.spec_token_ids or req.num_tokens - req.num_computed_tokens != 1:
            return []
        room = min(budget - 1, req.max_tokens - req.num_output_tokens - 1, self.max_len - req.num_tokens - 1)
        return req.spec_token_ids[:max(0, room)]

    def _admit_waiting(self, chosen: list[tuple[Request, int]], budget: int) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = pop_waiting(self.waiting, self.config.policy)
            if (req.status == RequestStatus.WAITING_FOR_REMOTE_KVS or waits_for_kv_leader(req)
                    or not lora_fits(req, self.running, self.max_loras)):
                skipped.append(req)
                continue
            hits: list = []
            num_external, fresh = 0, req.request_id not in self.kv.req_to_blocks
            if fresh:
                hits, num_local = self.kv.get_computed_blocks(req)
                if self.connector is not None:
                    n, is_async = self.connector.get_num_new_matched_tokens(req, num_local)
                    num_external = n or 0
                    if is_async and num_external > 0:
                        # Slots for the whole prompt (the connector contract); loads fill the external part.
                        if self.kv.allocate_slots(req, req.num_tokens - num_local, hits) is None:
                            self.waiting.appendleft(req)
                            break
                        self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id),
                                                                num_external)
                        req.num_computed_tokens = num_local
                        self.kv.record_prefix_lookup(req.num_tokens, num_local)
                        self.kv_transfers.start_load(req, num_external)
                        skipped.append(req)
                        continue
                # A load covering the whole prompt still leaves its last token to compute (its logits are needed):
                # it is recomputed, rewriting its slot in the loaded last block.
                num_computed = min(num_local + num_external, req.num_tokens - 1)
                # past the full blocks, the leading tokens of a cached block that begins the same way: copied
                partial = None if num_external else self.kv.get_partial_hit(req, hits)
                n_partial = partial[1] if partial else 0
                num_computed += n_partial
            else:
                num_computed, partial, n_partial = req.num_computed_tokens, None, 0
            num_new = req.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                self.waiting.appendleft(req)
                break
            num_new = min(num_new, budget)
            num_slots = req.num_tokens - num_local if num_external else num_new + n_partial
            if self.kv.allocate_slots(req, num_slots, hits, partial) is None:
                self.waiting.appendleft(req)
                break
            if fresh:
                self.kv.record_prefix_lookup(req.num_tokens, len(hits) * self.block_size, n_partial)
                if self.connector is not None:
                    self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), num_external)
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:   # the usage's cached_tokens: whole blocks only (README, side channel)
                req.num_cached_tokens = num_computed - n_partial
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chosen.append((req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.spec_token_ids = []
        self.runner_view.preempted(req.request_id)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- update ----------------------------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Advance counters by what ran, append sampled tokens, apply token-level stops. Returns the requests that
        progressed (got a token, finished, or failed) this step."""
        self.kv.release_copy_sources()   # the step's KV copies ran before its forward
        touched: dict[str, Request] = {}
        invalid = set() if self.kv_transfers is None else self.kv_transfers.poll(self.running, self.requests)
        starts = out.num_computed_tokens()
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or rid in invalid:
                continue
            start = starts[rid]
            self.prompt_tokens += max(0, min(start + n, req.num_prompt_tokens) - start)
            got = runner_out.get(rid)
            drafts = out.scheduled_spec_decode_tokens.get(rid)
            computed = start + n
            if drafts and got is not None:
                # Rejected drafts' KV slots roll back: only accepted tokens count as computed (the next step rewrites
                # those slots, and blocks are hashed only up to num_computed_tokens).
                num_accepted = len(got[0]) - 1
                computed -= len(drafts) - num_accepted
                self.spec_stats.observe(len(drafts), num_accepted)
            # Accepted drafts are not in all_token_ids yet: hash only what is there now (the rest after appending).
            req.num_computed_tokens = min(computed, req.num_tokens)
            self.kv.cache_blocks(req, req.num_computed_tokens)
            if self.connector is not None:
                self.connector.request_scheduled_for_save(req, self.kv.get_block_ids(rid), req.num_computed_tokens)
            req.num_computed_tokens = computed
            if got is None:
                continue
            token_ids, logprobs = got
            touched[rid] = req
            for k, token_id in enumerate(token_ids):
                req.append_output_token(token_id)
                self.generation_tokens += 1
                if req.logprobs is not None:
                    lp = logprobs[k] if logprobs else {}
                    req.logprobs.append(lp)
                    req.cumulative_logprob += lp.get(token_id, 0.0)
                if self._check_stop(req, token_id):   # the rest of an accepted run is dropped, as if never sampled
                    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                    break
            if drafts and not req.is_finished:
                self.kv.cache_blocks(req, req.num_computed_tokens)
            req.spec_token_ids = [] if req.is_finished else runner_out.spec_token_ids.get(rid, [])
        for req in self.finished_out:
            touched[req.request_id] = req
        self.finished_out = []
        return list(touched.values())

    def _check_stop(self, req: Request, token_id: int) -> bool:
        """Finish ``req`` if ``token_id`` stops it; True if it did. A stop check that raises (e.g. its detokenizer)
        fails only this request."""
        try:
            decision = self.stop_checker.check(req, token_id)
        except Exception as e:  # noqa: BLE001
            self.fail_request(req, f"{type(e).__name__}: {e}"[:500])
            return True
        if decision is not None:
            self.finish_request(req, *decision)
        return decision is not None
