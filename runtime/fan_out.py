"""``n > 1``: one client request fanned out into n child requests that share the prompt's cached blocks, and their
completions merged back into one ``RequestOutput`` per step.

Child ``i`` of request ``R`` is the engine request ``R#i`` with ``n=1`` and, for a seeded request, seed ``seed + i``
(so the n samples differ but replay). The parent's output is finished when every child is; it lists the completions
seen so far in child order (``index`` = i).
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.runtime.outputs import CompletionOutput
from pdserve.runtime.sampling_params import SamplingParams


class FanOut:
    def __init__(self) -> None:
        self._parents: dict[str, list[CompletionOutput | None]] = {}   # client id -> latest completion per child
        self._child_of: dict[str, tuple[str, int]] = {}                # child id -> (client id, index)

    def in_use(self, request_id: str) -> bool:
        """``request_id`` names a fanned-out request or one of its children."""
        return request_id in self._parents or request_id in self._child_of

    @staticmethod
    def children(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """The engine requests (id, params) that serve ``request_id``: itself when ``n == 1``."""
        if params.n == 1:
            return [(request_id, params)]
        return [(f"{request_id}#{i}", replace(params, n=1, seed=None if params.seed is None else params.seed + i))
                for i in range(params.n)]

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
