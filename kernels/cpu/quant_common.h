// What cadenza's kernels over GGUF blocks share, whatever the weights' layout (quant.h: the
// file's own blocks; quant_packed.h: blocks interleaved 16 rows at a time): float16 scales,
// de-quantized stores, bfloat16 rounding, and the int8 quantization of the activations.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace cadenza {

// GGML's type ids (enum ggml_type), as gguf.GGMLQuantizationType numbers them.
enum QuantTypeId : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ4_NL = 20, kIQ4_XS = 23, kMXFP4 = 39
};

// The 16 values a 4-bit index of IQ4_NL and IQ4_XS stands for (ggml's kvalues_iq4nl): a non-linear
// grid, denser near zero, scaled by the block's d.
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// The same plus 128, as unsigned bytes: what vpdpbusd multiplies (the 128 comes off with the
// activation's sum, as for Q8_0's stored q + 128).
alignas(16) constexpr uint8_t kIQ4ValuesBiased[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

// MXFP4's (ggml's kvalues_mxfp4): the E2M1 values of the OCP microscaling format, doubled so that
// they are integers (index 8 is E2M1's -0); the block's E8M0 scale is halved to match (e8m0_half).
alignas(16) constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
alignas(16) constexpr uint8_t kMXFP4ValuesBiased[16] = {128, 129, 130, 131, 132, 134, 136, 140,
                                                        128, 127, 126, 125, 124, 122, 120, 116};

// A 4-bit index's table as the products take it: the values, and the values plus 128.
struct NibbleTable {
  const int8_t* values;
  const uint8_t* biased;
};
constexpr NibbleTable kIQ4Table{kIQ4Values, kIQ4ValuesBiased};
constexpr NibbleTable kMXFP4Table{kMXFP4Values, kMXFP4ValuesBiased};

// An E8M0 scale byte e as MXFP4 applies it to the doubled values: 2^(e - 128), exactly (ggml's
// GGML_E8M0_TO_FP32_HALF). e >= 2 is a normal float with exponent field e - 1; 2^-127 (e = 1) and
// 2^-128 (e = 0) are denormals. e = 255 is 2^127, not the OCP format's NaN.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : static_cast<uint32_t>(e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// y[i] = q[i] * scale + offset for 32 int8 values q (signed; unsigned ones are below 128).
inline void store_affine32(__m256i q, float scale, float offset, float* y) {
  const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  const __m256 sv = _mm256_set1_ps(scale), ov = _mm256_set1_ps(offset);
  for (int h = 0; h < 2; ++h)
    for (int e = 0; e < 2; ++e) {
      const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e ? _mm_srli_si128(halves[h], 8) : halves[h]));
      _mm256_storeu_ps(y + 16 * h + 8 * e, _mm256_fmadd_ps(f, sv, ov));
    }
}

// Activations x [M, K] as int8 in blocks of 32 values: q[M*K]; per block its scale d, d * sum(q) and
// sum(q) itself (for kernels that subtract a weight offset in integers), and the sums of its two
// halves of 16 values as int16, the first in the low half of qhalves (for a weight with a scale
// per 16 values: packed Q6_K). The scale is max|x| / 127 over `group` values: 32 (every block its
// own), or 256 for the K-quants, as llama.cpp's Q8_K, whose sub-block scales then apply in integers
// or once per 256 values (the 16-row products, quant_packed.cpp). With 256, the 8 blocks of each
// 256 hold the same d, so a kernel that reads d per block computes the same sums either way.
// half_offsets holds -32 times each half's sum, two a block: where a weight's values carry an
// offset of 32 (Q6_K) or 4 (Q3_K: a shift of it), a product's int32 chain starts from it and
// comes out with the offset taken off.
struct QuantizedActivations {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> qsum, qhalves, half_offsets;
  int64_t K = 0, blocks = 0;  // blocks per row
  int64_t group = 32;         // values a scale: 32 or 256 (K % 256 == 0)
};

