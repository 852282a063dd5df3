"""pdserve's bf16 CPU kernels vs the torch paths they replace, same inputs, same run (per call, median of repeats).

- Prefill attention (kernels/paged_prefill_cpu.py, AMX) vs the torch path (SDPA per sequence, plus the gathered
  context and mask of a chunk that continues a cached prefix), both through ``paged_attention_ref`` with the step's
  plan, as the engine calls them: whole prompts of 64-2,048 tokens, a 256-token chunk after 394 cached tokens, 24 or
  32 new tokens after ~1,000 cached (32 after 992: the ``engine_throughput.py --mode ttft-prefix`` request), a step of
  four chunks after cached prefixes and a step of 8 mixed prompts. Default model shapes: 9 heads, 3 KV heads,
  head_dim 64, block 16.
- Decode attention (kernels/paged_decode_cpu.py) vs the torch path (padded gather + GEMMs), all 30 layers of an
  engine-shaped bf16 cache, 1-64 sequences.
- Decode's linears (kernels/amx_linear.py, AMX) vs oneDNN's packed linear (kernels/packed_linear.py): all 121 dense
  linears of the default model at 1-512 rows (the engine uses the AMX kernel up to 32 rows).
- ``--lossless``: the AMX linear over the default model's 120 real decoder weights in plain bf16 tiles vs their
  lossless 12-bit form (kernels/bf16_codec.py), 1-32 rows, alternated, outputs compared bit for bit.
- The fused elementwise ops (kernels/fused_cpu.py) vs the eager chains: RMSNorm, residual add + RMSNorm, RoPE on the
  q/k view, SiLU(gate) * up, at 32, 512 and 2,048 rows (hidden 576, intermediate 1,536).

    python benchmarks/cpu_kernels.py [--threads 1]
    python benchmarks/cpu_kernels.py --compare-decode <git revision>   # the decode kernel then vs now
    python benchmarks/cpu_kernels.py --compare-prefill <git revision>  # the prefill kernel then vs now
    python benchmarks/cpu_kernels.py --compare-linear <git revision>   # the AMX linear then vs now
    python benchmarks/cpu_kernels.py --lossless                        # plain tiles vs the coded weights
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from attention import bench, make_batch
from pdserve.kernels import amx_linear, fused_cpu, paged_prefill_cpu, torch_ref
from pdserve.kernels.packed_linear import PackedLinear
from pdserve.runtime.models.llama import RMSNorm, rotate_half

H, HKV, D, BS = 9, 3, 64, 16
PREFILL_STEPS = {  # name: (new tokens, whole length) of each sequence of one step
    "1 prompt of 64": ([64], [64]), "1 prompt of 340": ([340], [340]), "1 prompt of 650": ([650], [650]),
    "1 prompt of 2,048": ([2048], [2048]), "256-token chunk after 394 cached": ([256], [650]),
    "24 new tokens after 1,000 cached": ([24], [1024]),
    "32 new tokens after 992 cached (ttft-prefix)": ([32], [1024]),
    "4 chunks after cached prefixes (one step)": ([5, 1, 17, 3], [900, 40, 17, 300]),
    "8 prompts of 30-650 (one step)": ([30, 90, 170, 250, 330, 410, 490, 650],) * 2}


def timed(fn, repeat: int) -> float:
    """Median ms per call."""
    return bench(fn, "cpu", repeat) * 1e3


def prefill(q_lens: list[int], seq_lens: list[int], repeat: int) -> tuple[float, float]:
    kv, meta = make_batch(q_lens, seq_lens, BS, HKV, D, torch.bfloat16, "cpu")
    q = torch.randn(sum(q_lens), H, D).bfloat16()
    out = {}
    for path in ("torch", "paged"):
        plan = torch_ref.plan_step(meta, BS, q.device, paged_prefill=path == "paged")
        out[path] = timed(lambda: torch_ref.paged_attention_ref(q, kv, meta, D ** -0.5, plan=plan), repeat)
    return out["torch"], out["paged"]


def elementwise(rows: int, repeat: int) -> dict[str, tuple[float, float]]:
    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(rows, 576, generator=gen).bfloat16() for _ in range(2))
    qkv = torch.randn(rows, 960, generator=gen).bfloat16()
    qk = qkv[:, :768].view(rows, 12, D)
    cos, sin = (torch.randn(rows, 1, D, generator=gen).bfloat16() for _ in range(2))
    gate_up = torch.randn(rows, 3072, generator=gen).bfloat16()
    norm = RMSNorm(576, 1e-5).bfloat16()
    ops = torch.ops.pdserve_fused_cpu
    cases = {
        "RMSNorm": (lambda: norm(x), lambda: ops.rms_norm(x, None, norm.weight, 1e-5)),
        "add + RMSNorm": (lambda: norm(res + x), lambda: ops.rms_norm(x, res, norm.weight, 1e-5)),
        "RoPE (q and k)": (lambda: qk * cos + rotate_half(qk) * sin, lambda: ops.rope(qk, cos, sin)),
        "SiLU(gate) * up": (lambda: F.silu(gate_up[:, :1536]).mul_(gate_up[:, 1536:]), lambda: ops.silu_mul(gate_up)),
    }
    os.environ["PDSERVE_CPU_FUSED_ELEMENTWISE"] = "0"   # RMSNorm's own forward: the eager chain
    out = {name: (timed(eager, repeat), timed(fused, repeat)) for name, (eager, fused) in cases.items()}
    os.environ.pop("PDSERVE_CPU_FUSED_ELEMENTWISE")
    return out


def decode_inputs(seqs: int, context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An engine-shaped bf16 cache of 30 layers (block-major: a block holds every layer's K and V, so each layer's rows
    of consecutive blocks lie ~370 KB apart, out of the CPU's caches like a serving engine's), shuffled block tables
    (int64) of ``seqs`` sequences of ``context`` tokens, float32 queries."""
    nb = -(-context // BS)
    num_blocks = max(seqs * nb + 1, 2048)
    gen = torch.Generator().manual_seed(seqs)
    cache = torch.randn(num_blocks, 30, 2, BS, HKV, D, generator=gen).bfloat16()
    tables = torch.randperm(num_blocks, generator=gen)[:seqs * nb].view(seqs, nb).contiguous()
    return cache, tables, torch.randn(seqs, H, D, generator=gen)


def decode(seqs: int, context: int, repeat: int) -> tuple[float, float]:
    """Decode attention over :func:`decode_inputs`, all 30 layers: the torch path (padded gather + GEMMs) vs the paged
    kernel, ms."""
    from pdserve.kernels.base import AttentionMetadata

    cache, tables, q = decode_inputs(seqs, context)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(seqs, dtype=torch.long), query_start_loc=torch.arange(seqs + 1, dtype=torch.int32),
        seq_lens=torch.full((seqs,), context, dtype=torch.int32), block_tables=tables.int(), max_query_len=1,
        max_seq_len=context, query_lens_cpu=[1] * seqs, seq_lens_cpu=[context] * seqs)
    q = q.bfloat16()
    out = {}
    for paged in (False, True):
        plan = torch_ref.plan_step(meta, BS, q.device, paged=paged)
        out[paged] = timed(lambda: [torch_ref.paged_attention_ref(q, cache[:, i], meta, D ** -0.5, plan=plan)
                                    for i in range(cache.shape[1])], repeat)
    return out[False], out[True]


