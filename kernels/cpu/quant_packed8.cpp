// The products over the packed layout of quant_packed.h with 256-bit vectors, 8 rows a group:
// AVX2's `vpmaddubsw` (pairs of unsigned x signed bytes summed into int16) and `vpmaddwd`, or where
// the build has VNNI, `vpdpbusd` on ymm (the avx2vnni build: AVX-VNNI's VEX form, Alder Lake and
// later). Only the builds of 8-row groups compile this unit (kernels/cpu.py); otherwise it is empty.
//
// Per block of 32 Q4_x values and group of 8 rows the AVX2 products take about 30 instructions for
// each activation row (8 broadcasts of 4 activation bytes, 8 vpmaddubsw, their int16 sums, one
// vpmaddwd, the conversion and two fma) and 16 shared by the activation rows (loading and splitting
// the nibbles, the scales): about 6 an output row and block at batch 1, against about 20 in the
// file's layout (quant.cpp), which decodes each row's scales and converts each row's sum on its own.
// Measured on one core of a Sapphire Rapids Xeon as an AVX2 CPU, 3072 x 576 weights (768 for the
// K-quants): 1.6x (Q8_0) to 3x (Q4_K) the file layout's rate at 4 rows and more; AVX-VNNI 1.2x (Q4_1)
// to 2x (Q8_0) AVX2's. A prefill decodes the groups of the types whose bits cost more than a row's
// products (the K-quants) once per chunk of activation rows rather than once a pass (kDecodesOnce):
// one core, 256 rows of 2048 x 8192 and 8192 x 2048 weights, Q4_K 1.1x, Q5_K 1.3-1.5x, Q6_K 1.1-1.3x,
// Q3_K 1.2-1.35x, the sums bit for bit the same.
#include "quant_packed.h"

#if CADENZA_PACK_ROWS == 8

#include <immintrin.h>

#include <vector>

#include "linear.h"

namespace cadenza {
namespace {

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define CADENZA_YMM_VNNI 1
constexpr bool kVnni = true;
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
  return _mm256_dpbusd_epi32(acc, u, x);
#endif
}
#else
constexpr bool kVnni = false;
#endif

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// v as computed here: an empty asm that the compiler must assume reads and changes it, so that a
// chain of integer adds keeps its order. Re-associated by gcc 12 (all of a block's products first,
// then a tree of adds), the 4 activation rows of a pass spilled to the stack: about 70 moves in a
// block's 230 instructions, and 30% more time at 4 rows and more. The saturating add would keep the
// order too, but it runs on 2 of Zen's 4 vector ALU pipes (LLVM's Znver4 model, from AMD's guide).
inline __m256i pinned(__m256i v) {
  asm("" : "+x"(v));
  return v;
}

// The sum over a run of chunks of small unsigned bytes u (nibbles, or the 5-bit values of Q5_0, Q5_1
// and Q5_K) times 4 broadcast activation bytes: one int32 lane a row. AVX2 sums the pairs of vpmaddubsw in int16 for
// kInt16Chunks chunks before widening to int32: 8 of nibbles (8 x 2 x 15 x 127 = 30480 < 2^15;
// activations are within +-127), 4 of 5-bit values (4 x 2 x 31 x 127 = 31496). VNNI adds into int32
// in two chains, so that consecutive vpdpbusd do not wait on each other.
template <int kInt16Chunks>
class ByteDots {
 public:
  // Chunk k of the run (k even and odd alternate between the chains).
  void add(int k, __m256i u, __m256i x) {
#ifdef CADENZA_YMM_VNNI
    if (k % 2) s1_ = dpbusd(s1_, u, x);
    else s0_ = dpbusd(s0_, u, x);
#else
    s0_ = pinned(_mm256_add_epi16(s0_, _mm256_maddubs_epi16(u, x)));
    if (kInt16Chunks < 8 && k % kInt16Chunks == kInt16Chunks - 1 && k < 7) {
      s1_ = _mm256_add_epi32(s1_, _mm256_madd_epi16(s0_, _mm256_set1_epi16(1)));
      s0_ = _mm256_setzero_si256();
    }
#endif
  }
  __m256i sum() const {
    if constexpr (kVnni) return _mm256_add_epi32(s0_, s1_);
    const __m256i last = _mm256_madd_epi16(s0_, _mm256_set1_epi16(1));
    return kInt16Chunks < 8 ? _mm256_add_epi32(s1_, last) : last;
  }