// Values an activation scale spans for a weight of GGML type `type`: 256 for the types of 256-value
// blocks with integer sub-block scales (the K-quants and IQ4_XS), as llama.cpp quantizes their
// activations (Q8_K), so that the 16-row products apply those scales once a block; 32 for the rest,
// whose every block has a float scale of its own anyway. The same in every build and layout, so
// the packed and file layouts, and the 8- and 16-row builds, sum the same integers.
inline int64_t activation_group(int64_t type) {
  switch (type) {
    case kQ2_K: case kQ3_K: case kQ4_K: case kQ5_K: case kQ6_K: case kIQ4_XS: return 256;
    default: return 32;
  }
}

// max|x| of n floats (n a multiple of 32).
inline float absmax(const float* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 a = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) a = _mm256_max_ps(a, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  return hmax(a);
}

// One block of 32 values at x as int8 at q with the scale amax / 127 (amax: of its group).
inline void quantize_block_q8(const float* x, float amax, int8_t* q, float* d, float* s, int32_t* qsum, int32_t* qhalves,
                              int32_t* half_offsets) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  // Round to nearest (MXCSR's default mode): |q| <= 127.
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv)),
                i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
  // The sums of values 0-15 (A) and 16-31 (B): hadd gives [A, A, B, B | A, A, B, B] in partial
  // sums, the second [A, B, A, B] of the 128-bit halves, and adding its swapped 64-bit halves the whole.
  const __m256i halves = _mm256_hadd_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  __m128i s4 = _mm_hadd_epi32(_mm256_castsi256_si128(halves), _mm256_extracti128_si256(halves, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));  // [A, B, A, B]
  // The packs interleave 128-bit lanes: 4-value groups come out in the order 0 2 4 6 1 3 5 7.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(packed, order));
  *d = amax / 127.0f;
  const int32_t first = _mm_cvtsi128_si32(s4), second = _mm_extract_epi32(s4, 1);
  *qsum = first + second;
  *qhalves = static_cast<int32_t>((static_cast<uint32_t>(second) << 16) | (static_cast<uint32_t>(first) & 0xFFFFu));
  half_offsets[0] = -32 * first;
  half_offsets[1] = -32 * second;
  *s = *d * static_cast<float>(*qsum);
}

inline void quantize_row_q8(const float* x, int64_t K, int64_t group, int8_t* q, float* d, float* s, int32_t* qsum,
                            int32_t* qhalves, int32_t* half_offsets) {
  for (int64_t g = 0; g < K; g += group) {
    const float amax = absmax(x + g, group);
    for (int64_t b = g / 32; b < (g + group) / 32; ++b)
      quantize_block_q8(x + 32 * b, amax, q + 32 * b, d + b, s + b, qsum + b, qhalves + b, half_offsets + 2 * b);
  }
}

// x as int8 with a scale per `group` values (32, or 256 where K allows it and the weight asks).
inline void quantize_activations(In x, QuantizedActivations& a, int64_t group = 32) {
  const int64_t M = x.rows, K = x.cols, xs = x.stride;
  a.K = K;
  a.blocks = K / 32;
  a.group = group == 256 && K % 256 == 0 ? 256 : 32;
  if (static_cast<int64_t>(a.q.size()) < M * K) a.q.resize(M * K);
  if (static_cast<int64_t>(a.d.size()) < M * a.blocks) {
    a.d.resize(M * a.blocks);
    a.s.resize(M * a.blocks);
    a.qsum.resize(M * a.blocks);
    a.qhalves.resize(M * a.blocks);
    a.half_offsets.resize(2 * M * a.blocks);
  }
  const float* xp = x.data;
  auto rows = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row_q8(xp + m * xs, K, a.group, a.q.data() + m * K, a.d.data() + m * a.blocks, a.s.data() + m * a.blocks,
                      a.qsum.data() + m * a.blocks, a.qhalves.data() + m * a.blocks,
                      a.half_offsets.data() + 2 * m * a.blocks);
  };
  if (M * K < 65536) rows(0, M);
  else parallel_for(0, M, 16, rows);
}

}  // namespace cadenza
