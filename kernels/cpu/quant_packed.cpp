// The AVX-512 VNNI products over the packed layout of quant_packed.h, 16 rows a group: only the
// avx512vnni build compiles this unit (kernels/cpu.py); in a build of 8-row groups it is empty.
#include "quant_packed.h"

#if CADENZA_PACK_ROWS == 16

#include <immintrin.h>

#include <vector>

#include "linear.h"
#include "simd.h"

namespace cadenza {
namespace {

// 4-bit indices (bytes < 16) -> the values they stand for plus 128 (kIQ4ValuesBiased, or another
// table's biased values).
inline __m512i iq4_lookup(__m512i idx, const uint8_t* biased = kIQ4ValuesBiased) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(biased)));
  return _mm512_shuffle_epi8(table, idx);
}

// The table a 32-value layout's nibbles index (P::kTable).
template <class P>
constexpr NibbleTable table_of() {
  return P::kE8M0 ? kMXFP4Table : kIQ4Table;
}

// 16 rows' E8M0 scale bytes (MXFP4) -> 2^(e - 128) as e8m0_half gives it: exponent field e - 1,
// but for e < 2 the denormals 0x00200000 << e, blended in where e < 2 (never in real weights, kept
// exact all the same, as ggml's).
inline __m512 e8m0_half16(const uint8_t* p) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i denormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
  const __mmask16 tiny = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(tiny, normal, denormal));
}

// The 8 vectors of one group-block's values, each 16 rows x 4 consecutive values.
template <class P>
inline void packed_values(const uint8_t* chunks, __m512i* q) {
  if constexpr (P::kNibbles) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(chunks + 64 * c);
      q[2 * c] = _mm512_and_si512(v, low);
      q[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      if constexpr (P::kTable) {
        q[2 * c] = iq4_lookup(q[2 * c], table_of<P>().biased);
        q[2 * c + 1] = iq4_lookup(q[2 * c + 1], table_of<P>().biased);
      }
    }
  } else {
    for (int c = 0; c < 8; ++c) q[c] = _mm512_loadu_si512(chunks + 64 * c);
  }
}

// Q5_0 and Q5_1: 16 added to each value of q (in packed_values' order) whose fifth bit is set. Row
// r's 32 bits lie in lane r of qh (bit i: value i): values 4c + j (chunk c's low nibbles) have theirs
// in byte c / 2 of the lane, bit 4 (c % 2) + j, values 16 + 4c + j in byte 2 + c / 2. vpshufb copies
// that byte across its lane, vptestmb picks each value's bit, a masked vpaddb adds the 16.
inline void add_fifth_bits(__m512i qh, __m512i* q) {
  const __m512i lane_bytes = _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0);  // byte 0 of each row's 4
  const __m512i sixteen = _mm512_set1_epi8(16);
  for (int t = 0; t < 4; ++t) {  // byte t: chunks 2 (t % 2) and 2 (t % 2) + 1, low nibbles for t < 2
    const __m512i spread = _mm512_shuffle_epi8(qh, _mm512_add_epi8(lane_bytes, _mm512_set1_epi8(static_cast<char>(t))));
    for (int h = 0; h < 2; ++h) {
      const int v = 2 * (2 * (t % 2) + h) + t / 2;
      const __mmask64 set = _mm512_test_epi8_mask(spread, _mm512_set1_epi32(static_cast<int32_t>(0x08040201u << (4 * h))));
      q[v] = _mm512_mask_add_epi8(q[v], set, q[v], sixteen);
    }
  }
}

// Which 4 activation values (a group of the 32) vector v of `packed_values` multiplies.
template <class P>
constexpr int packed_x_group(int v) {
  return P::kNibbles ? (v % 2 ? v / 2 + 4 : v / 2) : v;
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// out rows [0, M) (of stride os), columns [n, n + 16) (+)= acc (+ bias).
template <int M>
inline void store_group(const __m512* acc, const float* bias, float* out, int64_t os, bool accumulate, int64_t n) {
  for (int m = 0; m < M; ++m) {
    __m512 v = acc[m];
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
    float* o = out + m * os + n;
    _mm512_storeu_ps(o, accumulate ? _mm512_add_ps(_mm512_loadu_ps(o), v) : v);
  }
}

// Fetch the bytes of one group-block of P at prefetch_ahead_bytes<P>() past `block` (quant_packed.h);
// a step with more rows, whose compute then hides the fetches, paid 0.45 ms a row with them
// instead of 0.65-0.8 (SmolLM2 Q4_1).
template <class P>
inline void prefetch_ahead(const uint8_t* block) {
  for (int64_t o = 0; o < kPackRows * P::kBytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + prefetch_ahead_bytes<P>() + o), _MM_HINT_T0);
}