 private:
  __m256i s0_ = _mm256_setzero_si256(), s1_ = _mm256_setzero_si256();
};

// The weight's offset left in the integer sum: Q8_0's stored q + 128 under VNNI (unsigned x signed);
// AVX2 recovers the signed q instead (vpmaddubsw's int16 pairs would overflow on 255 x 127).
template <class P>
constexpr int64_t sum_offset() {
  return (P::kNibbles && !P::kTable) || kVnni ? P::kOffset : 0;
}

// The 8 rows' integer sums of 32 values looked up in `values` (IQ4's, or MXFP4's; 4 chunks of 4-bit
// indices at `chunks`, each 8 rows x 4 bytes: low nibbles values 4c.., high ones 16 + 4c..) with the
// activation values at x[m]. VNNI multiplies the looked-up values plus 128 (the caller takes 128 *
// sum(x) off: sum_offset); AVX2 the signed values, their signs moved onto x (a pair at most 2 x 127
// x 127 < 2^15).
template <int M>
inline void iq4_sums(const uint8_t* chunks, const int8_t* const* x, __m256i* isum, NibbleTable values = kIQ4Table) {
  const __m256i low = _mm256_set1_epi8(0x0F);
#ifdef CADENZA_YMM_VNNI
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(values.biased)));
  __m256i s0[M], s1[M];
  for (int m = 0; m < M; ++m) s0[m] = s1[m] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 4 * kPackRows * c));
    const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
    const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    for (int m = 0; m < M; ++m) {
      s0[m] = dpbusd(s0[m], lo, broadcast4(x[m] + 4 * c));
      s1[m] = dpbusd(s1[m], hi, broadcast4(x[m] + 16 + 4 * c));
    }
  }
  for (int m = 0; m < M; ++m) isum[m] = _mm256_add_epi32(s0[m], s1[m]);
#else
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(values.values)));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < M; ++m) isum[m] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 4 * kPackRows * c));
    const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
    const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
    const __m256i alo = _mm256_abs_epi8(lo), ahi = _mm256_abs_epi8(hi);
    for (int m = 0; m < M; ++m) {
      const __m256i pl = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(broadcast4(x[m] + 4 * c), lo));
      const __m256i ph = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(broadcast4(x[m] + 16 + 4 * c), hi));
      isum[m] = pinned(_mm256_add_epi32(isum[m], _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones))));
    }
  }
#endif
}

// Q5_0 and Q5_1: 16 added to chunk c's low nibbles (values 4c + j) and high ones (16 + 4c + j)
// where their fifth bit is set. Row r's 32 bits lie in lane r of qh (bit i: value i), as
// quant_packed.cpp reads them: vpshufb copies the byte of a value's bit across its lane (byte
// c / 2 for the low nibbles, 2 + c / 2 for the high), and each byte tests its bit, 4 (c % 2) + j.
inline void add_fifth_bits(__m256i qh, int c, __m256i& lo, __m256i& hi) {
  const __m256i lane_bytes = _mm256_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0);
  const __m256i bit = _mm256_set1_epi32(static_cast<int32_t>(0x08040201u << (4 * (c % 2))));
  auto sixteens = [&](int t) {
    const __m256i spread = _mm256_shuffle_epi8(qh, _mm256_add_epi8(lane_bytes, _mm256_set1_epi8(static_cast<char>(t))));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
  };
  lo = _mm256_or_si256(lo, sixteens(c / 2));
  hi = _mm256_or_si256(hi, sixteens(2 + c / 2));
}

// The 8 rows' integer sums of one group-block's values with the 32 activation values at x[m], for
// M activation rows.
template <class P, int M>
inline void block_sums(const uint8_t* gb, const int8_t* const* x, __m256i* isum) {
  const uint8_t* chunks = gb + packed_header_bytes<P>();
  if constexpr (P::kTable) {
    iq4_sums<M>(chunks, x, isum, P::kE8M0 ? kMXFP4Table : kIQ4Table);
  } else if constexpr (P::kNibbles) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i qh = P::kFive ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + packed_bits_at<P>())) : low;
    ByteDots<P::kFive ? 4 : 8> dots[M];
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * c));
      __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      if constexpr (P::kFive) add_fifth_bits(qh, c, lo, hi);
      for (int m = 0; m < M; ++m) {
        dots[m].add(2 * c, lo, broadcast4(x[m] + 4 * c));
        dots[m].add(2 * c + 1, hi, broadcast4(x[m] + 16 + 4 * c));
      }
    }
    for (int m = 0; m < M; ++m) isum[m] = dots[m].sum();
  } else {
#ifdef CADENZA_YMM_VNNI
    __m256i s0[M], s1[M];
    for (int m = 0; m < M; ++m) s0[m] = s1[m] = _mm256_setzero_si256();
    for (int c = 0; c < 8; c += 2) {
      const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * c));
      const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * c + 32));
      for (int m = 0; m < M; ++m) {
        s0[m] = dpbusd(s0[m], u0, broadcast4(x[m] + 4 * c));
        s1[m] = dpbusd(s1[m], u1, broadcast4(x[m] + 4 * c + 4));
      }
    }
    for (int m = 0; m < M; ++m) isum[m] = _mm256_add_epi32(s0[m], s1[m]);
