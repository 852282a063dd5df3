"""``n > 1``: one client request fanned out into n child requests that share the prompt's cached blocks, and their
completions merged back into one ``RequestOutput`` per step.

Child ``i`` of request ``R`` is the engine request ``R#i`` with ``n=1`` and, for a seeded request, seed ``seed + i``
(so the n samples differ but replay). The parent's output is finished when every child is; it lists the completions
seen so far in child order (``index`` = i).

P/D: one copy of the prompt's KV moves once. A prefill handoff (``do_remote_decode``) is not fanned out: its sampled
token is discarded and ``n`` only shapes the decode side's sampling, so one request computes the prompt and one lease
hands it off (n children would each pin a lease that only one decode reader ever releases). On the decode side
(``do_remote_prefill``) only child 0 carries the ``kv_transfer_params``: it loads the prompt once; its siblings name it
their ``kv_leader`` and are not admitted until it has landed (runtime/kv_transfer_tracker.waits_for_kv_leader), then
hit the local prefix cache.
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.runtime.outputs import CompletionOutput
from pdserve.runtime.request import Request
from pdserve.runtime.sampling_params import SamplingParams


class FanOut:
    def __init__(self) -> None:
        self._parents: dict[str, list[CompletionOutput | None]] = {}   # client id -> latest completion per child
        self._child_of: dict[str, tuple[str, int]] = {}                # child id -> (client id, index)

    def in_use(self, request_id: str) -> bool:
        """``request_id`` names a fanned-out request or one of its children."""
        return request_id in self._parents or request_id in self._child_of

    @staticmethod
    def children(request_id: str, params: SamplingParams, kv_transfer_params: dict | None = None,
                 ) -> list[tuple[str, SamplingParams, dict | None]]:
        """The engine requests (id, params, kv_transfer_params) that serve ``request_id``: itself alone when
        ``n == 1`` or for a prefill handoff; else n children, only the first carrying an incoming remote prefill."""
        kv = kv_transfer_params or {}
        if params.n == 1 or kv.get("do_remote_decode"):
            return [(request_id, replace(params, n=1) if params.n > 1 else params, kv_transfer_params)]
        remote = bool(kv.get("do_remote_prefill"))
        return [(f"{request_id}#{i}", replace(params, n=1, seed=None if params.seed is None else params.seed + i),
                 kv_transfer_params if i == 0 or not remote else None) for i in range(params.n)]

    @staticmethod
    def share_remote_kv(reqs: list[Request]) -> None:
        """Children whose prompt KV only child 0 loads wait for it (``kv_leader``) instead of reading the lease."""
        for req in reqs[1:]:
            if req.kv_transfer_params is None and reqs[0].kv_transfer_params is not None:
                req.kv_leader = reqs[0]

    def register(self, request_id: str, child_ids: list[str]) -> None:
        """Start merging the children of ``request_id`` (only for ``n > 1``)."""
        self._parents[request_id] = [None] * len(child_ids)
        self._child_of.update({cid: (request_id, i) for i, cid in enumerate(child_ids)})

    def engine_ids(self, request_ids: list[str]) -> list[str]:
        """The engine requests to abort for these client ids; fanned-out ones are forgotten."""
        out = []
        for rid in request_ids:
            completions = self._parents.pop(rid, None)
            if completions is None:
                out.append(rid)
                continue
            children = [f"{rid}#{i}" for i in range(len(completions))]
            for cid in children:
                self._child_of.pop(cid, None)
            out += children
        return out

    def is_child(self, request_id: str) -> bool:
        return request_id in self._child_of

    def merge(self, child_id: str, completion: CompletionOutput) -> tuple[str, list[CompletionOutput], bool] | None:
        """Record a child's latest completion -> (client id, its completions so far, all finished); None if the
        parent is gone (aborted)."""
        request_id, index = self._child_of[child_id]
        completions = self._parents.get(request_id)
        if completions is None:
            return None
        completion.index = index
        completions[index] = completion
        finished = all(c is not None and c.finished for c in completions)
        if finished:
            del self._parents[request_id]
            for i in range(len(completions)):
                self._child_of.pop(f"{request_id}#{i}", None)
        return request_id, [c for c in completions if c is not None], finished
