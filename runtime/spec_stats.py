"""Speculative decoding counters, cumulative, under vLLM's metric names (exposed by runtime/metrics.py):
``vllm:spec_decode_num_drafts`` (verifications of a request's drafts), ``..._num_draft_tokens``,
``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos`` (label ``position``: how often the draft at that
position was accepted; position i counts only if 0..i-1 were accepted too)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's drafts were verified: ``num_accepted`` of its ``num_draft_tokens`` (a prefix) were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos += [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def snapshot(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))