// Output rows [n, n + 16) of M activation rows from m0: one packed group `wg`.
template <class P, int M>
inline void packed_dot_group(const uint8_t* wg, int64_t nblocks, const QuantizedActivations& a, int64_t m0,
                             const float* bias, float* out, int64_t os, bool accumulate, int64_t n) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* gb = wg + b * kPackRows * P::kBytes;
    prefetch_ahead<P>(gb);
    const __m512 d = P::kE8M0 ? e8m0_half16(gb) : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb)));
    __m512 mins = _mm512_setzero_ps();
    if constexpr (P::kHasMin) mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 32)));
    __m512i q[8];
    packed_values<P>(gb + packed_header_bytes<P>(), q);
    if constexpr (P::kFive) add_fifth_bits(_mm512_loadu_si512(gb + packed_bits_at<P>()), q);
    for (int m = 0; m < M; ++m) {
      const int64_t blk = (m0 + m) * a.blocks + b;
      const int8_t* x = a.q.data() + (m0 + m) * a.K + 32 * b;
      // Two chains of 4, so consecutive vpdpbusd do not wait on each other.
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int v = 0; v < 8; v += 2) {
        s0 = _mm512_dpbusd_epi32(s0, q[v], broadcast4(x + 4 * packed_x_group<P>(v)));
        s1 = _mm512_dpbusd_epi32(s1, q[v + 1], broadcast4(x + 4 * packed_x_group<P>(v + 1)));
      }
      __m512i s = _mm512_add_epi32(s0, s1);
      if constexpr (P::kOffset != 0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(static_cast<int32_t>(P::kOffset) * a.qsum[blk]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(a.d[blk])), acc[m]);
      if constexpr (P::kHasMin) acc[m] = _mm512_fmadd_ps(mins, _mm512_set1_ps(a.s[blk]), acc[m]);
    }
  }
  store_group<M>(acc, bias, out, os, accumulate, n);
}

// Q4_K's 16 rows' scale (d * sc) and negated min (-(dmin * m)) of each sub-block, from the 12
// scale bytes (byte i of every row at sb + 16 i), as q4k_scale_min in quant.h unpacks them.
inline void q4k_scales16(const uint8_t* sb, __m512 d, __m512 dmin, __m512* scale, __m512* minv) {
  __m512i b[12];
  for (int i = 0; i < 12; ++i) b[i] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * i)));
  const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(15);
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  for (int j = 0; j < 8; ++j) {
    __m512i sc, m;
    if (j < 4) {
      sc = _mm512_and_si512(b[j], m6);
      m = _mm512_and_si512(b[j + 4], m6);
    } else {
      sc = _mm512_or_si512(_mm512_and_si512(b[j + 4], m4), _mm512_slli_epi32(_mm512_srli_epi32(b[j - 4], 6), 4));
      m = _mm512_or_si512(_mm512_srli_epi32(b[j + 4], 4), _mm512_slli_epi32(_mm512_srli_epi32(b[j], 6), 4));
    }
    scale[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    minv[j] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m))), sign));
  }
}

// Q5_K's values of sub-block 2c + h, chunk k, 16 rows x 4: Q4_K's nibbles (low for h = 0, high for
// h = 1) with bit 2c + h of the chunk's qh bytes moved to bit 4.
inline __m512i q5k_values16(const uint8_t* gb, int c, int h, int k) {
  const __m512i v = _mm512_loadu_si512(gb + 256 + 512 * c + 64 * k);
  const __m512i nibbles = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
  const __m512i qh = _mm512_loadu_si512(gb + 144 * kPackRows + 64 * k);
  return _mm512_or_si512(nibbles, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * c + h), _mm512_set1_epi8(0x01)), 4));
}

// Where a group's decoded float scales start in decode_group's layout, after its values: per block
// 16 vectors of 16 rows, Q4_K's and Q5_K's 8 sub-blocks' scales then negated mins, or the 16 halves'
// scales of Q6_K and Q3_K.
inline int64_t decoded_scales_at(int64_t nblocks, int64_t b) { return nblocks * 256 * kPackRows + b * 16 * 64; }

// A decoded vector in decode_group's layout (64 bytes a chunk, in order of block, sub-block and chunk).
inline __m512i pre_values(const uint8_t* pre, int64_t b, int j, int k) {
  return _mm512_load_si512(pre + 64 * (8 * (8 * b + j) + k));
}

// Sub-block j's 8 value vectors (16 rows x 4 values each) of a Q4_K or Q5_K group-block `gb`: Q5_K's
// are Q4_K's nibbles (low for even j, high for odd) plus 16 where their bit in qh is set, at most 31.
template <class P>
inline void q4k_sub_values16(const uint8_t* gb, int j, __m512i* q) {
  for (int k = 0; k < 8; ++k) {
    if constexpr (std::is_same_v<P, PackQ5_K>) {
      q[k] = q5k_values16(gb, j / 2, j % 2, k);
    } else {
      const __m512i v = _mm512_loadu_si512(gb + 256 + 512 * (j / 2) + 64 * k);
      q[k] = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0F));
    }
  }
}

