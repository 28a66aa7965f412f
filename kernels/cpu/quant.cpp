// The linears over GGUF blocks of quant.h: the block types, their integer dot products and
// de-quantization. Packed weights' products are quant_packed.cpp's (AVX-512 VNNI, 16 rows a group)
// or quant_packed8.cpp's (AVX2 and AVX-VNNI, 8 rows), whichever the build compiles.
#include "quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "linear.h"
#include "quant_common.h"
#include "quant_packed.h"
#include "simd.h"

namespace cadenza {
namespace {

// 16 bytes of packed nibbles -> 32 bytes: low nibbles first (values 0..15), then the high ones.
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

// Eight int32 partial sums of u (unsigned bytes) * x (signed bytes).
inline __m256i dot_u8_i8(__m256i u, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

// One 32-value sub-block of a weight row: values, and how its integer dot product is scaled:
// dot = scale * dx * isum + minv * (dx * sum of the activation's int8 values).
struct SubBlock {
  __m256i q;
  float scale, minv;
  void store(float* y) const { store_affine32(q, scale, minv, y); }  // de-quantized (Q8_0: minv 0)
  float min_sum(const QuantizedActivations& a, int64_t i) const { return a.s[i]; }  // what minv multiplies
};

// Q3_K's and Q6_K's sub-blocks carry two signed scales (one per 16 values), applied inside the
// integer sum; their values are stored unsigned, kOffset above x / (d * sc): dot = scale * dx *
// sum(sc * (q - kOffset) * x) over both halves.
template <int kOffset>
struct SubBlock16 {
  __m256i q;
  __m256i scales;  // as vpmaddwd takes them: the first half's scale in each int16 of the low 128 bits
  float scale, minv;
  float half_scales[2];  // d * the scale of each 16 values
  void store(float* y) const {
    alignas(32) float tmp[32];
    store_affine32(q, 1.0f, -static_cast<float>(kOffset), tmp);
    for (int i = 0; i < 32; ++i) y[i] = tmp[i] * half_scales[i / 16];
  }
};

// s's scales and their float products with d, from the two halves' integer scales.
template <int kOffset>
inline void set_half_scales(SubBlock16<kOffset>& s, float d, int first, int second) {
  s.scales = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(second)), _mm_set1_epi16(static_cast<int16_t>(first)));
  s.scale = d;
  s.minv = 0.0f;
  s.half_scales[0] = d * static_cast<float>(first);
  s.half_scales[1] = d * static_cast<float>(second);
}

// sum(sc * (q - kOffset) * x) of each half, q - kOffset as q*x - kOffset*x in int16 (vpmaddubsw
// pairs: at most 2 x 63 x 127 each), the halves' scales by vpmaddwd.
template <int kOffset>
inline __m256i dot_scaled16(const SubBlock16<kOffset>& s, __m256i x) {
  __m256i p = _mm256_maddubs_epi16(s.q, x);
  if constexpr (kOffset != 0) p = _mm256_sub_epi16(p, _mm256_maddubs_epi16(_mm256_set1_epi8(kOffset), x));
  return _mm256_madd_epi16(p, s.scales);
}

// Q2_K's sub-blocks add a min per 16 values (minv = -dmin): dot as SubBlock16's, plus minv * dx *
// (m_a * sum(x_a) + m_b * sum(x_b)), that sum from the activation's half sums.
struct SubBlock2 : SubBlock16<0> {
  int32_t mins[2];
  float half_mins[2];  // -dmin * each half's min
  float min_sum(const QuantizedActivations& a, int64_t i) const {
    const int32_t halves = a.qhalves[i];
    return a.d[i] * static_cast<float>(mins[0] * static_cast<int16_t>(halves & 0xFFFF) + mins[1] * (halves >> 16));
  }
  void store(float* y) const {
    alignas(32) float tmp[32];
    store_affine32(q, 1.0f, 0.0f, tmp);
    for (int i = 0; i < 32; ++i) y[i] = std::fma(tmp[i], half_scales[i / 16], half_mins[i / 16]);
  }
};

// 16 bytes of 4-bit indices -> the 32 signed values of `values` they stand for (low nibbles first).
inline __m256i iq4_values32(const uint8_t* p, const int8_t* values = kIQ4Values) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(values)));
  return _mm256_shuffle_epi8(table, nibbles32(p));
}