#else
    // |q| (unsigned) x (x with q's sign): llama.cpp's way to a signed x signed product on
    // vpmaddubsw; a pair is at most 2 x 128 x 127 < 2^15, so each chunk goes to int32 at once.
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
    for (int m = 0; m < M; ++m) isum[m] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 32 * c)), flip);
      const __m256i aq = _mm256_abs_epi8(q);
      for (int m = 0; m < M; ++m) {
        const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(broadcast4(x[m] + 4 * c), q));
        isum[m] = pinned(_mm256_add_epi32(isum[m], _mm256_madd_epi16(p, ones)));
      }
    }
#endif
  }
}

// Fetch the bytes of one group-block of P at prefetch_ahead_bytes<P>() past `block` (quant_packed.h).
template <class P>
inline void prefetch_ahead(const uint8_t* block) {
  for (int64_t o = 0; o < kPackRows * P::kBytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + prefetch_ahead_bytes<P>() + o), _MM_HINT_T0);
}

// out rows [0, M) (of stride os), columns [n, n + 8) (+)= acc + macc (+ bias).
template <int M>
inline void store_group(const __m256* acc, const __m256* macc, const float* bias, float* out, int64_t os,
                        bool accumulate, int64_t n) {
  for (int m = 0; m < M; ++m) {
    __m256 v = _mm256_add_ps(acc[m], macc[m]);
    if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n));
    float* o = out + m * os + n;
    _mm256_storeu_ps(o, accumulate ? _mm256_add_ps(_mm256_loadu_ps(o), v) : v);
  }
}

inline __m256 load_halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 rows' E8M0 scale bytes (MXFP4) -> 2^(e - 128) as e8m0_half gives it: exponent field e - 1, but
// for e < 2 the denormals 0x00200000 << e, blended in where e < 2 (as quant_packed.cpp does).
inline __m256 e8m0_half8(const uint8_t* p) {
  const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i denormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, denormal, tiny));
}

// Output rows [n, n + 8) of M activation rows from m0: one packed group `wg` of a 32-value type.
// The scaled sums and the mins' terms go to separate accumulators (shorter dependency chains).
template <class P, int M>
inline void packed_dot_group(const uint8_t* wg, int64_t nblocks, const QuantizedActivations& a, int64_t m0,
                             const float* bias, float* out, int64_t os, bool accumulate, int64_t n) {
  __m256 acc[M], macc[M];
  for (int m = 0; m < M; ++m) acc[m] = macc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* gb = wg + b * kPackRows * P::kBytes;
    prefetch_ahead<P>(gb);
    const int8_t* x[M];
    for (int m = 0; m < M; ++m) x[m] = a.q.data() + (m0 + m) * a.K + 32 * b;
    __m256i isum[M];
    block_sums<P, M>(gb, x, isum);
    const __m256 d = P::kE8M0 ? e8m0_half8(gb) : load_halves8(gb);
    const __m256 mins = P::kHasMin ? load_halves8(gb + 2 * kPackRows) : _mm256_setzero_ps();
    for (int m = 0; m < M; ++m) {
      const int64_t blk = (m0 + m) * a.blocks + b;
      __m256i s = isum[m];
      if constexpr (sum_offset<P>() != 0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(static_cast<int32_t>(sum_offset<P>()) * a.qsum[blk]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(a.d[blk])), acc[m]);
      if constexpr (P::kHasMin) macc[m] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.s[blk]), macc[m]);
    }
  }
  store_group<M>(acc, macc, bias, out, os, accumulate, n);
}

// Q4_K's 8 rows' scale (d * sc) and negated min (-(dmin * m)) of each sub-block j into scale[j],
// minv[j], from the 12 scale bytes (byte i of every row at sb + 8 i), as q4k_scale_min in quant.cpp
// unpacks them.
inline void q4k_scales8(const uint8_t* sb, __m256 d, __m256 dmin, __m256* scale, __m256* minv) {
  __m256i b[12];
  for (int i = 0; i < 12; ++i) b[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sb + 8 * i)));
  const __m256i m6 = _mm256_set1_epi32(63), m4 = _mm256_set1_epi32(15);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int j = 0; j < 8; ++j) {
    __m256i sc, m;
    if (j < 4) {
      sc = _mm256_and_si256(b[j], m6);
      m = _mm256_and_si256(b[j + 4], m6);
    } else {
      sc = _mm256_or_si256(_mm256_and_si256(b[j + 4], m4), _mm256_slli_epi32(_mm256_srli_epi32(b[j - 4], 6), 4));
      m = _mm256_or_si256(_mm256_srli_epi32(b[j + 4], 4), _mm256_slli_epi32(_mm256_srli_epi32(b[j], 6), 4));
    }
    scale[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
    minv[j] = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m)), sign);
  }
}

