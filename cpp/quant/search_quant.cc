#include "search_quant.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define LLMQ_SEARCH_X86 1
#endif

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

namespace llmq_quant {
namespace {

constexpr int kMaxCands = 3 * kSearchFactors;
constexpr int kLanes = 8;         // groups per AVX2 batch
constexpr int64_t kRowBlock = 16;  // rows searched before their codes are written (search_quantize)

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

float factor(int i) { return 1.0f - static_cast<float>(i) / 64.0f; }

// The reference's error of one group for scale s and zero z (symmetric: z is the offset
// 2^(b-1) and codes are clamped signed first): float64, summed in element order, each term
// (fl32(s*(q - z)) - w)^2, times a_j when weighted.
double group_error(const float* x, const float* a, int64_t n, float s, float z, int bits, bool symmetric) {
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
    double t = d * d;
    if (a) t = t * static_cast<double>(a[j]);
    err += t;
  }
  return err;
}

// The candidates (scale, zero) of one group in search order (search.candidates); returns
// how many (kSearchFactors symmetric, 3x that asymmetric), or -1 if a scale is not finite
// (an asymmetric range that overflows float32).
int group_candidates(const float* x, int64_t n, int bits, bool symmetric, float* cs, float* cz) {
  float xmin = x[0], xmax = x[0];
  for (int64_t j = 1; j < n; ++j) {
    xmin = std::min(xmin, x[j]);
    xmax = std::max(xmax, x[j]);
  }
  const float eps = FLT_MIN;
  const float min_neg = std::min(xmin, 0.0f);
  const float max_pos = std::max(xmax, 0.0f);
  if (symmetric) {
    const int qmin = -(1 << (bits - 1)), qmax = (1 << (bits - 1)) - 1;
    const float base = std::max(std::max(-min_neg, max_pos) / (static_cast<float>(qmax - qmin) / 2.0f), eps);
    for (int i = 0; i < kSearchFactors; ++i) {
      cs[i] = std::max(base * factor(i), eps);
      cz[i] = static_cast<float>(1 << (bits - 1));
    }
    return kSearchFactors;
  }
  const float qmax = static_cast<float>((1 << bits) - 1);
  const float base = std::max((max_pos - min_neg) / qmax, eps);
  const float centre = (min_neg + max_pos) * 0.5f;
  for (int i = 0; i < kSearchFactors; ++i) {
    const float s = round_mantissa(std::max(base * factor(i), eps), 24 - bits);
    if (!std::isfinite(s)) return -1;
    cs[3 * i] = cs[3 * i + 1] = cs[3 * i + 2] = s;
    cz[3 * i] = clampf(0.0f - std::nearbyint(min_neg / s), 0.0f, qmax);
    cz[3 * i + 1] = clampf(qmax - std::nearbyint(max_pos / s), 0.0f, qmax);
    cz[3 * i + 2] = clampf(std::nearbyint(qmax / 2.0f - centre / s), 0.0f, qmax);
  }
  return 3 * kSearchFactors;
}

// Portable path: every candidate exactly; the first smallest error wins.
bool search_group_exact(const float* x, const float* a, int64_t n, int bits, bool symmetric, float* scale_out,
                        float* zero_out) {
  float cs[kMaxCands], cz[kMaxCands];
  const int nc = group_candidates(x, n, bits, symmetric, cs, cz);
  if (nc < 0) return false;
  double best = 0.0;
  int bi = 0;
  for (int c = 0; c < nc; ++c) {
    const double e = group_error(x, a, n, cs[c], cz[c], bits, symmetric);
    if (c == 0 || e < best) {
      best = e;
      bi = c;
    }
  }
  *scale_out = cs[bi];
  if (zero_out) *zero_out = cz[bi];
  return true;
}

// Per-thread buffers of the vector path: one batch of 8 groups, lane l = group g0 + l.
struct Batch {
  std::vector<float> xt, at;  // [n][8]: element j of each group (importance likewise)
  alignas(32) float s[kMaxCands][kLanes];
  alignas(32) float z[kMaxCands][kLanes];
  alignas(32) float lo[kMaxCands][kLanes];  // clamp window of q - z: [-z, qmax - z]
  alignas(32) float hi[kMaxCands][kLanes];
  alignas(32) float los[kMaxCands][kLanes];  // fl32(lo * s), fl32(hi * s)
  alignas(32) float his[kMaxCands][kLanes];
  alignas(32) float inv[kSearchFactors][kLanes];
  alignas(32) float approx[kMaxCands][kLanes];
  alignas(32) float amax_imp[kLanes];  // largest / smallest importance per group (1 unweighted)
  alignas(32) float amin_imp[kLanes];
  alignas(32) float gmin[kLanes];  // each group's smallest / largest element
  alignas(32) float gmax[kLanes];
  alignas(32) float min_neg[kLanes];  // min(gmin, 0), max(gmax, 0), (min_neg + max_pos) / 2
  alignas(32) float max_pos[kLanes];
  alignas(32) float centre[kLanes];
  int count[kLanes];                   // surviving candidates per lane
  uint8_t lists[kLanes][kMaxCands];    // their indices, in candidate order
};

#if LLMQ_SEARCH_X86
#define LLMQ_AVX2_FMA __attribute__((target("avx2,fma")))

LLMQ_AVX2_FMA inline __m256 round_even(__m256 v) {
  return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// dst[j][l] = src[l * n + j] for lanes l < lanes (groups of n contiguous floats), 0 for the
// others; 8x8 register transposes when n % 8 == 0 and all 8 lanes are real.
LLMQ_AVX2_FMA void transpose_groups(const float* src, int64_t n, int lanes, float* dst) {
  if (lanes == kLanes && n % 8 == 0) {
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      __m256 r[8];
      for (int l = 0; l < 8; ++l) r[l] = _mm256_loadu_ps(src + l * n + j0);
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* d = dst + j0 * kLanes;
      _mm256_storeu_ps(d + 0 * 8, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(d + 1 * 8, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(d + 2 * 8, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(d + 3 * 8, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(d + 4 * 8, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(d + 5 * 8, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(d + 6 * 8, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(d + 7 * 8, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
    return;
  }
  for (int l = 0; l < kLanes; ++l)
    for (int64_t j = 0; j < n; ++j) dst[j * kLanes + l] = l < lanes ? src[l * n + j] : 0.0f;
}

// Lane-wise minimum and maximum over the n rows of a transposed batch (kLanes floats a row)
// into 32-byte aligned mn / mx.
LLMQ_AVX2_FMA void lane_min_max(const float* t, int64_t n, float* mn, float* mx) {
  __m256 vmn = _mm256_loadu_ps(t), vmx = vmn;
  for (int64_t j = 1; j < n; ++j) {
    const __m256 x = _mm256_loadu_ps(t + j * kLanes);
    vmn = _mm256_min_ps(vmn, x);
    vmx = _mm256_max_ps(vmx, x);
  }
  _mm256_store_ps(mn, vmn);
  _mm256_store_ps(mx, vmx);
}

// Candidates of the 8 groups, lane-wise exactly group_candidates' float32 operations.
// False if an asymmetric scale is not finite.
LLMQ_AVX2_FMA bool batch_candidates(int64_t n, int bits, bool symmetric, Batch* b) {
  lane_min_max(b->xt.data(), n, b->gmin, b->gmax);
  const __m256 vmn = _mm256_load_ps(b->gmin), vmx = _mm256_load_ps(b->gmax);
  const __m256 zero = _mm256_setzero_ps(), eps = _mm256_set1_ps(FLT_MIN);
  const __m256 min_neg = _mm256_min_ps(vmn, zero), max_pos = _mm256_max_ps(vmx, zero);
  _mm256_store_ps(b->min_neg, min_neg);
  _mm256_store_ps(b->max_pos, max_pos);
  if (symmetric) {
    const __m256 amax = _mm256_max_ps(_mm256_sub_ps(zero, min_neg), max_pos);
    const __m256 base = _mm256_max_ps(_mm256_div_ps(amax, _mm256_set1_ps(static_cast<float>((1 << bits) - 1) / 2.0f)),
                                      eps);
    for (int i = 0; i < kSearchFactors; ++i)
      _mm256_store_ps(b->s[i], _mm256_max_ps(_mm256_mul_ps(base, _mm256_set1_ps(factor(i))), eps));
    return true;
  }
  const __m256 qmax = _mm256_set1_ps(static_cast<float>((1 << bits) - 1));
  const __m256 base = _mm256_max_ps(_mm256_div_ps(_mm256_sub_ps(max_pos, min_neg), qmax), eps);
  _mm256_store_ps(b->centre, _mm256_mul_ps(_mm256_add_ps(min_neg, max_pos), _mm256_set1_ps(0.5f)));
  const __m256i keep = _mm256_set1_epi32(~((1 << bits) - 1)), half = _mm256_set1_epi32((1 << (bits - 1)) - 1);
  const __m256i one_i = _mm256_set1_epi32(1), expo = _mm256_set1_epi32(0x7f800000);
  __m256i bad = _mm256_setzero_si256();
  for (int i = 0; i < kSearchFactors; ++i) {
    __m256i u = _mm256_castps_si256(_mm256_max_ps(_mm256_mul_ps(base, _mm256_set1_ps(factor(i))), eps));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, bits), one_i);
    u = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, half), lsb), keep);
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(u, expo), expo));
    for (int t = 0; t < 3; ++t) _mm256_store_ps(b->s[3 * i + t], _mm256_castsi256_ps(u));
  }
  return _mm256_testz_si256(bad, bad);
}

// The rest of scale i's candidates (1/s, zeros, clamp windows), computed only for the scales
// batch_approx visits.
LLMQ_AVX2_FMA void scale_params(int i, int bits, bool symmetric, Batch* b) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  if (symmetric) {
    const float off = static_cast<float>(1 << (bits - 1));
    const __m256 s = _mm256_load_ps(b->s[i]);
    _mm256_store_ps(b->inv[i], _mm256_div_ps(one, s));
    _mm256_store_ps(b->z[i], _mm256_set1_ps(off));
    _mm256_store_ps(b->lo[i], _mm256_set1_ps(-off));
    _mm256_store_ps(b->hi[i], _mm256_set1_ps(off - 1.0f));
    _mm256_store_ps(b->los[i], _mm256_mul_ps(_mm256_set1_ps(-off), s));
    _mm256_store_ps(b->his[i], _mm256_mul_ps(_mm256_set1_ps(off - 1.0f), s));
    return;
  }
  const float qmaxf = static_cast<float>((1 << bits) - 1);
  const __m256 qmax = _mm256_set1_ps(qmaxf);
  const __m256 s = _mm256_load_ps(b->s[3 * i]);
  const __m256 zs[3] = {
      _mm256_sub_ps(zero, round_even(_mm256_div_ps(_mm256_load_ps(b->min_neg), s))),
      _mm256_sub_ps(qmax, round_even(_mm256_div_ps(_mm256_load_ps(b->max_pos), s))),
      round_even(_mm256_sub_ps(_mm256_set1_ps(qmaxf / 2.0f), _mm256_div_ps(_mm256_load_ps(b->centre), s))),
  };
  _mm256_store_ps(b->inv[i], _mm256_div_ps(one, s));
  for (int t = 0; t < 3; ++t) {
    const __m256 z = _mm256_min_ps(_mm256_max_ps(zs[t], zero), qmax);
    _mm256_store_ps(b->z[3 * i + t], z);
    _mm256_store_ps(b->lo[3 * i + t], _mm256_sub_ps(zero, z));
    _mm256_store_ps(b->hi[3 * i + t], _mm256_sub_ps(qmax, z));
    _mm256_store_ps(b->los[3 * i + t], _mm256_mul_ps(_mm256_sub_ps(zero, z), s));
    _mm256_store_ps(b->his[3 * i + t], _mm256_mul_ps(_mm256_sub_ps(qmax, z), s));
  }
}

// approx[c] = float32 sum over j of (fl32(s*clamp(round(x*inv), lo, hi)) - x)^2 [* a], for
// kP scales at a time, each with kZ windows (symmetric 1, asymmetric 3): candidate
// c = kZ*i + t. Order of summation is free here (only bounded, see search_quant.h).
//
// Scales are visited in order (decreasing), and once a scale provably loses in every lane, it
// and all smaller ones are skipped (approx = FLT_MAX, i.e. never surviving): every code of a
// candidate with scale s lies in a window of width <= (2^b - 1)*s*(1 + 2^-23), so the group's
// largest and smallest elements alone contribute at least a_min * (max - min - width)^2 / 2,
// which grows as s shrinks (symmetric: the window is fixed, [-2^(b-1) s, (2^(b-1) - 1) s], so
// a_min * ((max - top)_+^2 + (bottom - min)_+^2)). A scale is skipped when that lower bound
// exceeds the upper bound (A + sig)(1 + rho) of a candidate already estimated.
// Returns how many candidates were estimated (the rest cannot be the reference's choice).
template <int kP, int kZ, bool kWeighted>
LLMQ_AVX2_FMA int batch_approx(int64_t n, int bits, int real_lanes, Batch* b) {
  const float* xt = b->xt.data();
  const float* at = b->at.data();
  const double rho = std::ldexp(static_cast<double>(n + 8), -22);
  const double sig = std::ldexp(static_cast<double>(n + 2), -147);
  const __m256d rho_up = _mm256_set1_pd(1.0 + rho), one = _mm256_set1_pd(1.0), zero = _mm256_setzero_pd();
  const __m256 amax_imp = _mm256_load_ps(b->amax_imp), amin_imp = _mm256_load_ps(b->amin_imp);
  const __m256 gmin = _mm256_load_ps(b->gmin), gmax = _mm256_load_ps(b->gmax);
  const __m256d sig_lo = _mm256_mul_pd(_mm256_set1_pd(sig),
                                       _mm256_add_pd(one, _mm256_cvtps_pd(_mm256_castps256_ps128(amax_imp))));
  const __m256d sig_hi = _mm256_mul_pd(_mm256_set1_pd(sig),
                                       _mm256_add_pd(one, _mm256_cvtps_pd(_mm256_extractf128_ps(amax_imp, 1))));
  const __m256d half_a = _mm256_set1_pd(0.5 * (1.0 - std::ldexp(1.0, -30)));
  const __m256d ah_lo = _mm256_mul_pd(half_a, _mm256_cvtps_pd(_mm256_castps256_ps128(amin_imp)));
  const __m256d ah_hi = _mm256_mul_pd(half_a, _mm256_cvtps_pd(_mm256_extractf128_ps(amin_imp, 1)));
  const __m256d d_lo = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(gmax)),
                                     _mm256_cvtps_pd(_mm256_castps256_ps128(gmin)));
  const __m256d d_hi = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(gmax, 1)),
                                     _mm256_cvtps_pd(_mm256_extractf128_ps(gmin, 1)));
  const double grow = 1.0 + std::ldexp(1.0, -22);
  const __m256d wq = _mm256_set1_pd(static_cast<double>((1 << bits) - 1) * grow);
  const __m256d top = _mm256_set1_pd(static_cast<double>((1 << (bits - 1)) - 1) * grow);
  const __m256d bottom = _mm256_set1_pd(-static_cast<double>(1 << (bits - 1)) * grow);
  const __m256d mx_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(gmax)),
                mx_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(gmax, 1));
  const __m256d mn_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(gmin)),
                mn_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(gmin, 1));
  const int pad = (0xff << real_lanes) & 0xff;  // padding lanes never block a skip
  __m256d ub_lo = _mm256_set1_pd(std::numeric_limits<double>::infinity()), ub_hi = ub_lo;
  for (int i0 = 0; i0 < kSearchFactors; i0 += kP) {
    if (i0 > 0) {
      const __m256 sv = _mm256_load_ps(b->s[kZ * i0]);
      const __m256d s_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(sv)),
                    s_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(sv, 1));
      __m256d lb_lo, lb_hi;
      if (kZ == 1) {  // symmetric: fixed window
        const __m256d t_lo = _mm256_max_pd(_mm256_sub_pd(mx_lo, _mm256_mul_pd(s_lo, top)), zero);
        const __m256d t_hi = _mm256_max_pd(_mm256_sub_pd(mx_hi, _mm256_mul_pd(s_hi, top)), zero);
        const __m256d u_lo = _mm256_max_pd(_mm256_sub_pd(_mm256_mul_pd(s_lo, bottom), mn_lo), zero);
        const __m256d u_hi = _mm256_max_pd(_mm256_sub_pd(_mm256_mul_pd(s_hi, bottom), mn_hi), zero);
        // twice the bound: ah_* holds a_min / 2
        lb_lo = _mm256_mul_pd(_mm256_add_pd(_mm256_mul_pd(t_lo, t_lo), _mm256_mul_pd(u_lo, u_lo)),
                              _mm256_add_pd(ah_lo, ah_lo));
        lb_hi = _mm256_mul_pd(_mm256_add_pd(_mm256_mul_pd(t_hi, t_hi), _mm256_mul_pd(u_hi, u_hi)),
                              _mm256_add_pd(ah_hi, ah_hi));
      } else {
        const __m256d p_lo = _mm256_max_pd(_mm256_sub_pd(d_lo, _mm256_mul_pd(s_lo, wq)), zero);
        const __m256d p_hi = _mm256_max_pd(_mm256_sub_pd(d_hi, _mm256_mul_pd(s_hi, wq)), zero);
        lb_lo = _mm256_mul_pd(_mm256_mul_pd(p_lo, p_lo), ah_lo);
        lb_hi = _mm256_mul_pd(_mm256_mul_pd(p_hi, p_hi), ah_hi);
      }
      const int lost = _mm256_movemask_pd(_mm256_cmp_pd(lb_lo, ub_lo, _CMP_GT_OQ)) |
                       (_mm256_movemask_pd(_mm256_cmp_pd(lb_hi, ub_hi, _CMP_GT_OQ)) << 4);
      if ((lost | pad) == 0xff) return kZ * i0;
    }
    for (int p = 0; p < kP; ++p) scale_params(i0 + p, bits, kZ == 1, b);
    __m256 acc[kP * kZ];
    for (int c = 0; c < kP * kZ; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 x = _mm256_loadu_ps(xt + j * kLanes);
      __m256 a = _mm256_setzero_ps();
      if (kWeighted) a = _mm256_loadu_ps(at + j * kLanes);
      for (int p = 0; p < kP; ++p) {
        const int i = i0 + p;
        const __m256 rs = _mm256_mul_ps(round_even(_mm256_mul_ps(x, _mm256_load_ps(b->inv[i]))),
                                        _mm256_load_ps(b->s[kZ * i]));
        for (int t = 0; t < kZ; ++t) {
          const int c = kZ * i + t;
          // fl(clamp(r, lo, hi) * s) = clamp(fl(r * s), fl(lo * s), fl(hi * s)): rounding is monotone
          const __m256 e = _mm256_sub_ps(
              _mm256_min_ps(_mm256_max_ps(rs, _mm256_load_ps(b->los[c])), _mm256_load_ps(b->his[c])), x);
          if (kWeighted) acc[kZ * p + t] = _mm256_fmadd_ps(_mm256_mul_ps(e, e), a, acc[kZ * p + t]);
          else acc[kZ * p + t] = _mm256_fmadd_ps(e, e, acc[kZ * p + t]);
        }
      }
    }
    for (int c = 0; c < kP * kZ; ++c) {
      _mm256_store_ps(b->approx[kZ * i0 + c], acc[c]);
      const __m256d u_lo = _mm256_mul_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(acc[c])), sig_lo),
                                         rho_up);
      const __m256d u_hi = _mm256_mul_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(acc[c], 1)), sig_hi),
                                         rho_up);
      ub_lo = _mm256_min_pd(ub_lo, u_lo);  // a NaN estimate makes ub NaN: that lane never skips
      ub_hi = _mm256_min_pd(ub_hi, u_hi);
    }
  }
  return kZ * kSearchFactors;
}

bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// For each lane, the candidates whose error bound does not rule them out (see
// search_quant.h), in candidate order: lists[l][0 .. count[l]). With A the float32 estimate,
// the reference's error E satisfies (A - sig)(1 - rho) <= E <= (A + sig)(1 + rho), so a
// candidate whose lower bound exceeds the smallest upper bound U cannot be (first) smallest:
// it survives iff A <= U / (1 - rho) + sig, compared in float32 against that threshold
// rounded up. A lane with a non-finite estimate keeps every candidate.
LLMQ_AVX2_FMA void batch_survivors(int64_t n, int nc, bool symmetric, Batch* b) {
  const double rho = std::ldexp(static_cast<double>(n + 8), -22);
  const double sig = std::ldexp(static_cast<double>(n + 2), -147);
  __m256 amin = _mm256_set1_ps(INFINITY);
  __m256i special = _mm256_setzero_si256();  // A - A is +0 for finite A
  for (int c = 0; c < nc; ++c) {
    const __m256 A = _mm256_load_ps(b->approx[c]);
    special = _mm256_or_si256(special, _mm256_castps_si256(_mm256_sub_ps(A, A)));
    amin = _mm256_min_ps(amin, A);
  }
  const int all = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(special, _mm256_setzero_si256()))) ^ 0xff;
  alignas(32) float lo[kLanes], thr[kLanes];
  _mm256_store_ps(lo, amin);
  for (int l = 0; l < kLanes; ++l) {
    const double sl = sig * (1.0 + static_cast<double>(b->amax_imp[l]));
    const double t = ((static_cast<double>(lo[l]) + sl) * (1.0 + rho)) / (1.0 - rho) + sl;
    thr[l] = std::nextafter(static_cast<float>(std::min(t, 3.0e38)), INFINITY);
  }
  const __m256 vthr = _mm256_load_ps(thr);
  for (int l = 0; l < kLanes; ++l) b->count[l] = 0;
  for (int c = 0; c < nc; ++c) {
    int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_load_ps(b->approx[c]), vthr, _CMP_LE_OQ)) | all;
    // a zero equal to an earlier one of the same scale is the same candidate: it cannot win
    const __m256 z = _mm256_load_ps(b->z[c]);
    if (!symmetric && c % 3 >= 1) m &= ~_mm256_movemask_ps(_mm256_cmp_ps(z, _mm256_load_ps(b->z[c - 1]), _CMP_EQ_OQ));
    if (!symmetric && c % 3 == 2) m &= ~_mm256_movemask_ps(_mm256_cmp_ps(z, _mm256_load_ps(b->z[c - 2]), _CMP_EQ_OQ));
    while (m) {
      const int l = __builtin_ctz(m);
      m &= m - 1;
      b->lists[l][b->count[l]++] = static_cast<uint8_t>(c);
    }
  }
}