def kernel_of(ref: str, module: str, library: str, op: str, needs: tuple[str, ...] = ()):
    """The kernel of git revision ``ref`` (``kernels/<module>.py`` there, with that revision's
    ``kernels/cpu_simd.py`` helpers, torch library ``library``, compiled with the CPU flags ``needs``), built under its
    own library name next to this tree's: its ``op``."""
    import subprocess
    import sys
    import types
    from pathlib import Path

    from pdserve.kernels import cpp_build

    root = Path(__file__).resolve().parents[1]

    def at_ref(name: str) -> types.ModuleType:
        text = subprocess.run(["git", "show", f"{ref}:kernels/{name}.py"], cwd=root, check=True,
                              capture_output=True, text=True).stdout
        code = types.ModuleType(f"{name}_at_ref")
        exec(compile(text, f"{ref}:kernels/{name}.py", "exec"), code.__dict__)
        return code

    helpers, ours = "pdserve.kernels.cpu_simd", sys.modules.get("pdserve.kernels.cpu_simd")
    has_helpers = subprocess.run(["git", "cat-file", "-e", f"{ref}:kernels/cpu_simd.py"], cwd=root).returncode == 0
    if has_helpers:   # what ``from pdserve.kernels.cpu_simd import ...`` finds there (older revisions had none)
        sys.modules[helpers] = at_ref("cpu_simd")
    try:
        code = at_ref(module)
    finally:
        if ours is None:
            sys.modules.pop(helpers, None)   # (absent when the revision had no helpers to swap in)
        else:
            sys.modules[helpers] = ours
    name = f"{library}_ref"
    if reason := cpp_build.build(name, code.SOURCE.replace(library, name), cpp_build.simd_cflags(needs),
                                 f"{module} of {ref}"):
        raise SystemExit(reason)
    return getattr(getattr(torch.ops, name), op)


