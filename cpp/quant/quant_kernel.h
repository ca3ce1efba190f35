// Group-wise integer weight quantization (method "minmax") into llmq's canonical form,
// torch-free. It reproduces python/llmq/quant/quantize.py bit for bit: the same float32
// operations in the same order (w * (1/scale), round half to even, clamp), so the Python
// torch path stays the reference and this is only a faster way to get the same bytes.
//
//   w[r, k] ~= scale[r, k/gs] * q[r, k] + bias[r, k/gs],  q unsigned in [0, 2^bits)
//   qdata rows: little-endian LSB-first bit stream, element k at bits [k*bits, (k+1)*bits).
//
// Every group is read once from memory: one sweep finds min/max (and NaN/Inf), the second
// sweep (from L1) quantizes; a row is then packed. Rows are split across std::threads.
// ISA paths (AVX-512, AVX2+F16C, portable) are chosen at run time; none needs -march.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace llmq_quant {

enum class InputType { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum class Isa { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };

// What went wrong, if anything. Errors stop the work early; the caller reports them (the
// Python wrapper re-runs its reference path, which raises the exact message).
enum class Status { kOk = 0, kNotFinite = 1, kRangeOverflow = 2 };

// The input matrix and how to run over it: what every kernel of this library takes (the FP
// kernels take it as it is; QuantizeArgs adds the integer format and its outputs).
struct MatrixArgs {
  const void* w = nullptr;  // [rows, k] contiguous, of `input`
  InputType input = InputType::kFloat32;
  int64_t rows = 0;
  int64_t k = 0;
  int threads = 0;  // 0 = every CPU this process may run on
  Isa isa = Isa::kAuto;
};

struct QuantizeArgs : MatrixArgs {
  int bits = 4;              // 2..8
  int64_t group_size = 32;   // divides k
  bool symmetric = true;
  uint8_t* qdata = nullptr;  // [rows, k*bits/8]
  float* scale = nullptr;    // [rows, k/group_size]
  float* bias = nullptr;     // [rows, k/group_size]
  // Optional per-group parameters chosen elsewhere (method "search", search_quant.h):
  // float32 [rows, k/group_size] scales and, when !symmetric, integer-valued zeros. When
  // given_scale is set no min/max sweep runs: codes, packing and bias follow the same rules
  // from these (symmetric: zero 2^(b-1), bias = -2^(b-1)*scale; asymmetric: bias =
  // 0 - zero*scale). Inputs must then be finite (not re-checked). `scale` may alias given_scale.
  const float* given_scale = nullptr;
  const float* given_zero = nullptr;
};

// f(std::integral_constant<InputType, t>{}): turns the run-time input type into the template
// argument the row loops are instantiated for.
template <typename F>
auto dispatch_input(InputType t, F&& f) {
  switch (t) {
    case InputType::kBFloat16: return f(std::integral_constant<InputType, InputType::kBFloat16>{});
    case InputType::kFloat16: return f(std::integral_constant<InputType, InputType::kFloat16>{});
    default: return f(std::integral_constant<InputType, InputType::kFloat32>{});
  }
}

// Empty if `threads` and `isa` can run here, else a reason (the last checks of check_args and
// check_fp_args).
std::string check_threads_isa(const MatrixArgs& a);

// Empty if the arguments describe a layout this kernel handles, else a reason.
std::string check_args(const QuantizeArgs& a);

// Quantize; the arguments must pass check_args (std::invalid_argument otherwise).
Status quantize(const QuantizeArgs& a);

// NaN and +-Inf among n elements of `input` at `data`, from the bit patterns (exponent field
// all ones; NaN iff the mantissa is non-zero). One thread, no allocation: the checkpoint
// reader runs it on every float tensor it reads, on its read-ahead thread, where torch's
// aminmax would start an OpenMP team that spins against the pipeline's other threads.
struct NonFiniteCounts {
  int64_t nan = 0;
  int64_t inf = 0;
};
NonFiniteCounts count_nonfinite(const void* data, InputType input, int64_t n);

// out[i] = float32 value of element i of `input` at `data`, i < n (exact).
void to_float32(const void* data, InputType input, int64_t n, float* out);

// The best ISA path this CPU supports (what kAuto picks), and its name.
Isa detect_isa();
const char* isa_name(Isa isa);

// Threads a kernel uses by default: the CPUs this process may run on (a container's cpuset,
// not the host's core count). Shared by the integer, FP and search kernels.
int default_threads();

// work(r0, r1) over row ranges splitting [0, rows) across `threads` threads (0: default_threads(),
// at most one per row); in the calling thread when that is one.
template <typename Work>
void parallel_rows(int64_t rows, int threads, Work work) {
  int t = threads > 0 ? threads : default_threads();
  t = static_cast<int>(std::min<int64_t>(t, std::max<int64_t>(rows, 1)));
  if (t <= 1) {
    work(int64_t{0}, rows);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = (rows + t - 1) / t;
  for (int i = 0; i < t; ++i) {
    const int64_t r0 = i * per, r1 = std::min(rows, r0 + per);
    if (r0 < r1) pool.emplace_back(work, r0, r1);
  }
  for (auto& th : pool) th.join();
}

}  // namespace llmq_quant
