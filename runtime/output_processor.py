"""The engine's postprocess stage: requests that progressed in a step -> the client's cumulative ``RequestOutput``s.

Text comes from each request's incremental detokenizer (its stops were already decided by the scheduler's stop
checker); ``n > 1`` children are merged into their client request (pdserve.runtime.fan_out); a finished prefill
handoff whose ``kv_transfer_params`` are still being produced off the engine thread (``req.handoff_pending``) gets no
output until the KV-transfer tracker reports it again with them. A request whose postprocessing raises ends in an
error output; the engine keeps running.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from pdserve.runtime.detokenizer import IncrementalDetokenizer
from pdserve.runtime.fan_out import FanOut
from pdserve.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pdserve.runtime.request import Request, RequestStatus

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, detokenizers: Mapping[str, IncrementalDetokenizer], fan_out: FanOut,
                 finish: Callable[[Request, RequestStatus], None], forget: Callable[[str], None]) -> None:
        self.detokenizers = detokenizers   # one per unfinished request (the engine registers and forgets them)
        self.fan_out = fan_out
        self._finish = finish              # the scheduler's finish_request
        self._forget = forget              # the engine's: drop a finished request and what it pinned

    def process(self, progressed: list[Request]) -> list[RequestOutput]:
        now = time.time()
        outputs = []
        for req in progressed:
            if req.request_id not in self.detokenizers:   # forgotten already (aborted)
                continue
            if req.first_token_time is None and req.num_output_tokens:
                req.first_token_time = now
            try:
                out = self._output(req)
            except Exception as e:  # noqa: BLE001 - one request's bug must not take the engine down
                log.exception("postprocessing request %s failed", req.request_id)
                out = self._fail_output(req, e)
            if out is not None:
                outputs.append(out)
        return outputs

    def _output(self, req: Request) -> RequestOutput | None:
        if req.handoff_pending:   # finished, but its kv_transfer_params are not valid yet: reported again once they are
            return None
        detok = self.detokenizers[req.request_id]
        completion = CompletionOutput(
            index=0, text=detok.output_text(req.is_finished), token_ids=list(req.output_token_ids),
            finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None)
        if req.is_finished:
            self._forget(req.request_id)
        return self._make_output(req, completion)

    def _fail_output(self, req: Request, error: Exception) -> RequestOutput | None:
        """The error output of a request whose postprocessing raised (it is finished and forgotten)."""
        if not req.is_finished:
            self._finish(req, RequestStatus.FINISHED_ERROR)
        req.status = RequestStatus.FINISHED_ERROR
        req.error = f"{type(error).__name__}: {error}"[:500]
        self._forget(req.request_id)
        return self._make_output(req, CompletionOutput(index=0, text="", token_ids=list(req.output_token_ids),
                                                       finish_reason="error", stop_reason=None))

    def _make_output(self, req: Request, completion: CompletionOutput) -> RequestOutput | None:
        metrics = RequestMetrics(arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
                                 first_token_time=req.first_token_time,
                                 finished_time=time.time() if req.is_finished else None,
                                 num_preemptions=req.num_preemptions, num_recomputed_tokens=req.num_recomputed_tokens,
                                 kv_transfer=req.kv_transfer or None)
        request_id, outs, finished = req.request_id, [completion], req.is_finished
        if self.fan_out.is_child(req.request_id):
            merged = self.fan_out.merge(req.request_id, completion)
            if merged is None:   # the client request was aborted
                return None
            request_id, outs, finished = merged
        return RequestOutput(request_id=request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=outs, finished=finished, num_cached_tokens=max(0, req.num_cached_tokens),
                             kv_transfer_params=req.kv_transfer_params if req.is_finished else None,
                             metrics=metrics, error=req.error)
