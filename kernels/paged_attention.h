// Decode attention read in place from the paged KV cache, and the cache write before it.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "linear.h"
#include "simd.h"

namespace cadenza {

// Keys (and values) fetched ahead of the one being read; runs no shorter than this many keys.
constexpr int64_t kPrefetchKeys = 8;
constexpr int64_t kMinRunKeys = 32;

inline void prefetch_row(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// Decode attention straight from the paged cache: one query token per sequence.
// q [B, H, D]; kv_cache [2, num_blocks, block_size, KVH, D]; block_tables [B, max_blocks];
// seq_lens [B] (keys in the cache, the new token's included). Keys at positions
// [max(0, seq_len - window), seq_len) are attended (window <= 0: all). Returns [B, H, D].
inline torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                            const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                            double scale, int64_t window) {
  check_f32_rows(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(1) == q.size(2), "q must be [seqs, heads, head_dim] with packed heads");
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat32 && kv_cache.is_contiguous() && kv_cache.dim() == 5,
              "kv_cache must be a contiguous float32 [2, blocks, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int64 [seqs, max_blocks], contiguous in its last dimension");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous(), "seq_lens must be contiguous int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % KVH == 0, "q and kv_cache disagree on heads or head_dim");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.numel() == B,
              "block_tables and seq_lens need one row per sequence");
  const int64_t G = H / KVH, max_blocks = block_tables.size(1), bts = block_tables.stride(0), qs = q.stride(0);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * BS, "seq_len ", lens[b], " does not fit the block table");
    for (int64_t j = 0; j < (lens[b] + BS - 1) / BS; ++j)
      TORCH_CHECK(tables[b * bts + j] >= 0 && tables[b * bts + j] < NB, "block id out of range");
  }
  auto out = torch::empty({B, H, D}, q.options());
  // Work items are (sequence, kv head, run of key positions). A few sequences with one kv head
  // each would leave threads idle (batch 1 of a 3-kv-head model: 3 items on 2 threads), so each
  // (sequence, kv head) splits its keys into runs until there are a few items per thread; runs of
  // one pair are merged after (flash-decoding's rescaled sums).
  const int64_t threads = at::get_num_threads(), pairs = B * KVH;
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>((4 * threads + pairs - 1) / pairs, 16));
  const int64_t longest = *std::max_element(lens, lens + B);
  const int64_t attended = window > 0 ? std::min(longest, window) : longest;
  const int64_t run = std::max<int64_t>(kMinRunKeys, (attended + splits - 1) / splits);
  // Per item and query head of the group: running max, sum of exponentials, unnormalized output.
  std::vector<float> partial(splits > 1 ? static_cast<size_t>(pairs * splits * G * (D + 2)) : 0);
  const float* qp = q.data_ptr<float>();
  const float* keys = kv_cache.data_ptr<float>();
  const float* values = keys + NB * BS * KVH * D;
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  auto slot = [&](const int64_t* table, int64_t t) { return table[t / BS] * BS + t % BS; };
  at::parallel_for(0, pairs * splits, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, acc(static_cast<size_t>(G * D)), maxes(G), sums(G);  // per thread, reused
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t pair = i / splits, split = i % splits, b = pair / KVH, kvh = pair % KVH, len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t t0 = std::min(len, first + split * run), t1 = std::min(len, t0 + run), n = t1 - t0;
      const int64_t* table = tables + b * bts;
      const float* qh = qp + b * qs + kvh * G * D;
      scores.resize(static_cast<size_t>(G * std::max<int64_t>(n, 1)));
      // A head's keys sit KVH * D floats apart (all kv heads of a slot) in blocks anywhere: the hardware
      // prefetcher loses the stream at each block, so fetch a few keys ahead by hand.
      for (int64_t t = t0; t < t1; ++t) {
        if (t + kPrefetchKeys < t1)
          prefetch_row(keys + (slot(table, t + kPrefetchKeys) * KVH + kvh) * D, D);
        const float* key = keys + (slot(table, t) * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * n + (t - t0)] = dot(qh + g * D, key, D) * fscale;
      }
      std::fill(maxes.begin(), maxes.end(), -INFINITY);
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t g = 0; g < G && n > 0; ++g) {
        float* s = scores.data() + g * n;
        __m256 mv = _mm256_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
        float mx = hmax(mv);
        for (; j < n; ++j) mx = std::max(mx, s[j]);
        const __m256 m8 = _mm256_set1_ps(mx);
        __m256 sv = _mm256_setzero_ps();
        for (j = 0; j + 8 <= n; j += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m8));
          _mm256_storeu_ps(s + j, e);
          sv = _mm256_add_ps(sv, e);
        }
        float sum = hsum(sv);
        for (; j < n; ++j) {
          s[j] = exp1(s[j] - mx);
          sum += s[j];
        }
        maxes[g] = mx;
        sums[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = t0; t < t1; ++t) {
        if (t + kPrefetchKeys < t1)
          prefetch_row(values + (slot(table, t + kPrefetchKeys) * KVH + kvh) * D, D);
        const float* value = values + (slot(table, t) * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * n + (t - t0)], value, acc.data() + g * D, D);
      }
      if (splits == 1) {  // the whole sequence: normalize straight into the output
        for (int64_t g = 0; g < G; ++g) {
          float* o = op + (b * H + kvh * G + g) * D;
          const float inv = 1.0f / sums[g];
          for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
        }
      } else {
        float* p = partial.data() + i * G * (D + 2);
        for (int64_t g = 0; g < G; ++g, p += D + 2) {
          p[0] = maxes[g];
          p[1] = sums[g];
          std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D, p + 2);
        }
      }
    }
  });
  if (splits > 1) {
    // out = sum_r e^(m_r - M) acc_r / sum_r e^(m_r - M) l_r over a pair's runs (empty runs: m = -inf).
    at::parallel_for(0, pairs * G, 16, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t pair = j / G, g = j % G, b = pair / KVH, kvh = pair % KVH;
        const float* first = partial.data() + (pair * splits * G + g) * (D + 2);
        const int64_t step = G * (D + 2);
        float mx = -INFINITY;
        for (int64_t r = 0; r < splits; ++r) mx = std::max(mx, first[r * step]);
        float* o = op + (b * H + kvh * G + g) * D;
        std::fill(o, o + D, 0.0f);
        float total = 0.0f;
        for (int64_t r = 0; r < splits; ++r) {
          const float* p = first + r * step;
          if (p[0] == -INFINITY) continue;
          const float w = exp1(p[0] - mx);
          total += w * p[1];
          axpy(w, p + 2, o, D);
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    });
  }
  return out;
}

