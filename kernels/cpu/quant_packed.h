// GGUF's 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4) and its 256-value ones (Q2_K,
// Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) re-laid kPackRows output rows at a time (16 for AVX-512's 512-bit
// vectors, 8 for AVX2's 256-bit ones): one instruction then computes a 4-value integer dot product
// for that many rows at once, and the float scaling of a block (its scale times the activation's)
// runs once per group of rows, not per row.
//
// The file's layout keeps each row's blocks together, so a kernel multiplies one row at a time
// and its 8 lanes of partial sums are one row's: about 18 instructions per 32 weights on AVX2
// (decoding the row's scales, converting and scaling each block's sum), which made batch-1 decode
// of the default model instruction-bound (20 GB/s of its ~50 GB/s of cache and memory bandwidth).
// Packed, a group of R = kPackRows rows stores each block as
//
//   R float16 scales d | R float16 mins m (Q4_1, Q5_1) | R x 4 bytes of fifth bits (Q5_x) | value chunks of 4R bytes
//
// (MXFP4: R E8M0 scale bytes, then the chunks: a group-block of 17R bytes, as the file's blocks)
//
// where chunk c holds bytes [4c, 4c + 4) of each of the R rows' values, row r at offset 4r:
// 4 chunks of nibbles (Q4_x; a low nibble is value 4c + j, a high one value 16 + 4c + j) or 8 of
// bytes (Q8_0, stored as q + 128 so that VNNI's unsigned x signed product applies). `vpdpbusd`
// (or AVX2's `vpmaddubsw` and `vpmaddwd`) with the activation's 4 matching bytes broadcast adds
// one chunk into R lanes of int32 sums, one per row. The integer sum is exact; the weight's offset
// (Q4_0: 8, Q5_0: 16, Q8_0: 128) is subtracted in integers (sum(q) of the activation block is known), so
// packed products equal the unpacked ones' math. A packed weight has the same shape and bytes as
// the file's ([out, bytes per row], out a multiple of R); its type id is the GGML id plus
// kPackedFlag, in the layout of the build that packed it (a process runs one build, kernels/cpu.py).
// Each output row's sum is computed the same way whatever the number of activation rows (batch
// invariant, bit for bit).
//
// Here: the layout, which every build reads (quant.cpp packs weights and re-assembles a row's
// block from it for de-quantizing). The products over it: quant_packed.cpp (AVX-512 VNNI, 16
// rows) and quant_packed8.cpp (AVX2, AVX-VNNI: 8 rows), each a unit only its builds compile.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "quant_common.h"

// Rows a group packs: kernels/cpu.py sets it per build variant (16: the zmm products, 8: the ymm ones).
#ifndef CADENZA_PACK_ROWS
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define CADENZA_PACK_ROWS 16
#else
#define CADENZA_PACK_ROWS 8
#endif
#endif

