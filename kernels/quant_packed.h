// GGUF's 32-value block types (Q4_0, Q4_1, Q8_0) and Q4_K re-laid 16 output rows at a time, for AVX-512
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
//
// Here: the layout, which every build reads (quant.cpp packs weights and re-assembles a row's
// block from it for de-quantizing). The AVX-512 VNNI products over it are quant_packed.cpp, a unit
// only the avx512vnni build compiles (kernels/cpu.py).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "quant_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define CADENZA_PACKED_KERNELS 1
#endif

namespace cadenza {

constexpr int64_t kPackedFlag = 256;  // type id of a packed weight: GGML id + kPackedFlag
constexpr int64_t kPackRows = 16;

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

// Q4_K: 256-value super-blocks of 8 sub-blocks with 6-bit scales and mins. A group-block is
//   16 d | 16 dmin (float16) | the 12 scale bytes, byte i of the 16 rows at 64 + 16 i |
//   per pair c of sub-blocks (2c: low nibbles, 2c + 1: high), 8 chunks of 64 bytes at 256 + 512 c
// (chunk k: bytes [4k, 4k + 4) of each row's 32 bytes of the pair): the file's 144 bytes a row.
struct PackQ4_K {
  static constexpr int64_t kBytes = 144;
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
    case kQ4_K: return f(PackQ4_K{});
    default: break;
  }
  fail("GGML type ", qtype, " has no packed layout (Q4_0, Q4_1, Q8_0 and Q4_K do)");
}

inline bool is_packed(int64_t qtype) { return (qtype & kPackedFlag) != 0; }
inline int64_t unpacked_type(int64_t qtype) { return qtype & ~kPackedFlag; }

// Calls f(raw, packed, bytes) for each field of a block: `bytes` bytes at offset `raw` of row r's
// block in the file sit at offset packed + r * bytes of its group-block. The layouts above, once,
// for packing and for re-assembling a row's block alike.
template <class P, class F>
inline void for_each_field(F&& f) {
  if constexpr (std::is_same_v<P, PackQ4_K>) {
    f(0, 0, 2);                                                                   // d
    f(2, 2 * kPackRows, 2);                                                       // dmin
    for (int64_t i = 0; i < 12; ++i) f(4 + i, 4 * kPackRows + kPackRows * i, 1);  // the scale bytes
    for (int64_t c = 0; c < 4; ++c)
      for (int64_t k = 0; k < 8; ++k) f(16 + 32 * c + 4 * k, 16 * kPackRows + 512 * c + 64 * k, 4);
  } else {
    f(0, 0, 2);                                        // d
    if constexpr (P::kHasMin) f(2, 2 * kPackRows, 2);  // m
    for (int64_t c = 0; c < P::kChunks; ++c) f(P::kValues + 4 * c, packed_header_bytes<P>() + 64 * c, 4);
  }
}

// Q8_0's values are stored as q + 128 (`vpdpbusd` multiplies unsigned weights): the sign bit of
// each of the n bytes at p flipped, one way or the other.
inline void flip_sign_bits(uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] ^= 0x80;
}

// Row r's block of one packed group-block `gb`, as the file stores it (`raw`: P::kBytes bytes).
template <class P>
inline void packed_raw_block(const uint8_t* gb, int64_t r, uint8_t* raw) {
  for_each_field<P>([&](int64_t at, int64_t packed, int64_t bytes) { std::memcpy(raw + at, gb + packed + r * bytes, bytes); });
  if constexpr (std::is_same_v<P, PackQ8_0>) flip_sign_bits(raw + P::kValues, P::kBytes - P::kValues);
}

#ifdef CADENZA_PACKED_KERNELS
// out [M, N] (+)= a @ W^T (+ w.bias) for a packed weight w (quant_packed.cpp).
void packed_matmul(const QuantizedActivations& a, int64_t M, const Weight& w, Out out, bool accumulate);
#endif

}  // namespace cadenza