// Eight int32 partial sums of q * x, both signed: the signs moved onto x (a pair of vpmaddubsw is
// at most 2 x 128 x 127 < 2^15).
inline __m256i dot_i8_i8(__m256i q, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)), _mm256_set1_epi16(1));
}

struct BlockIQ4_NL {  // d (f16), 16 bytes of indices into kIQ4Values: x = d * kIQ4Values[q]
  static constexpr int64_t kElems = 32, kBytes = 18, kSubs = 1;
  static constexpr int64_t kType = kIQ4_NL;
  static constexpr bool kHasMin = false;
  using Sub = SubBlock;
  static void decode(const uint8_t* b, Sub* s) {
    s[0].q = iq4_values32(b + 2);
    s[0].scale = half_at(b);
    s[0].minv = 0.0f;
  }
  static __m256i dot(const Sub& s, __m256i x) { return dot_i8_i8(s.q, x); }
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b);
    for (int i = 0; i < 16; ++i) {
      y[i] = d * static_cast<float>(kIQ4Values[b[2 + i] & 0x0F]);
      y[i + 16] = d * static_cast<float>(kIQ4Values[b[2 + i] >> 4]);
    }
  }
};

// MXFP4: e (E8M0), 16 bytes of indices into kMXFP4Values (E2M1 values doubled): x = 2^(e - 128) *
// kMXFP4Values[q]. The decoded values are products of a power of two and an integer of at most 12,
// exact in float32 (and bfloat16) down to e = 0's denormals; e >= 254 overflows to inf where |q| >=
// 4 (254) or 2 (255), as in ggml.
struct BlockMXFP4 {
  static constexpr int64_t kElems = 32, kBytes = 17, kSubs = 1;
  static constexpr int64_t kType = kMXFP4;
  static constexpr bool kHasMin = false;
  using Sub = SubBlock;
  static void decode(const uint8_t* b, Sub* s) {
    s[0].q = iq4_values32(b + 1, kMXFP4Values);
    s[0].scale = e8m0_half(b[0]);
    s[0].minv = 0.0f;
  }
  static __m256i dot(const Sub& s, __m256i x) { return dot_i8_i8(s.q, x); }
  static void dequant(const uint8_t* b, float* y) {
    const float d = e8m0_half(b[0]);
    for (int i = 0; i < 16; ++i) {
      y[i] = d * static_cast<float>(kMXFP4Values[b[1 + i] & 0x0F]);
      y[i + 16] = d * static_cast<float>(kMXFP4Values[b[1 + i] >> 4]);
    }
  }
};

// IQ4_XS's 6-bit scale of sub-block j (of 8), less its offset of 32: 4 low bits in the
// scales_l bytes at q (two a byte), 2 high bits in the 16-bit scales_h.
inline int iq4xs_scale(const uint8_t* b, int j) {
  const int high = (b[2] | (b[3] << 8)) >> (2 * j) & 3;
  return (((b[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (high << 4)) - 32;
}

struct BlockIQ4_XS {  // d (f16), scales_h (u16), scales_l (4 bytes), 8 x 16 bytes of indices: x = d * ls * table[q]
  static constexpr int64_t kElems = 256, kBytes = 136, kSubs = 8;
  static constexpr int64_t kType = kIQ4_XS;
  static constexpr bool kHasMin = false;
  using Sub = SubBlock;
  static void decode(const uint8_t* b, Sub* s) {
    const float d = half_at(b);
    for (int j = 0; j < 8; ++j) {
      s[j].q = iq4_values32(b + 8 + 16 * j);
      s[j].scale = d * static_cast<float>(iq4xs_scale(b, j));
      s[j].minv = 0.0f;
    }
  }
  static __m256i dot(const Sub& s, __m256i x) { return dot_i8_i8(s.q, x); }
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b);
    for (int j = 0; j < 8; ++j) {
      const float dl = d * static_cast<float>(iq4xs_scale(b, j));
      const uint8_t* q = b + 8 + 16 * j;
      for (int i = 0; i < 16; ++i) {
        y[32 * j + i] = dl * static_cast<float>(kIQ4Values[q[i] & 0x0F]);
        y[32 * j + i + 16] = dl * static_cast<float>(kIQ4Values[q[i] >> 4]);
      }
    }
  }
};

struct BlockQ8_0 {  // d (f16), 32 x int8: x = d * q
  static constexpr int64_t kElems = 32, kBytes = 34, kSubs = 1;
  static constexpr int64_t kType = kQ8_0;
  static constexpr bool kHasMin = false;
  using Sub = SubBlock;
  static void decode(const uint8_t* b, Sub* s) {
    s[0].q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    s[0].scale = half_at(b);
    s[0].minv = 0.0f;
  }
  static __m256i dot(const Sub& s, __m256i x) { return dot_i8_i8(s.q, x); }  // signed x signed
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b);
    for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
  }
};