// The reference's exact error (group_error) of one candidate per lane, all 8 lanes at once:
// float32 codes, float64 terms, each lane's sum in element order.
template <bool kWeighted>
LLMQ_AVX2_FMA void batch_exact(int64_t n, const float* s, const float* inv, const float* lo, const float* hi, Batch* b,
                               double* err) {
  const __m256 vs = _mm256_load_ps(s), vinv = _mm256_load_ps(inv), vlo = _mm256_load_ps(lo), vhi = _mm256_load_ps(hi);
  __m256d e_lo = _mm256_setzero_pd(), e_hi = _mm256_setzero_pd();
  const float* xt = b->xt.data();
  const float* at = b->at.data();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 x = _mm256_loadu_ps(xt + j * kLanes);
    const __m256 q = _mm256_min_ps(_mm256_max_ps(round_even(_mm256_mul_ps(x, vinv)), vlo), vhi);
    const __m256 recon = _mm256_mul_ps(q, vs);  // = fl32((q - z) * s): the product is exact in float64
    const __m256d d_lo = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(recon)),
                                       _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    const __m256d d_hi = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(recon, 1)),
                                       _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
    __m256d t_lo = _mm256_mul_pd(d_lo, d_lo), t_hi = _mm256_mul_pd(d_hi, d_hi);
    if (kWeighted) {
      const __m256 a = _mm256_loadu_ps(at + j * kLanes);
      t_lo = _mm256_mul_pd(t_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
      t_hi = _mm256_mul_pd(t_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
    }
    e_lo = _mm256_add_pd(e_lo, t_lo);
    e_hi = _mm256_add_pd(e_hi, t_hi);
  }
  _mm256_storeu_pd(err, e_lo);
  _mm256_storeu_pd(err + 4, e_hi);
}

