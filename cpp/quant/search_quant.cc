#include "search_quant.h"

#include "quant_kernel.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

namespace llmq_quant {
namespace {

// Round a positive normal float to `sig` significant bits, nearest-even, on its bit pattern
// (quantize.round_scale_mantissa).
float round_mantissa(float x, int sig) {
  const int drop = 24 - sig;
  if (drop <= 0) return x;
  int32_t b;
  std::memcpy(&b, &x, 4);
  const int32_t lsb = (b >> drop) & 1;
  b = (b + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1);
  std::memcpy(&x, &b, 4);
  return x;
}

float clampf(float x, float lo, float hi) { return std::min(std::max(x, lo), hi); }

// Squared error (float64, summed in element order) of one group for scale s and zero z
// (symmetric: z is the offset 2^(b-1) and codes are clamped signed first).
double group_error(const float* x, int64_t n, float s, float z, int bits, bool symmetric) {
  const float inv = 1.0f / s;
  const double s64 = s;
  const double z64 = z;
  const float qmax = static_cast<float>((1 << bits) - 1);
  const float off = static_cast<float>(1 << (bits - 1));
  double err = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const float r = std::nearbyint(x[j] * inv);
    const float q = symmetric ? clampf(r, -off, off - 1.0f) + off : clampf(r + z, 0.0f, qmax);
    const double recon = static_cast<double>(static_cast<float>((static_cast<double>(q) - z64) * s64));
    const double d = recon - static_cast<double>(x[j]);
    err += d * d;
  }
  return err;
}

void search_group(const float* x, int64_t n, int bits, bool symmetric, float* scale_out, float* zero_out) {
  float xmin = x[0], xmax = x[0];
  for (int64_t j = 1; j < n; ++j) {
    xmin = std::min(xmin, x[j]);
    xmax = std::max(xmax, x[j]);
  }
  const float eps = FLT_MIN;
  const float min_neg = std::min(xmin, 0.0f);
  const float max_pos = std::max(xmax, 0.0f);
  double best = 0.0;
  float best_s = 0.0f, best_z = 0.0f;
  bool first = true;
  auto consider = [&](float s, float z) {
    const double e = group_error(x, n, s, z, bits, symmetric);
    if (first || e < best) {
      best = e;
      best_s = s;
      best_z = z;
      first = false;
    }
  };
  if (symmetric) {
    const int qmin = -(1 << (bits - 1)), qmax = (1 << (bits - 1)) - 1;
    const float base = std::max(std::max(-min_neg, max_pos) / (static_cast<float>(qmax - qmin) / 2.0f), eps);
    const float off = static_cast<float>(1 << (bits - 1));
    for (int i = 0; i < kSearchFactors; ++i) {
      const float f = 1.0f - static_cast<float>(i) / 64.0f;
      consider(std::max(base * f, eps), off);
    }
  } else {
    const float qmax = static_cast<float>((1 << bits) - 1);
    const float base = std::max((max_pos - min_neg) / qmax, eps);
    const float centre = (min_neg + max_pos) * 0.5f;
    for (int i = 0; i < kSearchFactors; ++i) {
      const float f = 1.0f - static_cast<float>(i) / 64.0f;
      const float s = round_mantissa(std::max(base * f, eps), 24 - bits);
      consider(s, clampf(0.0f - std::nearbyint(min_neg / s), 0.0f, qmax));
      consider(s, clampf(qmax - std::nearbyint(max_pos / s), 0.0f, qmax));
      consider(s, clampf(std::nearbyint(qmax / 2.0f - centre / s), 0.0f, qmax));
    }
  }
  *scale_out = best_s;
  if (!symmetric) *zero_out = best_z;
}

}  // namespace

void search_qparams(const float* g, int64_t rows, int64_t k, int64_t group_size, int bits, bool symmetric,
                    float* scale, float* zero, int threads) {
  const int64_t groups = k / group_size;
  auto work = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t gi = 0; gi < groups; ++gi)
        search_group(g + r * k + gi * group_size, group_size, bits, symmetric, scale + r * groups + gi,
                     zero ? zero + r * groups + gi : nullptr);
  };
  parallel_rows(rows, threads, work);
}

}  // namespace llmq_quant
