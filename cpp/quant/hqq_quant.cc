#include "hqq_quant.h"

#include "cpp/common/bits.h"

#include "quant_kernel.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

namespace llmq_quant {
namespace {

constexpr double kLn2 = 0.6931471805599453;
constexpr double kSqrtHalf = 0.7071067811865476;
// hqq._LOG_COEFS: 1/19, 1/17, ..., 1/1 and hqq._EXP_COEFS: 1/13!, ..., 1/0!
constexpr double kLogCoefs[] = {1.0 / 19.0, 1.0 / 17.0, 1.0 / 15.0, 1.0 / 13.0, 1.0 / 11.0,
                                1.0 / 9.0,  1.0 / 7.0,  1.0 / 5.0,  1.0 / 3.0,  1.0 / 1.0};
constexpr double kExpCoefs[] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                                1.0 / 362880.0,     1.0 / 40320.0,     1.0 / 5040.0,     1.0 / 720.0,
                                1.0 / 120.0,        1.0 / 24.0,        1.0 / 6.0,        1.0 / 2.0,
                                1.0 / 1.0,          1.0 / 1.0};

#define HQQ_INLINE inline __attribute__((always_inline))

constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52: integer <-> double by bit patterns

HQQ_INLINE int64_t bits_of(double d) { return llmq_bits::double_to_bits(d); }

HQQ_INLINE double double_of(int64_t b) { return llmq_bits::bits_to_double(b); }

// hqq.pow_det for a positive normal double: a = m 2^k (m in [0.5, 1), what frexp returns),
// m moved to [sqrt(1/2), sqrt(2)), ln m by its atanh series, exp by its Taylor series around
// the nearest multiple of ln 2, then an exact power of two. Branch-free (integer <-> double
// conversions through the 1.5 * 2^52 bit trick, exact for these small integers) so that the
// compiler can vectorise the loop that calls it.
HQQ_INLINE double pow_det(double a, double e) {
  const int64_t b = bits_of(a);
  const int64_t k = ((b >> 52) & 0x7ff) - 1022;
  double m = double_of((b & 0x000fffffffffffffLL) | 0x3fe0000000000000LL);
  double kd = double_of(k + bits_of(kMagic)) - kMagic;
  const bool small = m < kSqrtHalf;
  m = small ? m * 2.0 : m;
  kd = small ? kd - 1.0 : kd;
  const double t = (m - 1.0) / (m + 1.0);
  const double t2 = t * t;
  double s = kLogCoefs[0];
  for (size_t i = 1; i < sizeof(kLogCoefs) / sizeof(kLogCoefs[0]); ++i) s = s * t2 + kLogCoefs[i];
  const double y = (2.0 * t * s + kd * kLn2) * e;
  const double nn = std::nearbyint(y / kLn2);
  const double r = y - nn * kLn2;
  double p = kExpCoefs[0];
  for (size_t i = 1; i < sizeof(kExpCoefs) / sizeof(kExpCoefs[0]); ++i) p = p * r + kExpCoefs[i];
  const int64_t n = bits_of(nn + kMagic) - bits_of(kMagic);
  return p * double_of((n + 1023) << 52);
}

// Codes and float32 residual of one group at zero z (vectorisable: no reduction).
HQQ_INLINE void evaluate(const float* w, int64_t n, float s, float inv, float z, float qmax, float* q, float* x) {
  for (int64_t j = 0; j < n; ++j) {
    const float c = std::min(std::max(std::nearbyint(w[j] * inv + z), 0.0f), qmax);
    q[j] = c;
    x[j] = w[j] - s * (c - z);
  }
}

// float64 sum of term(j), j < n, in hqq._sum64's order: 8 interleaved lanes, each in element
// order, combined pairwise; element order when n % 8 != 0.
template <typename F>
HQQ_INLINE double lane_sum(int64_t n, F term) {
  if (n % 8) {
    double s = term(0);
    for (int64_t j = 1; j < n; ++j) s += term(j);
    return s;
  }
  double acc[8];
  for (int l = 0; l < 8; ++l) acc[l] = term(l);
  for (int64_t i = 8; i < n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += term(i + l);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// sum x^2, or sum (x^2) a with per-element weights a (nullptr: unweighted).
HQQ_INLINE double sum_sq(const float* x, const float* a, int64_t n) {
  if (a == nullptr)
    return lane_sum(n, [x](int64_t j) {
      const double d = x[j];
      return d * d;
    });
  return lane_sum(n, [x, a](int64_t j) {
    const double d = x[j];
    return (d * d) * static_cast<double>(a[j]);
  });
}

// The zero update z = mean(q - (w - shrink(x)) * inv), shrink in float64 (hqq.shrink_lp).
// Elements with |x| < cutoff (= beta^(-1/(2-p)) * (1 - 1e-6)) shrink to exactly 0 (there
// |x| < |x|^(p-1)/beta by a relative margin far above pow_det's error): pow_det is skipped.
// Weighted (a != nullptr): sum(t a) / a_sum.
HQQ_INLINE float update_zero(const float* w, const float* q, const float* x, const float* a, double a_sum, int64_t n,
                             float inv, double beta, double cutoff, float* we) {
  bool any = false;
  for (int64_t j = 0; j < n; ++j) {
    we[j] = 0.0f;
    any |= std::fabs(static_cast<double>(x[j])) >= cutoff;
  }
  if (any) {  // every element, branch-free (vectorisable); tiny ones masked out
    const double e = kHqqP - 1.0;
    for (int64_t j = 0; j < n; ++j) {
      const double a = std::fabs(static_cast<double>(x[j]));
      const double v = a - pow_det(std::max(a, static_cast<double>(FLT_MIN)), e) / beta;
      const float f = std::copysign(static_cast<float>(v), x[j]);
      we[j] = (a >= FLT_MIN && v > 0) ? f : 0.0f;
    }
  }
  if (a != nullptr) {
    const double sum = lane_sum(
        n, [&](int64_t j) { return static_cast<double>(q[j] - (w[j] - we[j]) * inv) * static_cast<double>(a[j]); });
    return static_cast<float>(sum / a_sum);
  }
  const double sum = lane_sum(n, [&](int64_t j) { return static_cast<double>(q[j] - (w[j] - we[j]) * inv); });
  return static_cast<float>(sum / static_cast<double>(n));
}

// buf: 5 * n floats of scratch.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void hqq_group(const float* w, const float* a, int64_t n, int bits, const double* betas, const double* cutoffs,
               float* buf, float* scale_out, float* zero_out) {
  float *q = buf, *x = buf + n, *q2 = buf + 2 * n, *x2 = buf + 3 * n, *we = buf + 4 * n;
  const float qmax = static_cast<float>((1 << bits) - 1);
  float xmin = w[0], xmax = w[0];
  for (int64_t j = 1; j < n; ++j) {
    xmin = std::min(xmin, w[j]);
    xmax = std::max(xmax, w[j]);
  }
  const float min_neg = std::min(xmin, 0.0f);
  const float max_pos = std::max(xmax, 0.0f);
  const float s = std::max((max_pos - min_neg) / qmax, FLT_MIN);
  const float inv = 1.0f / s;
  float z = 0.0f - min_neg / s;
  const double a_sum = a == nullptr ? 0.0 : lane_sum(n, [a](int64_t j) { return static_cast<double>(a[j]); });
  evaluate(w, n, s, inv, z, qmax, q, x);
  double best = sum_sq(x, a, n);
  for (int it = 0; it < kHqqIters; ++it) {
    const float z_new = update_zero(w, q, x, a, a_sum, n, inv, betas[it], cutoffs[it], we);
    evaluate(w, n, s, inv, z_new, qmax, q2, x2);
    const double err = sum_sq(x2, a, n);
    if (!(err < best)) break;
    best = err;
    z = z_new;
    std::swap(q, q2);
    std::swap(x, x2);
  }
  *scale_out = s;
  *zero_out = z;
}

}  // namespace

double hqq_pow_det(double a, double e) { return pow_det(a, e); }

void hqq_qparams(const float* g, int64_t rows, int64_t k, int64_t group_size, int bits, float* scale, float* zero,
                 int threads, const float* importance) {
  const int64_t groups = k / group_size;
  // beta_it = BETA * KAPPA^it by repeated multiplication, as hqq_qparams_torch does
  double betas[kHqqIters], cutoffs[kHqqIters];
  double beta = kHqqBeta;
  for (int it = 0; it < kHqqIters; ++it) {
    betas[it] = beta;
    cutoffs[it] = std::pow(beta, -1.0 / (2.0 - kHqqP)) * (1.0 - 1e-6);
    beta *= kHqqKappa;
  }
  auto work = [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(5 * group_size);
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t gi = 0; gi < groups; ++gi)
        hqq_group(g + r * k + gi * group_size, importance ? importance + gi * group_size : nullptr, group_size, bits,
                  betas, cutoffs, buf.data(), scale + r * groups + gi, zero + r * groups + gi);
  };
  parallel_rows(rows, threads, work);
}

}  // namespace llmq_quant
