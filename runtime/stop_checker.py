"""The one place that decides whether a request stops, called once per new token (by the scheduler's update).

Token stops and text stops are decided together, in this order: EOS and ``stop_token_ids`` (only once ``min_tokens``
tokens were generated; EOS not with ``ignore_eos``), then ``max_tokens`` and the context limit, then the stop strings
over the request's incremental detokenization (its text is cut there). A stop token id other than EOS stays in the
token ids but its text is dropped unless ``include_stop_str_in_output``. A stop string found on the token that also hit
a token stop or a length limit becomes the stop reason (the finish reason stays the token's). When a request finishes,
the text its detokenizer still held back is flushed (and checked too).
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.runtime.detokenizer import IncrementalDetokenizer
from pdserve.runtime.request import Request, RequestStatus

StopDecision = tuple[RequestStatus, int | str | None]   # (final status, stop_reason)


class StopChecker:
    def __init__(self, max_len: int, detokenizers: Mapping[str, IncrementalDetokenizer] | None = None) -> None:
        self.max_len = max_len                     # the request's context limit (model and pool)
        self.detokenizers = detokenizers if detokenizers is not None else {}   # request id -> its detokenizer

    def check(self, req: Request, token_id: int) -> StopDecision | None:
        """``token_id`` was just appended to ``req``: feed its text, and return how the request stops, if it does."""
        sp = req.sampling_params
        status, reason = None, None
        if req.num_output_tokens >= sp.min_tokens:
            if token_id == req.eos_token_id and not sp.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token_id in sp.stop_token_ids:
                status, reason = RequestStatus.FINISHED_STOPPED, token_id
        if status is None and (req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_len):
            status = RequestStatus.FINISHED_LENGTH
        detok = self.detokenizers.get(req.request_id)
        if detok is None:
            return None if status is None else (status, reason)
        text_stop = None
        if reason is None or sp.include_stop_str_in_output:
            text_stop = detok.update([token_id])
        if status is not None and text_stop is None:
            text_stop = detok.flush()
        if text_stop is not None:
            return status or RequestStatus.FINISHED_STOPPED, text_stop
        return None if status is None else (status, reason)
