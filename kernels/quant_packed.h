// GGUF's 32-value block types (Q4_0, Q4_1, Q8_0) re-laid 16 output rows at a time, for AVX-512
// VNNI: one instruction then computes a 4-value integer dot product for 16 rows at once, and the
// float scaling of a block (its scale times the activation's) runs once per 16 rows, not per row.
//
// The file's layout keeps each row's blocks together, so a kernel reduces 8 lanes of partial sums
// to one number per (row, block) before it can scale them: about 18 instructions per 32 weights
// on AVX2, which made batch-1 decode of the default model instruction-bound (20 GB/s of its
// ~50 GB/s of cache and memory bandwidth). Packed, a group of 16 rows stores each block as
//
//   16 float16 scales d | 16 float16 mins m (Q4_1 only) | value chunks of 64 bytes
//
// where chunk c holds bytes [4c, 4c + 4) of each of the 16 rows' values, row r at offset 4r:
// 4 chunks of nibbles (Q4_x; a low nibble is value 4c + j, a high one value 16 + 4c + j) or 8 of
// bytes (Q8_0, stored as q + 128 so that VNNI's unsigned x signed product applies). `vpdpbusd`
// with the activation's 4 matching bytes broadcast adds one chunk into 16 lanes of int32 sums.
// The integer sum is exact; the weight's offset (Q4_0: 8, Q8_0: 128) is subtracted in integers
// (sum(q) of the activation block is known), so packed products equal the unpacked ones' math.
// A packed weight has the same shape and bytes as the file's ([out, bytes per row], out a multiple
// of 16); its type id is the GGML id plus kPackedFlag. Each output row's sum is computed the same
// way whatever the number of activation rows (batch invariant, bit for bit).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#include "linear.h"
#include "quant_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define CADENZA_PACKED_KERNELS 1
#endif

namespace cadenza {

constexpr int64_t kPackedFlag = 256;  // type id of a packed weight: GGML id + kPackedFlag
constexpr int64_t kPackRows = 16;

inline bool packed_kernels_built() {
#ifdef CADENZA_PACKED_KERNELS
  return true;
#else
  return false;
#endif
}

// The packed layouts. kValues: where the values start in the file's block; kOffset: subtracted
// from every stored value (x = d * (stored - offset) + m).
struct PackQ4_0 {
  static constexpr int64_t kBytes = 18, kValues = 2, kOffset = 8, kChunks = 4;
  static constexpr bool kHasMin = false, kNibbles = true;
};
struct PackQ4_1 {
  static constexpr int64_t kBytes = 20, kValues = 4, kOffset = 0, kChunks = 4;
  static constexpr bool kHasMin = true, kNibbles = true;
};
struct PackQ8_0 {
  static constexpr int64_t kBytes = 34, kValues = 2, kOffset = 128, kChunks = 8;
  static constexpr bool kHasMin = false, kNibbles = false;
};

template <class P>
constexpr int64_t packed_header_bytes() {
  return kPackRows * 2 * (P::kHasMin ? 2 : 1);
}

// Calls f(Pack{}) for the packed layout of GGML type `qtype` (without the flag).
template <class F>
inline auto with_packed_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: return f(PackQ4_0{});
    case kQ4_1: return f(PackQ4_1{});
    case kQ8_0: return f(PackQ8_0{});
    default: break;
  }
  TORCH_CHECK(false, "GGML type ", qtype, " has no packed layout (Q4_0, Q4_1 and Q8_0 do)");
  return f(PackQ8_0{});  // not reached
}

inline bool is_packed(int64_t qtype) { return (qtype & kPackedFlag) != 0; }
inline int64_t unpacked_type(int64_t qtype) { return qtype & ~kPackedFlag; }

// Row r's block of one packed group-block `gb`, as the file stores it (`raw`: P::kBytes bytes).
template <class P>
inline void packed_raw_block(const uint8_t* gb, int64_t r, uint8_t* raw) {
  std::memcpy(raw, gb + 2 * r, 2);
  if constexpr (P::kHasMin) std::memcpy(raw + 2, gb + 2 * kPackRows + 2 * r, 2);
  const uint8_t* chunks = gb + packed_header_bytes<P>();
  for (int64_t c = 0; c < P::kChunks; ++c) std::memcpy(raw + P::kValues + 4 * c, chunks + 64 * c + 4 * r, 4);
  if constexpr (P::kOffset == 128)
    for (int64_t i = P::kValues; i < P::kBytes; ++i) raw[i] ^= 0x80;
}

