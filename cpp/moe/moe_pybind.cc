// pybind11 binding of the MoE kernel. It takes raw addresses (Python ints, e.g.
// torch.Tensor.data_ptr()) and sizes: the Python wrapper (python/llmq/ops) owns all
// dtype/shape/contiguity checks, so this file needs no torch headers (the op itself is
// registered with the dispatcher by moe_torch_op.cc, linked into the same library). The GIL
// is released while the kernel runs. std::invalid_argument surfaces as ValueError.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "moe_kernel.h"
#include "moe_torch_op.h"

namespace py = pybind11;
using namespace llmq_moe;

namespace {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

Isa parse_isa(const std::string& name) {
  if (name == "auto" || name.empty()) return Isa::kAuto;
  if (name == "scalar") return Isa::kScalar;
  if (name == "avx512_vnni") return Isa::kAvx512Vnni;
  if (name == "avx2") return Isa::kAvx2;
  throw std::invalid_argument("unknown isa '" + name + "' (expected auto, scalar, avx2, avx512_vnni)");
}

ScoreFunc parse_score(const std::string& name) {
  if (name == "softmax") return ScoreFunc::kSoftmax;
  if (name == "sigmoid") return ScoreFunc::kSigmoid;
  throw std::invalid_argument("unknown score function '" + name + "' (expected softmax or sigmoid)");
}

// sb_bf16: the scale/bias buffer holds bfloat16 bit patterns instead of float32.
QMatrix matrix(uintptr_t q, uintptr_t sb, bool sb_bf16, int64_t n, int64_t k, int bits, int gs) {
  QMatrix m;
  m.qdata = ptr<const uint8_t>(q);
  if (sb_bf16) m.sb16 = ptr<const uint16_t>(sb);
  else m.sb = ptr<const float>(sb);
  m.n = n;
  m.k = k;
  m.bits = bits;
  m.group_size = gs;
  return m;
}

void pack(uintptr_t q, uintptr_t scale, uintptr_t bias, int64_t batch, int64_t n, int64_t k, int bits, int gs,
          uintptr_t out_q, uintptr_t out_sb) {
  std::string err = check_layout(n, k, bits, gs);
  if (!err.empty()) throw std::invalid_argument(err);
  py::gil_scoped_release release;
  const int64_t qbytes = n * k * bits / 8, groups = n * (k / gs);
  for (int64_t b = 0; b < batch; ++b)
    pack_matrix(ptr<const uint8_t>(q) + b * qbytes, ptr<const float>(scale) + b * groups,
                ptr<const float>(bias) + b * groups, n, k, bits, gs, ptr<uint8_t>(out_q) + b * qbytes,
                ptr<float>(out_sb) + b * 2 * groups);
}

Schedule parse_schedule(const std::string& name) {
  if (name == "auto") return Schedule::kAuto;
  if (name == "by_expert") return Schedule::kByExpert;
  if (name == "by_columns") return Schedule::kByColumns;
  throw std::invalid_argument("unknown schedule '" + name + "' (auto, by_expert, by_columns)");
}

MoEArgs make_args(const py::dict& d) {
  MoEArgs a;
  a.x = ptr<const float>(d["x"].cast<uintptr_t>());
  a.tokens = d["tokens"].cast<int64_t>();
  a.hidden = d["hidden"].cast<int64_t>();
  a.router = ptr<const float>(d["router"].cast<uintptr_t>());
  a.expert_bias = ptr<const float>(d["expert_bias"].cast<uintptr_t>());
  a.experts = d["experts"].cast<int64_t>();
  a.top_k = d["top_k"].cast<int64_t>();
  a.score = parse_score(d["score_func"].cast<std::string>());
  a.route_scale = d["route_scale"].cast<float>();
  const int64_t f = d["intermediate"].cast<int64_t>();
  const int bits = d["bits"].cast<int>(), gs = d["group_size"].cast<int>();
  const bool bf16 = d.contains("sb_bf16") && d["sb_bf16"].cast<bool>();
  a.w13 = matrix(d["w13_q"].cast<uintptr_t>(), d["w13_sb"].cast<uintptr_t>(), bf16, 2 * f, a.hidden, bits, gs);
  a.w2 = matrix(d["w2_q"].cast<uintptr_t>(), d["w2_sb"].cast<uintptr_t>(), bf16, a.hidden, f, bits, gs);
  if (d["shared_w13_q"].cast<uintptr_t>()) {
    const int64_t fs = d["shared_intermediate"].cast<int64_t>();
    const int sbits = d["shared_bits"].cast<int>(), sgs = d["shared_group_size"].cast<int>();
    const bool sbf16 = d.contains("shared_sb_bf16") && d["shared_sb_bf16"].cast<bool>();
    a.shared_w13 = matrix(d["shared_w13_q"].cast<uintptr_t>(), d["shared_w13_sb"].cast<uintptr_t>(), sbf16, 2 * fs,
                          a.hidden, sbits, sgs);
    a.shared_w2 = matrix(d["shared_w2_q"].cast<uintptr_t>(), d["shared_w2_sb"].cast<uintptr_t>(), sbf16, a.hidden, fs,
                         sbits, sgs);
    a.shared_gate = ptr<const float>(d["shared_gate"].cast<uintptr_t>());
  }
  a.num_threads = d["num_threads"].cast<int>();
  a.isa = parse_isa(d["isa"].cast<std::string>());
  a.schedule = parse_schedule(d.contains("schedule") ? d["schedule"].cast<std::string>() : "auto");
  return a;
}

void run_moe(const py::dict& d, uintptr_t out) {
  MoEArgs a = make_args(d);
  py::gil_scoped_release release;
  moe_ffn(a, ptr<float>(out));
}

void run_route(const py::dict& d, uintptr_t idx, uintptr_t weights) {
  MoEArgs a = make_args(d);
  py::gil_scoped_release release;
  route(a, ptr<int32_t>(idx), ptr<float>(weights));
}

}  // namespace

PYBIND11_MODULE(_moe_kernel, m) {
  m.doc() = "llmq fused quantized MoE FFN kernel (raw-pointer API; use llmq.ops)";
  m.def(
      "best_isa", [] { return std::string(isa_name(detect_isa())); },
      "The fastest instruction-set path this CPU supports.");
  m.def("check_layout", &check_layout, "Empty string if (n, k, bits, group_size) can be packed.");
  m.def("pack", &pack, "Canonical [batch, n, k] -> tiled layout (see moe_kernel.h).");
  m.def("moe_ffn", &run_moe, "Run the op; arguments as a dict of addresses and sizes.");
  m.def("route", &run_route, "Router + scores + top-k only.");
  m.def(
      "set_op_isa", [](const std::string& name) { set_op_isa(parse_isa(name)); },
      "Instruction-set path torch.ops.llmq.quantized_moe_ffn uses from now on.");
  m.def(
      "set_op_schedule", [](const std::string& name) { set_op_schedule(parse_schedule(name)); },
      "w2 work split torch.ops.llmq.quantized_moe_ffn uses from now on.");
  m.def(
      "op_settings",
      [] {
        static const char* schedules[] = {"auto", "by_expert", "by_columns"};
        py::dict d;
        d["isa"] = isa_name(op_isa());
        d["schedule"] = schedules[static_cast<int>(op_schedule())];
        return d;
      },
      "The path and schedule the op uses now (as set by set_op_isa / set_op_schedule).");
}