// Output rows [n, n + 8) of M activation rows from m0 for a packed Q4_K or Q5_K group `wg` (P):
// Q5_K's values are Q4_K's nibbles plus 16 where their bit in qh is set.
// Q5_K's 5-bit values of sub-block 2c + h (h = 0: the low nibbles, 1: the high ones), chunk k: the
// nibbles plus bit 2c + h of the chunk's qh bytes, moved to bit 4.
inline __m256i q5k_values8(const uint8_t* gb, int c, int h, int k) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 16 * kPackRows + 32 * kPackRows * c + 4 * kPackRows * k));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 144 * kPackRows + 4 * kPackRows * k));
  const __m256i nibbles = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
  return _mm256_or_si256(nibbles, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + h), _mm256_set1_epi8(0x01)), 4));
}

// Where a Q4_K or Q5_K group's decoded scales start in decode_group's layout, after its values: per
// block the 8 sub-blocks' scales then negated mins, 8 rows each.
inline int64_t q4k_scales_at(int64_t nblocks, int64_t b) { return nblocks * 256 * kPackRows + b * 16 * 32; }

// With kPre, the values and scales come decoded from `pre` (decode_group's layout: 32 bytes a chunk,
// in order of block, sub-block and chunk, then q4k_scales_at's) rather than from the group's bits.
template <class P, int M, bool kPre = false>
inline void packed_dot_group_q4k(const uint8_t* wg, int64_t nblocks, const QuantizedActivations& a, int64_t m0,
                                 const float* bias, float* out, int64_t os, bool accumulate, int64_t n,
                                 const uint8_t* pre = nullptr) {
  constexpr bool kFive = std::is_same_v<P, PackQ5_K>;
  using Dots = ByteDots<kFive ? 4 : 8>;
  __m256 acc[M], macc[M];
  for (int m = 0; m < M; ++m) acc[m] = macc[m] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* gb = wg + b * kPackRows * P::kBytes;
    __m256 scale_own[8], minv_own[8];
    const __m256* scale = scale_own;
    const __m256* minv = minv_own;
    if constexpr (kPre) {
      scale = reinterpret_cast<const __m256*>(pre + q4k_scales_at(nblocks, b));
      minv = scale + 8;
    } else {
      prefetch_ahead<P>(gb);
      q4k_scales8(gb + 4 * kPackRows, load_halves8(gb), load_halves8(gb + 2 * kPackRows), scale_own, minv_own);
    }
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high)
      if constexpr (kFive || kPre) {
        // One sub-block at a time: the int16 and int32 sums of two at once (4 registers an
        // activation row) spilled at 4 rows a pass.
        for (int h = 0; h < 2; ++h) {
          Dots dots[M];
#pragma GCC unroll 8
          for (int k = 0; k < 8; ++k) {
            const __m256i v = kPre ? _mm256_load_si256(reinterpret_cast<const __m256i*>(pre + 32 * (8 * (8 * b + 2 * c + h) + k)))
                                   : q5k_values8(gb, c, h, k);
            for (int m = 0; m < M; ++m) dots[m].add(k, v, broadcast4(a.q.data() + (m0 + m) * a.K + 256 * b + 64 * c + 32 * h + 4 * k));
          }
          for (int m = 0; m < M; ++m) {
            const int64_t blk = (m0 + m) * a.blocks + 8 * b + 2 * c + h;
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[m].sum()), _mm256_mul_ps(scale[2 * c + h], _mm256_set1_ps(a.d[blk])), acc[m]);
            macc[m] = _mm256_fmadd_ps(minv[2 * c + h], _mm256_set1_ps(a.s[blk]), macc[m]);
          }
        }
        continue;
      }
      const uint8_t* chunks = gb + 16 * kPackRows + 32 * kPackRows * c;
      Dots lo_dots[M], hi_dots[M];
      for (int k = 0; k < 8; ++k) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + 4 * kPackRows * k));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int m = 0; m < M; ++m) {
          const int8_t* x = a.q.data() + (m0 + m) * a.K + 256 * b + 64 * c;
          lo_dots[m].add(k, lo, broadcast4(x + 4 * k));
          hi_dots[m].add(k, hi, broadcast4(x + 32 + 4 * k));
        }
      }
      for (int m = 0; m < M; ++m) {
        const int64_t blk = (m0 + m) * a.blocks + 8 * b + 2 * c;
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo_dots[m].sum()), _mm256_mul_ps(scale[2 * c], _mm256_set1_ps(a.d[blk])), acc[m]);
        macc[m] = _mm256_fmadd_ps(minv[2 * c], _mm256_set1_ps(a.s[blk]), macc[m]);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi_dots[m].sum()), _mm256_mul_ps(scale[2 * c + 1], _mm256_set1_ps(a.d[blk + 1])), acc[m]);
        macc[m] = _mm256_fmadd_ps(minv[2 * c + 1], _mm256_set1_ps(a.s[blk + 1]), macc[m]);
      }
    }
  }
  store_group<M>(acc, macc, bias, out, os, accumulate, n);
}