// sum(q * x) of one row's 32 activations x (in packed_values' order) and the 8 value vectors q of
// a sub-block, in int32 (exact): two chains where the rows are few, so that consecutive vpdpbusd
// do not wait on each other; with 4 rows or more the rows' chains interleave.
template <int M>
inline __m512i sub_dot16(const __m512i* q, const int8_t* x) {
  if constexpr (M >= 4) {
    __m512i s = _mm512_setzero_si512();
    for (int k = 0; k < 8; ++k) s = _mm512_dpbusd_epi32(s, q[k], broadcast4(x + 4 * k));
    return s;
  } else {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int k = 0; k < 8; k += 2) {
      s0 = _mm512_dpbusd_epi32(s0, q[k], broadcast4(x + 4 * k));
      s1 = _mm512_dpbusd_epi32(s1, q[k + 1], broadcast4(x + 4 * k + 4));
    }
    return _mm512_add_epi32(s0, s1);
  }
}

// Output rows [n, n + 16) of M activation rows from m0 for a packed Q4_K or Q5_K group `wg` (P),
// activations with one scale per 256 values (QuantizedActivations::group): per block, a row sums
// its sub-blocks' int32 products times their scales d * sc in float, and the activation's scale
// multiplies that once a block; the mins (-dmin * m times the sub-block's d * sum(x)) go straight
// into the row's sum. With kPre, the values and scales come decoded from `pre` (decode_group's
// layout) rather than from the group's bits; the sums are the same, added in the same order.
template <class P, int M, bool kPre = false>
inline void packed_dot_group_q4k(const uint8_t* wg, int64_t nblocks, const QuantizedActivations& a, int64_t m0,
                                 const float* bias, float* out, int64_t os, bool accumulate, int64_t n,
                                 const uint8_t* pre = nullptr) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* gb = wg + b * kPackRows * P::kBytes;
    __m512 scale_own[16];
    const __m512* scale = scale_own;
    if constexpr (kPre) {
      scale = reinterpret_cast<const __m512*>(pre + decoded_scales_at(nblocks, b));
    } else {
      prefetch_ahead<P>(gb);
      q4k_scales16(gb + 64, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb))),
                   _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 32))), scale_own,
                   scale_own + 8);
    }
    const __m512* minv = scale + 8;
    __m512 sums[M];
    for (int m = 0; m < M; ++m) sums[m] = _mm512_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      __m512i q[8];
      if constexpr (kPre) {
        for (int k = 0; k < 8; ++k) q[k] = pre_values(pre, b, j, k);
      } else {
        q4k_sub_values16<P>(gb, j, q);
      }
      for (int m = 0; m < M; ++m) {
        const int64_t blk = (m0 + m) * a.blocks + 8 * b + j;
        const __m512i s = sub_dot16<M>(q, a.q.data() + (m0 + m) * a.K + 256 * b + 32 * j);
        sums[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale[j], sums[m]);
        acc[m] = _mm512_fmadd_ps(minv[j], _mm512_set1_ps(a.s[blk]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(sums[m], _mm512_set1_ps(a.d[(m0 + m) * a.blocks + 8 * b]), acc[m]);
  }
  store_group<M>(acc, bias, out, os, accumulate, n);
}

// The 16 rows' int8 numbers of sub-block j's two halves of 16 values (Q2_K's mins), from int8s at sc
// (number i of row r at sc + 16 i + r), both in one int32 lane (the first in its low int16) for
// vpmaddwd against the activation's two half sums (QuantizedActivations::qhalves).
inline __m512i half_pairs16(const int8_t* sc, int j) {
  const __m512i a = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * (2 * j))));
  const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * (2 * j + 1))));
  return _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(b, 16));
}

// A group-block's int8 scales in that layout: Q6_K's are stored so (at 2R).
inline const int8_t* block_scales16(PackQ6_K, const uint8_t* gb, int8_t*) {
  return reinterpret_cast<const int8_t*>(gb + 2 * kPackRows);
}

// Q2_K's scales and mins: the low and the high nibbles of its 16 bytes at 4R, into out and out + 16 R.
inline const int8_t* block_scales16(PackQ2_K, const uint8_t* gb, int8_t* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int t = 0; t < 4; ++t) {
    const __m512i v = _mm512_loadu_si512(gb + 4 * kPackRows + 64 * t);
    _mm512_store_si512(out + 64 * t, _mm512_and_si512(v, m4));
    _mm512_store_si512(out + 16 * kPackRows + 64 * t, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
  }
  return out;
}

