// ExecuTorch kernel of llmq::quantized_moe_ffn.out: the out variant of torch.ops.llmq.quantized_moe_ffn
// (schema: models/pipeline/moe_pte.py) over the torch-free kernel of moe_kernel.h, for .pte programs.
//
// Built against the headers and libexecutorch.so of the installed executorch wheel
// (@llmq_platform//:executorch_runtime, cpp/moe/executorch_kernel.bzl). Loading the shared library
// into a process whose ExecuTorch runtime is that libexecutorch.so (the Python runtime,
// executorch.runtime, links it) registers the kernel from a static initializer; a program that
// calls the op then finds it by name. The computation is moe_ffn itself, so for the same inputs,
// ISA path and schedule the .pte's result equals the torch op's bit for bit.
//
// The argument checks are those of moe_torch_op.cc (the shapes the exporter wrote are checked
// again here, against a hand-made or mismatched program); a failed check logs one line and fails
// the method with InvalidArgument.
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/operator_registry.h>

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "moe_kernel.h"

namespace llmq_moe {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::KernelRuntimeContext;

constexpr int kArgs = 20;  // the functional schema's arguments; then `out` (and the returned out)

struct BadArgument {
  std::string message;
};

const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "torch.float32";
    case ScalarType::BFloat16: return "torch.bfloat16";
    case ScalarType::Half: return "torch.float16";
    case ScalarType::Double: return "torch.float64";
    case ScalarType::Byte: return "torch.uint8";
    case ScalarType::Char: return "torch.int8";
    case ScalarType::Int: return "torch.int32";
    case ScalarType::Long: return "torch.int64";
    default: return "torch.<other>";
  }
}

std::string shape_str(const Tensor& t) {
  std::ostringstream out;
  out << "[";
  for (ssize_t i = 0; i < t.dim(); ++i) out << (i ? ", " : "") << t.size(i);
  out << "]";
  return out.str();
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

template <typename... Parts>
void check(bool cond, const Parts&... parts) {
  if (cond) return;
  std::ostringstream out;
  out << "quantized_moe_ffn: ";
  (out << ... << parts);
  throw BadArgument{out.str()};
}

bool has_shape(const Tensor& t, const std::vector<int64_t>& shape) {
  if (t.dim() != static_cast<ssize_t>(shape.size())) return false;
  for (size_t i = 0; i < shape.size(); ++i)
    if (t.size(i) != shape[i]) return false;
  return true;
}

void expect(const Tensor& t, const char* name, ScalarType dtype, const std::vector<int64_t>& shape) {
  check(t.scalar_type() == dtype && has_shape(t, shape), name, " must be ", dtype_name(dtype), " ", shape_str(shape),
        ", got ", dtype_name(t.scalar_type()), " ", shape_str(t));
}

ArgTensor arg(const Tensor& t) {
  ArgTensor a{dtype_name(t.scalar_type()), {}};
  for (ssize_t i = 0; i < t.dim(); ++i) a.shape.push_back(t.size(i));
  return a;
}

void check_matrix(const Tensor& q, const Tensor& sb, const std::string& name, int64_t e, int64_t n, int64_t k,
                  int64_t bits, int64_t gs) {
  const std::string bad = check_packed_matrix(arg(q), arg(sb), name, e, n, k, bits, gs);
  check(bad.empty(), bad);
}

QMatrix matrix(const Tensor& q, const Tensor& sb, int64_t n, int64_t k, int64_t bits, int64_t gs) {
  return QMatrix::over(q.const_data_ptr<uint8_t>(), sb.const_data_ptr(), sb.scalar_type() == ScalarType::BFloat16, n, k,
                       bits, gs);
}

const Tensor* optional_tensor(EValue* v) { return v->isNone() ? nullptr : &v->toTensor(); }

int default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n ? static_cast<int>(n) : 1;
}

