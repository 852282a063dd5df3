"""KV-transfer bookkeeping the scheduler delegates: async loads in flight, blocks held for a remote reader, and
recovery from blocks whose load failed.

The scheduler decides *what* runs; this tracker follows the connector's side of each request (the call order is in
pdserve.kv_connectors.base):

- an async load (``start_load``) keeps the request in WAITING_FOR_REMOTE_KVS until ``get_finished`` lists it received;
  then its loaded tokens count as computed (or it is cut back, see below) and it may be scheduled;
- a request finished while its load is still writing into its blocks is parked in ``aborted_loading`` and released
  only when the load ends (its blocks must not get a new owner while a connector writes them);
- ``release`` asks the connector whether it still reads the blocks (``delay_free``: a prefill handoff); such a request
  waits in ``sending`` until the connector says sent, then its blocks are freed. A handoff whose blocking part runs
  on the connector's thread (``pending``) also waits in ``awaiting_params`` (``req.handoff_pending``: the engine holds
  its response) until the connector settles its params; it is then reported again, finished, with them;
- a block reported invalid cuts every request holding it back to the start of its first invalid block (policy
  ``recompute``) or fails the request (policy ``fail``). Blocks reach the prefix cache only after their KV is verified,
  so an invalid block has no second owner and is recomputed once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pdserve.kv_connectors.base import KVConnectorBase
from pdserve.runtime.kv_cache_manager import KVCacheManager
from pdserve.runtime.request import Request, RequestStatus


def waits_for_kv_leader(req: Request) -> bool:
    """An ``n > 1`` sibling on the decode side waits until child 0 (its ``kv_leader``) has landed the remote prompt KV
    (sampled a token, so its blocks are in the prefix cache) or finished: it then hits the prefix cache instead of
    reading the lease a second time (runtime/fan_out.py)."""
    leader = req.kv_leader
    if leader is None:
        return False
    if leader.is_finished or leader.num_output_tokens > 0:
        req.kv_leader = None
        return False
    return True


class KVTransferTracker:
    def __init__(self, connector: KVConnectorBase, kv: KVCacheManager, load_failure_policy: str,
                 fail_request: Callable[[Request, str], None], report: Callable[[Request], None]) -> None:
        self.connector = connector
        self.kv = kv
        self.block_size = kv.block_size
        self.load_failure_policy = load_failure_policy
        self._fail_request = fail_request                 # the scheduler's: finish with an error, report next update
        self._report = report                             # the scheduler's: report a finished request next update
        self.awaiting_params: dict[str, Request] = {}     # finished, response held until its handoff params settle
        self.sending: dict[str, Request] = {}             # finished, blocks held until the connector says sent
        self.aborted_loading: dict[str, Request] = {}     # finished during an async load; freed when the load ends
        self._num_external: dict[str, int] = {}           # async-load tokens pending per request
        self._bad_blocks: set[int] = set()                # reported invalid, waiting for their async load to end
        self.kv_load_failures = 0
        self.recomputed_tokens = 0

    def has_pending(self) -> bool:
        """Blocks still held for a transfer (keep stepping so they are released)."""
        return bool(self.sending or self.aborted_loading or self.awaiting_params)

    def start_load(self, req: Request, num_external: int) -> None:
        """``req``'s blocks are allocated and an async load of ``num_external`` tokens into them has been requested."""
        self._num_external[req.request_id] = num_external
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS

    def on_finish(self, req: Request) -> None:
        """``req`` finished: free its blocks, unless a load still writes them or the connector still reads them."""
        if req.request_id in self._num_external:
            self.aborted_loading[req.request_id] = req
            return
        self.release(req)

    def release(self, req: Request) -> None:
        delay, params, pending = self.connector.start_request_finished(req, self.kv.get_block_ids(req.request_id))
        if pending:
            req.handoff_pending = True
            self.awaiting_params[req.request_id] = req
        else:
            req.kv_transfer_params = params
        if delay:
            self.sending[req.request_id] = req
            return
        self.kv.free(req)

    def poll(self, running: Iterable[Request], requests: dict[str, Request]) -> set[str]:
        """Collect finished transfers and load errors. Returns the ids of running requests whose step must be
        discarded (cut back or failed); loads that ended make their requests WAITING again."""
        for rid, params in self.connector.get_finished_handoffs().items():
            req = self.awaiting_params.pop(rid, None)
            if req is not None:
                req.kv_transfer_params, req.handoff_pending = params, False
                self._report(req)
        sending, recving = self.connector.get_finished()
        self._bad_blocks |= self.connector.get_block_ids_with_load_errors()
        for rid in sending:
            req = self.sending.pop(rid, None)
            if req is not None:
                self.kv.free(req)
        invalid: set[str] = set()
        for req in list(running):
            end = req.num_computed_tokens  # still the scheduled-time value: sync loads counted as computed
            if self._handle_invalid(req, end):
                invalid.add(req.request_id)
        for rid in recving:
            if rid not in self._num_external:
                continue
            num_external = self._num_external.pop(rid)
            req = self.aborted_loading.pop(rid, None)
            if req is not None:                  # aborted while loading: the blocks are ours again
                self.release(req)
                continue
            req = requests[rid]
            req.status = RequestStatus.WAITING
            end = min(req.num_computed_tokens + num_external, req.num_tokens - 1)   # the last token is recomputed
            if not self._handle_invalid(req, end):
                req.num_computed_tokens = end
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
            self._fail_request(req, f"KV load failed for block {first} of request {req.request_id!r}")
            return True
        cut = min(first * self.block_size, req.num_computed_tokens if req.status == RequestStatus.RUNNING else end)
        self.recomputed_tokens += end - cut
        req.num_recomputed_tokens += end - cut
        req.num_computed_tokens = cut
        return True
