// Method "search" (python/llmq/quant/search.py): per group, the scale (and integer zero) with
// the smallest squared error among a fixed set of shrunk min/max candidates, optionally
// weighted per input channel (importance). Torch-free; the chosen candidate is bit for bit
// the Python reference's (search_qparams_torch).
//
// Two paths, same result:
//  * portable: every candidate's error exactly as the reference computes it (float32 codes,
//    float64 (fl32(s*(q-z)) - w)^2 [* a], summed in element order); the first smallest wins.
//  * AVX2+FMA: 8 groups at a time (one per lane, the group transposed so that lane l holds
//    element j of group l), each candidate's error approximated in float32, with a rigorous
//    bound on how far that can be from the reference's float64 sum (relative (n+8)*2^-22
//    plus an absolute underflow term). Scales are visited largest first; once, in every lane,
//    a lower bound shared by all candidates of a scale (the group's extreme elements falling
//    outside the code window, see batch_approx) exceeds an upper bound already found, that
//    scale and all smaller ones are skipped. Only candidates whose lower bound does not exceed
//    the smallest upper bound can be the reference's choice; those (usually one to three) are
//    then evaluated exactly (float32 codes, float64 terms summed in element order per lane),
//    in candidate order, and the first smallest wins. A group whose approximation is not
//    finite is evaluated exactly throughout.
#pragma once

#include <cstdint>

#include "quant_kernel.h"

namespace llmq_quant {

// Number of shrink factors f_i = 1 - i/64 (i = 0 .. kSearchFactors-1).
constexpr int kSearchFactors = 32;

// g: float32 [rows, k] contiguous, finite; group_size divides k; bits 2..8.
// scale, zero: float32 [rows, k/group_size]; zero is written only when !symmetric.
// importance: nullptr, or float32 [k] positive finite per-input-channel weights.
// Rows are split across `threads` std::threads (0 = every CPU this process may run on).
// isa: kScalar forces the portable path; otherwise AVX2+FMA when the CPU has it.
void search_qparams(const float* g, int64_t rows, int64_t k, int64_t group_size, int bits, bool symmetric, float* scale,
                    float* zero, int threads, const float* importance = nullptr, Isa isa = Isa::kAuto);

// Method "search" end to end: the (scale, zero) of search_qparams per group of a.w (any
// InputType), then codes, packing and bias by quantize() from those parameters (the same
// bytes as the reference: quantize.py's codes for that scale / zero). a.given_* must be null;
// a.isa applies to both steps. kNotFinite on NaN/Inf, kRangeOverflow when an asymmetric
// group's range overflows float32 (nothing meaningful is written then).
Status search_quantize(const QuantizeArgs& a, const float* importance = nullptr);

}  // namespace llmq_quant
