// CPU kernel of llmq::quantized_moe_ffn, registered from C++ so that a call costs one trip
// through the dispatcher instead of a Python function: 29 us less per Qwen3.5 decode call
// back to back, 180 us less right after other torch work (the usual case in a model, where
// attention runs between MoE layers; measured in docs/moe_kernel.md, "Fourth pass").
//
// The argument checks mirror check_moe_args in python/llmq/ops/moe_op.py (the fake kernel)
// message for message; moe_op_test runs every bad argument through both.
#include "moe_torch_op.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace llmq_moe {
namespace {

std::atomic<int> g_isa{static_cast<int>(Isa::kAuto)};
std::atomic<int> g_schedule{static_cast<int>(Schedule::kAuto)};

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// dtypes as Python prints them, so both kernels word their errors alike
std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kDouble: return "torch.float64";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string shape_str(at::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
}

#define LLMQ_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, "quantized_moe_ffn: ", __VA_ARGS__)

void expect(const Tensor& t, const char* name, c10::ScalarType dtype, const std::vector<int64_t>& shape) {
  LLMQ_CHECK(t.scalar_type() == dtype && t.sizes() == at::IntArrayRef(shape), name, " must be ", dtype_name(dtype), " ",
             shape_str(shape), ", got ", dtype_name(t.scalar_type()), " ", shape_str(t.sizes()));
}

void check_sb_pair(const Tensor& a, const Tensor& b, const char* what) {
  LLMQ_CHECK(a.scalar_type() == b.scalar_type(), what,
             " w13_sb and w2_sb must share a dtype (float32 or bfloat16), got ", dtype_name(a.scalar_type()), " and ",
             dtype_name(b.scalar_type()));
}

void check_matrix(const Tensor& q, const Tensor& sb, const std::string& name, int64_t e, int64_t n, int64_t k,
                  int64_t bits, int64_t gs) {
  const std::string bad = check_packed_matrix({dtype_name(q.scalar_type()), q.sizes().vec()},
                                              {dtype_name(sb.scalar_type()), sb.sizes().vec()}, name, e, n, k, bits,
                                              gs);
  LLMQ_CHECK(bad.empty(), bad);
}

void check_cpu(const Tensor& t, const char* name) {
  LLMQ_CHECK(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
}

// One packed matrix (or a stack) as the kernel sees it; `t_q`/`t_sb` are contiguous.
QMatrix matrix(const Tensor& q, const Tensor& sb, int64_t n, int64_t k, int64_t bits, int64_t gs) {
  return QMatrix::over(q.data_ptr<uint8_t>(), sb.data_ptr(), sb.scalar_type() == at::kBFloat16, n, k, bits, gs);
}

Tensor quantized_moe_ffn_cpu(const Tensor& x, const Tensor& router_weight, const OptTensor& expert_bias,
                             const Tensor& w13_qdata, const Tensor& w13_sb, const Tensor& w2_qdata, const Tensor& w2_sb,
                             int64_t top_k, int64_t bits, int64_t group_size, c10::string_view score_func,
                             double route_scale, const OptTensor& shared_w13_qdata, const OptTensor& shared_w13_sb,
                             const OptTensor& shared_w2_qdata, const OptTensor& shared_w2_sb,
                             const OptTensor& shared_gate_weight, int64_t shared_bits, int64_t shared_group_size,
                             int64_t num_threads) {
  // ---- the checks of check_moe_args, in the same order
  LLMQ_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
             "x must be float32 or bfloat16 [T, D], got ", dtype_name(x.scalar_type()), " ", shape_str(x.sizes()));
  const int64_t d = x.size(1);
  LLMQ_CHECK(router_weight.dim() == 2 && router_weight.scalar_type() == at::kFloat,
             "router_weight must be float32 [E, D], got ", dtype_name(router_weight.scalar_type()), " ",
             shape_str(router_weight.sizes()));
  const int64_t e = router_weight.size(0);
  expect(router_weight, "router_weight", at::kFloat, {e, d});
  LLMQ_CHECK(1 <= top_k && top_k <= e, "top_k=", top_k, " must be in [1, num_experts=", e, "]");
  const bool sigmoid = score_func == "sigmoid";
  LLMQ_CHECK(sigmoid || score_func == "softmax", "score_func '", std::string(score_func),
             "' unknown; expected one of ('softmax', 'sigmoid')");
  if (expert_bias) {
    LLMQ_CHECK(sigmoid, "expert_bias (selection-only bias) is used with score_func='sigmoid'");
    expect(*expert_bias, "expert_bias", at::kFloat, {e});
  }
  LLMQ_CHECK(w13_qdata.dim() == 3 && w13_qdata.size(0) == e, "w13_qdata must be uint8 [E=", e,
             ", 2F/16, 16*D*bits/8], got ", shape_str(w13_qdata.sizes()));
  const int64_t f = w13_qdata.size(1) * 8;
  LLMQ_CHECK(group_size <= 0 || d % group_size == 0, "group_size ", group_size,
             " does not divide the hidden size D=", d);
  LLMQ_CHECK(group_size <= 0 || f % group_size == 0, "group_size ", group_size,
             " does not divide the expert intermediate size F=", f);
  check_matrix(w13_qdata, w13_sb, "w13", e, 2 * f, d, bits, group_size);
  check_matrix(w2_qdata, w2_sb, "w2", e, d, f, bits, group_size);
  check_sb_pair(w13_sb, w2_sb, "routed");
  const int given = int(shared_w13_qdata.has_value()) + int(shared_w13_sb.has_value()) +
                    int(shared_w2_qdata.has_value()) + int(shared_w2_sb.has_value());
  int64_t fs = 0;
  if (given) {
    LLMQ_CHECK(given == 4, "give all four shared expert tensors (w13/w2 qdata and sb) or none");
    LLMQ_CHECK(shared_w13_qdata->dim() == 3 && shared_w13_qdata->size(0) == 1,
               "shared_w13_qdata must be uint8 [1, 2Fs/16, ...], got ", shape_str(shared_w13_qdata->sizes()));
    fs = shared_w13_qdata->size(1) * 8;
    check_matrix(*shared_w13_qdata, *shared_w13_sb, "shared_w13", 1, 2 * fs, d, shared_bits, shared_group_size);
    check_matrix(*shared_w2_qdata, *shared_w2_sb, "shared_w2", 1, d, fs, shared_bits, shared_group_size);
    check_sb_pair(*shared_w13_sb, *shared_w2_sb, "shared");
    if (shared_gate_weight) expect(*shared_gate_weight, "shared_gate_weight", at::kFloat, {1, d});
  } else {
    LLMQ_CHECK(!shared_gate_weight, "shared_gate_weight given without a shared expert");
  }
  LLMQ_CHECK(num_threads >= 0, "num_threads must be >= 0 (0 = torch.get_num_threads()), got ", num_threads);
  // (not in the fake kernel: meta tensors have no device to disagree about)
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&x, "x"},
                                {&router_weight, "router_weight"},
                                {&w13_qdata, "w13_qdata"},
                                {&w13_sb, "w13_sb"},
                                {&w2_qdata, "w2_qdata"},
                                {&w2_sb, "w2_sb"}})
    check_cpu(*t, name);
  for (const auto& [t, name] : {std::pair<const OptTensor*, const char*>{&expert_bias, "expert_bias"},
                                {&shared_w13_qdata, "shared_w13_qdata"},
                                {&shared_w13_sb, "shared_w13_sb"},
                                {&shared_w2_qdata, "shared_w2_qdata"},
                                {&shared_w2_sb, "shared_w2_sb"},
                                {&shared_gate_weight, "shared_gate_weight"}})
    if (t->has_value()) check_cpu(**t, name);

  // ---- contiguous views (no copy when already contiguous) and the kernel's argument block
  const Tensor xf = x.to(at::kFloat).contiguous();
  const Tensor router = router_weight.contiguous(), w13q = w13_qdata.contiguous(), w13s = w13_sb.contiguous(),
               w2q = w2_qdata.contiguous(), w2s = w2_sb.contiguous();
  const Tensor bias = expert_bias ? expert_bias->contiguous() : Tensor();
  MoEArgs a = MoEArgs::routed(xf.data_ptr<float>(), x.size(0), d, router.data_ptr<float>(),
                              bias.defined() ? bias.data_ptr<float>() : nullptr, e, top_k,
                              sigmoid ? ScoreFunc::kSigmoid : ScoreFunc::kSoftmax, route_scale,
                              matrix(w13q, w13s, 2 * f, d, bits, group_size), matrix(w2q, w2s, d, f, bits, group_size));
  Tensor s13q, s13s, s2q, s2s, sgate;
  if (given) {
    s13q = shared_w13_qdata->contiguous(), s13s = shared_w13_sb->contiguous();
    s2q = shared_w2_qdata->contiguous(), s2s = shared_w2_sb->contiguous();
    a.shared_w13 = matrix(s13q, s13s, 2 * fs, d, shared_bits, shared_group_size);
    a.shared_w2 = matrix(s2q, s2s, d, fs, shared_bits, shared_group_size);
    if (shared_gate_weight) {
      sgate = shared_gate_weight->contiguous();
      a.shared_gate = sgate.data_ptr<float>();
    }
  }
  a.num_threads = static_cast<int>(num_threads ? num_threads : at::get_num_threads());
  a.isa = op_isa();
  a.schedule = op_schedule();

  Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  moe_ffn(a, out.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

#define LLMQ_LINEAR_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, "quantized_linear: ", __VA_ARGS__)

// llmq::quantized_linear: y = x W^T on one packed matrix (dense_linear). The checks mirror
// check_linear_args in python/llmq/ops/dense_op.py (the fake kernel) message for message.
Tensor quantized_linear_cpu(const Tensor& x, const Tensor& qdata, const Tensor& sb, int64_t out_features, int64_t bits,
                            int64_t group_size, int64_t num_threads) {
  LLMQ_LINEAR_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    "x must be float32 or bfloat16 [T, K], got ", dtype_name(x.scalar_type()), " ",
                    shape_str(x.sizes()));
  const int64_t k = x.size(1);
  LLMQ_LINEAR_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  LLMQ_LINEAR_CHECK(group_size > 0 && group_size % 32 == 0 && k % group_size == 0, "group_size ", group_size,
                    " must be a positive multiple of 32 dividing K=", k);
  LLMQ_LINEAR_CHECK(qdata.dim() == 2 && qdata.scalar_type() == at::kByte && qdata.size(1) == 16 * k * bits / 8,
                    "qdata must be torch.uint8 [N/16, ", 16 * k * bits / 8, "], got ", dtype_name(qdata.scalar_type()),
                    " ", shape_str(qdata.sizes()));
  const int64_t n = qdata.size(0) * 16;
  const std::vector<int64_t> sb_shape{n / 16, 32 * (k / group_size)};
  LLMQ_LINEAR_CHECK(
      (sb.scalar_type() == at::kFloat || sb.scalar_type() == at::kBFloat16) && sb.sizes() == at::IntArrayRef(sb_shape),
      "sb must be float32 or bfloat16 ", shape_str(sb_shape), ", got ", dtype_name(sb.scalar_type()), " ",
      shape_str(sb.sizes()));
  LLMQ_LINEAR_CHECK(n - 16 < out_features && out_features <= n, "out_features=", out_features, " does not fit ", n,
                    " packed rows");
  LLMQ_LINEAR_CHECK(num_threads >= 0, "num_threads must be >= 0 (0 = torch.get_num_threads()), got ", num_threads);
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&x, "x"}, {&qdata, "qdata"}, {&sb, "sb"}})
    LLMQ_LINEAR_CHECK(t->device().is_cpu(), name, " must be on the CPU, got ", t->device());
  const Tensor xf = x.to(at::kFloat).contiguous(), q = qdata.contiguous(), s = sb.contiguous();
  Tensor out = at::empty({x.size(0), out_features}, x.options().dtype(at::kFloat));
  dense_linear(xf.data_ptr<float>(), x.size(0), matrix(q, s, n, k, bits, group_size), out_features,
               static_cast<int>(num_threads ? num_threads : at::get_num_threads()), op_isa(), out.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

void set_op_isa(Isa isa) { g_isa.store(static_cast<int>(isa)); }
void set_op_schedule(Schedule schedule) { g_schedule.store(static_cast<int>(schedule)); }
Isa op_isa() { return static_cast<Isa>(g_isa.load()); }
Schedule op_schedule() { return static_cast<Schedule>(g_schedule.load()); }

}  // namespace llmq_moe

// The schema is defined by python/llmq/ops/moe_op.py; the dispatcher accepts this kernel
// before or after it and checks the signature against it.
TORCH_LIBRARY_IMPL(llmq, CPU, m) {
  m.impl("quantized_moe_ffn", TORCH_FN(llmq_moe::quantized_moe_ffn_cpu));
  m.impl("quantized_linear", TORCH_FN(llmq_moe::quantized_linear_cpu));
}