// 4 bytes of fifth bits (bit i: value i) -> 32 bytes, 16 where the bit is set: each byte takes the
// bits' byte of its value (vpshufb within 128-bit halves: values 0-15 from bytes 0-1, 16-31 from
// bytes 2-3) and tests its own bit in it.
inline __m256i fifth_bits32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)),
                                             _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201u));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// Q4_0, Q4_1, Q5_0 and Q5_1: d (f16), m (f16; the _1 types), 4 bytes of fifth bits (Q5_x; bit i:
// value i), 16 bytes of nibbles (byte i: value i low, value 16 + i high). _0: x = d * (q - 8) or
// d * (q - 16) (Q5_0); _1: x = d * q + m. Pairs of vpmaddubsw stay below 2^15 (2 x 31 x 127).
template <bool kFive, bool kMin>
struct BlockQ45 {
  static constexpr int64_t kBits = kMin ? 4 : 2, kNibbles = kBits + (kFive ? 4 : 0);  // where each starts
  static constexpr int64_t kElems = 32, kBytes = kNibbles + 16, kSubs = 1;
  static constexpr int64_t kType = kFive ? (kMin ? kQ5_1 : kQ5_0) : (kMin ? kQ4_1 : kQ4_0);
  static constexpr int kOffset = kMin ? 0 : (kFive ? 16 : 8);
  static constexpr bool kHasMin = true;
  using Sub = SubBlock;
  static void decode(const uint8_t* b, Sub* s) {
    s[0].q = nibbles32(b + kNibbles);
    if constexpr (kFive) s[0].q = _mm256_or_si256(s[0].q, fifth_bits32(b + kBits));
    s[0].scale = half_at(b);
    s[0].minv = kMin ? half_at(b + 2) : -static_cast<float>(kOffset) * s[0].scale;
  }
  static __m256i dot(const Sub& s, __m256i x) { return dot_u8_i8(s.q, x); }
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b);
    uint32_t bits = 0;
    if constexpr (kFive) std::memcpy(&bits, b + kBits, 4);
    for (int i = 0; i < 16; ++i) {
      const int lo = (b[kNibbles + i] & 0x0F) | ((bits >> i) & 1) << 4;
      const int hi = (b[kNibbles + i] >> 4) | ((bits >> (16 + i)) & 1) << 4;
      if constexpr (kMin) {
        y[i] = d * static_cast<float>(lo) + half_at(b + 2);
        y[i + 16] = d * static_cast<float>(hi) + half_at(b + 2);
      } else {
        y[i] = d * static_cast<float>(lo - kOffset);
        y[i + 16] = d * static_cast<float>(hi - kOffset);
      }
    }
  }
};
using BlockQ4_0 = BlockQ45<false, false>;
using BlockQ4_1 = BlockQ45<false, true>;
using BlockQ5_0 = BlockQ45<true, false>;
using BlockQ5_1 = BlockQ45<true, true>;