// Store the step's keys and values at their cache slots: k, v [T, KVH, D] (packed heads, any row
// stride: views of the fused projection), kv_cache [2, num_blocks, block_size, KVH, D].
inline void write_kv_(torch::Tensor kv_cache, const torch::Tensor& k, const torch::Tensor& v,
                      const torch::Tensor& slot_mapping) {
  check_f32_rows(k, "k");
  check_f32_rows(v, "v");
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat32 && kv_cache.is_contiguous() && kv_cache.dim() == 5,
              "kv_cache must be a contiguous float32 [2, blocks, block_size, kv_heads, head_dim] tensor");
  const int64_t T = k.size(0), KVH = kv_cache.size(3), D = kv_cache.size(4);
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2), row = KVH * D;
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == KVH && k.size(2) == D && k.stride(1) == D &&
                  v.stride(1) == D,
              "k and v must be [tokens, kv_heads, head_dim] with packed heads, matching the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "slot_mapping must be contiguous int64 [tokens]");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " out of range");
  float* keys = kv_cache.data_ptr<float>();
  float* values = keys + slots * row;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(keys + slot[t] * row, kp + t * k.stride(0), row * sizeof(float));
    std::memcpy(values + slot[t] * row, vp + t * v.stride(0), row * sizeof(float));
  }
}

}  // namespace cadenza
