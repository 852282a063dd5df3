"""A lossless 12-bit form of packed bf16 weights, for the AMX linear (kernels/amx_linear.py): the same bits in 3/4
of the bytes.

A bf16 word's low byte (the exponent's last bit and the 7 mantissa bits) is close to uniform, but its high byte
(the sign and the exponent's top 7 bits) takes few values: a trained layer's weights lie within a few octaves of
each other. So each column block of a packed weight (16 columns by K: ``kb`` tiles of 16 x 32 words, see
``amx_linear.pack``) keeps its 16 most frequent high bytes in a table, and each word is stored as its low byte plus
a 4-bit index into that table. A high byte missing from the table is an exception: kept whole in a list and written
back after decoding. SmolLM2-135M's decoder linears miss the table at 3,798 of 106 M words (0.004%) and take
159.5 MB instead of 212.3.

Why: a decode step of a few rows multiplies them by every weight, so its linears cost the weights' read from memory
(kernels/amx_linear.py). Decoding a tile takes ~30 cycles of byte shuffles, and the kernel decodes a column block's
next tile while AMX multiplies the current one, so the linears of a step of 1-32 rows read 1/4 fewer bytes and do
the same products on the same words: the outputs are the uncompressed kernel's, bit for bit.

Layout, per column block: its tiles one after another, 768 bytes each. A tile's 512 words go in 8 groups of 64: the
group's low bytes (64 bytes at ``64 g``) and its codes (32 bytes at ``512 + 32 g``, two a byte, the low nibble
first), both in storage order, the order in which ``unpacklo_epi8`` / ``unpackhi_epi8`` of 128-bit lanes give the
words back: word ``8 L + i`` (``i < 8``) of the group at storage byte ``16 L + i``, word ``32 + 8 L + i`` at
``16 L + 8 + i``. ``meta`` (int32) holds every block's table (4 words: code ``c``'s high byte at byte ``c``), then
``nb + 1`` offsets into ``meta`` where each block's exceptions start (the last: where they end), then the
exceptions: ``(word index in the block << 8) | high byte``, in word order; the coded word itself holds code 0.

``CODEC`` (inside the AMX build, after ``<immintrin.h>``, ``<algorithm>`` and ``<vector>``): ``encode_block``,
``CodedBlock`` / ``coded_block`` and ``decode_tile``.
"""

CODEC = r"""
constexpr int64_t kCodedTile = 768;   // bytes a coded tile of 512 words takes

// A column block's kb tiles (kb * 512 words) -> out (kb * 768 bytes) and its table; appends its exceptions.
void encode_block(const uint16_t* w, int64_t kb, uint8_t* out, uint8_t table[16], std::vector<int32_t>& exc) {
  int64_t hist[256] = {};
  for (int64_t i = 0; i < kb * 512; i++) hist[w[i] >> 8]++;
  int order[256];
  for (int i = 0; i < 256; i++) order[i] = i;
  std::stable_sort(order, order + 256, [&](int a, int b) { return hist[a] > hist[b]; });
  for (int c = 0; c < 16; c++) table[c] = uint8_t(order[c]);
  const __m512i to_storage = _mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0);   // natural 8-word runs -> storage order
  for (int64_t t = 0; t < kb; t++)
    for (int g = 0; g < 8; g++) {
      const uint16_t* src = w + t * 512 + g * 64;
      const __m512i a = _mm512_loadu_si512(src), b = _mm512_loadu_si512(src + 32);
      auto bytes = [&](__m512i x, __m512i y) {   // one byte of each of the 64 words, in storage order
        return _mm512_permutexvar_epi64(to_storage, _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm512_cvtepi16_epi8(x)), _mm512_cvtepi16_epi8(y), 1));
      };
      const __m512i lo = bytes(a, b), hi = bytes(_mm512_srli_epi16(a, 8), _mm512_srli_epi16(b, 8));
      __m512i code = _mm512_setzero_si512();
      __mmask64 hit = 0;
      for (int c = 0; c < 16; c++) {
        const __mmask64 m = _mm512_cmpeq_epi8_mask(hi, _mm512_set1_epi8(char(table[c])));
        code = _mm512_mask_mov_epi8(code, m, _mm512_set1_epi8(char(c)));
        hit |= m;
      }
      if (~hit)
        for (int n = 0; n < 64; n++) {   // word order: 8 L + i at 16 L + i, 32 + 8 L + i at 16 L + 8 + i
          const int p = n < 32 ? 16 * (n / 8) + n % 8 : 16 * ((n - 32) / 8) + 8 + n % 8;
          if (!((hit >> p) & 1)) exc.push_back(int32_t((t * 512 + g * 64 + n) << 8 | src[n] >> 8));
        }
      const __m512i nib = _mm512_or_si512(_mm512_and_si512(code, _mm512_set1_epi16(0x000F)),
                                          _mm512_and_si512(_mm512_srli_epi16(code, 4), _mm512_set1_epi16(0x00F0)));
      _mm512_storeu_si512(out + t * kCodedTile + 64 * g, lo);
      _mm256_storeu_si256((__m256i*)(out + t * kCodedTile + 512 + 32 * g), _mm512_cvtepi16_epi8(nib));
    }
}

// A coded column block being read: its tiles, its table in every 128-bit lane, its exceptions not yet written back.
struct CodedBlock { const uint8_t* tiles; __m512i table; const int32_t* exc; const int32_t* exc_end; };

inline CodedBlock coded_block(const uint8_t* codes, const int32_t* meta, int64_t nb, int64_t kb, int64_t j) {
  const int32_t* starts = meta + 4 * nb;
  return {codes + j * kb * kCodedTile, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(meta + 4 * j))),
          meta + starts[j], meta + starts[j + 1]};
}

// Tile k of the block into d (512 words); tiles in increasing k (the exceptions are consumed in word order).
inline void decode_tile(CodedBlock& b, int64_t k, uint16_t* d) {
  const uint8_t* s = b.tiles + k * kCodedTile;
  for (int g = 0; g < 8; g++) {
    const __m512i lo = _mm512_loadu_si512(s + 64 * g);
    // a code pair a word
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(s + 512 + 32 * g)));
    const __m512i codes = _mm512_and_si512(   // byte 2m: the low nibble of pair m, byte 2m + 1: its high nibble
        _mm512_ternarylogic_epi32(_mm512_set1_epi16(0x0F00), _mm512_slli_epi16(x, 4), x, 0xCA), _mm512_set1_epi8(0x0F));
    const __m512i hi = _mm512_shuffle_epi8(b.table, codes);
    _mm512_storeu_si512(d + 64 * g, _mm512_unpacklo_epi8(lo, hi));
    _mm512_storeu_si512(d + 64 * g + 32, _mm512_unpackhi_epi8(lo, hi));
  }
  for (; b.exc < b.exc_end && (*b.exc >> 8) < (k + 1) * 512; b.exc++)
    ((uint8_t*)d)[2 * ((*b.exc >> 8) - k * 512) + 1] = uint8_t(*b.exc & 0xFF);
}
"""