// Q3_K's, decoded into `out` (16 x 16 bytes) from the 12 bytes at 2R as q3k_scale in quant.cpp reads
// them, 64 bytes at a time: of scales 4t + u (u < 4; vector t, lanes 16u + r), the low 4 bits are
// nibbles of bytes 0-3 (t = 0, 2: low and high) or 4-7 (t = 1, 3), the high 2 bits bits 2t of bytes 8-11.
inline const int8_t* block_scales16(PackQ3_K, const uint8_t* gb, int8_t* out) {
  const uint8_t* sb = gb + 2 * kPackRows;
  const __m512i l0 = _mm512_loadu_si512(sb), l1 = _mm512_loadu_si512(sb + 64), h = _mm512_loadu_si512(sb + 128);
  const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30);
  const __m512i low[4] = {l0, l1, _mm512_srli_epi16(l0, 4), _mm512_srli_epi16(l1, 4)};
  const __m512i high[4] = {_mm512_slli_epi16(h, 4), _mm512_slli_epi16(h, 2), h, _mm512_srli_epi16(h, 2)};  // to bits 4-5
  for (int t = 0; t < 4; ++t) {
    const __m512i v = _mm512_or_si512(_mm512_and_si512(low[t], m4), _mm512_and_si512(high[t], m2));
    _mm512_store_si512(out + 64 * t, _mm512_sub_epi8(v, _mm512_set1_epi8(32)));
  }
  return out;
}

// 64 bytes of sub-block j's (4h + s) values, chunk k (of 8), 16 rows x 4, unsigned: Q6_K's 6 bits
// (0..63) from its ql run (low nibbles for s < 2, high ones above) and qh (bits 2s).
inline __m512i sub_values16(PackQ6_K, const uint8_t* gb, int j, int k) {
  constexpr int64_t R = kPackRows;
  const int h = j / 4, s = j % 4;
  const __m512i lo = _mm512_loadu_si512(gb + 18 * R + 32 * R * (2 * h + s % 2) + 4 * R * k);
  const __m512i hi = _mm512_loadu_si512(gb + 146 * R + 32 * R * h + 4 * R * k);
  const __m512i low4 = _mm512_and_si512(s < 2 ? lo : _mm512_srli_epi16(lo, 4), _mm512_set1_epi8(0x0F));
  const __m512i high2 = _mm512_and_si512(_mm512_srli_epi16(hi, 2 * s), _mm512_set1_epi8(0x03));
  return _mm512_or_si512(low4, _mm512_slli_epi16(high2, 4));
}

// Q2_K's 2 bits (0..3): bits 2s of its qs run h.
inline __m512i sub_values16(PackQ2_K, const uint8_t* gb, int j, int k) {
  const __m512i qs = _mm512_loadu_si512(gb + 20 * kPackRows + 32 * kPackRows * (j / 4) + 4 * kPackRows * k);
  return _mm512_and_si512(_mm512_srli_epi16(qs, 2 * (j % 4)), _mm512_set1_epi8(0x03));
}

// Q3_K's 3 bits (0..7): bits 2s of its qs run h, and bit j of hmask moved to bit 2.
inline __m512i sub_values16(PackQ3_K, const uint8_t* gb, int j, int k) {
  constexpr int64_t R = kPackRows;
  const int h = j / 4, s = j % 4;
  const __m512i qs = _mm512_loadu_si512(gb + 46 * R + 32 * R * h + 4 * R * k);
  const __m512i hm = _mm512_loadu_si512(gb + 14 * R + 4 * R * k);
  const __m512i third = j < 2 ? _mm512_slli_epi16(hm, 2 - j) : _mm512_srli_epi16(hm, j - 2);
  return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(qs, 2 * s), _mm512_set1_epi8(0x03)),
                         _mm512_and_si512(third, _mm512_set1_epi8(0x04)));
}

// The 16 rows' float scales d * sc of a group-block's 16 halves of 16 values (Q2_K, Q3_K, Q6_K), from
// its int8 scales (scale i of row r at sc + 16 i + r).
inline void half_scales16(const int8_t* sc, __m512 d, __m512* scale) {
  for (int i = 0; i < 16; ++i)
    scale[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * i)))));
}

// A group-block's halves' float scales (half_scales16) into `scale`; returns its int8 scales (and
// Q2_K's mins after them), decoded into `decoded` where the layout needs it (block_scales16).
template <class P>
inline const int8_t* block_half_scales16(const uint8_t* gb, int8_t* decoded, __m512* scale) {
  const int8_t* scales = block_scales16(P{}, gb, decoded);
  half_scales16(scales, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb))), scale);
  return scales;
}

// The int32 a half's product chain starts from: the offset (2^P::kOffsetBits) times the half's
// activation sum, negated, so that the chain ends at sum((q - offset) * x); zero for Q2_K.
template <class P>
inline __m512i half_chain_start(const QuantizedActivations& a, int64_t blk, int h) {
  if constexpr (P::kOffsetBits == 0) return _mm512_setzero_si512();
  const __m512i v = _mm512_set1_epi32(a.half_offsets[2 * blk + h]);  // -32 * sum
  return P::kOffsetBits == 5 ? v : _mm512_srai_epi32(v, 5 - P::kOffsetBits);
}