// The 8 rows' signed scales of sub-block j's two halves of 16 values (Q2_K, Q3_K, Q6_K; a: the first, b:
// the second), from int8 scales (scale i of row r at sc + 8 i + r), as vpmaddwd takes them: each
// row's scale in both int16 of its lane (dup_a, dup_b: against pairs of products), and the two in one
// lane (pair: against the activation's two half sums).
struct Scales8 {
  __m256i dup_a, dup_b, pair;
};

inline Scales8 sub_scales8(const int8_t* sc, int j) {
  const __m256i a = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * (2 * j))));
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * (2 * j + 1))));
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  const __m256i a_low = _mm256_and_si256(a, low);
  return {_mm256_or_si256(a_low, _mm256_slli_epi32(a, 16)), _mm256_or_si256(_mm256_and_si256(b, low), _mm256_slli_epi32(b, 16)),
          _mm256_or_si256(a_low, _mm256_slli_epi32(b, 16))};
}

// A group-block's int8 scales in that layout: Q6_K's are stored so (at 2R).
inline const int8_t* block_scales8(PackQ6_K, const uint8_t* gb, int8_t*) {
  return reinterpret_cast<const int8_t*>(gb + 2 * kPackRows);
}

// Q2_K's scales and mins: the low and the high nibbles of its 16 bytes at 4R, into out and out + 16 R.
inline const int8_t* block_scales8(PackQ2_K, const uint8_t* gb, int8_t* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int t = 0; t < 4; ++t) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 4 * kPackRows + 32 * t));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * t), _mm256_and_si256(v, m4));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 16 * kPackRows + 32 * t), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
  }
  return out;
}

// Q3_K's, decoded into `out` (16 x 8 bytes) from the 12 bytes at 2R as q3k_scale in quant.cpp reads
// them, 32 bytes at a time: of scales 4t + u (u < 4; vector t, lanes 8u + r), the low 4 bits are
// nibbles of bytes 0-3 (t = 0, 2: low and high) or 4-7 (t = 1, 3), the high 2 bits bits 2t of bytes 8-11.
inline const int8_t* block_scales8(PackQ3_K, const uint8_t* gb, int8_t* out) {
  const uint8_t* sb = gb + 2 * kPackRows;
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 32));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64));
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
  const __m256i low[4] = {l0, l1, _mm256_srli_epi16(l0, 4), _mm256_srli_epi16(l1, 4)};
  const __m256i high[4] = {_mm256_slli_epi16(h, 4), _mm256_slli_epi16(h, 2), h, _mm256_srli_epi16(h, 2)};  // to bits 4-5
  for (int t = 0; t < 4; ++t) {
    const __m256i v = _mm256_or_si256(_mm256_and_si256(low[t], m4), _mm256_and_si256(high[t], m2));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * t), _mm256_sub_epi8(v, _mm256_set1_epi8(32)));
  }
  return out;
}

// 32 bytes of sub-block j's (4h + s) values, chunk k (of 8), 8 rows x 4, unsigned: Q6_K's 6 bits
// (0..63) from its ql run (low nibbles for s < 2, high ones above) and qh (bits 2s).
inline __m256i sub_values8(PackQ6_K, const uint8_t* gb, int j, int k) {
  constexpr int64_t R = kPackRows;
  const int h = j / 4, s = j % 4;
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 18 * R + 32 * R * (2 * h + s % 2) + 4 * R * k));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 146 * R + 32 * R * h + 4 * R * k));
  const __m256i low4 = _mm256_and_si256(s < 2 ? lo : _mm256_srli_epi16(lo, 4), _mm256_set1_epi8(0x0F));
  const __m256i high2 = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * s), _mm256_set1_epi8(0x03));
  return _mm256_or_si256(low4, _mm256_slli_epi16(high2, 4));
}

// Q2_K's 2 bits (0..3): bits 2s of its qs run h.
inline __m256i sub_values8(PackQ2_K, const uint8_t* gb, int j, int k) {
  const uint8_t* qs = gb + 20 * kPackRows + 32 * kPackRows * (j / 4) + 4 * kPackRows * k;
  return _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)), 2 * (j % 4)), _mm256_set1_epi8(0x03));
}

