"""Build paged-attention batches by hand for kernel and model tests: sequences grow step by step over blocks drawn from
a shuffled pool, so block tables are non-trivial (permuted, non-contiguous ids)."""

from __future__ import annotations

import torch

from pdserve.kernels.base import AttentionMetadata


class PagedBatchBuilder:
    """Tracks each sequence's length and block table; ``step({seq: num_new})`` describes one forward pass."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0):
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new_tokens: dict[int, int], device: str | torch.device = "cpu") -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata for this step (sequences in dict order) and the (T,) positions of the new tokens."""
        bs = self.block_size
        slots, positions, q_lens, seq_lens = [], [], [], []
        for sid, n in new_tokens.items():
            table = self.tables.setdefault(sid, [])
            start = self.lens.get(sid, 0)
            end = start + n
            while len(table) * bs < end:
                table.append(self.free.pop())
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            positions += list(range(start, end))
            q_lens.append(n)
            seq_lens.append(end)
            self.lens[sid] = end
        width = max(len(self.tables[sid]) for sid in new_tokens)
        tables = [self.tables[sid] + [0] * (width - len(self.tables[sid])) for sid in new_tokens]
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens, seq_lens_cpu=seq_lens,
        )
        return meta, torch.tensor(positions, dtype=torch.int64, device=device)


def run_model_steps(model, seqs: dict[int, torch.Tensor], schedule: list[dict[int, int]], *, num_blocks: int,
                    block_size: int, seed: int) -> dict[int, list[torch.Tensor]]:
    """Run ``schedule`` (per step: seq -> number of new tokens) through ``model`` over a fresh paged cache and collect
    each sequence's logits rows in order."""
    builder = PagedBatchBuilder(num_blocks=num_blocks, block_size=block_size, seed=seed)
    kv = torch.zeros(num_blocks, model.num_layers, 2, block_size, model.num_kv_heads, model.head_dim)
    done = {s: 0 for s in seqs}
    rows: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
    for step in schedule:
        meta, positions = builder.step(step)
        ids = torch.cat([seqs[s][done[s]:done[s] + n] for s, n in step.items()])
        with torch.no_grad():
            logits = model.compute_logits(model(ids, positions, kv, meta))
        for s, chunk in zip(step, logits.split(list(step.values()))):
            rows[s].append(chunk)
            done[s] += step[s]
    return rows