// Output rows [n, n + 16) of M activation rows from m0 for a packed Q6_K, Q3_K or Q2_K group `wg`
// (P), whose values carry an offset of 2^P::kOffsetBits (32, 4; Q2_K none, but mins), activations
// with one scale per 256 values. Per half of 16 values, sum((q - offset) * x) in int32 and exactly:
// vpdpbusd sums the unsigned q times x (at most 16 x 63 x 127) onto -offset * sum(x); each half's
// sum times its scale d * sc adds to the block's float sum, which the activation's scale multiplies
// once a block. Q2_K's mins, m_a * sum(x_a) + m_b * sum(x_b) from the activation's half sums by one
// vpmaddwd, are scaled by -dmin. With kPre, the values and the halves' float scales come decoded
// from `pre` (decode_group's layout) rather than from the group's bits; the sums are the same.
template <class P, int M, bool kPre = false>
inline void packed_dot_group_scales16(const uint8_t* wg, int64_t nblocks, const QuantizedActivations& a, int64_t m0,
                                      const float* bias, float* out, int64_t os, bool accumulate, int64_t n,
                                      const uint8_t* pre = nullptr) {
  constexpr int64_t R = kPackRows;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* gb = wg + b * R * P::kBytes;
    __m512 scale_own[16];
    const __m512* scale = scale_own;
    alignas(64) int8_t decoded[(P::kHasMin ? 32 : 16) * R];  // scales (and Q2_K's mins after them)
    const int8_t* scales = nullptr;
    __m512 minus_dmin = _mm512_setzero_ps();
    if constexpr (kPre) {
      scale = reinterpret_cast<const __m512*>(pre + decoded_scales_at(nblocks, b));
    } else {
      prefetch_ahead<P>(gb);
      scales = block_half_scales16<P>(gb, decoded, scale_own);
      if constexpr (P::kHasMin)
        minus_dmin = _mm512_sub_ps(minus_dmin, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 2 * R))));
    }
    __m512 sums[M];
    for (int m = 0; m < M; ++m) sums[m] = _mm512_setzero_ps();
    // Unrolled, so that each sub-block's shifts are immediates (gcc kept the loop: shifts by xmm
    // counts, 2 uops each, and a branch a chunk). One core, the weight in L2, batch 1: Q3_K 8.2 ->
    // 14.1 GB/s, Q6_K 20.5 -> 26.7.
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i q[8];
      for (int k = 0; k < 8; ++k) q[k] = kPre ? pre_values(pre, b, j, k) : sub_values16(P{}, gb, j, k);
      __m512i min_pair = _mm512_setzero_si512();
      if constexpr (P::kHasMin) min_pair = half_pairs16(scales + 16 * R, j);
      for (int m = 0; m < M; ++m) {
        const int64_t blk = (m0 + m) * a.blocks + 8 * b + j;
        const int8_t* x = a.q.data() + (m0 + m) * a.K + 256 * b + 32 * j;
        __m512i sa = half_chain_start<P>(a, blk, 0), sb = half_chain_start<P>(a, blk, 1);
        for (int k = 0; k < 4; ++k) {
          sa = _mm512_dpbusd_epi32(sa, q[k], broadcast4(x + 4 * k));
          sb = _mm512_dpbusd_epi32(sb, q[k + 4], broadcast4(x + 16 + 4 * k));
        }
        sums[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sa), scale[2 * j], sums[m]);
        sums[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sb), scale[2 * j + 1], sums[m]);
        if constexpr (P::kHasMin) {
          const __m512i min_sum = _mm512_madd_epi16(min_pair, _mm512_set1_epi32(a.qhalves[blk]));
          sums[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(min_sum), minus_dmin, sums[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(sums[m], _mm512_set1_ps(a.d[(m0 + m) * a.blocks + 8 * b]), acc[m]);
  }
  store_group<M>(acc, bias, out, os, accumulate, n);
}

// IQ4_XS's 16 rows' scale (d * (ls - 32)) of each sub-block, from scales_h (16 uint16 at sh) and
// the 4 scales_l bytes (byte i of every row at sl + 16 i), as iq4xs_scale in quant.cpp reads them.
inline void iq4xs_scales16(const uint8_t* sh, const uint8_t* sl, __m512 d, __m512* scale) {
  const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sh)));
  const __m512i m4 = _mm512_set1_epi32(15), m2 = _mm512_set1_epi32(3), bias = _mm512_set1_epi32(32);
  for (int j = 0; j < 8; ++j) {
    const __m512i lb = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sl + 16 * (j / 2))));
    const __m512i ls = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(lb, 4 * (j % 2)), m4),
                                       _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * j), m2), 4));
    scale[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, bias)));
  }
}

