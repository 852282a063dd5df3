"""The engine's structured-output stages: requests wait here (not in the scheduler) while their grammar compiles,
each step's bitmask is attached to the scheduler output, and matchers advance over accepted tokens.

A request whose grammar is still compiling holds no blocks and no one up: it reaches the scheduler, in arrival order,
at the first step after its compile ends (a compile that failed or timed out fails it there, with the reason).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from pdserve.runtime.request import Request, RequestStatus
from pdserve.runtime.sched_output import SchedulerOutput
from pdserve.runtime.scheduler import Scheduler
from pdserve.runtime.structured_output.manager import DEAD_END, StructuredOutputManager


class StructuredOutputHooks:
    def __init__(self, manager: StructuredOutputManager, scheduler: Scheduler) -> None:
        self.manager = manager
        self.scheduler = scheduler
        self._waiting: list[Request] = []   # constrained requests whose grammar is still compiling
        self._dead_end: dict[str, str] = {}  # rows whose mask allowed no token this step -> why (their sample is refused)

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def add(self, req: Request) -> None:
        """Queue a constrained request: scheduled once its grammar is compiled."""
        self.manager.add_request(req.request_id, req.sampling_params.structured_outputs)
        self._waiting.append(req)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Drop waiting requests among ``request_ids`` (marked aborted); returns them."""
        gone = set(request_ids)
        aborted = [r for r in self._waiting if r.request_id in gone]
        for req in aborted:
            req.status = RequestStatus.FINISHED_ABORTED
        self._waiting = [r for r in self._waiting if r.request_id not in gone]
        return aborted

    def admit_compiled(self) -> None:
        """Hand requests whose grammar is compiled to the scheduler (in arrival order); fail those whose compile
        failed or timed out. Others keep waiting without holding anyone up."""
        if not self._waiting:
            return
        still = []
        for req in self._waiting:
            try:
                ready = self.manager.ready(req.request_id)
            except ValueError as e:
                self.scheduler.add_request(req)
                self.scheduler.fail_request(req, f"structured output: {e}"[:500])
                continue
            if ready:
                self.scheduler.add_request(req)
            else:
                still.append(req)
        self._waiting = still

    def add_bitmask(self, sched_out: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """The bitmask of the constrained requests that sample this step (their chunk reaches their last token)."""
        if not self.manager.has_requests():
            return
        computed = sched_out.num_computed_tokens()
        ids = [rid for rid, n in sched_out.num_scheduled_tokens.items()
               if self.manager.is_ready(rid) and computed[rid] + n >= requests[rid].num_tokens]
        if not ids:
            return
        sched_out.structured_output_request_ids = ids
        sched_out.grammar_bitmask = bitmask = self.manager.grammar_bitmask(ids)
        reqs = [requests[rid] for rid in ids]
        held = [r.sampling_params.held_back_token_ids(r.eos_token_id, r.num_output_tokens) for r in reqs]
        grammar_allows = bitmask.any(dim=1).tolist() if any(held) else None   # before min_tokens' mask
        for i, h in enumerate(held):
            if h:
                _clear(bitmask[i], h)
        for i, (rid, req, allows) in enumerate(zip(ids, reqs, bitmask.any(dim=1).tolist())):
            self._dead_end.pop(rid, None)
            if allows:
                continue
            # no token left: the grammar's own dead end, or it may only stop and min_tokens holds the stop tokens back
            self._dead_end[rid] = (f"{DEAD_END}: it allows only a stop token after {req.num_output_tokens} tokens, "
                                   f"and min_tokens={req.sampling_params.min_tokens} holds those back"
                                   if grammar_allows and grammar_allows[i] else DEAD_END)

    def advance(self, progressed: list[Request]) -> None:
        """Advance each constrained request's matcher over its newly accepted tokens (see StructuredOutputManager).
        A grammar that accepted its stop token ends the request even under ``ignore_eos``: nothing more may follow."""
        for req in progressed:
            rid = req.request_id
            if not self.manager.has(rid):
                continue
            why = self._dead_end.pop(rid, None)   # a dead-end row's draw is arbitrary (it may even be a stop token)
            if why is not None or not self.manager.accept(rid, req.output_token_ids):
                why = why or "structured output: grammar refused a token"
                if not req.is_finished:
                    self.scheduler.fail_request(req, why)
                req.status, req.error = RequestStatus.FINISHED_ERROR, why
            elif not req.is_finished and self.manager.is_terminated(rid):
                self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)


def _clear(row: torch.Tensor, token_ids: list[int]) -> None:
    """Clear ``token_ids``' bits in one packed int32 bitmask row (in place)."""
    for t in token_ids:
        if 0 <= t < row.numel() * 32:
            row[t // 32] = int(row[t // 32]) & ~(1 << (t % 32))   # a Python int's & keeps the int32 range