// Q4_K's 6-bit scale and min of sub-block j (of 8), packed into 12 bytes.
inline void q4k_scale_min(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K and Q5_K: d, dmin (f16), 12 bytes of 6-bit scales and mins, then (Q5_K) 32 bytes of fifth
// bits and 128 of nibbles; 8 sub-blocks. Value l of sub-block j is a nibble of byte 32 (j / 2) + l of
// the nibbles (low for even j), plus 16 (Q5_K) when bit j of the fifth bits' byte l is set:
// x = d * sc * q - dmin * m. Pairs of vpmaddubsw stay below 2^15 (2 x 31 x 127).
template <bool kFive>
struct BlockQK {
  static constexpr int64_t kElems = 256, kBytes = kFive ? 176 : 144, kSubs = 8;
  static constexpr int64_t kType = kFive ? kQ5_K : kQ4_K;
  static constexpr int64_t kNibbles = kFive ? 48 : 16;  // where the nibbles start
  static constexpr bool kHasMin = true;
  using Sub = SubBlock;
  static void decode(const uint8_t* b, Sub* s) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(0x01);
    const __m256i qh = kFive ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
    auto high = [&](int j) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4); };
    for (int c = 0; c < 4; ++c) {  // 32 bytes: low nibbles are sub-block 2c, high ones 2c + 1
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kNibbles + 32 * c));
      s[2 * c].q = _mm256_and_si256(v, low);
      s[2 * c + 1].q = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      if constexpr (kFive) {
        s[2 * c].q = _mm256_or_si256(s[2 * c].q, high(2 * c));
        s[2 * c + 1].q = _mm256_or_si256(s[2 * c + 1].q, high(2 * c + 1));
      }
    }
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      q4k_scale_min(b + 4, j, sc, m);
      s[j].scale = d * static_cast<float>(sc);
      s[j].minv = -dmin * static_cast<float>(m);
    }
  }
  static __m256i dot(const Sub& s, __m256i x) { return dot_u8_i8(s.q, x); }
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* qh = b + 16;
    for (int c = 0; c < 4; ++c) {
      int sc0, m0, sc1, m1;
      q4k_scale_min(b + 4, 2 * c, sc0, m0);
      q4k_scale_min(b + 4, 2 * c + 1, sc1, m1);
      const uint8_t* q = b + kNibbles + 32 * c;
      for (int l = 0; l < 32; ++l) {
        const int lo = (q[l] & 0x0F) | (kFive ? ((qh[l] >> (2 * c)) & 1) << 4 : 0);
        const int hi = (q[l] >> 4) | (kFive ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0);
        y[64 * c + l] = d * sc0 * static_cast<float>(lo) - dmin * m0;
        y[64 * c + 32 + l] = d * sc1 * static_cast<float>(hi) - dmin * m1;
      }
    }
  }
};
using BlockQ4_K = BlockQK<false>;
using BlockQ5_K = BlockQK<true>;

struct BlockQ6_K {  // 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d (f16): x = d * sc * (q - 32)
  static constexpr int64_t kElems = 256, kBytes = 210, kSubs = 8;
  static constexpr int64_t kType = kQ6_K;
  static constexpr bool kHasMin = false;
  using Sub = SubBlock16<32>;
  static void decode(const uint8_t* b, Sub* s) {
    const float d = half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    for (int h = 0; h < 2; ++h) {  // each half: 64 bytes of ql and 32 of qh make 4 sub-blocks
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      auto high = [&](int shift) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, shift), m2), 4); };
      s[4 * h + 0].q = _mm256_or_si256(_mm256_and_si256(l0, m4), high(0));
      s[4 * h + 1].q = _mm256_or_si256(_mm256_and_si256(l1, m4), high(2));
      s[4 * h + 2].q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), high(4));
      s[4 * h + 3].q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), high(6));
    }
    for (int j = 0; j < 8; ++j) set_half_scales(s[j], d, sc[2 * j], sc[2 * j + 1]);
  }
  static __m256i dot(const Sub& s, __m256i x) { return dot_scaled16(s, x); }
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      float* yh = y + 128 * h;
      for (int l = 0; l < 32; ++l) {
        const int q[4] = {(ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4), (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                          (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)};
        for (int j = 0; j < 4; ++j) {
          const int e = 32 * j + l;
          yh[e] = d * sc[(128 * h + e) / 16] * static_cast<float>(q[j] - 32);
        }
      }
    }
  }
};

