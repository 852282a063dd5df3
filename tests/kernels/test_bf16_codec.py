"""The lossless 12-bit form of the AMX linear's weights (kernels/bf16_codec.py): it decodes to the packed tiles bit
for bit, whatever the words (special values, more high bytes than its table holds, partial tiles); it is the
documented layout (read back here by a plain Python decoder); the kernel's products over it equal those over the
plain tiles bit for bit at every row count and thread split; a corrupt ``meta`` is an error, never a read or write
outside; the engine holds its decoder linears in it by default (``PDSERVE_CPU_AMX_LOSSLESS=0``: plain tiles), its LM
head in plain tiles, and generates the same tokens and logprobs either way."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import amx_linear

BUILD = amx_linear.load_extension()
needs_amx = pytest.mark.skipif(BUILD is not None, reason=f"kernel not usable here: {BUILD}")
ops = torch.ops.pdserve_amx_linear if BUILD is None else None


def _bf16(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _words(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.int16)


def _exceptions(codes: torch.Tensor, meta: torch.Tensor) -> int:
    return meta.numel() - 5 * codes.shape[0] - 1


def _special(n: int, k: int) -> torch.Tensor:
    """Weights over many octaves, with every special word: +-0, +-inf, NaNs, subnormals, the largest finite."""
    w = _bf16(n, k, seed=3) * torch.exp2(torch.randint(-40, 40, (n, k), generator=torch.Generator().manual_seed(4)))
    bits = _words(w.bfloat16()).flatten()
    special = [0x0000, -0x8000, 0x7F80, -0x0080, 0x7FC0, 0x7F81, -0x0001, 0x0001, -0x7FFF, 0x7F7F]
    bits[: len(special)] = torch.tensor(special, dtype=torch.int16)
    return bits.view(n, k).view(torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (17, 33), (5, 7), (48, 64), (16, 31)])
@pytest.mark.parametrize("kind", ["trained-like", "special"])
def test_it_decodes_to_the_packed_tiles_bit_for_bit(n, k, kind):
    w = _bf16(n, k, seed=1, scale=0.05) if kind == "trained-like" else _special(n, k)
    codes, meta = ops.pack_lossless(w)
    assert codes.shape == (-(-n // 16), -(-k // 32), 768) and codes.dtype == torch.uint8
    assert torch.equal(_words(ops.unpack_lossless(codes, meta)), _words(ops.pack(w)))
    if kind == "special" and n * k > 500:
        assert _exceptions(codes, meta) > 100   # far more high bytes than a table holds: the exceptions carry them


@needs_amx
def test_a_block_with_few_high_bytes_has_no_exceptions_and_takes_three_quarters():
    w = _bf16(960, 576, seed=2, scale=0.05).abs().clamp(2 ** -9, 0.12)   # one sign, 6 octaves: 4 high bytes
    w[::7, ::5] = 0
    codes, meta = ops.pack_lossless(w)
    assert _exceptions(codes, meta) == 0
    assert codes.nbytes + meta.nbytes <= 0.76 * ops.pack(w).nbytes
    assert torch.equal(_words(ops.unpack_lossless(codes, meta)), _words(ops.pack(w)))


def _reference_decode(codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """The layout as kernels/bf16_codec.py documents it, decoded word by word in Python."""
    nb, kb = codes.shape[:2]
    m = meta.tolist()
    table = torch.tensor(m[: 4 * nb], dtype=torch.int32).view(torch.uint8).view(nb, 16).tolist()
    natural_at = [8 * (p // 16) + p % 16 if p % 16 < 8 else 32 + 8 * (p // 16) + p % 16 - 8 for p in range(64)]
    c = codes.tolist()
    out = [[0] * (kb * 512) for _ in range(nb)]
    for j in range(nb):
        for t in range(kb):
            tile = c[j][t]
            for g in range(8):
                for p in range(64):
                    nib = tile[512 + 32 * g + p // 2]
                    code = nib & 0x0F if p % 2 == 0 else nib >> 4
                    out[j][t * 512 + 64 * g + natural_at[p]] = table[j][code] << 8 | tile[64 * g + p]
        for e in m[m[4 * nb + j]: m[4 * nb + j + 1]]:
            i = e >> 8
            out[j][i] = (e & 0xFF) << 8 | out[j][i] & 0xFF
    words = torch.tensor(out, dtype=torch.int32).view(nb, kb, 16, 32)
    return (words - (words >= 0x8000).int() * 0x10000).to(torch.int16)


@needs_amx
@pytest.mark.parametrize("kind", ["trained-like", "special"])
def test_it_is_the_documented_layout(kind):
    w = _bf16(40, 70, seed=5, scale=0.05) if kind == "trained-like" else _special(40, 70)
    codes, meta = ops.pack_lossless(w)
    assert torch.equal(_reference_decode(codes, meta), _words(ops.pack(w)))


@needs_amx
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (100, 40), (48, 64)])
def test_the_kernel_over_it_gives_the_plain_tiles_outputs(n, k, threads):
    """Every path: 1-16 rows (column block pairs, an odd block alone), 17-32 rows read in place (the last row tile
    short), 33 rows and more (whole blocks decoded, then the plain path), with and without bias."""
    w = _special(n, k) if n == 48 else _bf16(n, k, seed=6, scale=0.05)
    b = _bf16(n, seed=7)
    packed, (codes, meta) = ops.pack(w), ops.pack_lossless(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 5, 16, 17, 24, 31, 32, 33, 70):
            x = _bf16(m, k, seed=m)
            for bias in (None, b):
                want = ops.linear(x, packed, bias, n)
                assert torch.equal(_words(ops.linear(x, codes, bias, n, meta)), _words(want)), (m, bias is None)
        view = _bf16(24, k + 8, seed=8)[:, :k]   # strided rows: copied into whole tiles
        assert torch.equal(_words(ops.linear(view, codes, None, n, meta)), _words(ops.linear(view, packed, None, n)))
    finally:
        torch.set_num_threads(before)


@needs_amx
def test_a_corrupt_meta_is_an_error():
    w = _special(48, 64)
    codes, meta = ops.pack_lossless(w)
    x = _bf16(3, 64)
    nb = codes.shape[0]
    assert _exceptions(codes, meta) >= 2
    bad = {}
    first, end = meta[4 * nb].item(), meta[4 * nb + 1].item()   # block 0's exceptions
    assert end - first >= 2
    m = meta.clone(); m[first], m[first + 1] = meta[first + 1], meta[first]; bad["out of order"] = m
    m = meta.clone(); m[first] = (codes.shape[1] * 512) << 8; bad["an exception past its block"] = m
    m = meta.clone(); m[4 * nb] += 1; bad["offsets outside"] = m
    m = meta.clone(); m[5 * nb - 1] = 0; bad["the last block's offset"] = m
    bad["too short"] = meta[: 5 * nb]
    for why, m in bad.items():
        with pytest.raises(RuntimeError, match="meta"):
            ops.linear(x, codes, None, 48, m)
        with pytest.raises(RuntimeError, match="meta"):
            ops.unpack_lossless(codes, m)
    with pytest.raises(RuntimeError, match="coded weight"):
        ops.linear(x, codes[:, :, :512], None, 48, meta)
    with pytest.raises(RuntimeError, match="K of the packed weight"):
        ops.linear(_bf16(3, 96), codes, None, 48, meta)


def _generate(monkeypatch, lossless: str) -> tuple[list, amx_linear.AmxLinear, object]:
    from pdserve.runtime import LLM, SamplingParams

    monkeypatch.setenv("PDSERVE_CPU_AMX_LOSSLESS", lossless)
    llm = LLM(dtype="bfloat16", max_model_len=512, num_gpu_blocks=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)
        outs = llm.generate([[11, 12, 13, 14, 15], list(range(300, 340)), list(range(500, 509))], params)
        model = llm.engine.runner.model
        return ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], model.layers[3].mlp.down_proj,
                model.lm_head)
    finally:
        llm.shutdown()


@needs_amx
def test_the_engine_generates_the_same_tokens_and_logprobs_from_it(monkeypatch):
    coded, down, head = _generate(monkeypatch, "1")
    assert down.codes is not None and down.packed is None          # decoder linears: the lossless form
    assert head.packed is not None and head.codes is None          # the LM head: plain tiles, for the greedy head
    plain, down, _ = _generate(monkeypatch, "0")
    assert down.packed is not None and down.codes is None
    assert coded == plain                                          # every token and every logprob, bit for bit