// Checks the arguments (as moe_torch_op.cc does), resizes `out` to x's shape and runs the kernel.
void run(EValue** args, Tensor& out) {
  const Tensor& x = args[0]->toTensor();
  const Tensor& router_weight = args[1]->toTensor();
  const Tensor* expert_bias = optional_tensor(args[2]);
  const Tensor& w13_qdata = args[3]->toTensor();
  const Tensor& w13_sb = args[4]->toTensor();
  const Tensor& w2_qdata = args[5]->toTensor();
  const Tensor& w2_sb = args[6]->toTensor();
  const int64_t top_k = args[7]->toInt(), bits = args[8]->toInt(), group_size = args[9]->toInt();
  const auto score = args[10]->toString();
  const std::string score_func(score.data(), score.size());
  const double route_scale = args[11]->toDouble();
  const Tensor* shared_w13_qdata = optional_tensor(args[12]);
  const Tensor* shared_w13_sb = optional_tensor(args[13]);
  const Tensor* shared_w2_qdata = optional_tensor(args[14]);
  const Tensor* shared_w2_sb = optional_tensor(args[15]);
  const Tensor* shared_gate_weight = optional_tensor(args[16]);
  const int64_t shared_bits = args[17]->toInt(), shared_group_size = args[18]->toInt();
  const int64_t num_threads = args[19]->toInt();

  check(x.dim() == 2 && x.scalar_type() == ScalarType::Float, "x must be float32 [T, D] in a .pte, got ",
        dtype_name(x.scalar_type()), " ", shape_str(x));
  const int64_t d = x.size(1);
  check(router_weight.dim() == 2 && router_weight.scalar_type() == ScalarType::Float,
        "router_weight must be float32 [E, D], got ", dtype_name(router_weight.scalar_type()), " ",
        shape_str(router_weight));
  const int64_t e = router_weight.size(0);
  expect(router_weight, "router_weight", ScalarType::Float, {e, d});
  check(1 <= top_k && top_k <= e, "top_k=", top_k, " must be in [1, num_experts=", e, "]");
  const bool sigmoid = score_func == "sigmoid";
  check(sigmoid || score_func == "softmax", "score_func '", score_func,
        "' unknown; expected one of ('softmax', 'sigmoid')");
  if (expert_bias) {
    check(sigmoid, "expert_bias (selection-only bias) is used with score_func='sigmoid'");
    expect(*expert_bias, "expert_bias", ScalarType::Float, {e});
  }
  check(w13_qdata.dim() == 3 && w13_qdata.size(0) == e, "w13_qdata must be uint8 [E=", e, ", 2F/16, 16*D*bits/8], got ",
        shape_str(w13_qdata));
  const int64_t f = w13_qdata.size(1) * 8;
  check(group_size <= 0 || d % group_size == 0, "group_size ", group_size, " does not divide the hidden size D=", d);
  check(group_size <= 0 || f % group_size == 0, "group_size ", group_size,
        " does not divide the expert intermediate size F=", f);
  check_matrix(w13_qdata, w13_sb, "w13", e, 2 * f, d, bits, group_size);
  check_matrix(w2_qdata, w2_sb, "w2", e, d, f, bits, group_size);
  check(w13_sb.scalar_type() == w2_sb.scalar_type(),
        "routed w13_sb and w2_sb must share a dtype (float32 or bfloat16), got ", dtype_name(w13_sb.scalar_type()),
        " and ", dtype_name(w2_sb.scalar_type()));
  const int given = int(shared_w13_qdata != nullptr) + int(shared_w13_sb != nullptr) + int(shared_w2_qdata != nullptr) +
                    int(shared_w2_sb != nullptr);
  int64_t fs = 0;
  if (given) {
    check(given == 4, "give all four shared expert tensors (w13/w2 qdata and sb) or none");
    check(shared_w13_qdata->dim() == 3 && shared_w13_qdata->size(0) == 1,
          "shared_w13_qdata must be uint8 [1, 2Fs/16, ...], got ", shape_str(*shared_w13_qdata));
    fs = shared_w13_qdata->size(1) * 8;
    check_matrix(*shared_w13_qdata, *shared_w13_sb, "shared_w13", 1, 2 * fs, d, shared_bits, shared_group_size);
    check_matrix(*shared_w2_qdata, *shared_w2_sb, "shared_w2", 1, d, fs, shared_bits, shared_group_size);
    check(shared_w13_sb->scalar_type() == shared_w2_sb->scalar_type(),
          "shared w13_sb and w2_sb must share a dtype (float32 or bfloat16), got ",
          dtype_name(shared_w13_sb->scalar_type()), " and ", dtype_name(shared_w2_sb->scalar_type()));
    if (shared_gate_weight) expect(*shared_gate_weight, "shared_gate_weight", ScalarType::Float, {1, d});
  } else {
    check(shared_gate_weight == nullptr, "shared_gate_weight given without a shared expert");
  }
  check(num_threads >= 0, "num_threads must be >= 0 (0 = all hardware threads in a .pte), got ", num_threads);
  check(out.scalar_type() == ScalarType::Float, "out must be float32, got ", dtype_name(out.scalar_type()));
  check(executorch::runtime::resize_tensor(out, x.sizes()) == Error::Ok, "out cannot be resized to ", shape_str(x),
        " (its planned size is ", shape_str(out), ")");

  MoEArgs a = MoEArgs::routed(x.const_data_ptr<float>(), x.size(0), d, router_weight.const_data_ptr<float>(),
                              expert_bias ? expert_bias->const_data_ptr<float>() : nullptr, e, top_k,
                              sigmoid ? ScoreFunc::kSigmoid : ScoreFunc::kSoftmax, route_scale,
                              matrix(w13_qdata, w13_sb, 2 * f, d, bits, group_size),
                              matrix(w2_qdata, w2_sb, d, f, bits, group_size));
  if (given) {
    a.shared_w13 = matrix(*shared_w13_qdata, *shared_w13_sb, 2 * fs, d, shared_bits, shared_group_size);
    a.shared_w2 = matrix(*shared_w2_qdata, *shared_w2_sb, d, fs, shared_bits, shared_group_size);
    if (shared_gate_weight) a.shared_gate = shared_gate_weight->const_data_ptr<float>();
  }
  a.num_threads = static_cast<int>(num_threads ? num_threads : default_threads());
  moe_ffn(a, out.mutable_data_ptr<float>());
}