// Groups [g0, g0 + lanes) of row x (lanes <= 8) through the vector path.
LLMQ_AVX2_FMA bool search_batch(const float* x, const float* imp, int64_t g0, int lanes, int64_t n, int bits,
                                bool symmetric, float* scale_out, float* zero_out, Batch* b) {
  b->xt.resize(n * kLanes);
  if (imp) b->at.resize(n * kLanes);
  transpose_groups(x + g0 * n, n, lanes, b->xt.data());
  if (imp) {
    transpose_groups(imp + g0 * n, n, lanes, b->at.data());
    lane_min_max(b->at.data(), n, b->amin_imp, b->amax_imp);  // importances are positive and finite
  } else {
    _mm256_store_ps(b->amax_imp, _mm256_set1_ps(1.0f));
    _mm256_store_ps(b->amin_imp, _mm256_set1_ps(1.0f));
  }
  if (!batch_candidates(n, bits, symmetric, b)) return false;
  int nc;
  if (symmetric) nc = imp ? batch_approx<4, 1, true>(n, bits, lanes, b) : batch_approx<4, 1, false>(n, bits, lanes, b);
  else nc = imp ? batch_approx<2, 3, true>(n, bits, lanes, b) : batch_approx<2, 3, false>(n, bits, lanes, b);
  batch_survivors(n, nc, symmetric, b);
  int rounds = 0;
  for (int l = 0; l < lanes; ++l) rounds = std::max(rounds, b->count[l]);
  double best[kLanes];
  int best_c[kLanes];
  alignas(32) float s[kLanes], inv[kLanes], lo[kLanes], hi[kLanes];
  alignas(32) double err[kLanes];
  for (int k = 0; k < rounds; ++k) {
    int cand[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      // a lane with fewer survivors repeats its last one (an equal error never replaces)
      const int c = l < lanes ? b->lists[l][std::min(k, b->count[l] - 1)] : 0;
      cand[l] = c;
      s[l] = b->s[c][l];
      inv[l] = b->inv[symmetric ? c : c / 3][l];
      lo[l] = b->lo[c][l];
      hi[l] = b->hi[c][l];
    }
    if (imp) batch_exact<true>(n, s, inv, lo, hi, b, err);
    else batch_exact<false>(n, s, inv, lo, hi, b, err);
    for (int l = 0; l < lanes; ++l)
      if (k == 0 || err[l] < best[l]) {
        best[l] = err[l];
        best_c[l] = cand[l];
      }
  }
  for (int l = 0; l < lanes; ++l) {
    scale_out[g0 + l] = b->s[best_c[l]][l];
    if (zero_out) zero_out[g0 + l] = b->z[best_c[l]][l];
  }
  return true;
}
#endif  // LLMQ_SEARCH_X86