// Q3_K's 3 bits (0..7): bits 2s of its qs run h, and bit j of hmask moved to bit 2.
inline __m256i sub_values8(PackQ3_K, const uint8_t* gb, int j, int k) {
  constexpr int64_t R = kPackRows;
  const int h = j / 4, s = j % 4;
  const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 46 * R + 32 * R * h + 4 * R * k));
  const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 14 * R + 4 * R * k));
  const __m256i third = j < 2 ? _mm256_slli_epi16(hm, 2 - j) : _mm256_srli_epi16(hm, j - 2);
  return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 2 * s), _mm256_set1_epi8(0x03)),
                         _mm256_and_si256(third, _mm256_set1_epi8(0x04)));
}

// Chunks whose vpmaddubsw pairs sum in int16 before vpmaddwd applies the scale: Q6_K's 6-bit values
// 2 (2 x 2 x 63 x 127 = 32004 < 2^15), Q3_K's and Q2_K's the 4 of a half (4 x 2 x 7 x 127).
template <class P>
constexpr int kInt16Chunks = std::is_same_v<P, PackQ6_K> ? 2 : 4;

// Output rows [n, n + 8) of M activation rows from m0 for a packed Q6_K, Q3_K or Q2_K group `wg` (P),
// whose values carry an offset of 2^P::kOffsetBits (32, 4; Q2_K none, but mins): per 16 values
// sum(sc * (q - offset) * x) = sum(sc * q * x) - offset * sc * sum(x), the first from vpmaddubsw's
// int16 pairs, kInt16Chunks chunks summed, scaled by vpmaddwd, the second from the activation's half
// sums, as Q2_K's m * sum(x), scaled by dmin; the activations' scale is one per 256 values, so a
// block sums in int32 and turns to float once. The AVX-VNNI build takes the same path: vpdpbusd's
// int32 sums would need the scales of 16 values applied in int32 or float, one step more than
// vpmaddwd's.
// With kPre, the values come decoded from `pre` (decode_group's layout: 32 bytes a chunk, in order
// of block, sub-block and chunk) rather than from the group's bits.
template <class P, int M, bool kPre = false>
inline void packed_dot_group_scales16(const uint8_t* wg, int64_t nblocks, const QuantizedActivations& a, int64_t m0,
                                      const float* bias, float* out, int64_t os, bool accumulate, int64_t n,
                                      const uint8_t* pre = nullptr) {
  constexpr int64_t R = kPackRows;
  constexpr int kRun = kInt16Chunks<P>;
  __m256 acc[M], macc[M];
  for (int m = 0; m < M; ++m) acc[m] = macc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* gb = wg + b * R * P::kBytes;
    prefetch_ahead<P>(gb);
    const __m256 d = load_halves8(gb);
    const __m256 minus_dmin = P::kHasMin ? _mm256_sub_ps(_mm256_setzero_ps(), load_halves8(gb + 2 * R)) : _mm256_setzero_ps();
    alignas(32) int8_t decoded[(P::kHasMin ? 32 : 16) * R];  // scales (and Q2_K's mins after them)
    const int8_t* scales = block_scales8(P{}, gb, decoded);
    // The block's sums in int32 (the activation's scale is one per 256 values): at most 256 x 127 x
    // 63 x 127 for the scaled values, as much again for the offset's.
    __m256i isum[M], imin[M];
    for (int m = 0; m < M; ++m) isum[m] = imin[m] = _mm256_setzero_si256();
    // Unrolled, so that each sub-block's shifts are immediates, as in quant_packed.cpp.
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const Scales8 sc = sub_scales8(scales, j);
      const auto run = [&](int k) {  // chunks k .. k + kRun - 1
        __m256i q[kRun];
        for (int i = 0; i < kRun; ++i)
          q[i] = kPre ? _mm256_load_si256(reinterpret_cast<const __m256i*>(pre + 32 * (8 * (8 * b + j) + k + i)))
                      : sub_values8(P{}, gb, j, k + i);
        for (int m = 0; m < M; ++m) {
          const int8_t* x = a.q.data() + (m0 + m) * a.K + 256 * b + 32 * j + 4 * k;
          __m256i p = _mm256_maddubs_epi16(q[0], broadcast4(x));
          for (int i = 1; i < kRun; ++i) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(q[i], broadcast4(x + 4 * i)));
          isum[m] = pinned(_mm256_add_epi32(isum[m], _mm256_madd_epi16(p, k < 4 ? sc.dup_a : sc.dup_b)));
        }
      };
      // Unrolled where the values are loaded (a 1B Q6_K prefill 512: 93 tok/s, against 73 rolled, in
      // two runs); where they are decoded here (a few rows) it stays rolled: unrolled, Q6_K's batch 1
      // fell from 94% of the memory's rate to 64% (8 x 4 unrolled sub-blocks a kernel, of 4 kernels).
      if constexpr (kPre) {
#pragma GCC unroll 8
        for (int k = 0; k < 8; k += kRun) run(k);
      } else {
        for (int k = 0; k < 8; k += kRun) run(k);
      }
      for (int m = 0; m < M; ++m) {
        const int64_t blk = (m0 + m) * a.blocks + 8 * b + j;
        const __m256i halves = _mm256_set1_epi32(a.qhalves[blk]);
        if constexpr (P::kOffsetBits != 0)
          isum[m] = _mm256_sub_epi32(isum[m], _mm256_slli_epi32(_mm256_madd_epi16(sc.pair, halves), P::kOffsetBits));
        if constexpr (P::kHasMin)
          imin[m] = _mm256_add_epi32(imin[m], _mm256_madd_epi16(sub_scales8(scales + 16 * R, j).pair, halves));
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m256 dx = _mm256_set1_ps(a.d[(m0 + m) * a.blocks + 8 * b]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, dx), acc[m]);
      if constexpr (P::kHasMin) macc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin[m]), _mm256_mul_ps(minus_dmin, dx), macc[m]);
    }
  }
  store_group<M>(acc, macc, bias, out, os, accumulate, n);
}