// Q2_K: 16 bytes of scales (low 4 bits) and mins (high 4), one a 16 values; qs (64 bytes); d, dmin
// (f16). Value l of sub-block j = 4h + s (of 8, each two halves) is bits 2s of qs byte 32h + l:
// x = d * sc * q - dmin * m.
struct BlockQ2_K {
  static constexpr int64_t kElems = 256, kBytes = 84, kSubs = 8;
  static constexpr int64_t kType = kQ2_K;
  static constexpr bool kHasMin = true;
  using Sub = SubBlock2;
  static void decode(const uint8_t* b, Sub* s) {
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * h));
      for (int t = 0; t < 4; ++t) s[4 * h + t].q = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * t), _mm256_set1_epi8(0x03));
    }
    for (int j = 0; j < 8; ++j) {
      set_half_scales(s[j], d, b[2 * j] & 0x0F, b[2 * j + 1] & 0x0F);
      s[j].minv = -dmin;
      for (int half = 0; half < 2; ++half) {
        s[j].mins[half] = b[2 * j + half] >> 4;
        s[j].half_mins[half] = -dmin * static_cast<float>(s[j].mins[half]);
      }
    }
  }
  static __m256i dot(const Sub& s, __m256i x) { return dot_scaled16(s, x); }
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int e = 0; e < 256; ++e) {
      const int j = e / 32, l = e % 32, sm = b[e / 16];
      const int q = (b[16 + 32 * (j / 4) + l] >> (2 * (j % 4))) & 3;
      y[e] = d * static_cast<float>(sm & 0x0F) * static_cast<float>(q) - dmin * static_cast<float>(sm >> 4);
    }
  }
};

// Q3_K's signed 6-bit scale of 16-value sub-block i (of 16), from its 12 scale bytes q: 4 low bits
// in byte i % 8 (its high nibble from i = 8 on), 2 high bits in byte 8 + i % 4 (bits 2 (i / 4)).
inline int q3k_scale(const uint8_t* q, int i) {
  const int low = (q[i % 8] >> (4 * (i / 8))) & 0x0F, high = (q[8 + i % 4] >> (2 * (i / 4))) & 3;
  return (low | high << 4) - 32;
}

// All 16 of them at once: the low nibbles of bytes 0-7, then their high ones, each or'ed with its 2
// high bits (lane t of bytes 8-11 shifted by 2t holds those of scales 4t..4t + 3).
inline void q3k_scales(const uint8_t* q, int8_t* out) {
  const __m128i l = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)), m4 = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(l, m4), _mm_and_si128(_mm_srli_epi16(l, 4), m4));
  uint32_t h;
  std::memcpy(&h, q + 8, 4);
  const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(static_cast<int32_t>(h)), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
  const __m128i sc = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), sc);
}

// Q3_K: hmask (32 bytes), qs (64), 12 bytes of scales, d (f16). Value l of sub-block j = 4h + s (of
// 8, each two halves with a scale) has its low 2 bits at bits 2s of qs byte 32h + l and a third
// bit, bit j of hmask byte l: q = those 3 bits, x = d * sc * (q - 4) (ggml's 2 bits less 4 where the
// hmask bit is clear).
struct BlockQ3_K {
  static constexpr int64_t kElems = 256, kBytes = 110, kSubs = 8;
  static constexpr int64_t kType = kQ3_K;
  static constexpr bool kHasMin = false;
  using Sub = SubBlock16<4>;
  static void decode(const uint8_t* b, Sub* s) {
    const float d = half_at(b + 108);
    const __m256i m2 = _mm256_set1_epi8(0x03), bit2 = _mm256_set1_epi8(0x04);
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * h));
      for (int t = 0; t < 4; ++t) {
        const int j = 4 * h + t;
        const __m256i third = j < 2 ? _mm256_slli_epi16(hm, 2 - j) : _mm256_srli_epi16(hm, j - 2);  // bit j to bit 2
        s[j].q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 2 * t), m2), _mm256_and_si256(third, bit2));
      }
    }
    int8_t sc[16];
    q3k_scales(b + 96, sc);
    for (int j = 0; j < 8; ++j) set_half_scales(s[j], d, sc[2 * j], sc[2 * j + 1]);
  }
  static __m256i dot(const Sub& s, __m256i x) { return dot_scaled16(s, x); }
  static void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b + 108);
    for (int e = 0; e < 256; ++e) {
      const int j = e / 32, l = e % 32;
      const int q = ((b[32 + 32 * (j / 4) + l] >> (2 * (j % 4))) & 3) | ((b[l] >> j) & 1) << 2;
      y[e] = d * static_cast<float>(q3k_scale(b + 96, e / 16)) * static_cast<float>(q - 4);
    }
  }
};