// The weight w [N, row_bytes] of GGML type qtype, packed (same shape; N a multiple of 16).
inline torch::Tensor quant_pack(const torch::Tensor& w, int64_t qtype) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(),
              "quantized weight must be a contiguous uint8 CPU tensor [out_features, bytes_per_row]");
  TORCH_CHECK(w.size(0) % kPackRows == 0, "packing needs a multiple of ", kPackRows, " rows, not ", w.size(0));
  auto out = torch::empty_like(w);
  const int64_t row_bytes = w.size(1), groups = w.size(0) / kPackRows;
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  with_packed_type(qtype, [&](auto pack) {
    using P = decltype(pack);
    TORCH_CHECK(row_bytes % P::kBytes == 0, "bytes per row (", row_bytes, ") is not a whole number of blocks");
    const int64_t nblocks = row_bytes / P::kBytes, group_bytes = kPackRows * P::kBytes;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nblocks; ++b) {
          uint8_t* gb = dst + g * kPackRows * row_bytes + b * group_bytes;
          uint8_t* chunks = gb + packed_header_bytes<P>();
          for (int64_t r = 0; r < kPackRows; ++r) {
            const uint8_t* raw = src + (g * kPackRows + r) * row_bytes + b * P::kBytes;
            std::memcpy(gb + 2 * r, raw, 2);
            if constexpr (P::kHasMin) std::memcpy(gb + 2 * kPackRows + 2 * r, raw + 2, 2);
            for (int64_t c = 0; c < P::kChunks; ++c)
              for (int64_t j = 0; j < 4; ++j) {
                const uint8_t v = raw[P::kValues + 4 * c + j];
                chunks[64 * c + 4 * r + j] = P::kOffset == 128 ? v ^ 0x80 : v;  // Q8_0: q + 128
              }
          }
        }
    });
  });
  return out;
}

#ifdef CADENZA_PACKED_KERNELS

// The 8 vectors of one group-block's values, each 16 rows x 4 consecutive values.
template <class P>
inline void packed_values(const uint8_t* chunks, __m512i* q) {
  if constexpr (P::kNibbles) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(chunks + 64 * c);
      q[2 * c] = _mm512_and_si512(v, low);
      q[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
  } else {
    for (int c = 0; c < 8; ++c) q[c] = _mm512_loadu_si512(chunks + 64 * c);
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

// Output rows [n, n + 16) of M activation rows from m0: one packed group `wg`.
template <class P, int M>
inline void packed_dot_group(const uint8_t* wg, int64_t nblocks, const QuantizedActivations& a, int64_t m0,
                             const float* bias, float* out, int64_t os, bool accumulate, int64_t n) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* gb = wg + b * kPackRows * P::kBytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb)));
    __m512 mins = _mm512_setzero_ps();
    if constexpr (P::kHasMin) mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 32)));
    __m512i q[8];
    packed_values<P>(gb + packed_header_bytes<P>(), q);
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
  for (int m = 0; m < M; ++m) {
    __m512 v = acc[m];
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
    float* o = out + m * os + n;
    _mm512_storeu_ps(o, accumulate ? _mm512_add_ps(_mm512_loadu_ps(o), v) : v);
  }
}

// out [M, N] (+)= a @ W^T (+ bias) for a packed weight wp [N, row_bytes].
template <class P>
inline void packed_matmul(const QuantizedActivations& a, int64_t M, const uint8_t* wp, int64_t N, int64_t row_bytes,
                          const float* bias, float* out, int64_t os, bool accumulate) {
  const int64_t nblocks = row_bytes / P::kBytes;
  for_each_tile(N, M, kPackRows, [&](int64_t n0, int64_t, int64_t m, int64_t rows) {
    const uint8_t* wg = wp + n0 * row_bytes;
    float* om = out + m * os;
    switch (rows) {
      case 1: packed_dot_group<P, 1>(wg, nblocks, a, m, bias, om, os, accumulate, n0); break;
      case 2: packed_dot_group<P, 2>(wg, nblocks, a, m, bias, om, os, accumulate, n0); break;
      case 3: packed_dot_group<P, 3>(wg, nblocks, a, m, bias, om, os, accumulate, n0); break;
      default: packed_dot_group<P, 4>(wg, nblocks, a, m, bias, om, os, accumulate, n0); break;
    }
  });
}

#endif  // CADENZA_PACKED_KERNELS

}  // namespace cadenza
