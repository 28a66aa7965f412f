// See moe.h. Why a kernel of its own: at decode sizes each expert's products take tens of
// microseconds, and the same work from Python (gather the expert's rows, two products, SiLU, the
// scaling, the scatter back) cost as much again in dispatch per expert, 8 to 64 experts a layer.
#include "moe.h"

#include <vector>

#include "quant.h"
#include "small_ops.h"

namespace cadenza {

void moe_experts_add(In x, const int64_t* ids, const float* weights, int64_t top_k, const Weight* gate_up,
                     const Weight* down, const float* const* down_bias, int64_t num_experts, ExpertActivation act,
                     Out residual) {
  const int64_t T = x.rows, H = x.cols;
  // The (token, weight) pairs of each expert, experts in order of first use.
  std::vector<std::vector<std::pair<int64_t, float>>> routed(num_experts);
  std::vector<int64_t> order;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = ids[t * top_k + j];
      CADENZA_CHECK(e >= 0 && e < num_experts, "expert id ", e, " out of ", num_experts);
      if (routed[e].empty()) order.push_back(e);
      routed[e].emplace_back(t, weights[t * top_k + j]);
    }
  }
  std::vector<float> xs, gu, hidden, out;
  for (const int64_t e : order) {
    const auto& pairs = routed[e];
    const int64_t n = static_cast<int64_t>(pairs.size()), I2 = gate_up[e].rows, I = I2 / 2;
    CADENZA_CHECK(down[e].rows == H && gate_up[e].rows % 2 == 0, "expert ", e, " has the wrong shape");
    xs.resize(n * H);
    for (int64_t r = 0; r < n; ++r) {
      const float* src = x.row(pairs[r].first);
      std::copy(src, src + H, xs.data() + r * H);
    }
    gu.resize(n * I2);
    hidden.resize(n * I);
    quant_matmul(In{xs.data(), n, H, H}, gate_up[e], Out{gu.data(), n, I2, I2}, false);
    if (act.swiglu_limit > 0.0f)
      swiglu_clamped(In{gu.data(), n, I2, I2}, Out{hidden.data(), n, I, I}, act.swiglu_alpha, act.swiglu_limit);
    else
      silu_mul(In{gu.data(), n, I2, I2}, Out{hidden.data(), n, I, I});
    // The weight scales the hidden state (down is linear) and the down bias after it: w (D h + b).
    const float* bias = down_bias != nullptr ? down_bias[e] : nullptr;
    for (int64_t r = 0; r < n; ++r) {
      float* row = hidden.data() + r * I;
      for (int64_t i = 0; i < I; ++i) row[i] *= pairs[r].second;
      if (bias != nullptr) {
        float* dst = residual.row(pairs[r].first);
        for (int64_t h = 0; h < H; ++h) dst[h] += pairs[r].second * bias[h];
      }
    }
    if (n == 1) {  // straight into the token's residual row
      quant_matmul(In{hidden.data(), 1, I, I}, down[e], Out{residual.row(pairs[0].first), 1, H, H}, true);
      continue;
    }
    out.resize(n * H);
    quant_matmul(In{hidden.data(), n, I, I}, down[e], Out{out.data(), n, H, H}, false);
    for (int64_t r = 0; r < n; ++r) {
      float* dst = residual.row(pairs[r].first);
      const float* src = out.data() + r * H;
      for (int64_t h = 0; h < H; ++h) dst[h] += src[h];
    }
  }
}

}  // namespace cadenza