// Calls f(Block{}) for the block type of GGML type id `qtype`.
template <class F>
inline auto with_block_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ8_0: return f(BlockQ8_0{});
    case kQ4_0: return f(BlockQ4_0{});
    case kQ4_1: return f(BlockQ4_1{});
    case kQ5_0: return f(BlockQ5_0{});
    case kQ5_1: return f(BlockQ5_1{});
    case kQ2_K: return f(BlockQ2_K{});
    case kQ3_K: return f(BlockQ3_K{});
    case kQ4_K: return f(BlockQ4_K{});
    case kQ5_K: return f(BlockQ5_K{});
    case kQ6_K: return f(BlockQ6_K{});
    case kIQ4_NL: return f(BlockIQ4_NL{});
    case kIQ4_XS: return f(BlockIQ4_XS{});
    case kMXFP4: return f(BlockMXFP4{});
    default: break;
  }
  fail("no kernel for GGML quantization type ", qtype, " (supported: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)");
}

// R weight rows at a time share each activation load; M activation rows share each decoded block.
template <class T, int M, int R>
inline void qdot_rows(const uint8_t* w, int64_t row_bytes, const QuantizedActivations& a, int64_t m0,
                      const float* bias, float* out, int64_t os, bool accumulate, int64_t n) {
  __m256 acc[R][M];
  float macc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      acc[r][m] = _mm256_setzero_ps();
      macc[r][m] = 0.0f;
    }
  const int64_t nblocks = row_bytes / T::kBytes, K = a.K;
  const uint8_t* wr = w + n * row_bytes;
  // The next R rows follow these in memory: fetch them while these compute (as linear.h does).
  const char* next = reinterpret_cast<const char*>(wr + R * row_bytes);
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int64_t o = 0; o < R * T::kBytes; o += 64) _mm_prefetch(next + b * R * T::kBytes + o, _MM_HINT_T0);
    typename T::Sub sub[R][T::kSubs];
    for (int r = 0; r < R; ++r) T::decode(wr + r * row_bytes + b * T::kBytes, sub[r]);
    for (int j = 0; j < T::kSubs; ++j) {
      const int64_t blk = b * T::kSubs + j;
      for (int m = 0; m < M; ++m) {
        const int64_t row = m0 + m;
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + row * K + 32 * blk));
        const float dx = a.d[row * a.blocks + blk];
        for (int r = 0; r < R; ++r) {
          const __m256 p = _mm256_cvtepi32_ps(T::dot(sub[r][j], x));
          acc[r][m] = _mm256_fmadd_ps(p, _mm256_set1_ps(sub[r][j].scale * dx), acc[r][m]);
          // An explicit fma: contracted or not, vectorized or not, a row's sum must not depend on
          // how many rows share the call (batch invariance: greedy tokens alone = in a batch).
          if constexpr (T::kHasMin) macc[r][m] = std::fma(sub[r][j].minv, sub[r][j].min_sum(a, row * a.blocks + blk), macc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float v = hsum(acc[r][m]) + macc[r][m];
      if (bias != nullptr) v += bias[n + r];
      float* o = out + m * os + n + r;
      *o = accumulate ? *o + v : v;
    }
}

