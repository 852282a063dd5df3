"""Teacher forcing for comparing two engine paths' greedy choices position by position (the CPU kernel tests)."""

from __future__ import annotations


class ForcedSampler:
    """Samples as the engine would, records that token, then returns the reference run's token instead, so that
    both runs see the same contexts (teacher forcing): a rounding difference early cannot cascade into later ones."""

    def __init__(self, inner, reference: dict[str, list[int]] | None) -> None:
        self.inner, self.reference, self.chosen = inner, reference, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, logits, meta):
        from pdserve.runtime.sched_output import SampledToken

        out = []
        for rid, tok in zip(meta.req_ids, self.inner(logits, meta)):
            chosen = self.chosen.setdefault(rid, [])
            chosen.append(tok.token_id)
            out.append(tok if self.reference is None else SampledToken(self.reference[rid][len(chosen) - 1]))
        return out