// Output rows [n, n + 8) of M activation rows from m0 for a packed IQ4_XS group `wg`: per
// sub-block the integer sums of iq4_sums, then its scale d * (ls - 32) (scales_h, 8 uint16 at 2R;
// scales_l byte i of every row at 4R + R i).
template <int M>
inline void packed_dot_group_iq4xs(const uint8_t* wg, int64_t nblocks, const QuantizedActivations& a, int64_t m0,
                                   const float* bias, float* out, int64_t os, bool accumulate, int64_t n) {
  constexpr int64_t R = kPackRows;
  __m256 acc[M], none[M];
  for (int m = 0; m < M; ++m) acc[m] = none[m] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi32(15), m2 = _mm256_set1_epi32(3), bias32 = _mm256_set1_epi32(32);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* gb = wg + b * R * PackIQ4_XS::kBytes;
    prefetch_ahead<PackIQ4_XS>(gb);
    const __m256 d = load_halves8(gb);
    const __m256i high = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 2 * R)));
    for (int j = 0; j < 8; ++j) {
      const __m256i lb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gb + 4 * R + R * (j / 2))));
      const __m256i ls = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(lb, 4 * (j % 2)), m4),
                                         _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(high, 2 * j), m2), 4));
      const __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, bias32)));
      const int8_t* x[M];
      for (int m = 0; m < M; ++m) x[m] = a.q.data() + (m0 + m) * a.K + 32 * (8 * b + j);
      __m256i isum[M];
      iq4_sums<M>(gb + 8 * R + 16 * R * j, x, isum);
      for (int m = 0; m < M; ++m) {
        const int64_t blk = (m0 + m) * a.blocks + 8 * b + j;
        __m256i sum = isum[m];
        if constexpr (kVnni) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(128 * a.qsum[blk]));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(a.d[blk])), acc[m]);
      }
    }
  }
  store_group<M>(acc, none, bias, out, os, accumulate, n);
}

// Types whose values (and Q4_K's and Q5_K's scales) take a share of a pass's instructions to decode
// from their bits (Q5_K's fifth bits, the two planes of Q6_K and Q3_K, Q2_K's shifts, the 6-bit
// scales): a prefill decodes each of their groups once per chunk of activation rows (decode_group),
// and every pass of the chunk loads them. The 32-value types decode in 3 instructions a chunk and
// stay as they are.
template <class P>
constexpr bool kDecodesOnce = std::is_same_v<P, PackQ4_K> || std::is_same_v<P, PackQ5_K> || std::is_same_v<P, PackQ6_K> ||
                              std::is_same_v<P, PackQ3_K> || std::is_same_v<P, PackQ2_K>;

// Bytes of a group's decoded values (one a value) and, for Q4_K and Q5_K, scales.
template <class P>
inline int64_t decoded_group_bytes(int64_t nblocks) {
  constexpr bool kScales = std::is_same_v<P, PackQ4_K> || std::is_same_v<P, PackQ5_K>;
  return nblocks * (256 * kPackRows + (kScales ? 16 * 32 : 0));
}

// The values of a packed group `wg` (a kDecodesOnce type) into `pre`, in the order its kernel reads
// them with kPre: the same vectors it would decode, stored.
template <class P>
inline void decode_group(const uint8_t* wg, int64_t nblocks, uint8_t* pre) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* gb = wg + b * kPackRows * P::kBytes;
    if constexpr (std::is_same_v<P, PackQ4_K> || std::is_same_v<P, PackQ5_K>) {
      const __m256i low = _mm256_set1_epi8(0x0F);
      for (int j = 0; j < 8; ++j) {
        for (int k = 0; k < 8; ++k) {
          __m256i v;
          if constexpr (std::is_same_v<P, PackQ5_K>) {
            v = q5k_values8(gb, j / 2, j % 2, k);
          } else {
            v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 16 * kPackRows + 32 * kPackRows * (j / 2) + 4 * kPackRows * k));
            v = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, low);
          }
          _mm256_store_si256(reinterpret_cast<__m256i*>(pre + 32 * (8 * (8 * b + j) + k)), v);
        }
      }
      __m256* scales = reinterpret_cast<__m256*>(pre + q4k_scales_at(nblocks, b));
      q4k_scales8(gb + 4 * kPackRows, load_halves8(gb), load_halves8(gb + 2 * kPackRows), scales, scales + 8);
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        for (int k = 0; k < 8; ++k)
          _mm256_store_si256(reinterpret_cast<__m256i*>(pre + 32 * (8 * (8 * b + j) + k)), sub_values8(P{}, gb, j, k));
      }
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