template <class T, int M>
inline void qdot_range(const uint8_t* w, int64_t row_bytes, const QuantizedActivations& a, int64_t m0,
                       const float* bias, float* out, int64_t os, bool accumulate, int64_t n0, int64_t n1) {
  constexpr int R = M == 1 ? 4 : 2;
  int64_t n = n0;
  for (; n + R <= n1; n += R) qdot_rows<T, M, R>(w, row_bytes, a, m0, bias, out, os, accumulate, n);
  for (; n < n1; ++n) qdot_rows<T, M, 1>(w, row_bytes, a, m0, bias, out, os, accumulate, n);
}

// Output rows per tile: a tile's blocks (16 rows: at most ~16 KiB for these models) stay in cache
// while every group of 4 activation rows passes over them.
constexpr int64_t kQuantTileRows = 16;

template <class T>
inline void quant_matmul_impl(const QuantizedActivations& a, int64_t M, const Weight& w, const float* bias,
                              float* out, int64_t os, bool accumulate) {
  const int64_t N = w.rows, row_bytes = w.cols;
  const uint8_t* wp = static_cast<const uint8_t*>(w.data);
  for_each_tile(N, M, kQuantTileRows, [&](int64_t n0, int64_t n1, int64_t m, int64_t rows) {
    float* om = out + m * os;
    switch (rows) {
      case 1: qdot_range<T, 1>(wp, row_bytes, a, m, bias, om, os, accumulate, n0, n1); break;
      case 2: qdot_range<T, 2>(wp, row_bytes, a, m, bias, om, os, accumulate, n0, n1); break;
      case 3: qdot_range<T, 3>(wp, row_bytes, a, m, bias, om, os, accumulate, n0, n1); break;
      default: qdot_range<T, 4>(wp, row_bytes, a, m, bias, om, os, accumulate, n0, n1); break;
    }
  }, 4, activation_chunk_rows(a.K, 4));
}

// Block b of row n of w [N, row_bytes] as the file stores it: in place, or (packed) re-assembled
// into `raw`.
template <class B>
inline const uint8_t* file_block(const uint8_t* w, int64_t row_bytes, bool packed, int64_t n, int64_t b, uint8_t* raw) {
  if (!packed) return w + n * row_bytes + b * B::kBytes;
  with_packed_type(B::kType, [&](auto pack) {
    using P = decltype(pack);
    packed_raw_block<P>(w + (n / kPackRows) * kPackRows * row_bytes + b * kPackRows * P::kBytes, n % kPackRows, raw);
  });
  return raw;
}

}  // namespace

int64_t quant_in_features(int64_t rows, int64_t row_bytes, int64_t qtype) {
  if (is_packed(qtype)) {
    CADENZA_CHECK(packs(unpacked_type(qtype)), "this build of the kernels (", packed_path(), ") packs no weights of type ",
                  unpacked_type(qtype));
    CADENZA_CHECK(rows % kPackRows == 0, "a packed weight has a multiple of ", kPackRows, " rows, not ", rows);
  }
  return with_block_type(unpacked_type(qtype), [&](auto block) {
    using T = decltype(block);
    CADENZA_CHECK(row_bytes % T::kBytes == 0, "bytes per row (", row_bytes, ") is not a whole number of ", T::kBytes,
                  "-byte blocks");
    return row_bytes / T::kBytes * T::kElems;
  });
}

void quant_matmul(In x, const Weight& w, Out out, bool accumulate) {
  const int64_t M = x.rows, N = w.rows;
  if (M == 0 || N == 0) return;
  thread_local QuantizedActivations act;
  quantize_activations(x, act, activation_group(unpacked_type(w.qtype)));
  if (is_packed(w.qtype)) {
    packed_matmul(act, M, w, out, accumulate);
    return;
  }
  with_block_type(w.qtype, [&](auto block) {
    quant_matmul_impl<decltype(block)>(act, M, w, w.bias, out.data, out.stride, accumulate);
  });
}

