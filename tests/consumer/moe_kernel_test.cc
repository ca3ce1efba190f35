// @llmq//cpp/moe from another workspace: links the C++ kernel and runs it on a case whose
// answer is known in closed form.
#include <cmath>
#include <cstdio>
#include <vector>

#include "cpp/moe/moe_kernel.h"

int main() {
  // Layout checks are part of the public API.
  if (!llmq_moe::check_layout(16, 32, 4, 32).empty()) {
    std::fprintf(stderr, "check_layout rejected a valid 16x32 int4 g32 layout\n");
    return 1;
  }
  if (llmq_moe::check_layout(15, 32, 4, 32).empty()) {
    std::fprintf(stderr, "check_layout accepted 15 rows (must be a multiple of 16)\n");
    return 1;
  }
  // One expert, D = F = 32, INT8 group 32: every weight is q = 1 with scale 1/32 and bias 0
  // (w = 1/32), x = all ones. Activations quantize exactly (amax 1 -> q 127, scale 1/127),
  // so gate = up = sum_k x_k / 32 = 1, h = silu(1) * 1, out = F * h / 32.
  const int64_t D = 32, F2 = 32, gs = 32;
  const int bits = 8;
  std::vector<uint8_t> q13b(2 * F2 * D, 1), q2b(D * F2, 1);
  std::vector<float> scale13(2 * F2 * (D / gs), 1.0f / 32), bias13(2 * F2 * (D / gs), 0.0f);
  std::vector<float> scale2(D * (F2 / gs), 1.0f / 32), bias2(D * (F2 / gs), 0.0f);
  std::vector<uint8_t> t13(2 * F2 * D * bits / 8), t2(D * F2 * bits / 8);
  std::vector<float> sb13(2 * 2 * F2 * D / gs), sb2(2 * D * F2 / gs);
  llmq_moe::pack_matrix(q13b.data(), scale13.data(), bias13.data(), 2 * F2, D, bits, gs, t13.data(), sb13.data());
  llmq_moe::pack_matrix(q2b.data(), scale2.data(), bias2.data(), D, F2, bits, gs, t2.data(), sb2.data());

  std::vector<float> x(D, 1.0f), router(D, 0.1f), out(D, -1.0f);
  llmq_moe::MoEArgs a;
  a.x = x.data();
  a.tokens = 1;
  a.hidden = D;
  a.router = router.data();
  a.experts = 1;
  a.top_k = 1;
  a.w13 = llmq_moe::QMatrix::over(t13.data(), sb13.data(), false, 2 * F2, D, bits, gs);
  a.w2 = llmq_moe::QMatrix::over(t2.data(), sb2.data(), false, D, F2, bits, gs);
  llmq_moe::moe_ffn(a, out.data());

  const double h = 1.0 / (1.0 + std::exp(-1.0));  // silu(1) * 1
  const double want = F2 * h / 32.0;
  for (int64_t i = 0; i < D; ++i) {
    if (std::fabs(out[i] - want) > 1e-5 * want) {
      std::fprintf(stderr, "out[%ld] = %.8f, expected %.8f (isa %s)\n", static_cast<long>(i), out[i], want,
                   llmq_moe::isa_name(llmq_moe::detect_isa()));
      return 1;
    }
  }
  std::printf("moe_ffn on %s: out = %.6f as expected\n", llmq_moe::isa_name(llmq_moe::detect_isa()), out[0]);
  return 0;
}