// One row x[k]: scale_out / zero_out [k / n]. False on a non-finite asymmetric scale.
bool search_row(const float* x, const float* imp, int64_t k, int64_t n, int bits, bool symmetric, bool vec,
                float* scale_out, float* zero_out, Batch* b) {
  const int64_t groups = k / n;
#if LLMQ_SEARCH_X86
  if (vec) {
    for (int64_t g0 = 0; g0 < groups; g0 += kLanes) {
      const int lanes = static_cast<int>(std::min<int64_t>(kLanes, groups - g0));
      if (!search_batch(x, imp, g0, lanes, n, bits, symmetric, scale_out, zero_out, b)) return false;
    }
    return true;
  }
#else
  (void)vec;
#endif
  for (int64_t g = 0; g < groups; ++g)
    if (!search_group_exact(x + g * n, imp ? imp + g * n : nullptr, n, bits, symmetric, scale_out + g,
                            zero_out ? zero_out + g : nullptr))
      return false;
  return true;
}

bool use_vector_path(Isa isa) {
#if LLMQ_SEARCH_X86
  const Isa best = detect_isa();
  const Isa want = isa == Isa::kAuto ? best : isa;
  return want != Isa::kScalar && best != Isa::kScalar && cpu_has_avx2_fma();
#else
  (void)isa;
  return false;
#endif
}

}  // namespace