// Output rows [n, n + 16) of M activation rows from m0 for a packed IQ4_XS group `wg`, activations
// with one scale per 256 values: per sub-block, the looked-up values (plus 128) times x by vpdpbusd
// onto -128 * sum(x), then its scale; the activation's scale once a block.
template <int M>
inline void packed_dot_group_iq4xs(const uint8_t* wg, int64_t nblocks, const QuantizedActivations& a, int64_t m0,
                                   const float* bias, float* out, int64_t os, bool accumulate, int64_t n) {
  constexpr int64_t R = kPackRows;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* gb = wg + b * R * PackIQ4_XS::kBytes;
    prefetch_ahead<PackIQ4_XS>(gb);
    __m512 scale[8];
    iq4xs_scales16(gb + 2 * R, gb + 4 * R, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb))), scale);
    __m512 sums[M];  // the block's, before the activation's scale (one per 256 values)
    for (int m = 0; m < M; ++m) sums[m] = _mm512_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      __m512i q[8];  // q[2k]: values 4k.., q[2k + 1]: values 16 + 4k..
      for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_loadu_si512(gb + 8 * R + 16 * R * j + 4 * R * k);
        q[2 * k] = iq4_lookup(_mm512_and_si512(v, low));
        q[2 * k + 1] = iq4_lookup(_mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
      for (int m = 0; m < M; ++m) {
        const int64_t blk = (m0 + m) * a.blocks + 8 * b + j;
        const int8_t* x = a.q.data() + (m0 + m) * a.K + 32 * (8 * b + j);
        // The first chain starts from -128 * sum(x): it ends at sum(value * x).
        __m512i s0 = _mm512_set1_epi32(-128 * a.qsum[blk]), s1 = _mm512_setzero_si512();
        for (int k = 0; k < 4; ++k) {
          s0 = _mm512_dpbusd_epi32(s0, q[2 * k], broadcast4(x + 4 * k));
          s1 = _mm512_dpbusd_epi32(s1, q[2 * k + 1], broadcast4(x + 16 + 4 * k));
        }
        sums[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), scale[j], sums[m]);
      }
    }
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(sums[m], _mm512_set1_ps(a.d[(m0 + m) * a.blocks + 8 * b]), acc[m]);
  }
  store_group<M>(acc, bias, out, os, accumulate, n);
}

// Types whose values (and scales) take a share of a pass's instructions to decode from their bits
// (Q4_K's and Q5_K's 6-bit scales and mins, Q5_K's fifth bits, the two planes of Q6_K and Q3_K): a
// step of several passes a chunk (a prefill, a batch-32 decode) decodes each of their groups once per
// chunk of activation rows (decode_group), and every pass of the chunk loads them. One core, 64 and
// 256 rows of 8192 x 2048 and 2048 x 8192 weights, against a decode a pass: Q5_K 1.15-1.25x, Q6_K
// 1.10-1.21x, Q3_K 1.02-1.07x, the sums bit for bit the same; with activations scaled per 256 values
// (2 threads, 256 rows), Q4_K 1.04-1.23x and Q5_K 1.23-1.43x. Q2_K and IQ4_XS (its values looked up
// once a chunk: 0.87-1.0x) measured no gain.
template <class P>
constexpr bool kDecodesOnce = std::is_same_v<P, PackQ4_K> || std::is_same_v<P, PackQ5_K> || std::is_same_v<P, PackQ6_K> ||
                               std::is_same_v<P, PackQ3_K>;

template <class P>
constexpr bool kQ4KLike = std::is_same_v<P, PackQ4_K> || std::is_same_v<P, PackQ5_K>;

// Bytes of a group's decoded values (one a value) and float scales (16 vectors a block).
template <class P>
inline int64_t decoded_group_bytes(int64_t nblocks) {
  return nblocks * (256 * kPackRows + 16 * 64);
}

// The values of a packed group `wg` (a kDecodesOnce type) into `pre`, in the order its kernel reads
// them with kPre: the same vectors it would decode, stored.
template <class P>
inline void decode_group(const uint8_t* wg, int64_t nblocks, uint8_t* pre) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* gb = wg + b * kPackRows * P::kBytes;
    prefetch_ahead<P>(gb);
    const auto store = [&](int j, int k, __m512i v) { _mm512_store_si512(pre + 64 * (8 * (8 * b + j) + k), v); };
    if constexpr (kQ4KLike<P>) {
      for (int j = 0; j < 8; ++j) {
        __m512i q[8];
        q4k_sub_values16<P>(gb, j, q);
        for (int k = 0; k < 8; ++k) store(j, k, q[k]);
      }
      __m512* scales = reinterpret_cast<__m512*>(pre + decoded_scales_at(nblocks, b));
      q4k_scales16(gb + 64, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb))),
                   _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 32))), scales, scales + 8);
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        for (int k = 0; k < 8; ++k) store(j, k, sub_values16(P{}, gb, j, k));
      }
      alignas(64) int8_t decoded[16 * kPackRows];
      block_half_scales16<P>(gb, decoded, reinterpret_cast<__m512*>(pre + decoded_scales_at(nblocks, b)));
    }
  }
}

