// pybind11 binding of the quantization kernel. It takes raw addresses (Python ints, e.g.
// torch.Tensor.data_ptr()) and sizes: python/llmq/quant/_native.py owns every dtype, shape
// and contiguity check, so this module needs no torch headers. The GIL is released while
// the kernel runs; std::invalid_argument surfaces as ValueError.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "fp_quant.h"
#include "gguf_blocks.h"
#include "hqq_quant.h"
#include "int4_tiles.h"
#include "quant_kernel.h"
#include "search_quant.h"

namespace py = pybind11;
using namespace llmq_quant;

namespace {

InputType parse_input(const std::string& name) {
  if (name == "float32") return InputType::kFloat32;
  if (name == "bfloat16") return InputType::kBFloat16;
  if (name == "float16") return InputType::kFloat16;
  throw std::invalid_argument("unknown input type '" + name + "' (expected float32, bfloat16, float16)");
}

Isa parse_isa(const std::string& name) {
  if (name == "auto" || name.empty()) return Isa::kAuto;
  if (name == "scalar") return Isa::kScalar;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  throw std::invalid_argument("unknown isa '" + name + "' (expected auto, scalar, avx2, avx512)");
}

MatrixArgs matrix_args(uintptr_t w, const std::string& input, int64_t rows, int64_t k, int threads,
                       const std::string& isa) {
  MatrixArgs a;
  a.w = reinterpret_cast<const void*>(w);
  a.input = parse_input(input);
  a.rows = rows;
  a.k = k;
  a.threads = threads;
  a.isa = parse_isa(isa);
  return a;
}

// The integer kernels' arguments, checked (std::invalid_argument with check_args' reason).
QuantizeArgs quantize_args(uintptr_t w, const std::string& input, int64_t rows, int64_t k, int bits, int64_t group_size,
                           bool symmetric, uintptr_t qdata, uintptr_t scale, uintptr_t bias, int threads,
                           const std::string& isa) {
  QuantizeArgs a;
  static_cast<MatrixArgs&>(a) = matrix_args(w, input, rows, k, threads, isa);
  a.bits = bits;
  a.group_size = group_size;
  a.symmetric = symmetric;
  a.qdata = reinterpret_cast<uint8_t*>(qdata);
  a.scale = reinterpret_cast<float*>(scale);
  a.bias = reinterpret_cast<float*>(bias);
  const std::string err = check_args(a);
  if (!err.empty()) throw std::invalid_argument(err);
  return a;
}

const char* status_name(Status s) {
  return s == Status::kNotFinite ? "not_finite" : s == Status::kRangeOverflow ? "range_overflow" : "ok";
}

// Returns "ok", "not_finite" or "range_overflow".
std::string run_quantize(uintptr_t w, const std::string& input, int64_t rows, int64_t k, int bits, int64_t group_size,
                         bool symmetric, uintptr_t qdata, uintptr_t scale, uintptr_t bias, int threads,
                         const std::string& isa) {
  const QuantizeArgs a = quantize_args(w, input, rows, k, bits, group_size, symmetric, qdata, scale, bias, threads,
                                       isa);
  py::gil_scoped_release release;
  return status_name(quantize(a));
}

// Method "search" end to end (search_quantize): like run_quantize, plus importance (0 or
// the address of float32 [k]). Returns "ok", "not_finite" or "range_overflow".
std::string run_search_quantize(uintptr_t w, const std::string& input, int64_t rows, int64_t k, int bits,
                                int64_t group_size, bool symmetric, uintptr_t qdata, uintptr_t scale, uintptr_t bias,
                                int threads, const std::string& isa, uintptr_t importance) {
  const QuantizeArgs a = quantize_args(w, input, rows, k, bits, group_size, symmetric, qdata, scale, bias, threads,
                                       isa);
  py::gil_scoped_release release;
  return status_name(search_quantize(a, reinterpret_cast<const float*>(importance)));
}

// The (scale, zero) searches' layout check: std::invalid_argument naming `what`.
void check_group_layout(const char* what, int64_t rows, int64_t k, int64_t group_size, int bits) {
  if (rows < 0 || k <= 0 || group_size <= 0 || k % group_size || bits < 2 || bits > 8)
    throw std::invalid_argument(std::string(what) + ": bad rows/k/group_size/bits");
}

// Method "search": (scale, zero) per group of float32 rows g [rows, k] into scale / zero
// [rows, k/group_size] (zero == 0: symmetric, not written). importance: 0, or the address of
// float32 [k] positive per-input-channel weights.
void run_search_qparams(uintptr_t g, int64_t rows, int64_t k, int64_t group_size, int bits, bool symmetric,
                        uintptr_t scale, uintptr_t zero, int threads, uintptr_t importance, const std::string& isa) {
  check_group_layout("search_qparams", rows, k, group_size, bits);
  const Isa i = parse_isa(isa);
  py::gil_scoped_release release;
  search_qparams(reinterpret_cast<const float*>(g), rows, k, group_size, bits, symmetric,
                 reinterpret_cast<float*>(scale), symmetric ? nullptr : reinterpret_cast<float*>(zero), threads,
                 reinterpret_cast<const float*>(importance), i);
}

// Method "hqq": (scale, float zero) per group of float32 rows g [rows, k] into scale / zero
// [rows, k/group_size].
// importance: 0, or the address of float32 [k] positive per-input-channel weights.
void run_hqq_qparams(uintptr_t g, int64_t rows, int64_t k, int64_t group_size, int bits, uintptr_t scale,
                     uintptr_t zero, int threads, uintptr_t importance) {
  check_group_layout("hqq_qparams", rows, k, group_size, bits);
  py::gil_scoped_release release;
  hqq_qparams(reinterpret_cast<const float*>(g), rows, k, group_size, bits, reinterpret_cast<float*>(scale),
              reinterpret_cast<float*>(zero), threads, reinterpret_cast<const float*>(importance));
}

// (NaN count, Inf count) of n elements at address `data`.
py::tuple run_count_nonfinite(uintptr_t data, const std::string& input, int64_t n) {
  if (n < 0) throw std::invalid_argument("n must be >= 0");
  const InputType type = parse_input(input);
  NonFiniteCounts c;
  {
    py::gil_scoped_release release;
    c = count_nonfinite(reinterpret_cast<const void*>(data), type, n);
  }
  return py::make_tuple(c.nan, c.inf);
}

template <typename F>
std::string run_fp(F&& f) {
  Status s;
  {
    py::gil_scoped_release release;
    s = f();
  }
  return s == Status::kOk ? "ok" : "not_finite";
}

// granularity: "tensor" | "channel" | "block128"; scale is read (compute_scale false) or written.
std::string run_quantize_fp8(uintptr_t w, const std::string& input, int64_t rows, int64_t k,
                             const std::string& granularity, int64_t rows_per_scale, bool compute_scale,
                             uintptr_t scale, uintptr_t out, int threads, const std::string& isa) {
  const MatrixArgs a = matrix_args(w, input, rows, k, threads, isa);
  Fp8Granularity g;
  if (granularity == "tensor") g = Fp8Granularity::kTensor;
  else if (granularity == "channel") g = Fp8Granularity::kChannel;
  else if (granularity == "block128") g = Fp8Granularity::kBlock128;
  else
    throw std::invalid_argument("unknown FP8 granularity '" + granularity + "' (expected tensor, channel, block128)");
  const std::string err = check_fp_args(a, g == Fp8Granularity::kBlock128 ? 128 : 1);
  if (!err.empty()) throw std::invalid_argument(err);
  return run_fp([&] {
    return quantize_fp8(a, g, rows_per_scale, compute_scale, reinterpret_cast<float*>(scale),
                        reinterpret_cast<uint8_t*>(out));
  });
}

std::string run_quantize_mx(uintptr_t w, const std::string& input, int64_t rows, int64_t k, bool fp4, uintptr_t codes,
                            uintptr_t scale_e8m0, int threads, const std::string& isa) {
  const MatrixArgs a = matrix_args(w, input, rows, k, threads, isa);
  const std::string err = check_fp_args(a, 32);
  if (!err.empty()) throw std::invalid_argument(err);
  return run_fp(
      [&] { return quantize_mx(a, fp4, reinterpret_cast<uint8_t*>(codes), reinterpret_cast<uint8_t*>(scale_e8m0)); });
}

std::string run_quantize_nvfp4(uintptr_t w, const std::string& input, int64_t rows, int64_t k, int64_t rows_per_global,
                               bool compute_global, uintptr_t global_scale, uintptr_t codes, uintptr_t block_scale,
                               int threads, const std::string& isa) {
  const MatrixArgs a = matrix_args(w, input, rows, k, threads, isa);
  const std::string err = check_fp_args(a, 16);
  if (!err.empty()) throw std::invalid_argument(err);
  return run_fp([&] {
    return quantize_nvfp4(a, rows_per_global, compute_global, reinterpret_cast<float*>(global_scale),
                          reinterpret_cast<uint8_t*>(codes), reinterpret_cast<uint8_t*>(block_scale));
  });
}

std::string run_abs_max(uintptr_t w, const std::string& input, int64_t rows, int64_t k, int64_t rows_per_group,
                        uintptr_t amax, int threads, const std::string& isa) {
  const MatrixArgs a = matrix_args(w, input, rows, k, threads, isa);
  const std::string err = check_fp_args(a, 1);
  if (!err.empty()) throw std::invalid_argument(err);
  return run_fp([&] { return abs_max(a, rows_per_group, reinterpret_cast<float*>(amax)); });
}

void run_pack_int4_mma_tiles(uintptr_t src, int64_t batch, int64_t n, int64_t kbytes, int inner_k_tiles, uintptr_t dst,
                             int threads, bool simd) {
  py::gil_scoped_release release;
  pack_int4_mma_tiles(reinterpret_cast<const uint8_t*>(src), batch, n, kbytes, inner_k_tiles,
                      reinterpret_cast<int32_t*>(dst), threads, simd);
}

// GGUF blocks of type `type_name` (n_blocks * block_bytes bytes at `blocks`) -> canonical
// qdata / scale / bias at the given addresses (gguf_blocks.h gives their sizes).
void run_gguf_decode(const std::string& type_name, uintptr_t blocks, int64_t n_blocks, uintptr_t qdata, uintptr_t scale,
                     uintptr_t bias, int threads) {
  GgufBlockType type;
  if (!parse_gguf_block_type(type_name, &type))
    throw std::invalid_argument("GGUF block type '" + type_name + "' has no compiled decoder");
  if (n_blocks < 0) throw std::invalid_argument("n_blocks must be >= 0");
  py::gil_scoped_release release;
  decode_gguf_blocks(type, reinterpret_cast<const uint8_t*>(blocks), n_blocks, reinterpret_cast<uint8_t*>(qdata),
                     reinterpret_cast<float*>(scale), reinterpret_cast<float*>(bias), threads);
}

}  // namespace