// Activation rows a pass: 16 ymm registers hold the accumulators of 4 rows beside a chunk's values.
constexpr int64_t kPackPassRows = 4;
// Output rows a tile: two groups, so that each output row's 16 floats of a tile fill a 64-byte line
// (a long prefill's output does not fit L2; half lines were written twice).
constexpr int64_t kTileGroups = 2;

// out [M, N] (+)= a @ W^T (+ bias) for a packed weight wp [N, row_bytes].
template <class P>
inline void packed_matmul_of(const QuantizedActivations& a, int64_t M, const uint8_t* wp, int64_t N, int64_t row_bytes,
                             const float* bias, float* out, int64_t os, bool accumulate) {
  const int64_t nblocks = row_bytes / P::kBytes;
  const int64_t chunk = std::min(M, activation_chunk_rows(a.K, kPackPassRows));
  // Decoded once per chunk where a chunk takes more than one pass: a prefill, or a step of more than
  // 4 rows (batch-32 decode: 1.3-1.9x as AVX2); never batch 1.
  const bool once = kDecodesOnce<P> && chunk > kPackPassRows;
  const int64_t group_bytes = decoded_group_bytes<P>(nblocks);
  for_each_tile(N, M, kTileGroups * kPackRows, [&](int64_t n0, int64_t n1, int64_t m, int64_t rows) {
    float* om = out + m * os;
    if constexpr (kDecodesOnce<P>) {
      if (once) {
        // A (tile, chunk) is one thread's, its passes in order: the first decodes the tile's groups.
        thread_local std::vector<__m256i> decoded;
        const int64_t vectors = kTileGroups * group_bytes / 32;
        if (static_cast<int64_t>(decoded.size()) < vectors) decoded.resize(vectors);
        uint8_t* base = reinterpret_cast<uint8_t*>(decoded.data());
        if (m % chunk == 0) {
          for (int64_t n = n0; n < n1; n += kPackRows)
            decode_group<P>(wp + n * row_bytes, nblocks, base + (n - n0) / kPackRows * group_bytes);
        }
        for (int64_t n = n0; n < n1; n += kPackRows) {
          const uint8_t* wg = wp + n * row_bytes;
          const uint8_t* pre = base + (n - n0) / kPackRows * group_bytes;
          switch (rows) {
            case 1: dot_group<P, 1, true>(wg, nblocks, a, m, bias, om, os, accumulate, n, pre); break;
            case 2: dot_group<P, 2, true>(wg, nblocks, a, m, bias, om, os, accumulate, n, pre); break;
            case 3: dot_group<P, 3, true>(wg, nblocks, a, m, bias, om, os, accumulate, n, pre); break;
            default: dot_group<P, 4, true>(wg, nblocks, a, m, bias, om, os, accumulate, n, pre); break;
          }
        }
        return;
      }
    }
    for (int64_t n = n0; n < n1; n += kPackRows) {
      const uint8_t* wg = wp + n * row_bytes;
      switch (rows) {
        case 1: dot_group<P, 1>(wg, nblocks, a, m, bias, om, os, accumulate, n); break;
        case 2: dot_group<P, 2>(wg, nblocks, a, m, bias, om, os, accumulate, n); break;
        case 3: dot_group<P, 3>(wg, nblocks, a, m, bias, om, os, accumulate, n); break;
        default: dot_group<P, 4>(wg, nblocks, a, m, bias, om, os, accumulate, n); break;
      }
    }
  }, kPackPassRows, chunk);
}

}  // namespace

bool packed_dequantizes(int64_t) { return false; }  // 8-row builds re-assemble the file's blocks

void packed_dequantize_group(const uint8_t*, int64_t, int64_t qtype, void*, int64_t, bool) {
  fail("this build has no de-quantization from the packed layout of type ", qtype);
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

const char* packed_path() {
#if defined(__AVXVNNI__)
  return "avxvnni-packed8";
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512vnni-packed8";
#else
  return "avx2-packed8";
#endif
}

}  // namespace cadenza

#endif  // CADENZA_PACK_ROWS == 8