def decode_vs(ref_op, seqs: int, context: int, repeat: int, mixed: bool = False) -> tuple[float, float, bool]:
    """The kernel of another revision vs this tree's over :func:`decode_inputs`, all 30 layers: ms each, and whether
    their outputs are the same bits in every layer; ``mixed``: the sequences' lengths drawn from 30 to ``context``
    (seeded), as in a serving step."""
    cache, tables, q = decode_inputs(seqs, context)
    lens = (torch.randint(30, context + 1, (seqs,), generator=torch.Generator().manual_seed(seqs)) if mixed
            else torch.full((seqs,), context, dtype=torch.long))
    ops = (ref_op, torch.ops.pdserve_paged_cpu.decode)
    times = tuple(timed(lambda: [op(q, cache[:, i], tables, lens, D ** -0.5) for i in range(cache.shape[1])], repeat)
                  for op in ops)
    outs = [torch.stack([op(q, cache[:, i], tables, lens, D ** -0.5) for i in range(cache.shape[1])]) for op in ops]
    return *times, torch.equal(*outs)


def prefill_vs(ref_op, q_lens: list[int], seq_lens: list[int], repeat: int) -> tuple[float, float, bool]:
    """The prefill kernel of another revision vs this tree's over an engine-shaped 30-layer cache (as
    :func:`decode_inputs`), each sequence's last ``q_len`` of its ``seq_len`` tokens new, all 30 layers: ms each, and
    whether their outputs are the same bits in every layer."""
    cache, _, _ = decode_inputs(1, 16)
    nb = -(-max(seq_lens) // BS)
    gen = torch.Generator().manual_seed(1)
    tables = torch.randperm(cache.shape[0], generator=gen)[:len(seq_lens) * nb].view(len(seq_lens), nb).contiguous()
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    info = torch.tensor([[s, q, n] for s, q, n in zip(starts, q_lens, seq_lens)], dtype=torch.long)
    q = torch.randn(sum(q_lens), H, D, generator=gen).bfloat16()
    outs = [torch.empty(cache.shape[1], *q.shape, dtype=q.dtype) for _ in range(2)]
    ops = (ref_op, torch.ops.pdserve_prefill_cpu.prefill)
    times = tuple(timed(lambda: [op(q, out[i], cache[:, i], tables, info, D ** -0.5) for i in range(cache.shape[1])],
                        repeat) for op, out in zip(ops, outs))
    return *times, torch.equal(*outs)


def model_linears(rows: int) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """The weights of all 121 dense linears of the default model (per layer q/k/v, o, gate/up, down; the LM head),
    bf16, and an input of ``rows`` rows for each input width."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    weights = [(torch.randn(n, k, generator=gen) * 0.02).bfloat16() for n, k in shapes]
    return weights, {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (576, 1536)}


def linears(rows: int, repeat: int) -> tuple[float, float, int]:
    """:func:`model_linears` at ``rows`` rows: oneDNN's packed linear vs the AMX kernel (ms each), and the weight bytes
    they read."""
    weights, xs = model_linears(rows)
    onednn = [PackedLinear(w, None) for w in weights]
    amx = [(torch.ops.pdserve_amx_linear.pack(w), w.shape[0]) for w in weights]
    t_onednn = timed(lambda: [lin(xs[lin.in_features]) for lin in onednn], repeat)
    t_amx = timed(lambda: [torch.ops.pdserve_amx_linear.linear(xs[w.shape[1]], wp, None, n)
                           for w, (wp, n) in zip(weights, amx)], repeat)
    return t_onednn, t_amx, sum(w.nbytes for w in weights)


def linears_vs(ref_op, rows: int, repeat: int) -> tuple[float, float, bool]:
    """The AMX linear of another revision vs this tree's over :func:`model_linears` at ``rows`` rows: ms each, and
    whether their outputs are the same bits."""
    weights, xs = model_linears(rows)
    packed = [(torch.ops.pdserve_amx_linear.pack(w), w.shape[0]) for w in weights]

    def run(op) -> list[torch.Tensor]:
        return [op(xs[w.shape[1]], wp, None, n) for w, (wp, n) in zip(weights, packed)]

    ops = (ref_op, torch.ops.pdserve_amx_linear.linear)
    rounds = [[timed(lambda: run(op), repeat) for op in ops] for _ in range(3)]   # alternated: the host drifts
    ref_ms, new_ms = (min(col) for col in zip(*rounds))
    return ref_ms, new_ms, all(torch.equal(a, b) for a, b in zip(run(ops[0]), run(ops[1])))


def lossless(repeat: int) -> None:
    """The default model's decoder linears on the AMX kernel, plain tiles vs the lossless form, at 1-32 rows."""
    from safetensors import safe_open

    from pdserve.runtime.model_loader import resolve_model_path

    path = resolve_model_path(None)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}

    def t(i: int, name: str) -> torch.Tensor:
        return tensors[f"model.layers.{i}.{name}.weight"].bfloat16()

    weights = []   # as the engine fuses them: q/k/v, o, gate/up, down
    for i in range(len({k.split(".")[2] for k in tensors if k.startswith("model.layers.")})):
        weights += [torch.cat([t(i, "self_attn.q_proj"), t(i, "self_attn.k_proj"), t(i, "self_attn.v_proj")]),
                    t(i, "self_attn.o_proj"), torch.cat([t(i, "mlp.gate_proj"), t(i, "mlp.up_proj")]),
                    t(i, "mlp.down_proj")]
    ops = torch.ops.pdserve_amx_linear
    plain = [(ops.pack(w), None) for w in weights]
    coded = [ops.pack_lossless(w) for w in weights]
    plain_mb, coded_mb = (sum(a.nbytes + (0 if b is None else b.nbytes) for a, b in f) / 1e6 for f in (plain, coded))
    excs = sum(m.numel() - 5 * c.shape[0] - 1 for c, m in coded)
    print(f"{len(weights)} decoder linears: plain tiles {plain_mb:.1f} MB, coded {coded_mb:.1f} MB "
          f"({coded_mb / plain_mb:.3f}), {excs} exceptions of {sum(w.numel() for w in weights)} words")
    print(f"{'rows':44s} {'plain ms':>9s} {'coded ms':>9s}")
    for rows in (1, 8, 16, 24, 32):
        xs = {k: torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16() for k in (576, 1536)}

        def run(form) -> list[torch.Tensor]:
            return [ops.linear(xs[w.shape[1]], wp, None, w.shape[0], meta) for w, (wp, meta) in zip(weights, form)]

        rounds = [[timed(lambda: run(form), repeat) for form in (plain, coded)] for _ in range(3)]   # alternated
        p_ms, c_ms = (min(col) for col in zip(*rounds))
        same = all(torch.equal(a, b) for a, b in zip(run(plain), run(coded)))
        print(f"  {f'{rows} rows':42s} {p_ms:9.2f} {c_ms:9.2f} {p_ms / c_ms:7.2f}x  ({plain_mb / p_ms:.1f} / "
              f"{coded_mb / c_ms:.1f} GB/s read)  {'bit-equal' if same else 'OUTPUTS DIFFER'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--compare-decode", metavar="REF", help="only the decode kernel: git revision REF's vs this tree's")
    p.add_argument("--compare-prefill", metavar="REF", help="only the prefill kernel: git revision REF's vs this tree's")
    p.add_argument("--compare-linear", metavar="REF", help="only the AMX linear: git revision REF's vs this tree's")
    p.add_argument("--lossless", action="store_true", help="only the AMX linear: plain tiles vs the coded weights")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for what, reason in (("prefill kernel", paged_prefill_cpu.load_extension()), ("fused ops", fused_cpu.load_extension()),
                         ("AMX linear", amx_linear.load_extension())):
        if reason:
            raise SystemExit(f"{what} not available here: {reason}")
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    if args.compare_decode:
        from pdserve.kernels import paged_decode_cpu

        if reason := paged_decode_cpu.load_extension():
            raise SystemExit(reason)
        ref_op = kernel_of(args.compare_decode, "paged_decode_cpu", "pdserve_paged_cpu", "decode")
        print(f"{'decode attention, 30 layers, bf16':44s} {args.compare_decode[:9]:>9s} {'this tree':>9s}")
        for seqs, context, mixed in ((1, 1000, False), (2, 600, False), (8, 800, False), (32, 400, False),
                                     (64, 300, False), (8, 850, True), (32, 850, True)):
            r, k, same = decode_vs(ref_op, seqs, context, max(3, args.repeat // 4), mixed)
            name = f"{seqs} sequences of {'30-' if mixed else ''}{context} tokens"
            print(f"  {name:42s} {r:9.1f} {k:9.1f} {r / k:7.2f}x  {'bit-equal' if same else 'OUTPUTS DIFFER'}")
        return
    if args.compare_prefill:
        ref_op = kernel_of(args.compare_prefill, "paged_prefill_cpu", "pdserve_prefill_cpu", "prefill",
                           paged_prefill_cpu.NEEDS)
        print(f"{'prefill attention, 30 layers, bf16':44s} {args.compare_prefill[:9]:>9s} {'this tree':>9s}")
        for name, (q_lens, seq_lens) in PREFILL_STEPS.items():
            r, k, same = prefill_vs(ref_op, q_lens, seq_lens, max(3, args.repeat // 4))
            print(f"  {name:42s} {r:9.2f} {k:9.2f} {r / k:7.2f}x  {'bit-equal' if same else 'OUTPUTS DIFFER'}")
        return
    if args.lossless:
        return lossless(args.repeat)
    if args.compare_linear:
        ref_op = kernel_of(args.compare_linear, "amx_linear", "pdserve_amx_linear", "linear", amx_linear.NEEDS)
        print(f"{'all 121 linears, AMX':44s} {args.compare_linear[:9]:>9s} {'this tree':>9s}")
        for rows in (1, 8, 16, 17, 24, 31, 32):
            r, k, same = linears_vs(ref_op, rows, args.repeat)
            print(f"  {f'{rows} rows':42s} {r:9.2f} {k:9.2f} {r / k:7.2f}x  {'bit-equal' if same else 'OUTPUTS DIFFER'}")
        return
    print(f"{'prefill attention, one layer':44s} {'torch ms':>9s} {'kernel ms':>9s} {'speed-up':>8s}")
    for name, (q_lens, seq_lens) in PREFILL_STEPS.items():
        t, k = prefill(q_lens, seq_lens, args.repeat)
        print(f"{name:44s} {t:9.3f} {k:9.3f} {t / k:7.2f}x")
    print(f"{'decode attention, 30 layers, bf16':44s} {'torch ms':>9s} {'kernel ms':>9s}")
    for seqs, context in ((1, 1000), (8, 800), (32, 400), (64, 300)):
        t, k = decode(seqs, context, max(3, args.repeat // 4))
        print(f"  {f'{seqs} sequences of {context} tokens':42s} {t:9.1f} {k:9.1f} {t / k:7.2f}x")
    print(f"{'all 121 linears (GB/s: weight bytes read)':44s} {'oneDNN ms':>9s} {'AMX ms':>9s}")
    for rows in (1, 8, 24, 32, 64, 128, 512):
        o, a, nbytes = linears(rows, max(3, args.repeat // 4))
        print(f"  {f'{rows} rows':42s} {o:9.1f} {a:9.1f} {o / a:7.2f}x  ({nbytes / o / 1e6:.1f} / {nbytes / a / 1e6:.1f} GB/s)")
    for rows in (32, 512, 2048):
        print(f"{f'elementwise, {rows} rows':44s} {'eager ms':>9s} {'fused ms':>9s}")
        for name, (e, f) in elementwise(rows, args.repeat).items():
            print(f"  {name:42s} {e:9.3f} {f:9.3f} {e / f:7.2f}x")


if __name__ == "__main__":
    main()
