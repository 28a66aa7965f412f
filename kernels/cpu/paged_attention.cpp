// The decode attention and cache writes of paged_attention.h.
#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

namespace cadenza {
namespace {

// simd.h's float32 dot and axpy join the overloads below (for int8 and 16-bit rows).
using cadenza::axpy;
using cadenza::dot;

// Keys (and values) fetched ahead of the one being read; keys a work item covers (see decode_attention).
constexpr int64_t kPrefetchKeys = 8;
constexpr int64_t kRunKeys = 64;

inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T0);
}

// int8 rows of the quantized cache, widened to float32 lanes (exact).
inline __m256 load_i8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float dot(const float* a, const int8_t* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load_i8x8(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

inline void axpy(float alpha, const int8_t* x, float* y, int64_t n) {  // y += alpha * x
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, load_i8x8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * static_cast<float>(x[i]);
}

// 16-bit cache rows: bfloat16 or IEEE float16 bits, widened to float32 on load (exact).
struct Bf16 { uint16_t bits; };
struct F16 { uint16_t bits; };

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Bf16* p) { return load_bf16x8(reinterpret_cast<const uint16_t*>(p)); }
inline __m256 load8(const F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float to_float(float x) { return x; }
inline float to_float(Bf16 x) { return bf16_to_float(x.bits); }
inline float to_float(F16 x) { return _cvtsh_ss(x.bits); }
#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const Bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const F16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

// float32 -> a 16-bit cache row value, rounded to nearest even as PyTorch's `.to()` rounds.
inline void store_row(float x, float* out) { *out = x; }
inline void store_row(float x, Bf16* out) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  out->bits = std::isnan(x) ? uint16_t{0x7FC0} : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void store_row(float x, F16* out) { out->bits = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }

template <typename KV>
inline float dot(const float* a, const KV* b, int64_t n) {  // 16-bit rows
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * to_float(b[i]);
  return s;
}

template <typename KV>
inline void axpy(float alpha, const KV* x, float* y, int64_t n) {  // y += alpha * x, 16-bit rows
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, load8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * to_float(x[i]);
}

// The 8 sums of 8 keys' 8-lane partial dot products, by one tree of horizontal adds.
inline __m256 sum8x8(const __m256* a) {
  // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]: after two rounds each
  // 128-bit half holds four keys' partial sums (dims 0-3 below, 4-7 above).
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Dot products of one query with 8 keys (D a multiple of 8): eight accumulators reduced together
// by one tree of horizontal adds, instead of a horizontal sum per key. Built for AVX-512 and D a
// multiple of 16, the products take 16 lanes (half the multiply-adds: a speculative step's
// extra rows are bound by them), folded to 8 before the same tree.
template <typename KV>
inline __m256 dot8(const float* q, const KV* const* k, int64_t D) {
  __m256 a[8];
#ifdef __AVX512F__
  if (D % 16 == 0) {
    __m512 w[8];
    for (int j = 0; j < 8; ++j) w[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) w[j] = _mm512_fmadd_ps(qv, load16(k[j] + d), w[j]);
    }
    for (int j = 0; j < 8; ++j)
      a[j] = _mm256_add_ps(_mm512_castps512_ps256(w[j]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w[j]), 1)));
    return sum8x8(a);
  }
#endif
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8(k[j] + d), a[j]);
  }
  return sum8x8(a);
}

