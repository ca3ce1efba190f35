// Method "search" (python/llmq/quant/search.py): per group, the scale (and integer zero) with
// the smallest squared error among a fixed set of shrunk min/max candidates. Torch-free; the
// same float32/float64 operations in the same order as the Python reference (including the
// sequential float64 error sum), so both choose the same candidate bit for bit. Only the
// choice of (scale, zero) is done here; codes, packing and bias stay with the caller.
#pragma once

#include <cstdint>

namespace llmq_quant {

// Number of shrink factors f_i = 1 - i/64 (i = 0 .. kSearchFactors-1).
constexpr int kSearchFactors = 32;

// g: float32 [rows, k] contiguous, finite; group_size divides k; bits 2..8.
// scale, zero: float32 [rows, k/group_size]; zero is written only when !symmetric.
// Rows are split across `threads` std::threads (0 = every CPU this process may run on).
void search_qparams(const float* g, int64_t rows, int64_t k, int64_t group_size, int bits, bool symmetric,
                    float* scale, float* zero, int threads);

}  // namespace llmq_quant
