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
template <class Body>
inline void for_each_tile(int64_t N, int64_t M, int64_t tile_rows, Body&& body, int64_t pass_rows = 4) {
  // Passes of even size (9 rows at 8 a pass: 5 + 4, not 8 + 1): as many passes, and no pass of one
  // row whose multiply-adds wait on each other.
  const int64_t passes = (M + pass_rows - 1) / pass_rows;
  pass_rows = std::max<int64_t>(1, (M + passes - 1) / std::max<int64_t>(1, passes));
  const int64_t tiles = (N + tile_rows - 1) / tile_rows;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(num_threads(), tiles));
  const int64_t run = std::max<int64_t>(1, tiles / (threads * 8));
  std::atomic<int64_t> next{0};
  parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t0; (t0 = next.fetch_add(run, std::memory_order_relaxed)) < tiles;) {
      for (int64_t t = t0; t < std::min(tiles, t0 + run); ++t) {
        const int64_t n0 = t * tile_rows, n1 = std::min(N, n0 + tile_rows);
        for (int64_t m = 0; m < M; m += pass_rows) body(n0, n1, m, std::min<int64_t>(pass_rows, M - m));
      }
    }
  });
}

}  // namespace cadenza
