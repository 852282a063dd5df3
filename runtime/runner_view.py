"""The scheduler's view of what the model runner holds, so each ``SchedulerOutput`` sends a request whole the first
time (and again after a preemption, when the runner's row was dropped) and as a diff otherwise: the block ids
allocated since the last step, its counters. Requests finished since the last step are listed once, for the runner
to drop their state."""

from __future__ import annotations

from pdserve.runtime.request import Request
from pdserve.runtime.sched_output import CachedRequestData, NewRequestData, SchedulerOutput

_UNSEEN = -1


class RunnerView:
    def __init__(self) -> None:
        self._sent: dict[str, int | None] = {}   # request id -> block ids sent (None: preempted, send whole on resume)
        self._finished: set[str] = set()         # finished since the last step, known to the runner

    def add(self, out: SchedulerOutput, req: Request, block_ids: list[int]) -> None:
        """Send ``req`` (scheduled this step) whole or as a diff."""
        rid = req.request_id
        sent = self._sent.get(rid, _UNSEEN)
        self._sent[rid] = len(block_ids)
        if sent == _UNSEEN:
            out.scheduled_new_reqs.append(NewRequestData(
                rid, list(req.all_token_ids), req.num_prompt_tokens, req.sampling_params, req.eos_token_id, block_ids,
                req.num_computed_tokens, lora_id=req.lora.int_id if req.lora is not None else 0,
                lora_name=req.lora_name))
        else:
            resumed = sent is None
            out.scheduled_cached_reqs.append(CachedRequestData(
                rid, resumed, block_ids if resumed else block_ids[sent:], list(req.all_token_ids) if resumed else [],
                req.num_computed_tokens, req.num_output_tokens))

    def preempted(self, request_id: str) -> None:
        self._sent[request_id] = None

    def finished(self, request_id: str) -> None:
        if self._sent.pop(request_id, _UNSEEN) != _UNSEEN:
            self._finished.add(request_id)

    def take_finished(self) -> set[str]:
        done, self._finished = self._finished, set()
        return done
