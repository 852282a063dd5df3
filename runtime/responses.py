"""OpenAI response bodies built from the engine's cumulative ``RequestOutput``s: whole responses and SSE chunks.

Shapes follow OpenAI (and vLLM's extras): ``text_completion`` / ``chat.completion`` objects with ``usage``
(``prompt_tokens_details.cached_tokens`` included) and a top-level ``kv_transfer_params`` (the P/D handoff, echoed
verbatim from the engine); streams of ``text_completion`` / ``chat.completion.chunk`` objects carrying deltas, where,
with ``stream_options.include_usage``, every chunk has ``usage: null`` and a last chunk with no choices carries it.
Logprobs: completions use ``{tokens, token_logprobs, top_logprobs, text_offset}``; chat uses
``{content: [{token, logprob, bytes, top_logprobs: [...]}]}``.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.outputs import CompletionOutput, PositionLogprobs, RequestOutput


class ResponseBuilder:
    def __init__(self, engine: EngineClient):
        self.model = engine.served_model_name
        self._decode_one = functools.lru_cache(maxsize=65536)(lambda t: engine.tokenizer.decode([t]))

    # ---- whole responses ----
    def full(self, kind: str, req: Any, resp_id: str, prompt_ids: list[int], out: RequestOutput | None) -> dict:
        """The whole response; a completion the server aborted (shutdown) gets ``finish_reason="abort"``."""
        comps = completions(out, req.n)
        choices = []
        for c in comps:
            finish = c.finish_reason or "abort"
            if kind == "chat":
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": self._chat_logprobs(c, 0, req) if req.logprobs else None,
                                "finish_reason": finish, "stop_reason": c.stop_reason})
            else:
                lps = self._completion_logprobs(c, 0, 0, req) if req.logprobs is not None else None
                choices.append({"index": c.index, "text": c.text, "logprobs": lps, "finish_reason": finish,
                                "stop_reason": c.stop_reason})
        return {**self._head(kind, resp_id, chunk=False), "choices": choices,
                "usage": self.usage(prompt_ids, comps, out),
                "kv_transfer_params": out.kv_transfer_params if out is not None else None}

    def usage(self, prompt_ids: list[int], comps: list[CompletionOutput], out: RequestOutput | None) -> dict:
        n_prompt, n_gen = len(prompt_ids), sum(len(c.token_ids) for c in comps)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens if out is not None else 0}}

    def _head(self, kind: str, resp_id: str, *, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if kind == "chat" else "text_completion"
        return {"id": resp_id, "object": obj, "created": int(time.time()), "model": self.model}

    # ---- logprobs ----
    def _ranked(self, pos: PositionLogprobs) -> list[tuple[int, float]]:
        return sorted(pos.items(), key=lambda kv: -kv[1])

    def _completion_logprobs(self, comp: CompletionOutput, start: int, text_start: int, req: Any) -> dict | None:
        if comp.logprobs is None:
            return None
        k = req.logprobs or 0
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = text_start
        for tid, pos in zip(comp.token_ids[start:], comp.logprobs[start:]):
            s = self._decode_one(tid)
            tokens.append(s)
            token_lps.append(pos.get(tid))
            top = {self._decode_one(t): lp for t, lp in self._ranked(pos)[:k]}
            top.setdefault(s, pos.get(tid))
            tops.append(top)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, comp: CompletionOutput, start: int, req: Any) -> dict | None:
        if comp.logprobs is None:
            return None
        k = req.top_logprobs or 0

        def entry(tid: int, lp: float | None) -> dict:
            s = self._decode_one(tid)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        content = []
        for tid, pos in zip(comp.token_ids[start:], comp.logprobs[start:]):
            e = entry(tid, pos.get(tid))
            e["top_logprobs"] = [entry(t, lp) for t, lp in self._ranked(pos)[:k]]
            content.append(e)
        return {"content": content}

    # ---- streaming ----
    def chunker(self, kind: str, req: Any, resp_id: str, prompt_ids: list[int]) -> "Chunker":
        return Chunker(self, kind, req, resp_id, prompt_ids)


def completions(out: RequestOutput | None, n: int) -> list[CompletionOutput]:
    """All ``n`` completions of ``out`` by index (an empty one for an index with no output yet)."""
    by_index = {c.index: c for c in (out.outputs if out is not None else [])}
    return [by_index.get(i) or CompletionOutput(i, "", []) for i in range(n)]


class Chunker:
    """Turns successive cumulative outputs of one request into stream chunks (dicts, one per SSE event); each of the
    ``n`` choices is tracked on its own and gets exactly one chunk carrying its ``finish_reason``."""

    def __init__(self, builder: ResponseBuilder, kind: str, req: Any, resp_id: str, prompt_ids: list[int]):
        self.b, self.kind, self.req, self.resp_id, self.prompt_ids = builder, kind, req, resp_id, prompt_ids
        self.with_usage = req.wants_usage_chunk()
        self.sent_tokens = [0] * req.n
        self.sent_text = [0] * req.n
        self.done = [False] * req.n
        self.last: RequestOutput | None = None

    def _chunk(self, choices: list[dict], usage: dict | None = None, last: bool = False) -> dict:
        c = {**self.b._head(self.kind, self.resp_id, chunk=True), "choices": choices}
        if self.with_usage:
            c["usage"] = usage if last else None
        return c

    def start(self) -> list[dict]:
        if self.kind != "chat":
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.req.n)]

    def update(self, out: RequestOutput | None) -> list[dict]:
        """Chunks for what ``out`` adds; ``None`` means the server aborted the request (unfinished choices end with
        ``finish_reason="abort"``)."""
        aborted = out is None
        out = self.last if aborted else out
        self.last = out
        comps = completions(out, self.req.n)
        chunks = [c for comp in comps if not self.done[comp.index] for c in self._choice_chunks(comp, aborted)]
        if all(self.done) and self.with_usage:
            chunks.append(self._chunk([], self.b.usage(self.prompt_ids, comps, out), last=True))
        return chunks

    def _choice_chunks(self, comp: CompletionOutput, aborted: bool) -> list[dict]:
        i = comp.index
        finish = comp.finish_reason or ("abort" if aborted else None)
        delta_text = comp.text[self.sent_text[i]:]
        new_tokens = len(comp.token_ids) - self.sent_tokens[i]
        chunks = []
        if delta_text or (new_tokens > 0 and comp.logprobs is not None) or (finish and self.kind != "chat"):
            if self.kind == "chat":
                lps = self.b._chat_logprobs(comp, self.sent_tokens[i], self.req) if self.req.logprobs else None
                chunks.append(self._chunk([{"index": i, "delta": {"content": delta_text}, "logprobs": lps,
                                            "finish_reason": None}]))
            else:
                lps = (self.b._completion_logprobs(comp, self.sent_tokens[i], self.sent_text[i], self.req)
                       if self.req.logprobs is not None else None)
                chunks.append(self._chunk([{"index": i, "text": delta_text, "logprobs": lps,
                                            "finish_reason": finish, "stop_reason": comp.stop_reason}]))
        self.sent_text[i] = max(self.sent_text[i], len(comp.text))
        self.sent_tokens[i] = len(comp.token_ids)
        if finish and self.kind == "chat":
            chunks.append(self._chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish,
                                        "stop_reason": comp.stop_reason}]))
        self.done[i] = finish is not None
        return chunks
