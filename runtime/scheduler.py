"""Continuous-batching scheduler: decides, each step, which requests compute how many new tokens.

Every request has ``num_computed_tokens`` chasing ``num_tokens`` (prompt + output). One step spends a token budget
(``max_num_batched_tokens``) first on running requests (decodes and unfinished prefill chunks, in order), then admits
waiting ones (prefix-cache hits and KV-connector tokens count as already computed), up to ``max_num_seqs`` running.
When the pool runs dry, the lowest-priority / latest-arrived running request is preempted by recompute: its blocks are
freed, its counter reset to 0, and it goes back to the front of the queue (its cached blocks usually make the redo cheap).

KV connector hooks follow pdserve.kv_connectors.base exactly. A failed load cuts the request back to the start of its
first invalid block (policy ``recompute``) or finishes it with an error (policy ``fail``); since blocks are published to
the prefix cache only after their KV is verified, an invalid block never has a second owner and is recomputed once.
The scheduler never touches tensors.
"""

from __future__ import annotations

import time
from collections import deque

from pdserve.kv_connectors.base import KVConnectorBase
from pdserve.runtime.config import CacheConfig, SchedulerConfig
from pdserve.runtime.kv_cache_manager import KVCacheManager
from pdserve.runtime.request import Request, RequestStatus
from pdserve.runtime.sched_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int, max_model_len: int,
                 connector: KVConnectorBase | None = None, load_failure_policy: str = "recompute") -> None:
        self.config = config
        self.block_size = cache.block_size
        self.max_model_len = max_model_len
        # A request can never outgrow the whole pool (it would wait forever): cap it there too.
        self.max_len = min(max_model_len, num_blocks * cache.block_size)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.connector = connector
        self.load_failure_policy = load_failure_policy
        self.requests: dict[str, Request] = {}        # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.sending: dict[str, Request] = {}         # finished, blocks held until the connector says sent
        self.aborted_loading: dict[str, Request] = {}  # aborted during an async load; freed when the load ends
        self.finished_out: list[Request] = []         # finished outside update() (e.g. failed loads), to report
        self._num_external: dict[str, int] = {}       # async-load tokens pending per request
        self._bad_blocks: set[int] = set()            # reported invalid, waiting for their async load to end
        # What the model runner holds: request id -> number of block ids sent (None: preempted, send whole on resume).
        self._runner_blocks: dict[str, int | None] = {}
        self._finished_ids: set[str] = set()          # finished since the last schedule(): the runner drops them
        self.num_preemptions = 0
        self.kv_load_failures = 0
        self.recomputed_tokens = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    # ---- queue -----------------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_kv_transfers(self) -> bool:
        return bool(self.sending or self.aborted_loading)

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
        if self._runner_blocks.pop(req.request_id, -1) != -1:
            self._finished_ids.add(req.request_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.request_id in self._num_external:      # a connector is still writing into its blocks
            self.aborted_loading[req.request_id] = req
            return
        self._release(req)

    def fail_request(self, req: Request, error: str) -> None:
        """Finish ``req`` with an error now; the next ``update_from_output`` reports it."""
        req.error = error
        self.finish_request(req, RequestStatus.FINISHED_ERROR)
        self.finished_out.append(req)

    def _release(self, req: Request) -> None:
        if self.connector is not None:
            delay, params = self.connector.request_finished(req, self.kv.get_block_ids(req.request_id))
            req.kv_transfer_params = params
            if delay:
                self.sending[req.request_id] = req
                return
        self.kv.free(req)

    # ---- schedule --------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        out = SchedulerOutput()

        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self._pick_victim()
                vidx = self.running.index(victim)
                for j, (r, n) in enumerate(chosen):
                    if r is victim:
                        del chosen[j]
                        budget += n
                        break
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
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
            self._add_request_data(out, req)
        out.finished_req_ids, self._finished_ids = self._finished_ids, set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta()
        return out

    def _add_request_data(self, out: SchedulerOutput, req: Request) -> None:
        """Send ``req`` to the runner whole (first time), as a diff, or whole again after a preemption."""
        rid, ids = req.request_id, self.kv.get_block_ids(req.request_id)
        sent = self._runner_blocks.get(rid, -1)
        self._runner_blocks[rid] = len(ids)
        if sent == -1:
            out.scheduled_new_reqs.append(NewRequestData(
                rid, list(req.all_token_ids), req.num_prompt_tokens, req.sampling_params, req.eos_token_id, ids,
                req.num_computed_tokens))
        else:
            resumed = sent is None
            out.scheduled_cached_reqs.append(CachedRequestData(
                rid, resumed, ids if resumed else ids[sent:], list(req.all_token_ids) if resumed else [],
                req.num_computed_tokens, req.num_output_tokens))

    def _admit_waiting(self, chosen: list[tuple[Request, int]], budget: int) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._pop_waiting()
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
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
                        self._num_external[req.request_id] = num_external
                        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                        skipped.append(req)
                        continue
                num_computed = num_local + num_external
            else:
                num_computed = req.num_computed_tokens
            num_new = req.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and num_new > budget:
                self.waiting.appendleft(req)
                break
            num_new = min(num_new, budget)
            num_slots = req.num_tokens - num_computed + num_external if num_external else num_new
            if self.kv.allocate_slots(req, num_slots, hits) is None:
                self.waiting.appendleft(req)
                break
            if fresh:
                self.kv.record_prefix_lookup(req.num_tokens, len(hits) * self.block_size)
                if self.connector is not None:
                    self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), num_external)
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chosen.append((req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _pop_waiting(self) -> Request:
        if self.config.policy == "priority":
            best = min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
            self.waiting.remove(best)
            return best
        return self.waiting.popleft()

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._runner_blocks[req.request_id] = None
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
        touched: dict[str, Request] = {}
        invalid = self._poll_connector()
        starts = out.num_computed_tokens()
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or rid in invalid:
                continue
            start = starts[rid]
            self.prompt_tokens += max(0, min(start + n, req.num_prompt_tokens) - start)
            req.num_computed_tokens = start + n
            self.kv.cache_blocks(req, req.num_computed_tokens)
            if self.connector is not None:
                self.connector.request_scheduled_for_save(req, self.kv.get_block_ids(rid), req.num_computed_tokens)
            got = runner_out.get(rid)
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
                self._check_stop(req, token_id)
                if req.is_finished:
                    break
        for req in self.finished_out:
            touched[req.request_id] = req
        self.finished_out = []
        return list(touched.values())

    def _check_stop(self, req: Request, token_id: int) -> None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if token_id == req.eos_token_id and not sp.ignore_eos:
                return self.finish_request(req, RequestStatus.FINISHED_STOPPED)
            if token_id in sp.stop_token_ids:
                return self.finish_request(req, RequestStatus.FINISHED_STOPPED, token_id)
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_len:
            self.finish_request(req, RequestStatus.FINISHED_LENGTH)

    def _poll_connector(self) -> set[str]:
        """Collect finished transfers and load errors; returns ids of running requests whose step must be discarded."""
        if self.connector is None:
            return set()
        sending, recving = self.connector.get_finished()
        self._bad_blocks |= self.connector.get_block_ids_with_load_errors()
        for rid in sending:
            req = self.sending.pop(rid, None)
            if req is not None:
                self.kv.free(req)
        invalid: set[str] = set()
        for req in list(self.running):
            end = req.num_computed_tokens  # still the scheduled-time value: sync loads counted as computed
            if self._handle_invalid(req, end):
                invalid.add(req.request_id)
        for rid in recving:
            if rid not in self._num_external:
                continue
            num_external = self._num_external.pop(rid)
            req = self.aborted_loading.pop(rid, None)
            if req is not None:                  # aborted while loading: the blocks are ours again
                self._release(req)
                continue
            req = self.requests[rid]
            req.status = RequestStatus.WAITING
            if not self._handle_invalid(req, req.num_computed_tokens + num_external):
                req.num_computed_tokens += num_external
                self.kv.cache_blocks(req, req.num_computed_tokens)
            if req.num_cached_tokens < 0 and not req.is_finished:
                req.num_cached_tokens = req.num_computed_tokens
        loading = {b for rid in self._num_external for b in self.kv.get_block_ids(rid)}
        self._bad_blocks &= loading
        return invalid

    def _handle_invalid(self, req: Request, end: int) -> bool:
        """If a block holding tokens < ``end`` is invalid: cut back to its start (recompute) or fail. True if hit."""
        if not self._bad_blocks:
            return False
        ids = self.kv.get_block_ids(req.request_id)
        num_blocks = -(-end // self.block_size)
        first = next((i for i, b in enumerate(ids[:num_blocks]) if b in self._bad_blocks), None)
        if first is None:
            return False
        self._bad_blocks -= set(ids[first:num_blocks])
        self.kv_load_failures += 1
        self.kv.invalidate_from(req, first)
        if self.load_failure_policy == "fail":
            self.fail_request(req, f"KV load failed for block {first} of request {req.request_id!r}")
            return True
        cut = min(first * self.block_size, req.num_computed_tokens if req.status == RequestStatus.RUNNING else end)
        self.recomputed_tokens += end - cut
        req.num_recomputed_tokens += end - cut
        req.num_computed_tokens = cut
        return True
