// Method "hqq" (python/llmq/quant/hqq.py): per group, the float zero point found by
// half-quadratic splitting with the lp shrinkage (Badri & Shaji 2023), scale fixed at the
// minmax scale. Torch-free; the same float32/float64 operations in the same order as the
// Python reference (hqq_qparams_torch with its default parameters), so both return the same
// bits. Only (scale, zero) are chosen here; codes, packing and bias stay with the caller.
#pragma once

#include <cstdint>

namespace llmq_quant {

// The parameters of hqq.py (P_NORM, BETA, KAPPA, ITERS).
constexpr double kHqqP = 0.7;
constexpr double kHqqBeta = 10.0;
constexpr double kHqqKappa = 1.01;
constexpr int kHqqIters = 20;

// a^e for a positive normal double by +, *, / only (hqq.pow_det: same bits).
double hqq_pow_det(double a, double e);

// g: float32 [rows, k] contiguous, finite; group_size divides k; bits 2..8.
// scale, zero: float32 [rows, k/group_size]. Rows are split across `threads` std::threads
// (0 = every CPU this process may run on). importance: nullptr, or float32 [k] positive
// per-input-channel weights (weighted error and weighted-mean zero update, as in hqq.py).
void hqq_qparams(const float* g, int64_t rows, int64_t k, int64_t group_size, int bits, float* scale, float* zero,
                 int threads, const float* importance = nullptr);

}  // namespace llmq_quant