// One group through the kernel of its layout (kPre: its values decoded at `pre`).
template <class P, int M, bool kPre = false>
inline void dot_group(const uint8_t* wg, int64_t nblocks, const QuantizedActivations& a, int64_t m0, const float* bias,
                      float* out, int64_t os, bool accumulate, int64_t n, const uint8_t* pre = nullptr) {
  if constexpr (std::is_same_v<P, PackQ4_K> || std::is_same_v<P, PackQ5_K>)
    packed_dot_group_q4k<P, M, kPre>(wg, nblocks, a, m0, bias, out, os, accumulate, n, pre);
  else if constexpr (std::is_same_v<P, PackQ6_K> || std::is_same_v<P, PackQ3_K> || std::is_same_v<P, PackQ2_K>)
    packed_dot_group_scales16<P, M, kPre>(wg, nblocks, a, m0, bias, out, os, accumulate, n, pre);
  else if constexpr (std::is_same_v<P, PackIQ4_XS>) packed_dot_group_iq4xs<M>(wg, nblocks, a, m0, bias, out, os, accumulate, n);
  else packed_dot_group<P, M>(wg, nblocks, a, m0, bias, out, os, accumulate, n);
}

// M (1 to 8) activation rows from m0 through one group, the kernel instantiated for M.
template <class P, bool kPre = false>
inline void dot_group_rows(int64_t M, const uint8_t* wg, int64_t nblocks, const QuantizedActivations& a, int64_t m0,
                           const float* bias, float* out, int64_t os, bool accumulate, int64_t n,
                           const uint8_t* pre = nullptr) {
  switch (M) {
    case 1: dot_group<P, 1, kPre>(wg, nblocks, a, m0, bias, out, os, accumulate, n, pre); break;
    case 2: dot_group<P, 2, kPre>(wg, nblocks, a, m0, bias, out, os, accumulate, n, pre); break;
    case 3: dot_group<P, 3, kPre>(wg, nblocks, a, m0, bias, out, os, accumulate, n, pre); break;
    case 4: dot_group<P, 4, kPre>(wg, nblocks, a, m0, bias, out, os, accumulate, n, pre); break;
    case 5: dot_group<P, 5, kPre>(wg, nblocks, a, m0, bias, out, os, accumulate, n, pre); break;
    case 6: dot_group<P, 6, kPre>(wg, nblocks, a, m0, bias, out, os, accumulate, n, pre); break;
    case 7: dot_group<P, 7, kPre>(wg, nblocks, a, m0, bias, out, os, accumulate, n, pre); break;
    default: dot_group<P, 8, kPre>(wg, nblocks, a, m0, bias, out, os, accumulate, n, pre); break;
  }
}

constexpr int64_t kPackPassRows = 8;

// out [M, N] (+)= a @ W^T (+ bias) for a packed weight wp [N, row_bytes].
template <class P>
inline void packed_matmul_of(const QuantizedActivations& a, int64_t M, const uint8_t* wp, int64_t N, int64_t row_bytes,
                          const float* bias, float* out, int64_t os, bool accumulate) {
  const int64_t nblocks = row_bytes / P::kBytes;
  // A type decoded once takes chunks of twice the rows, 256 KiB of activations beside a group's
  // decoded values (128 KiB at 8,192 inputs): every build of 16-row groups runs on a CPU with 1-2
  // MiB of L2 a core (Xeons, Zen 4 and 5), and at 8,192 inputs a chunk of 16 rows, 2 passes, did
  // not pay for its decode (Q5_K, 2048 x 8192: 1.0x in chunks of 16 rows, 1.15-1.17x in chunks of 32).
  const int64_t chunk = std::min(M, (kDecodesOnce<P> ? 2 : 1) * activation_chunk_rows(a.K, kPackPassRows));
  // Decoded once per chunk where a chunk takes 4 passes or more (fewer did not pay for the stores
  // and loads): never at batch 1 to 31.
  const bool once = kDecodesOnce<P> && chunk >= 4 * kPackPassRows;
  // Up to 8 activation rows a pass (8 accumulators and the group's 8 value vectors fit the 32
  // registers): a speculative step's 5-9 rows unpack each group once or twice, not two or three times.
  for_each_tile(N, M, kPackRows, [&](int64_t n0, int64_t, int64_t m, int64_t rows) {
    const uint8_t* wg = wp + n0 * row_bytes;
    float* om = out + m * os;
    if constexpr (kDecodesOnce<P>) {
      if (once) {
        // A (tile, chunk) is one thread's, its passes in order: the first decodes the tile's group.
        thread_local std::vector<__m512i> decoded;
        const int64_t vectors = decoded_group_bytes<P>(nblocks) / 64;
        if (static_cast<int64_t>(decoded.size()) < vectors) decoded.resize(vectors);
        uint8_t* pre = reinterpret_cast<uint8_t*>(decoded.data());
        if (m % chunk == 0) decode_group<P>(wg, nblocks, pre);
        dot_group_rows<P, true>(rows, wg, nblocks, a, m, bias, om, os, accumulate, n0, pre);
        return;
      }
    }
    dot_group_rows<P>(rows, wg, nblocks, a, m, bias, om, os, accumulate, n0);
  }, kPackPassRows, chunk);
}

