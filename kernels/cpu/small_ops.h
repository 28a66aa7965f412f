// The small fused ops of a decoder layer: RMSNorm, rotary embedding in place, SiLU * up.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace cadenza {

// cos and sin of every position: float32 [positions, head_dim] each, contiguous.
struct RotaryTables {
  const float* cos;
  const float* sin;
  int64_t positions;
};

// out = x * rsqrt(mean(x^2) + eps) * weight over each row; weight [x.cols].
void rms_norm(In x, const float* weight, double eps, Out out);

// In-place rotary embedding in the half-split (NeoX) layout on x [tokens, heads, head_dim] (heads
// packed, tokens token_stride apart), cos/sin looked up at positions [tokens] (checked in range).
// With head_stride > head_dim (partial rotary: Phi-4-mini), heads sit head_stride apart and only
// their first head_dim values turn, the tables being [positions, head_dim].
void rotary(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride, const int64_t* positions,
            const RotaryTables& tables, int64_t head_stride = 0);

// out [rows, I] = SiLU(gate) * up of gate_up [rows, 2I].
void silu_mul(In gate_up, Out out);

// out [rows, I] = GELU(gate) * up of gate_up [rows, 2I], GELU tanh-approximated (Gemma's
// gelu_pytorch_tanh): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
void gelu_tanh_mul(In gate_up, Out out);

// out [rows, I] = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), of
// gate_up [rows, 2I]: gpt-oss's experts' activation.
void swiglu_clamped(In gate_up, Out out, float alpha, float limit);

// The same of bfloat16 gate_up [rows, 2I] (row stride in_stride) into bfloat16 out [rows, I] (row stride
// out_stride): computed in float32 as silu_mul does and rounded to nearest even, so the bits are those
// of widening gate_up, silu_mul, then PyTorch's conversion of its result. What a prefill's MLP runs
// between two bfloat16 GEMMs, without a float32 copy of either side.
void silu_mul_bf16(const uint16_t* gate_up, int64_t rows, int64_t I, int64_t in_stride, uint16_t* out, int64_t out_stride);

// A checksum of the n bytes at p, read once by every thread of the pool at the same time, 64 KiB
// a chunk (a tail under 64 KiB is left unread): the memory's read rate as the decode kernels can
// reach it. A torch reduction's arithmetic per byte understates it (torch's sum read 36.5 GiB/s
// where llama.cpp reads 43, on a 2-core Zen 5).
uint64_t stream_read(const uint8_t* p, int64_t n);

}  // namespace cadenza
