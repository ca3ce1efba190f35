// pybind11 binding of the quantization kernel. It takes raw addresses (Python ints, e.g.
// torch.Tensor.data_ptr()) and sizes: python/llmq/quant/_native.py owns every dtype, shape
// and contiguity check, so this module needs no torch headers. The GIL is released while
// the kernel runs; std::invalid_argument surfaces as ValueError.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "quant_kernel.h"

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

// Returns "ok", "not_finite" or "range_overflow".
std::string run_quantize(uintptr_t w, const std::string& input, int64_t rows, int64_t k, int bits,
                         int64_t group_size, bool symmetric, uintptr_t qdata, uintptr_t scale, uintptr_t bias,
                         int threads, const std::string& isa) {
  QuantizeArgs a;
  a.w = reinterpret_cast<const void*>(w);
  a.input = parse_input(input);
  a.rows = rows;
  a.k = k;
  a.bits = bits;
  a.group_size = group_size;
  a.symmetric = symmetric;
  a.qdata = reinterpret_cast<uint8_t*>(qdata);
  a.scale = reinterpret_cast<float*>(scale);
  a.bias = reinterpret_cast<float*>(bias);
  a.threads = threads;
  a.isa = parse_isa(isa);
  const std::string err = check_args(a);
  if (!err.empty()) throw std::invalid_argument(err);
  Status s;
  {
    py::gil_scoped_release release;
    s = quantize(a);
  }
  switch (s) {
    case Status::kNotFinite:
      return "not_finite";
    case Status::kRangeOverflow:
      return "range_overflow";
    default:
      return "ok";
  }
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

}  // namespace

PYBIND11_MODULE(_quant_kernel, m) {
  m.doc() = "Group-wise integer weight quantization (llmq canonical form), bit-identical to llmq.quant's torch path.";
  m.def("best_isa", [] { return std::string(isa_name(detect_isa())); }, "The ISA path 'auto' picks on this CPU.");
  m.def("quantize", &run_quantize, py::arg("w"), py::arg("input"), py::arg("rows"), py::arg("k"), py::arg("bits"),
        py::arg("group_size"), py::arg("symmetric"), py::arg("qdata"), py::arg("scale"), py::arg("bias"),
        py::arg("threads") = 0, py::arg("isa") = "auto",
        "Quantize rows [rows, k] at the given addresses; returns 'ok', 'not_finite' or 'range_overflow'.");
  m.def("count_nonfinite", &run_count_nonfinite, py::arg("data"), py::arg("input"), py::arg("n"),
        "(NaN count, Inf count) among n elements of the given float type at address data (one thread).");
}