// De-quantizing straight from the packed layout, for the GEMM that prefill takes (quant.cpp's
// quant_dequantize): re-assembling each row's block from its group first (65 fields a Q6_K block)
// de-quantized Q6_K at 1.9 G values a second on 2 threads, a third of a 1B prefill step's time.

// 16 floats, rows row0 .. row0 + 3 x 4 values each (lane 4 r + e), into rows of `out` (stride K) at
// column col: float32, or bfloat16 bits rounded as to_bf16x8 rounds (quant_dequantize's file path).
inline void store_rows4(__m512 f, void* out, int64_t K, int64_t row0, int64_t col, bool bf16) {
  if (!bf16) {
    float* o = static_cast<float*>(out) + row0 * K + col;
    _mm_storeu_ps(o, _mm512_castps512_ps128(f));
    _mm_storeu_ps(o + K, _mm512_extractf32x4_ps(f, 1));
    _mm_storeu_ps(o + 2 * K, _mm512_extractf32x4_ps(f, 2));
    _mm_storeu_ps(o + 3 * K, _mm512_extractf32x4_ps(f, 3));
    return;
  }
  uint16_t* o = static_cast<uint16_t*>(out) + row0 * K + col;
  const __m128i lo = to_bf16x8(_mm512_castps512_ps256(f));
  const __m128i hi = to_bf16x8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(o), lo);
  _mm_storeh_pd(reinterpret_cast<double*>(o + K), _mm_castsi128_pd(lo));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(o + 2 * K), hi);
  _mm_storeh_pd(reinterpret_cast<double*>(o + 3 * K), _mm_castsi128_pd(hi));
}

// One Q6_K group's 16 rows (row stride K) from its packed blocks: x = (q - 32) * (d * sc), the two
// roundings of BlockQ6_K's de-quantization (SubBlock16::store), lane for lane. A block's 16 rows go
// to a staging buffer first, then out a row at a time: written straight out, a row of 2,048
// bfloat16 values is 4 KiB, so 16 rows' lines fell in one L1 set and evicted each other.
void dequantize_group_q6k(const uint8_t* wg, int64_t nblocks, void* out, int64_t K, bool bf16) {
  constexpr int64_t R = kPackRows;
  const __m512i offset = _mm512_set1_epi32(32);
  alignas(64) float stage[R * 256];  // bfloat16 uses its first half
  const int64_t elem = bf16 ? 2 : 4;
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* gb = wg + b * R * PackQ6_K::kBytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb)));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512 half_scales[2];
      for (int t = 0; t < 2; ++t) {
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 2 * R + R * (2 * j + t)));
        half_scales[t] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
      }
      for (int k = 0; k < 8; ++k) {
        const __m512i v = sub_values16(PackQ6_K{}, gb, j, k);  // 16 rows x values 4k .. 4k + 3 of sub-block j
        for (int i = 0; i < 4; ++i) {  // rows 4i .. 4i + 3
          const __m512i q = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(v, i));
          const __m512i rows = _mm512_add_epi32(_mm512_set1_epi32(4 * i), _mm512_srli_epi32(
              _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2));
          const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, offset)),
                                         _mm512_permutexvar_ps(rows, half_scales[k / 4]));
          store_rows4(f, stage, 256, 4 * i, 32 * j + 4 * k, bf16);
        }
      }
    }
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(static_cast<uint8_t*>(out) + (r * K + 256 * b) * elem, reinterpret_cast<const uint8_t*>(stage) + r * 256 * elem,
                  256 * elem);
  }
}

}  // namespace

bool packed_dequantizes(int64_t qtype) { return qtype == kQ6_K; }

void packed_dequantize_group(const uint8_t* wg, int64_t row_bytes, int64_t qtype, void* out, int64_t K, bool bf16) {
  CADENZA_CHECK(packed_dequantizes(qtype), "no de-quantization from the packed layout of type ", qtype);
  dequantize_group_q6k(wg, row_bytes / PackQ6_K::kBytes, out, K, bf16);
}

void packed_matmul(const QuantizedActivations& a, int64_t M, const Weight& w, Out out, bool accumulate) {
  const int64_t type = unpacked_type(w.qtype);
  CADENZA_CHECK(a.group == activation_group(type), "products of type ", type, " take activations with a scale per ",
                activation_group(type), " values, not ", a.group);
  with_packed_type(type, [&](auto pack) {
    using P = decltype(pack);
    packed_matmul_of<P>(a, M, static_cast<const uint8_t*>(w.data), w.rows, w.cols, w.bias, out.data, out.stride, accumulate);
  });
}

const char* packed_path() { return "avx512vnni-packed16"; }

}  // namespace cadenza

#endif  // CADENZA_PACK_ROWS == 16