namespace cadenza {

constexpr int64_t kPackedFlag = 256;  // type id of a packed weight: GGML id + kPackedFlag
constexpr int64_t kPackRows = CADENZA_PACK_ROWS;
static_assert(kPackRows == 8 || kPackRows == 16, "packed groups are 8 rows (ymm) or 16 (zmm)");

// The packed layouts. kValues: where the values start in the file's block; kOffset: subtracted
// from every stored value (x = d * (stored - offset) + m).
// kTable: the nibbles index a table of values (IQ4_NL: kIQ4Values; MXFP4: kMXFP4Values); the
// products look each up as that value plus 128 (kOffset), as Q8_0's stored q + 128.
// kE8M0: the scale is one byte, an E8M0 exponent (MXFP4: d = 2^(e - 128), e8m0_half), not a float16.
struct PackQ4_0 {
  static constexpr int64_t kBytes = 18, kValues = 2, kOffset = 8, kChunks = 4;
  static constexpr bool kHasMin = false, kNibbles = true, kTable = false, kFive = false, kE8M0 = false;
};
struct PackQ4_1 {
  static constexpr int64_t kBytes = 20, kValues = 4, kOffset = 0, kChunks = 4;
  static constexpr bool kHasMin = true, kNibbles = true, kTable = false, kFive = false, kE8M0 = false;
};
struct PackQ8_0 {
  static constexpr int64_t kBytes = 34, kValues = 2, kOffset = 128, kChunks = 8;
  static constexpr bool kHasMin = false, kNibbles = false, kTable = false, kFive = false, kE8M0 = false;
};
struct PackIQ4_NL {
  static constexpr int64_t kBytes = 18, kValues = 2, kOffset = 128, kChunks = 4;
  static constexpr bool kHasMin = false, kNibbles = true, kTable = true, kFive = false, kE8M0 = false;
};
struct PackMXFP4 {
  static constexpr int64_t kBytes = 17, kValues = 1, kOffset = 128, kChunks = 4;
  static constexpr bool kHasMin = false, kNibbles = true, kTable = true, kFive = false, kE8M0 = true;
};
// kFive: Q4_x's nibbles plus a fifth bit each, the file's 4 bytes before the nibbles (bit i: value
// i), kept as they are: row r's 4 bytes at 4r after the scales (packed_bits_at), a lane each.
struct PackQ5_0 {
  static constexpr int64_t kBytes = 22, kValues = 6, kOffset = 16, kChunks = 4;
  static constexpr bool kHasMin = false, kNibbles = true, kTable = false, kFive = true, kE8M0 = false;
};
struct PackQ5_1 {
  static constexpr int64_t kBytes = 24, kValues = 8, kOffset = 0, kChunks = 4;
  static constexpr bool kHasMin = true, kNibbles = true, kTable = false, kFive = true, kE8M0 = false;
};

// Q4_K: 256-value super-blocks of 8 sub-blocks with 6-bit scales and mins. A group-block is
//   R d | R dmin (float16) | the 12 scale bytes, byte i of the R rows at 4R + R i |
//   per pair c of sub-blocks (2c: low nibbles, 2c + 1: high), 8 chunks of 4R bytes at 16R + 32R c
// (chunk k: bytes [4k, 4k + 4) of each row's 32 bytes of the pair): the file's 144 bytes a row.
struct PackQ4_K {
  static constexpr int64_t kBytes = 144;
};

// Q5_K: Q4_K's super-block with a fifth bit a value (bit j of the file's qh byte l: value l of
// sub-block j). A group-block is Q4_K's (d, dmin, scale bytes, the nibbles' 4 pairs of 8 chunks at
// 16R + 32R c) with the 32 qh bytes after it, chunk k at 144R + 4R k: the file's 176 bytes a row.
struct PackQ5_K {
  static constexpr int64_t kBytes = 176;
};

// Q6_K: 256-value super-blocks of 16 int8 scales (one per 16 values); each value's low 4 bits in ql
// (128 bytes: value l of sub-block j = 4h + s is the low (s < 2) or high nibble of ql byte
// 64h + 32 (s % 2) + l) and its high 2 bits in qh (bits 2s of byte 32h + l). A group-block is
//   R d (float16) | the 16 scale bytes, byte i of the R rows at 2R + R i |
//   ql in 4 runs t of 32 bytes, 8 chunks of 4R bytes each at 18R + 32R t + 4R k |
//   qh in 2 runs h of 32 bytes, chunk k at 146R + 32R h + 4R k
// (chunk k: bytes [4k, 4k + 4) of each row's run): the file's 210 bytes a row.
struct PackQ6_K {
  static constexpr int64_t kBytes = 210;
  static constexpr int kOffsetBits = 5;  // the values carry 32 (x = d * sc * (q - 32))
  static constexpr bool kHasMin = false;
};

// Q3_K: 256-value super-blocks of 16 signed 6-bit scales (one per 16 values, in 12 bytes as
// quant.cpp's q3k_scale reads them); value l of sub-block j = 4h + s has its low 2 bits at bits 2s
// of qs byte 32h + l and a third at bit j of hmask byte l. A group-block is
//   R d (float16) | the 12 scale bytes, byte i of the R rows at 2R + R i |
//   hmask, chunk k at 14R + 4R k | qs in 2 runs h of 32 bytes, chunk k at 46R + 32R h + 4R k
// (chunk k: bytes [4k, 4k + 4) of each row's run): the file's 110 bytes a row.
struct PackQ3_K {
  static constexpr int64_t kBytes = 110;
  static constexpr int kOffsetBits = 2;  // the values carry 4 (x = d * sc * (q - 4))
  static constexpr bool kHasMin = false;
};

// Q2_K: 256-value super-blocks of 16 scale bytes (one per 16 values: a 4-bit scale, and a 4-bit min
// in the high nibble); value l of sub-block j = 4h + s at bits 2s of qs byte 32h + l. A group-block is
//   R d | R dmin (float16) | the 16 scale bytes, byte i of the R rows at 4R + R i |
//   qs in 2 runs h of 32 bytes, chunk k at 20R + 32R h + 4R k: the file's 84 bytes a row.
struct PackQ2_K {
  static constexpr int64_t kBytes = 84;
  static constexpr int kOffsetBits = 0;  // none: x = d * sc * q - dmin * m
  static constexpr bool kHasMin = true;
};

// IQ4_XS: 256-value super-blocks of 8 sub-blocks, each a 6-bit scale (4 bits in scales_l, 2 in
// the 16-bit scales_h) and 16 bytes of indices into kIQ4Values. A group-block is
//   R d (float16) | R scales_h (uint16) at 2R | the 4 scales_l bytes, byte i of the R rows at 4R + R i |
//   per sub-block j, 4 chunks of 4R bytes at 8R + 16R j + 4R k (chunk k: bytes [4k, 4k + 4) of each
//   row's 16: low nibbles values 4k.., high ones 16 + 4k..): the file's 136 bytes a row.
struct PackIQ4_XS {
  static constexpr int64_t kBytes = 136;
};

// Bytes of weights the products fetch ahead of the group-block they read (prefetch_ahead in each
// build; groups lie one after another, so this runs on into the next group). The hardware
// prefetcher alone left a batch-1 step waiting on memory (SmolLM2 Q4_1: 3.5-3.9 ms a step with
// 5120 bytes against 4.5-4.9 without). The 256-value types, whose group-blocks are 1.3-3.4 KiB and
// take more instructions a byte, stream best fetching 1 KiB ahead: Llama-3.2-1B's shape as Q4_K_M,
// batch 1, 34-35 tok/s against 26-28 at 5120 bytes (AVX-512 VNNI; AVX2's 8 rows: 33-34 against 22-23),
// its products at 1 row 82-87% of the memory's read rate against 76-79%; the 32-value types keep
// 5120 (the default model's decode: 222-234 tok/s against 185-203 at 1 KiB).
template <class P>
constexpr int64_t prefetch_ahead_bytes() {
  return P::kBytes > 64 ? 1024 : 5120;  // every 256-value block is 84 bytes or more, every 32-value one 34 or less
}

// Bytes of one row's scale in a 32-value block: a float16, or MXFP4's E8M0 byte.
template <class P>
constexpr int64_t scale_bytes() {
  return P::kE8M0 ? 1 : 2;
}

// A 32-value group-block's fifth bits (Q5_x) start here, after its scales; its values after both.
template <class P>
constexpr int64_t packed_bits_at() {
  return kPackRows * scale_bytes<P>() * (P::kHasMin ? 2 : 1);
}
template <class P>
constexpr int64_t packed_header_bytes() {
  return packed_bits_at<P>() + (P::kFive ? 4 * kPackRows : 0);
}

// Calls f(Pack{}) for the packed layout of GGML type `qtype` (without the flag).
template <class F>
inline auto with_packed_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_0: return f(PackQ4_0{});
    case kQ4_1: return f(PackQ4_1{});
    case kQ5_0: return f(PackQ5_0{});
    case kQ5_1: return f(PackQ5_1{});
    case kQ8_0: return f(PackQ8_0{});
    case kQ2_K: return f(PackQ2_K{});
    case kQ3_K: return f(PackQ3_K{});
    case kQ4_K: return f(PackQ4_K{});
    case kQ5_K: return f(PackQ5_K{});
    case kQ6_K: return f(PackQ6_K{});
    case kIQ4_NL: return f(PackIQ4_NL{});
    case kIQ4_XS: return f(PackIQ4_XS{});
    case kMXFP4: return f(PackMXFP4{});
    default: break;
  }
  fail("GGML type ", qtype, " has no packed layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS and MXFP4 do)");
}