void search_qparams(const float* g, int64_t rows, int64_t k, int64_t group_size, int bits, bool symmetric, float* scale,
                    float* zero, int threads, const float* importance, Isa isa) {
  const int64_t groups = k / group_size;
  const bool vec = use_vector_path(isa);
  parallel_rows(rows, threads, [&](int64_t r0, int64_t r1) {
    Batch b;
    for (int64_t r = r0; r < r1; ++r)
      search_row(g + r * k, importance, k, group_size, bits, symmetric, vec, scale + r * groups,
                 symmetric ? nullptr : zero + r * groups, &b);
  });
}

Status search_quantize(const QuantizeArgs& a, const float* importance) {
  const std::string err = check_args(a);
  if (!err.empty()) throw std::invalid_argument(err);
  if (a.given_scale || a.given_zero) throw std::invalid_argument("search_quantize chooses the parameters itself");
  if (a.rows == 0) return Status::kOk;
  const int64_t k = a.k, groups = k / a.group_size, row_bytes = k * a.bits / 8;
  const size_t esize = a.input == InputType::kFloat32 ? 4 : 2;
  const bool vec = use_vector_path(a.isa);
  std::atomic<int> status{0};
  parallel_rows(a.rows, a.threads, [&](int64_t r0, int64_t r1) {
    Batch b;
    std::vector<float> xrow(k), zbuf(a.symmetric ? 0 : kRowBlock * groups);
    for (int64_t b0 = r0; b0 < r1; b0 += kRowBlock) {
      const int64_t b1 = std::min(r1, b0 + kRowBlock);
      for (int64_t r = b0; r < b1; ++r) {
        if (status.load(std::memory_order_relaxed) != 0) return;
        to_float32(static_cast<const char*>(a.w) + static_cast<size_t>(r) * k * esize, a.input, k, xrow.data());
        uint32_t special = 0;  // x - x is +0 for finite x, NaN otherwise
        for (int64_t j = 0; j < k; ++j) {
          const float d = xrow[j] - xrow[j];
          uint32_t u;
          std::memcpy(&u, &d, 4);
          special |= u;
        }
        if (special) {
          status.store(static_cast<int>(Status::kNotFinite));
          return;
        }
        if (!search_row(xrow.data(), importance, k, a.group_size, a.bits, a.symmetric, vec, a.scale + r * groups,
                        a.symmetric ? nullptr : zbuf.data() + (r - b0) * groups, &b)) {
          status.store(static_cast<int>(Status::kRangeOverflow));
          return;
        }
      }
      QuantizeArgs q = a;
      q.w = static_cast<const char*>(a.w) + static_cast<size_t>(b0) * k * esize;
      q.rows = b1 - b0;
      q.qdata = a.qdata + b0 * row_bytes;
      q.scale = a.scale + b0 * groups;
      q.bias = a.bias + b0 * groups;
      q.threads = 1;
      q.given_scale = q.scale;
      q.given_zero = a.symmetric ? nullptr : zbuf.data();
      quantize(q);
    }
  });
  return static_cast<Status>(status.load());
}

}  // namespace llmq_quant
