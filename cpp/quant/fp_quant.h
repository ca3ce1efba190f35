// Floating-point weight quantization (FP8 e4m3 per tensor / channel / 128x128 block, MXFP8,
// MXFP4, NVFP4), torch-free. It reproduces python/llmq/quant/fp.py bit for bit: the same
// float32 (and, for the MX exponent, float64) operations in the same order, round to nearest
// even everywhere, so the Python reference stays the definition and this is only faster.
//
// Layouts are fp.py's, flattened to rows [rows, k] (K is the block dimension):
//   FP8      out [rows, k] e4m3 bytes; scale float32 per tensor (per expert: one per
//            rows_per_scale rows), per row, or per 128x128 tile [rows/128, k/128].
//   MX       codes [rows, k/2] (mxfp4: E2M1, element 2i in the low nibble) or [rows, k]
//            (mxfp8: e4m3 bytes); scale_e8m0 [rows, k/32] biased exponents.
//   NVFP4    codes [rows, k/2]; block_scale [rows, k/16] e4m3 bytes; global_scale float32,
//            one per rows_per_global rows (one per expert).
// Scales are computed (compute_* = true) or read from the caller (fp.py's override arguments;
// the caller has checked them finite and positive).
//
// The row loops are written as straight loops the compiler vectorises; they are compiled
// twice, for the baseline ISA and with AVX2 (and AVX-512 where the CPU has it), chosen at run
// time; Isa::kScalar forces the baseline build. Rows are split across std::threads.
#pragma once

#include <cstdint>
#include <string>

#include "quant_kernel.h"

namespace llmq_quant {

enum class Fp8Granularity { kTensor = 0, kChannel = 1, kBlock128 = 2 };

// Empty if the layout is one the FP kernels handle (for `block`: 1, 16, 32 or 128), else a reason.
std::string check_fp_args(const MatrixArgs& a, int64_t block);

// Each returns kNotFinite (outputs then undefined) if the input holds a NaN or Inf; the
// caller's reference path raises the error message. std::invalid_argument on bad arguments.
Status quantize_fp8(const MatrixArgs& a, Fp8Granularity granularity, int64_t rows_per_scale, bool compute_scale,
                    float* scale, uint8_t* out);
Status quantize_mx(const MatrixArgs& a, bool fp4, uint8_t* codes, uint8_t* scale_e8m0);
Status quantize_nvfp4(const MatrixArgs& a, int64_t rows_per_global, bool compute_global, float* global_scale,
                      uint8_t* codes, uint8_t* block_scale);

// max |w| over each group of rows_per_group consecutive rows (one per expert, or one for the
// whole tensor), as float32 (exact: |x| and max are exact); kNotFinite if a NaN or Inf is present.
Status abs_max(const MatrixArgs& a, int64_t rows_per_group, float* amax);

// Element codecs, exposed for tests: float32 -> e4m3fn byte (round to nearest even, sign
// kept, |x| <= 448 expected: callers clamp first) and float32 -> 4-bit E2M1 code.
uint8_t e4m3_from_float(float x);
float e4m3_to_float(uint8_t code);
uint8_t e2m1_from_float(float x);

}  // namespace llmq_quant