// Boxed calling convention: the schema's 20 arguments, then `out`, then (when the program lists it)
// the returned value, which is `out` again.
void quantized_moe_ffn_out(KernelRuntimeContext& ctx, executorch::runtime::Span<EValue*> stack) {
  if (stack.size() < kArgs + 1) {
    ET_LOG(Error, "llmq::quantized_moe_ffn.out: %zu arguments, expected at least %d", stack.size(), kArgs + 1);
    ctx.fail(Error::InvalidArgument);
    return;
  }
  Tensor& out = stack[kArgs]->toTensor();
  try {
    run(stack.data(), out);
  } catch (const BadArgument& bad) {
    ET_LOG(Error, "%s", bad.message.c_str());
    ctx.fail(Error::InvalidArgument);
    return;
  } catch (const std::exception& err) {  // moe_ffn's own std::invalid_argument
    ET_LOG(Error, "quantized_moe_ffn: %s", err.what());
    ctx.fail(Error::InvalidArgument);
    return;
  }
  if (stack.size() > kArgs + 1) *stack[kArgs + 1] = EValue(out);
}

const executorch::runtime::Kernel kKernels[] = {
    executorch::runtime::Kernel("llmq::quantized_moe_ffn.out", quantized_moe_ffn_out),
};

// Registered when the library is loaded; a second load of the same library registers nothing new.
const bool kRegistered = [] {
  const Error err = executorch::runtime::register_kernels({kKernels, 1});
  if (err != Error::Ok) ET_LOG(Error, "llmq::quantized_moe_ffn.out: register_kernels failed (error %d)", int(err));
  return err == Error::Ok;
}();

}  // namespace
}  // namespace llmq_moe
