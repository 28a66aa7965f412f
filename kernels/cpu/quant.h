// Linears over GGUF's block-quantized weights as the file stores them: y = x @ W^T (+ bias),
// W a uint8 tensor [out_features, bytes_per_row] of GGML blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K,
// Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4),
// x float32 [rows, in_features].
//
// Activations are quantized per 32 values to int8 with a float scale (llama.cpp's q8_0 for its
// activations), so each 32-value block of a weight row meets its activations in one integer dot
// product (_mm256_maddubs_epi16: unsigned weight bytes x signed activation bytes), scaled once by
// both blocks' scales. A block's weights are read once per call whatever the rows: threads claim
// tiles of output rows, and every group of 4 activation rows passes over a tile while it sits in
// L1/L2. Results differ from the float reference by the activations' rounding: at most half a
// quantization step (max|x of the block| / 254) per value. Each output row's sum is computed the
// same way whatever the number of rows (batch invariant, bit for bit).
// Also: rows de-quantized for an embedding lookup (`quant_rows`), and a whole weight de-quantized
// into a scratch buffer (`quant_dequantize_`) for steps of many rows, which a float GEMM serves
// faster (models/quantized_linear.py).
#pragma once

#include <cstdint>

#include "kernels.h"

namespace cadenza {

// in_features of raw blocks [rows, row_bytes] of GGML type qtype (or a packed type, quant_packed.h):
// checks that the type has a kernel, the bytes are whole blocks, and a packed weight fits this build.
int64_t quant_in_features(int64_t rows, int64_t row_bytes, int64_t qtype);

// out [M, N] (+)= x [M, K] @ W^T (+ w.bias), W raw blocks [N, row_bytes] (w.cols: row_bytes) of
// K values a row; out may be a column slice of a wider matrix. Shapes are checked by the caller.
void quant_matmul(In x, const Weight& w, Out out, bool accumulate);

// Rows ids [n] of W (checked in range), de-quantized into out, float32 [n, in_features]: an
// embedding lookup.
void quant_rows(const Weight& w, const int64_t* ids, int64_t n, float* out);

// The whole weight de-quantized into out [N, in_features]: float32, or bfloat16 (bf16) rounded to
// nearest even as PyTorch's conversion does, written in one pass rather than through a float32 copy.
void quant_dequantize(const Weight& w, void* out, bool bf16);

// Blocks w [rows, row_bytes] of GGML type qtype re-laid pack_rows() rows at a time into out (same
// size): the packed layout of quant_packed.h. Checks rows, type and bytes.
void quant_pack(const uint8_t* w, int64_t rows, int64_t row_bytes, int64_t qtype, uint8_t* out);

// Whether this build packs weights of GGML type qtype (its packed products beat the file's layout).
bool packs(int64_t qtype);

// Rows a packed group holds in this build (quant_packed.h): 16 (AVX-512 VNNI) or 8 (AVX2, AVX-VNNI).
int64_t pack_rows();

// The name of this build's products over packed weights, e.g. "avx2-packed8" (quant_packed.h).
const char* packed_path();

}  // namespace cadenza
