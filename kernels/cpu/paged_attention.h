// Decode attention read in place from the paged KV cache, and the cache write before it.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace cadenza {

enum class KvType { kFloat32, kBFloat16, kFloat16, kInt8 };

// A paged cache [2, blocks, block_size, kv_heads, head_dim], contiguous: keys, then values, as
// float32, bfloat16, float16 or int8 rows; an int8 cache's rows have float16 scales
// [2, blocks, block_size, kv_heads] (a row is int8 * scale; nullptr for the other types).
struct KvCache {
  void* data;
  uint16_t* scales;
  KvType type;
  int64_t blocks, block_size, kv_heads, head_dim;
};

// Rows of packed heads, [tokens, heads, head_dim] float32, tokens `stride` floats apart.
struct Heads {
  const float* data;
  int64_t tokens, heads, head_dim, stride;
};

// Each query row's block table (tables [rows, max_blocks], rows `stride` apart) and the keys it
// sees (lens [rows], the new token's included).
struct BlockTables {
  const int64_t* tables;
  int64_t rows, max_blocks, stride;
  const int64_t* lens;
};

// out [rows, heads, head_dim] = one-token-per-sequence attention of q (one row per table row,
// heads a multiple of the cache's kv heads) over the keys at positions
// [max(0, len - window), len) of its table (window <= 0: all). Checks lens and block ids.
// `sinks` [heads] (gpt-oss; nullptr: none): a logit per query head in each softmax's denominator
// with no value behind it.
void paged_decode_attention(Heads q, const KvCache& cache, const BlockTables& tables, double scale, int64_t window,
                            float* out, const float* sinks = nullptr);

// Store keys and values k, v [tokens, kv_heads, head_dim] at their cache slots (checked in range):
// copied (float32), rounded to nearest even (16-bit types, as PyTorch's `.to()`), or quantized
// (int8: each row symmetrically, scale absmax / 127 stored as float16 and used rounded, as
// `quantize_int8` in attention_backends/base.py does).
void write_kv(const KvCache& cache, Heads k, Heads v, const int64_t* slots);

}  // namespace cadenza
