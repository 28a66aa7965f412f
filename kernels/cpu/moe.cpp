// See moe.h. Why a kernel of its own: at decode sizes each expert's products take tens of
// microseconds, and the same work from Python (gather the expert's rows, two products, SiLU, the
// scaling, the scatter back) cost as much again in dispatch per expert, 8 to 64 experts a layer.
#include "moe.h"

#include <vector>

#include "quant.h"
#include "small_ops.h"

namespace cadenza {

namespace {

// Steps of at most this many tokens (decode) keep each route's output apart and sum each token's in
// the order of its picks. (Running a decode step's experts side by side, an expert a thread, rather
// than each product split across the threads, was measured and not kept: Qwen3-30B-A3B's layers at
// batch 1, 41.5 against 46.8 tok/s, and at batch 8 level.)
constexpr int64_t kSlotOrderMaxTokens = 16;

// A token's (row t) routing to an expert: its slot j of top_k and its weight.
struct Route {
  int64_t t, j;
  float w;
};

// The scratch rows of an expert's products, reused from expert to expert.
struct ExpertScratch {
  std::vector<float> xs, gu, hidden, out;
};

// Expert e over its routes: each route's output row, w (D act(G x) + b), into out_row(route)
// (+= where accumulate).
template <class OutRow>
void run_expert(In x, const std::vector<Route>& routes, const Weight& gate_up, const Weight& down, const float* bias,
                ExpertActivation act, ExpertScratch& s, const OutRow& out_row, bool accumulate) {
  const int64_t n = static_cast<int64_t>(routes.size()), H = x.cols, I2 = gate_up.rows, I = I2 / 2;
  s.xs.resize(n * H);
  for (int64_t r = 0; r < n; ++r) {
    const float* src = x.row(routes[r].t);
    std::copy(src, src + H, s.xs.data() + r * H);
  }
  s.gu.resize(n * I2);
  s.hidden.resize(n * I);
  quant_matmul(In{s.xs.data(), n, H, H}, gate_up, Out{s.gu.data(), n, I2, I2}, false);
  if (act.swiglu_limit > 0.0f)
    swiglu_clamped(In{s.gu.data(), n, I2, I2}, Out{s.hidden.data(), n, I, I}, act.swiglu_alpha, act.swiglu_limit);
  else
    silu_mul(In{s.gu.data(), n, I2, I2}, Out{s.hidden.data(), n, I, I});
  // The weight scales the hidden state (down is linear) and the down bias after it: w (D h + b).
  for (int64_t r = 0; r < n; ++r) {
    float* row = s.hidden.data() + r * I;
    for (int64_t i = 0; i < I; ++i) row[i] *= routes[r].w;
  }
  if (n == 1) {
    quant_matmul(In{s.hidden.data(), 1, I, I}, down, Out{out_row(routes[0]), 1, H, H}, accumulate);
  } else {
    s.out.resize(n * H);
    quant_matmul(In{s.hidden.data(), n, I, I}, down, Out{s.out.data(), n, H, H}, false);
    for (int64_t r = 0; r < n; ++r) {
      float* dst = out_row(routes[r]);
      const float* src = s.out.data() + r * H;
      if (accumulate) {
        for (int64_t h = 0; h < H; ++h) dst[h] += src[h];
      } else {
        std::copy(src, src + H, dst);
      }
    }
  }
  if (bias != nullptr) {
    for (const Route& route : routes) {
      float* dst = out_row(route);
      for (int64_t h = 0; h < H; ++h) dst[h] += route.w * bias[h];
    }
  }
}

}  // namespace

void moe_experts_add(In x, const int64_t* ids, const float* weights, int64_t top_k, const Weight* gate_up,
                     const Weight* down, const float* const* down_bias, int64_t num_experts, ExpertActivation act,
                     Out residual) {
  const int64_t T = x.rows, H = x.cols;
  // The routes of each expert, experts in order of first use.
  std::vector<std::vector<Route>> routed(num_experts);
  std::vector<int64_t> order;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = ids[t * top_k + j];
      CADENZA_CHECK(e >= 0 && e < num_experts, "expert id ", e, " out of ", num_experts);
      if (routed[e].empty()) order.push_back(e);
      routed[e].push_back(Route{t, j, weights[t * top_k + j]});
    }
  }
  for (const int64_t e : order)
    CADENZA_CHECK(down[e].rows == H && gate_up[e].rows % 2 == 0, "expert ", e, " has the wrong shape");
  const auto bias_of = [&](int64_t e) { return down_bias != nullptr ? down_bias[e] : nullptr; };
  ExpertScratch scratch;
  if (T > kSlotOrderMaxTokens) {
    for (const int64_t e : order)
      run_expert(x, routed[e], gate_up[e], down[e], bias_of(e), act, scratch,
                 [&](const Route& r) { return residual.row(r.t); }, true);
    return;
  }
  // Each route's output in a row of its own; then each token adds its top_k rows in the order of
  // its picks, so that its sum does not depend on the other tokens of the step (a row's products
  // do not depend on how many rows share them: quant.h) nor on the order the experts ran in.
  std::vector<float> outs(T * top_k * H);
  for (const int64_t e : order)
    run_expert(x, routed[e], gate_up[e], down[e], bias_of(e), act, scratch,
               [&](const Route& r) { return outs.data() + (r.t * top_k + r.j) * H; }, false);
  for (int64_t t = 0; t < T; ++t) {
    float* dst = residual.row(t);
    for (int64_t j = 0; j < top_k; ++j) {
      const float* src = outs.data() + (t * top_k + j) * H;
      for (int64_t h = 0; h < H; ++h) dst[h] += src[h];
    }
  }
}

}  // namespace cadenza