// acc [kD] += sum over t of w[t] * rows[t], the accumulator in registers (kD a multiple of 16).
// Each lane sums in the same order at any vector width, so the AVX-512 build's result is the
// AVX2 build's, in half the multiply-adds.
template <int kD, typename KV>
inline void weighted_rows_sum(const float* w, const KV* const* rows, int64_t n, float* acc) {
#ifdef __AVX512F__
  __m512 a[kD / 16];
  for (int c = 0; c < kD / 16; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 wt = _mm512_set1_ps(w[t]);
    for (int c = 0; c < kD / 16; ++c) a[c] = _mm512_fmadd_ps(wt, load16(rows[t] + 16 * c), a[c]);
  }
  for (int c = 0; c < kD / 16; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
#else
  __m256 a[kD / 8];
  for (int c = 0; c < kD / 8; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 wt = _mm256_set1_ps(w[t]);
    for (int c = 0; c < kD / 8; ++c) a[c] = _mm256_fmadd_ps(wt, load8(rows[t] + 8 * c), a[c]);
  }
  for (int c = 0; c < kD / 8; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
#endif
}

// Every row's length fits its table, and every block it reads is one of the cache's.
inline void check_tables(const BlockTables& t, int64_t NB, int64_t BS) {
  for (int64_t b = 0; b < t.rows; ++b) {
    const int64_t len = t.lens[b];
    CADENZA_CHECK(len >= 1 && len <= t.max_blocks * BS, "seq_len ", len, " does not fit the block table");
    for (int64_t j = 0; j < (len + BS - 1) / BS; ++j)
      CADENZA_CHECK(t.tables[b * t.stride + j] >= 0 && t.tables[b * t.stride + j] < NB, "block id out of range");
  }
}

// Decode attention straight from the paged cache: one query token per sequence.
// q [B, H, D]; keys and values [num_blocks, block_size, KVH, D] each, float32, bfloat16 or float16
// (`Bf16`, `F16`: widened on load, the arithmetic float32 throughout), or int8 (then with
// float16 scales [num_blocks, block_size, KVH], a row being int8 * scale); block_tables
// [B, max_blocks]; seq_lens [B] (keys in the cache, the new token's included). Keys at positions
// [max(0, seq_len - window), seq_len) are attended (window <= 0: all). Writes out [B, H, D].
// Arguments are checked by the callers (the binding, and `check_tables`).
template <typename KV>
inline void decode_attention(Heads q, const KV* keys, const KV* values, const uint16_t* key_scales,
                             const uint16_t* value_scales, int64_t BS, int64_t KVH, const BlockTables& block_tables,
                             double scale, int64_t window, float* out, const float* sinks) {
  constexpr bool kQuantized = std::is_same<KV, int8_t>::value;
  const int64_t B = q.tokens, H = q.heads, D = q.head_dim;
  const int64_t G = H / KVH, bts = block_tables.stride, qs = q.stride, max_blocks = block_tables.max_blocks;
  const int64_t* tables = block_tables.tables;
  const int64_t* lens = block_tables.lens;
  // Work items are (sequence, kv head, run of kRunKeys key positions): a few sequences of one kv
  // head each still give every thread work (batch 1 of a 3-kv-head model at 96 keys: 6 items),
  // and runs of one pair are merged after (flash-decoding's rescaled sums). Runs depend on the
  // sequence's own length alone, so a row's result does not depend on the rest of the batch or on
  // the threads (batch invariance: a speculative step's rows equal the decode steps they replace).
  const int64_t pairs = B * KVH;
  std::vector<int64_t> first_item(static_cast<size_t>(pairs + 1), 0);  // pair p's runs: [first_item[p], first_item[p + 1])
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t len = lens[pair / KVH], attended = window > 0 ? std::min(len, window) : len;
    first_item[pair + 1] = first_item[pair] + std::max<int64_t>(1, (attended + kRunKeys - 1) / kRunKeys);
  }
  const int64_t items = first_item[pairs];
  // Per item and query head of the group: running max, sum of exponentials, unnormalized output.
  std::vector<float> partial(items > pairs ? static_cast<size_t>(items * G * (D + 2)) : 0);
  const float* qp = q.data;
  float* op = out;
  const float fscale = static_cast<float>(scale);
  // A power-of-two block size (the usual) finds a key's slot by shift and mask: a division per key
  // cost more than its multiply-adds.
  const bool pow2 = (BS & (BS - 1)) == 0;
  const int shift = pow2 ? __builtin_ctzll(static_cast<unsigned long long>(BS)) : 0;
  auto slot = [&](const int64_t* table, int64_t t) {
    return pow2 ? (table[t >> shift] << shift) + (t & (BS - 1)) : table[t / BS] * BS + t % BS;
  };
  // Consecutive rows with the same block table are one sequence's rows (a speculative step, a
  // short chunk): they share work entries (kv head, run), whose keys' slots are found and fetched
  // once and then read from L1 by each row in turn. Each row computes exactly what it would alone.
  // A sliding window starts each row's runs at its own position, so its rows stay apart.
  std::vector<int64_t> group_start;  // rows [group_start[k], group_start[k + 1])
  for (int64_t b = 0; b < B; ++b) {
    const bool joins = b > 0 && window <= 0 && std::memcmp(tables + b * bts, tables + (b - 1) * bts, max_blocks * sizeof(int64_t)) == 0;
    if (!joins) group_start.push_back(b);
  }
  group_start.push_back(B);
  // Row b's keys in its run `run`: [t0, t1).
  auto run_span = [&](int64_t b, int64_t run) {
    const int64_t len = lens[b], first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t t0 = std::min(len, first + run * kRunKeys);
    return std::make_pair(t0, std::min(len, t0 + kRunKeys));
  };
  struct Entry { int64_t b0, b1, kvh, run; };
  std::vector<Entry> entries;
  for (size_t k = 0; k + 1 < group_start.size(); ++k) {
    const int64_t b0 = group_start[k], b1 = group_start[k + 1];
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      int64_t most = 0;
      for (int64_t b = b0; b < b1; ++b) most = std::max(most, first_item[b * KVH + kvh + 1] - first_item[b * KVH + kvh]);
      for (int64_t run = 0; run < most; ++run) entries.push_back({b0, b1, kvh, run});
    }
  }
  parallel_for(0, static_cast<int64_t>(entries.size()), 1, [&](int64_t e0, int64_t e1) {
    std::vector<float> scores, acc(static_cast<size_t>(G * D)), maxes(G), sums(G);  // per thread, reused
    std::vector<int64_t> krow;  // cache row (slot * KVH + kv head) of each key of the entry's run
    std::vector<const KV*> key_ptr, value_ptr;
    for (int64_t e = e0; e < e1; ++e) {
      const Entry& entry = entries[e];
      const int64_t kvh = entry.kvh;
      const int64_t* table = tables + entry.b0 * bts;
      // The keys any row of the entry reads in this run (rows of one sequence read the same keys,
      // up to their own lengths; rows that only share a table may have any lengths).
      int64_t run_t0 = INT64_MAX, run_t1 = 0;
      for (int64_t b = entry.b0; b < entry.b1; ++b) {
        const auto [t0, t1] = run_span(b, entry.run);
        run_t0 = std::min(run_t0, t0);
        run_t1 = std::max(run_t1, t1);
      }
      krow.resize(static_cast<size_t>(std::max<int64_t>(run_t1 - run_t0, 1)));
      for (int64_t t = run_t0; t < run_t1; ++t) krow[t - run_t0] = slot(table, t) * KVH + kvh;
      if constexpr (!kQuantized) {
        key_ptr.resize(krow.size());
        value_ptr.resize(krow.size());
        for (int64_t j = 0; j < run_t1 - run_t0; ++j) {
          key_ptr[j] = keys + krow[j] * D;
          value_ptr[j] = values + krow[j] * D;
        }
      }
      bool fetched = false;  // the first row fetches keys ahead by hand (see below); the rest find them in L1
      for (int64_t b = entry.b0; b < entry.b1; ++b) {
        const int64_t pair = b * KVH + kvh, runs = first_item[pair + 1] - first_item[pair];
        if (entry.run >= runs) continue;  // a shorter row of the group: no such run
        const int64_t i = first_item[pair] + entry.run;
        const auto [t0, t1] = run_span(b, entry.run);
        const int64_t n = t1 - t0;
        const int64_t* rows_of = krow.data() + (t0 - run_t0);
        const float* qh = qp + b * qs + kvh * G * D;
        const bool fetch = !fetched;
        fetched = true;
        scores.resize(static_cast<size_t>(G * std::max<int64_t>(n, 1)));
        // A head's keys sit KVH * D floats apart (all kv heads of a slot) in blocks anywhere: the
        // hardware prefetcher loses the stream at each block, so fetch a few keys ahead by hand.
        int64_t t = t0;
        if constexpr (!kQuantized) {  // float32 or 16-bit keys: 8 at a time (dot8)
          if (D % 8 == 0) {
            const __m256 sv = _mm256_set1_ps(fscale);
            for (; t + 8 <= t1; t += 8) {
              if (fetch)
                for (int j = 0; j < 8; ++j)
                  if (t + j + kPrefetchKeys < t1) prefetch_row(keys + rows_of[t + j + kPrefetchKeys - t0] * D, D * sizeof(KV));
              const KV* const* rows = key_ptr.data() + (t - run_t0);
              for (int64_t g = 0; g < G; ++g)
                _mm256_storeu_ps(scores.data() + g * n + (t - t0), _mm256_mul_ps(dot8(qh + g * D, rows, D), sv));
            }
          }
        }
        for (; t < t1; ++t) {
          if (fetch && t + kPrefetchKeys < t1) prefetch_row(keys + rows_of[t + kPrefetchKeys - t0] * D, D * sizeof(KV));
          const int64_t row = rows_of[t - t0];
          const KV* key = keys + row * D;
          const float s = kQuantized ? fscale * _cvtsh_ss(key_scales[row]) : fscale;
          for (int64_t g = 0; g < G; ++g) scores[g * n + (t - t0)] = dot(qh + g * D, key, D) * s;
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
            const __m256 e8 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m8));
            _mm256_storeu_ps(s + j, e8);
            sv = _mm256_add_ps(sv, e8);
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
        bool summed = false;
        if constexpr (!kQuantized) {  // float32 or 16-bit values, head_dim 64 or 128: accumulators in registers
          if (D == 64 || D == 128) {
            const KV* const* vrows = value_ptr.data() + (t0 - run_t0);
            if (fetch)  // the run's rows, fetched while the first ones are summed
              for (int64_t j = 0; j < n; ++j) prefetch_row(vrows[j], D * sizeof(KV));
            for (int64_t g = 0; g < G; ++g) {
              if (D == 64) weighted_rows_sum<64>(scores.data() + g * n, vrows, n, acc.data() + g * D);
              else weighted_rows_sum<128>(scores.data() + g * n, vrows, n, acc.data() + g * D);
            }
            summed = true;
          }
        }
        if (!summed) {
          for (int64_t t = t0; t < t1; ++t) {
            if (fetch && t + kPrefetchKeys < t1) prefetch_row(values + rows_of[t + kPrefetchKeys - t0] * D, D * sizeof(KV));
            const int64_t row = rows_of[t - t0];
            const KV* value = values + row * D;
            const float s = kQuantized ? _cvtsh_ss(value_scales[row]) : 1.0f;
            for (int64_t g = 0; g < G; ++g) axpy(scores[g * n + (t - t0)] * s, value, acc.data() + g * D, D);
          }
        }
        if (runs == 1) {  // the whole sequence: normalize straight into the output
          for (int64_t g = 0; g < G; ++g) {
            float* o = op + (b * H + kvh * G + g) * D;
            float inv = 1.0f / sums[g];
            if (sinks != nullptr) {  // e^sink joins the denominator, both relative to the larger of it and the max
              const float sink = sinks[kvh * G + g], top = std::max(maxes[g], sink);
              const float w = exp1(maxes[g] - top);
              inv = w / (sums[g] * w + exp1(sink - top));
            }
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
    }
  });
  if (items > pairs) {
    // out = sum_r e^(m_r - M) acc_r / sum_r e^(m_r - M) l_r over a pair's runs (empty runs: m = -inf).
    parallel_for(0, pairs * G, 16, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t pair = j / G, g = j % G, b = pair / KVH, kvh = pair % KVH;
        const int64_t runs = first_item[pair + 1] - first_item[pair];
        if (runs == 1) continue;  // normalized in place above
        const float* first = partial.data() + (first_item[pair] * G + g) * (D + 2);
        const int64_t step = G * (D + 2);
        const float sink = sinks != nullptr ? sinks[kvh * G + g] : -INFINITY;
        float mx = sink;
        for (int64_t r = 0; r < runs; ++r) mx = std::max(mx, first[r * step]);
        float* o = op + (b * H + kvh * G + g) * D;
        std::fill(o, o + D, 0.0f);
        float total = sinks != nullptr ? exp1(sink - mx) : 0.0f;
        for (int64_t r = 0; r < runs; ++r) {
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
}


// Calls f with the cache's base pointer typed as its rows are: float, Bf16 or F16.
template <typename F>
inline auto with_float_rows(const KvCache& cache, F&& f) {
  switch (cache.type) {
    case KvType::kBFloat16: return f(static_cast<Bf16*>(cache.data));
    case KvType::kFloat16: return f(static_cast<F16*>(cache.data));
    default: return f(static_cast<float*>(cache.data));
  }
}

// Every slot of the step's tokens is one of the cache's.
inline void check_slots(const KvCache& cache, const int64_t* slot, int64_t T) {
  const int64_t slots = cache.blocks * cache.block_size;
  for (int64_t t = 0; t < T; ++t) CADENZA_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " out of range");
}

// A float cache's write: float32 copied, a 16-bit type rounded to nearest even (as PyTorch's `.to()`).
inline void write_float_kv(const KvCache& cache, Heads k, Heads v, const int64_t* slot) {
  const int64_t T = k.tokens, row = cache.kv_heads * cache.head_dim;
  const int64_t slots = cache.blocks * cache.block_size;
  with_float_rows(cache, [&](auto* keys) {
    using KV = std::remove_pointer_t<decltype(keys)>;
    KV* values = keys + slots * row;
    for (int64_t t = 0; t < T; ++t) {
      const float* ks = k.data + t * k.stride;
      const float* vs = v.data + t * v.stride;
      KV* kd = keys + slot[t] * row;
      KV* vd = values + slot[t] * row;
      if constexpr (std::is_same<KV, float>::value) {
        std::memcpy(kd, ks, row * sizeof(float));
        std::memcpy(vd, vs, row * sizeof(float));
      } else {
        for (int64_t j = 0; j < row; ++j) {
          store_row(ks[j], kd + j);
          store_row(vs[j], vd + j);
        }
      }
    }
    return 0;
  });
}

// The int8 cache's write: each token's kv head quantized symmetrically (scale absmax / 127, stored as
// float16 and used rounded, as `quantize_int8` in attention_backends/base.py does).
inline void write_int8_kv(const KvCache& cache, Heads k, Heads v, const int64_t* slot) {
  const int64_t T = k.tokens, KVH = cache.kv_heads, D = cache.head_dim;
  const int64_t slots = cache.blocks * cache.block_size;
  int8_t* data = static_cast<int8_t*>(cache.data);
  uint16_t* scales = cache.scales;
  const float* src[2] = {k.data, v.data};
  const int64_t stride[2] = {k.stride, v.stride};
  for (int64_t which = 0; which < 2; ++which) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < KVH; ++h) {
        const float* x = src[which] + t * stride[which] + h * D;
        float absmax = 0.0f;
        for (int64_t d = 0; d < D; ++d) absmax = std::max(absmax, std::fabs(x[d]));
        const uint16_t half = _cvtss_sh(std::min(absmax / 127.0f, 65504.0f), _MM_FROUND_TO_NEAREST_INT);
        const float s = _cvtsh_ss(half);
        const float divisor = s == 0.0f ? 1.0f : s;
        const int64_t at = (which * slots + slot[t]) * KVH + h;
        int8_t* out = data + at * D;
        for (int64_t d = 0; d < D; ++d)
          out[d] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, std::nearbyint(x[d] / divisor))));
        scales[at] = half;
      }
    }
  }
}

}  // namespace

