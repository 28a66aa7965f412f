// bf16-weight linear for float32 activations: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])
// (+ out[m, n]). Float32 accumulation: the exact float32 product of the bf16 weights. Also the
// tiling every product that streams its weights shares (quant.cpp, quant_packed.cpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "kernels.h"

namespace cadenza {

// out [M, N] (+)= x [M, K] @ w^T (+ bias): w the bits of a contiguous bfloat16 [N, K].
void linear_bf16(In x, const uint16_t* w, int64_t N, const float* bias, Out out, bool accumulate);

// Calls body(n0, n1, m, rows) for every tile [n0, n1) of `tile_rows` output features of N and every
// group of `rows` (at most `pass_rows`) activation rows starting at m, over the intra-op threads. Threads
// claim runs of tiles from a shared counter rather than a fixed half each: a thread that starts
// late (woken from its spin, or sharing its core) would otherwise leave the other waiting at the
// end of every product (a fifth of a batch-1 step was spent so). A run is one forward stream
// through the weights, long enough for the prefetcher, short enough to balance.
// Activation rows go in chunks of at most `chunk_rows`, every tile over one chunk before any over
// the next (one parallel region all the same): a chunk's activations stay in each core's L2 while
// the tiles pass over them, rather than every tile reading all of a long prefill's from L3.
template <class Body>
inline void for_each_tile(int64_t N, int64_t M, int64_t tile_rows, Body&& body, int64_t pass_rows = 4,
                          int64_t chunk_rows = 0) {
  if (chunk_rows <= 0 || chunk_rows > M) chunk_rows = M;
  const int64_t chunks = (M + chunk_rows - 1) / std::max<int64_t>(1, chunk_rows);
  // Passes of even size (9 rows at 8 a pass: 5 + 4, not 8 + 1): as many passes, and no pass of one
  // row whose multiply-adds wait on each other.
  const int64_t passes = (chunk_rows + pass_rows - 1) / pass_rows;
  pass_rows = std::max<int64_t>(1, (chunk_rows + passes - 1) / std::max<int64_t>(1, passes));
  const int64_t tiles = (N + tile_rows - 1) / tile_rows, items = tiles * chunks;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(num_threads(), items));
  const int64_t run = std::max<int64_t>(1, tiles / (threads * 8));
  std::atomic<int64_t> next{0};
  parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i0; (i0 = next.fetch_add(run, std::memory_order_relaxed)) < items;) {
      for (int64_t i = i0; i < std::min(items, i0 + run); ++i) {
        const int64_t t = i % tiles, c = i / tiles;
        const int64_t n0 = t * tile_rows, n1 = std::min(N, n0 + tile_rows);
        const int64_t m1 = std::min(M, (c + 1) * chunk_rows);
        for (int64_t m = c * chunk_rows; m < m1; m += pass_rows) body(n0, n1, m, std::min<int64_t>(pass_rows, m1 - m));
      }
    }
  });
}

// Activation rows a chunk for products over int8 activations of K values a row (see for_each_tile):
// 128 KiB of them, whole passes. Sized by reasoning for Zen 2 and 3's 512 KiB of L2 a core, beside
// the weights' tiles; on a Xeon's 2 MiB it measured the same as no chunks (512-row steps).
inline int64_t activation_chunk_rows(int64_t K, int64_t pass_rows) {
  return std::max<int64_t>(1, (int64_t{128} << 10) / std::max<int64_t>(1, K) / pass_rows) * pass_rows;
}

}  // namespace cadenza