void quant_rows(const Weight& w, const int64_t* ids, int64_t T, float* out) {
  const int64_t K = quant_in_features(w.rows, w.cols, w.qtype), N = w.rows, row_bytes = w.cols;
  for (int64_t t = 0; t < T; ++t) CADENZA_CHECK(ids[t] >= 0 && ids[t] < N, "row id ", ids[t], " out of range [0, ", N, ")");
  const uint8_t* wp = static_cast<const uint8_t*>(w.data);
  const bool packed = is_packed(w.qtype);
  with_block_type(unpacked_type(w.qtype), [&](auto block) {
    using B = decltype(block);
    parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      uint8_t raw[B::kBytes];
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t b = 0; b < row_bytes / B::kBytes; ++b)
          B::dequant(file_block<B>(wp, row_bytes, packed, ids[t], b, raw), out + t * K + b * B::kElems);
    });
  });
}

void quant_dequantize(const Weight& w, void* out, bool bf16) {
  const int64_t K = quant_in_features(w.rows, w.cols, w.qtype), N = w.rows, row_bytes = w.cols;
  const uint8_t* wp = static_cast<const uint8_t*>(w.data);
  float* op = bf16 ? nullptr : static_cast<float*>(out);
  uint16_t* hp = bf16 ? static_cast<uint16_t*>(out) : nullptr;
  const bool packed = is_packed(w.qtype);
  if (packed && packed_dequantizes(unpacked_type(w.qtype))) {
    const int64_t elem_bytes = bf16 ? 2 : 4;
    parallel_for(0, N / kPackRows, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        packed_dequantize_group(wp + g * kPackRows * row_bytes, row_bytes, unpacked_type(w.qtype),
                                static_cast<uint8_t*>(out) + g * kPackRows * K * elem_bytes, K, bf16);
    });
    return;
  }
  with_block_type(unpacked_type(w.qtype), [&](auto block) {
    using B = decltype(block);
    parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      typename B::Sub sub[B::kSubs];
      alignas(32) float tmp[32];
      uint8_t raw[B::kBytes];
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t b = 0; b < row_bytes / B::kBytes; ++b) {
          B::decode(file_block<B>(wp, row_bytes, packed, n, b, raw), sub);
          for (int j = 0; j < B::kSubs; ++j) {
            const int64_t at = n * K + (b * B::kSubs + j) * 32;
            if (!bf16) {
              sub[j].store(op + at);
              continue;
            }
            sub[j].store(tmp);
            for (int i = 0; i < 4; ++i)
              _mm_storeu_si128(reinterpret_cast<__m128i*>(hp + at + 8 * i), to_bf16x8(_mm256_load_ps(tmp + 8 * i)));
          }
        }
    });
  });
}

void quant_pack(const uint8_t* src, int64_t rows, int64_t row_bytes, int64_t qtype, uint8_t* dst) {
  CADENZA_CHECK(packs(qtype), "this build of the kernels (", packed_path(), ") packs no weights of type ", qtype);
  CADENZA_CHECK(rows % kPackRows == 0, "packing needs a multiple of ", kPackRows, " rows, not ", rows);
  const int64_t groups = rows / kPackRows;
  with_packed_type(qtype, [&](auto pack) {
    using P = decltype(pack);
    CADENZA_CHECK(row_bytes % P::kBytes == 0, "bytes per row (", row_bytes, ") is not a whole number of blocks");
    const int64_t nblocks = row_bytes / P::kBytes, group_bytes = kPackRows * P::kBytes;
    parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nblocks; ++b) {
          uint8_t* gb = dst + g * kPackRows * row_bytes + b * group_bytes;
          for (int64_t r = 0; r < kPackRows; ++r) {
            const uint8_t* raw = src + (g * kPackRows + r) * row_bytes + b * P::kBytes;
            for_each_field<P>([&](int64_t at, int64_t packed, int64_t bytes) { std::memcpy(gb + packed + r * bytes, raw + at, bytes); });
          }
          if constexpr (std::is_same_v<P, PackQ8_0>)
            flip_sign_bits(gb + packed_header_bytes<P>(), group_bytes - packed_header_bytes<P>());
        }
    });
  });
}

bool packs(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kIQ4_NL:
    case kQ2_K: case kQ3_K: case kQ4_K: case kQ5_K: case kQ6_K: case kIQ4_XS: case kMXFP4: return true;
    default: return false;
  }
}

int64_t pack_rows() { return kPackRows; }

}  // namespace cadenza