PYBIND11_MODULE(_quant_kernel, m) {
  m.doc() = "Group-wise integer weight quantization (llmq canonical form), bit-identical to llmq.quant's torch path.";
  m.def("best_isa", [] { return std::string(isa_name(detect_isa())); }, "The ISA path 'auto' picks on this CPU.");
  m.def("quantize", &run_quantize, py::arg("w"), py::arg("input"), py::arg("rows"), py::arg("k"), py::arg("bits"),
        py::arg("group_size"), py::arg("symmetric"), py::arg("qdata"), py::arg("scale"), py::arg("bias"),
        py::arg("threads") = 0, py::arg("isa") = "auto",
        "Quantize rows [rows, k] at the given addresses; returns 'ok', 'not_finite' or 'range_overflow'.");
  m.def("search_qparams", &run_search_qparams, py::arg("g"), py::arg("rows"), py::arg("k"), py::arg("group_size"),
        py::arg("bits"), py::arg("symmetric"), py::arg("scale"), py::arg("zero"), py::arg("threads"),
        py::arg("importance") = 0, py::arg("isa") = "auto",
        "Method 'search': per-group (scale, zero) of float32 rows (search_quant.h).");
  m.def("search_quantize", &run_search_quantize, py::arg("w"), py::arg("input"), py::arg("rows"), py::arg("k"),
        py::arg("bits"), py::arg("group_size"), py::arg("symmetric"), py::arg("qdata"), py::arg("scale"),
        py::arg("bias"), py::arg("threads") = 0, py::arg("isa") = "auto", py::arg("importance") = 0,
        "Method 'search' end to end: codes, scale, bias (search_quant.h); 'ok', 'not_finite' or 'range_overflow'.");
  m.def("hqq_qparams", &run_hqq_qparams, py::arg("g"), py::arg("rows"), py::arg("k"), py::arg("group_size"),
        py::arg("bits"), py::arg("scale"), py::arg("zero"), py::arg("threads"), py::arg("importance") = 0,
        "Method 'hqq': per-group (scale, float zero) of float32 rows (hqq_quant.h).");
  m.def("count_nonfinite", &run_count_nonfinite, py::arg("data"), py::arg("input"), py::arg("n"),
        "(NaN count, Inf count) among n elements of the given float type at address data (one thread).");
  m.def("quantize_fp8", &run_quantize_fp8, py::arg("w"), py::arg("input"), py::arg("rows"), py::arg("k"),
        py::arg("granularity"), py::arg("rows_per_scale"), py::arg("compute_scale"), py::arg("scale"), py::arg("out"),
        py::arg("threads") = 0, py::arg("isa") = "auto",
        "FP8 e4m3 (llmq.quant.fp.quantize_fp8); returns 'ok' or 'not_finite'.");
  m.def("quantize_mx", &run_quantize_mx, py::arg("w"), py::arg("input"), py::arg("rows"), py::arg("k"), py::arg("fp4"),
        py::arg("codes"), py::arg("scale_e8m0"), py::arg("threads") = 0, py::arg("isa") = "auto",
        "MXFP4 / MXFP8 (llmq.quant.fp.quantize_mx); returns 'ok' or 'not_finite'.");
  m.def("quantize_nvfp4", &run_quantize_nvfp4, py::arg("w"), py::arg("input"), py::arg("rows"), py::arg("k"),
        py::arg("rows_per_global"), py::arg("compute_global"), py::arg("global_scale"), py::arg("codes"),
        py::arg("block_scale"), py::arg("threads") = 0, py::arg("isa") = "auto",
        "NVFP4 (llmq.quant.fp.quantize_nvfp4); returns 'ok' or 'not_finite'.");
  m.def("abs_max", &run_abs_max, py::arg("w"), py::arg("input"), py::arg("rows"), py::arg("k"),
        py::arg("rows_per_group"), py::arg("amax"), py::arg("threads") = 0, py::arg("isa") = "auto",
        "max |w| per group of rows_per_group rows into float32 amax; returns 'ok' or 'not_finite'.");
  m.def("pack_int4_mma_tiles", &run_pack_int4_mma_tiles, py::arg("src"), py::arg("batch"), py::arg("n"),
        py::arg("kbytes"), py::arg("inner_k_tiles"), py::arg("dst"), py::arg("threads") = 0, py::arg("simd") = true,
        "Canonical 4-bit rows -> m16n8k16 B-fragment int32 tiles (int4_tiles.h).");
  m.def("gguf_decode", &run_gguf_decode, py::arg("type_name"), py::arg("blocks"), py::arg("n_blocks"), py::arg("qdata"),
        py::arg("scale"), py::arg("bias"), py::arg("threads") = 0,
        "GGUF quantized blocks -> canonical codes, float32 scale and bias (gguf_blocks.h).");
}
