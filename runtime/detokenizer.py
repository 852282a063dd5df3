"""Incremental detokenization and stop strings for one request.

Text grows by decoding a short window of the newest tokens (``prefix_offset .. read_offset`` is context already turned
into text, so byte-level BPE merges and spacing come out exactly as a full ``tokenizer.decode`` would). A window that
ends in an incomplete UTF-8 character ("\\ufffd") waits for the next token. While the request runs, the last
``max_stop_len - 1`` characters are held back from ``output_text`` so a stop string is never streamed and then cut.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string that matched (text is then cut), else None."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            return None
        before = len(self.text)
        self.text += new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        if self.stop:
            return self._check_stop(before)
        return None

    def _check_stop(self, before: int) -> str | None:
        start = max(0, before - self.hold)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stopped_by = s
        return s

    def flush(self) -> str | None:
        """At finish: emit whatever a held window still holds (e.g. a token that really decodes to U+FFFD)."""
        if self.read_offset >= len(self.token_ids) or self.stopped_by is not None:
            return None
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        before = len(self.text)
        self.text += self._decode(self.token_ids[self.prefix_offset:])[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return self._check_stop(before) if self.stop else None

    def output_text(self, finished: bool) -> str:
        if finished or not self.stop or self.hold == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold)]