void paged_decode_attention(Heads q, const KvCache& cache, const BlockTables& tables, double scale, int64_t window,
                            float* out, const float* sinks) {
  const int64_t NB = cache.blocks, BS = cache.block_size, KVH = cache.kv_heads, D = cache.head_dim;
  check_tables(tables, NB, BS);
  const int64_t half = NB * BS * KVH * D;  // keys, then values
  if (cache.type == KvType::kInt8) {
    const int8_t* keys = static_cast<const int8_t*>(cache.data);
    decode_attention<int8_t>(q, keys, keys + half, cache.scales, cache.scales + NB * BS * KVH, BS, KVH, tables, scale,
                             window, out, sinks);
    return;
  }
  with_float_rows(cache, [&](auto* keys) {
    using KV = std::remove_pointer_t<decltype(keys)>;
    const KV* k = keys;
    decode_attention<KV>(q, k, k + half, nullptr, nullptr, BS, KVH, tables, scale, window, out, sinks);
    return 0;
  });
}

void write_kv(const KvCache& cache, Heads k, Heads v, const int64_t* slots) {
  check_slots(cache, slots, k.tokens);
  if (cache.type == KvType::kInt8) write_int8_kv(cache, k, v, slots);
  else write_float_kv(cache, k, v, slots);
}

}  // namespace cadenza