inline bool is_packed(int64_t qtype) { return (qtype & kPackedFlag) != 0; }
inline int64_t unpacked_type(int64_t qtype) { return qtype & ~kPackedFlag; }

// Calls f(raw, packed, bytes) for each field of a block: `bytes` bytes at offset `raw` of row r's
// block in the file sit at offset packed + r * bytes of its group-block. The layouts above, once,
// for packing and for re-assembling a row's block alike.
template <class P, class F>
inline void for_each_field(F&& f) {
  if constexpr (std::is_same_v<P, PackQ4_K> || std::is_same_v<P, PackQ5_K>) {
    constexpr int64_t qs = std::is_same_v<P, PackQ5_K> ? 48 : 16;               // the nibbles, in the file's block
    f(0, 0, 2);                                                                   // d
    f(2, 2 * kPackRows, 2);                                                       // dmin
    for (int64_t i = 0; i < 12; ++i) f(4 + i, 4 * kPackRows + kPackRows * i, 1);  // the scale bytes
    for (int64_t c = 0; c < 4; ++c)
      for (int64_t k = 0; k < 8; ++k) f(qs + 32 * c + 4 * k, 16 * kPackRows + 32 * kPackRows * c + 4 * kPackRows * k, 4);
    if constexpr (std::is_same_v<P, PackQ5_K>)
      for (int64_t k = 0; k < 8; ++k) f(16 + 4 * k, 144 * kPackRows + 4 * kPackRows * k, 4);  // qh
  } else if constexpr (std::is_same_v<P, PackIQ4_XS>) {
    f(0, 0, 2);                                                                  // d
    f(2, 2 * kPackRows, 2);                                                      // scales_h
    for (int64_t i = 0; i < 4; ++i) f(4 + i, 4 * kPackRows + kPackRows * i, 1);  // scales_l
    for (int64_t j = 0; j < 8; ++j)
      for (int64_t k = 0; k < 4; ++k) f(8 + 16 * j + 4 * k, 8 * kPackRows + 16 * kPackRows * j + 4 * kPackRows * k, 4);
  } else if constexpr (std::is_same_v<P, PackQ2_K>) {
    f(80, 0, 2);                                                            // d
    f(82, 2 * kPackRows, 2);                                                // dmin
    for (int64_t i = 0; i < 16; ++i) f(i, 4 * kPackRows + kPackRows * i, 1);  // the scales and mins
    for (int64_t h = 0; h < 2; ++h)                                          // qs
      for (int64_t k = 0; k < 8; ++k) f(16 + 32 * h + 4 * k, 20 * kPackRows + 32 * kPackRows * h + 4 * kPackRows * k, 4);
  } else if constexpr (std::is_same_v<P, PackQ3_K>) {
    f(108, 0, 2);                                                                  // d
    for (int64_t i = 0; i < 12; ++i) f(96 + i, 2 * kPackRows + kPackRows * i, 1);  // the scales
    for (int64_t k = 0; k < 8; ++k) f(4 * k, 14 * kPackRows + 4 * kPackRows * k, 4);  // hmask
    for (int64_t h = 0; h < 2; ++h)                                                 // qs
      for (int64_t k = 0; k < 8; ++k) f(32 + 32 * h + 4 * k, 46 * kPackRows + 32 * kPackRows * h + 4 * kPackRows * k, 4);
  } else if constexpr (std::is_same_v<P, PackQ6_K>) {
    f(208, 0, 2);                                                                   // d
    for (int64_t i = 0; i < 16; ++i) f(192 + i, 2 * kPackRows + kPackRows * i, 1);  // the scales
    for (int64_t t = 0; t < 4; ++t)                                                 // ql
      for (int64_t k = 0; k < 8; ++k) f(32 * t + 4 * k, 18 * kPackRows + 32 * kPackRows * t + 4 * kPackRows * k, 4);
    for (int64_t h = 0; h < 2; ++h)  // qh
      for (int64_t k = 0; k < 8; ++k) f(128 + 32 * h + 4 * k, 146 * kPackRows + 32 * kPackRows * h + 4 * kPackRows * k, 4);
  } else {
    f(0, 0, scale_bytes<P>());                         // d (MXFP4: e)
    if constexpr (P::kHasMin) f(2, 2 * kPackRows, 2);  // m
    if constexpr (P::kFive) f(P::kValues - 4, packed_bits_at<P>(), 4);  // the fifth bits
    for (int64_t c = 0; c < P::kChunks; ++c) f(P::kValues + 4 * c, packed_header_bytes<P>() + 4 * kPackRows * c, 4);
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

// out [M, N] (+)= a @ W^T (+ w.bias) for a packed weight w (quant_packed.cpp or quant_packed8.cpp,
// whichever this build compiles).
void packed_matmul(const QuantizedActivations& a, int64_t M, const Weight& w, Out out, bool accumulate);

// Whether this build de-quantizes packed weights of GGML type qtype straight from their groups
// (quant_packed.cpp: Q6_K), and that: one group's kPackRows rows (its blocks at wg, row_bytes a row)
// into rows of `out` (K values apart; float32, or bfloat16 bits where bf16), bit for bit what
// de-quantizing the file's blocks gives.
bool packed_dequantizes(int64_t qtype);
void packed_dequantize_group(const uint8_t* wg, int64_t row_bytes, int64_t qtype, void* out, int64_t K, bool bf16);

// The products' name, for the log and the tests: "avx2-packed8", "avxvnni-packed8", "avx512vnni-packed16".
const char* packed_path();

}  // namespace cadenza
