// Fused quantized MoE FFN: see moe_kernel.h for the layout and the numerical contract.
//
// Every ISA-specific function has a scalar twin that performs the same IEEE operations
// in the same order (fma where the vector code uses fma), so the paths agree bit for bit
// and the portable one doubles as the specification of the fast one.

#include "moe_kernel.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define LLMQ_X86 1
#define LLMQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define LLMQ_AVX2 __attribute__((target("avx2,fma")))
#else
#define LLMQ_X86 0
#endif

namespace llmq_moe {

// ---------------------------------------------------------------- ISA selection

Isa detect_isa() {
#if LLMQ_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
    return Isa::kAvx512Vnni;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAuto: return "auto";
    case Isa::kScalar: return "scalar";
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvx2: return "avx2";
  }
  return "?";
}

static Isa resolve(Isa isa) {
  static const Isa best = detect_isa();
  if (isa == Isa::kAuto) return best;
  if (isa == Isa::kAvx512Vnni && best != Isa::kAvx512Vnni)
    throw std::invalid_argument("this CPU lacks AVX-512 VNNI; use isa 'avx2', 'scalar' or 'auto'");
  if (isa == Isa::kAvx2 && best == Isa::kScalar)
    throw std::invalid_argument("this CPU lacks AVX2/FMA; use isa 'scalar' or 'auto'");
  return isa;
}

// ---------------------------------------------------------------- layout and packing

std::string check_layout(int64_t n, int64_t k, int64_t bits, int64_t group_size) {
  if (bits != 4 && bits != 8) return "bits must be 4 or 8, got " + std::to_string(bits);
  if (group_size <= 0 || group_size % 32)
    return "group_size must be a positive multiple of 32, got " + std::to_string(group_size);
  if (k <= 0 || k % group_size)
    return "group_size " + std::to_string(group_size) + " does not divide K=" + std::to_string(k);
  if (n <= 0 || n % 16) return "N must be a positive multiple of 16, got " + std::to_string(n);
  return "";
}

static std::string shape_str(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string check_packed_matrix(const ArgTensor& q, const ArgTensor& sb, const std::string& name, int64_t e, int64_t n,
                                int64_t k, int64_t bits, int64_t group_size) {
  const std::string layout = check_layout(n, k, bits, group_size);
  if (!layout.empty()) return name + " " + layout;
  const std::vector<int64_t> q_shape{e, n / 16, 16 * k * bits / 8};
  if (q.dtype != "torch.uint8" || q.shape != q_shape)
    return name + "_qdata must be torch.uint8 " + shape_str(q_shape) + ", got " + q.dtype + " " + shape_str(q.shape);
  const std::vector<int64_t> sb_shape{e, n / 16, 32 * (k / group_size)};
  if ((sb.dtype != "torch.float32" && sb.dtype != "torch.bfloat16") || sb.shape != sb_shape)
    return name + "_sb must be float32 or bfloat16 " + shape_str(sb_shape) + ", got " + sb.dtype + " " +
           shape_str(sb.shape);
  return "";
}

void pack_matrix(const uint8_t* q, const float* scale, const float* bias, int64_t n, int64_t k, int bits,
                 int group_size, uint8_t* out_q, float* out_sb) {
  std::string err = check_layout(n, k, bits, group_size);
  if (!err.empty()) throw std::invalid_argument(err);
  const int64_t groups = k / group_size;
  const int per_step = bits == 4 ? 8 : 4;
  const int64_t steps = group_size / per_step;
  const int64_t row_bytes = k * bits / 8;
  auto qat = [&](int64_t row, int64_t col) -> uint8_t {
    const uint8_t byte = q[row * row_bytes + (bits == 4 ? col / 2 : col)];
    return bits == 8 ? byte : ((col & 1) ? (byte >> 4) : (byte & 0x0F));
  };
  for (int64_t t = 0; t < n / 16; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t s = 0; s < steps; ++s) {
        uint8_t* dst = out_q + ((t * groups + g) * steps + s) * 64;
        const int64_t k0 = g * group_size + s * per_step;
        for (int r = 0; r < 16; ++r) {
          for (int j = 0; j < 4; ++j) {
            const int64_t row = t * 16 + r;
            dst[r * 4 + j] = bits == 8 ? qat(row, k0 + j)
                                       : static_cast<uint8_t>(qat(row, k0 + j) | (qat(row, k0 + 4 + j) << 4));
          }
        }
      }
      float* sb = out_sb + (t * groups + g) * 32;
      for (int r = 0; r < 16; ++r) {
        sb[r] = scale[(t * 16 + r) * groups + g];
        sb[16 + r] = bias[(t * 16 + r) * groups + g];
      }
    }
  }
}

// ---------------------------------------------------------------- exp / SwiGLU

namespace {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpLo = -87.0f, kExpHi = 88.0f;

inline float max_like_vec(float a, float b) { return a > b ? a : b; }  // == _mm512_max_ps(a, b)
inline float min_like_vec(float a, float b) { return a < b ? a : b; }  // == _mm512_min_ps(a, b)

// exp by range reduction and a degree-6 Taylor polynomial (~1 ulp on fp32).
// exp's polynomial on the reduced argument r, Horner order (highest degree first).
constexpr int kExpPolyTerms = 7;
constexpr float kExpPoly[kExpPolyTerms] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

inline float exp_scalar(float x) {
  x = min_like_vec(max_like_vec(x, kExpLo), kExpHi);
  float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kExpPoly[0];
  for (int i = 1; i < kExpPolyTerms; ++i) p = std::fma(p, r, kExpPoly[i]);
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

inline float swiglu_scalar(float g, float u) { return g / (1.0f + exp_scalar(-g)) * u; }

#if LLMQ_X86
LLMQ_AVX512 inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < kExpPolyTerms; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// h[i] = silu(g[i]) * u[i] for 16 lanes.
LLMQ_AVX512 inline void swiglu16_avx512(const float* g, const float* u, float* h) {
  __m512 gv = _mm512_loadu_ps(g);
  __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
  __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  _mm512_storeu_ps(h, _mm512_mul_ps(s, _mm512_loadu_ps(u)));
}

LLMQ_AVX2 inline __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < kExpPolyTerms; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

LLMQ_AVX2 inline void swiglu16_avx2(const float* g, const float* u, float* h) {
  for (int half = 0; half < 16; half += 8) {
    __m256 gv = _mm256_loadu_ps(g + half);
    __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(h + half, _mm256_mul_ps(s, _mm256_loadu_ps(u + half)));
  }
}
#endif

void swiglu16(const float* g, const float* u, float* h, Isa isa) {
#if LLMQ_X86
  if (isa == Isa::kAvx512Vnni) return swiglu16_avx512(g, u, h);
  if (isa == Isa::kAvx2) return swiglu16_avx2(g, u, h);
#endif
  (void)isa;
  for (int i = 0; i < 16; ++i) h[i] = swiglu_scalar(g[i], u[i]);
}

// ---------------------------------------------------------------- activation quantization

// Per-group quantization parameters from the group's absolute maximum. A group holding a
// NaN or an infinity gets scale NaN (so the token's output is NaN, not silently wrong); a
// group whose amax is below 1e-30 is treated as zero (127/amax would overflow).
struct GroupQ {
  float scale, inv;
  bool zero, poisoned;
};

inline GroupQ group_params(float amax, bool nonfinite) {
  if (nonfinite) return {std::numeric_limits<float>::quiet_NaN(), 0.f, true, true};
  if (!(amax >= 1e-30f)) return {0.f, 0.f, true, false};
  return {amax / 127.0f, 127.0f / amax, false, false};
}

void quantize_row_scalar(const float* x, int64_t k, int gs, int8_t* xq, float* ascale, float* asum) {
  for (int64_t g = 0; g < k / gs; ++g) {
    const float* xg = x + g * gs;
    float amax = 0.f;
    bool nonfinite = false;
    for (int i = 0; i < gs; ++i) {
      nonfinite |= !std::isfinite(xg[i]);
      amax = max_like_vec(amax, std::fabs(xg[i]));
    }
    GroupQ p = group_params(amax, nonfinite);
    int32_t sum = 0;
    for (int i = 0; i < gs; ++i) {
      int32_t v = 0;
      if (!p.zero) {
        float r = std::nearbyint(xg[i] * p.inv);
        v = static_cast<int32_t>(min_like_vec(max_like_vec(r, -127.f), 127.f));
      }
      xq[g * gs + i] = static_cast<int8_t>(v);
      sum += v;
    }
    ascale[g] = p.scale;
    asum[g] = static_cast<float>(sum);
  }
}

#if LLMQ_X86
LLMQ_AVX512 void quantize_row_avx512(const float* x, int64_t k, int gs, int8_t* xq, float* ascale, float* asum) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t g = 0; g < k / gs; ++g) {
    const float* xg = x + g * gs;
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int i = 0; i < gs; i += 16) {
      __m512 v = _mm512_andnot_ps(sign, _mm512_loadu_ps(xg + i));
      // |x| == inf or NaN  <=>  not (|x| <= FLT_MAX)
      bad |= _mm512_cmp_ps_mask(v, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ);
      vmax = _mm512_max_ps(vmax, v);
    }
    GroupQ p = group_params(_mm512_reduce_max_ps(vmax), bad != 0);
    __m512i vsum = _mm512_setzero_si512();
    const __m512 inv = _mm512_set1_ps(p.inv);
    for (int i = 0; i < gs; i += 16) {
      __m512i q = _mm512_setzero_si512();
      if (!p.zero) {
        __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xg + i), inv),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
        q = _mm512_cvtps_epi32(r);
      }
      vsum = _mm512_add_epi32(vsum, q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * gs + i), _mm512_cvtsepi32_epi8(q));
    }
    ascale[g] = p.scale;
    asum[g] = static_cast<float>(_mm512_reduce_add_epi32(vsum));
  }
}

LLMQ_AVX2 void quantize_row_avx2(const float* x, int64_t k, int gs, int8_t* xq, float* ascale, float* asum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < k / gs; ++g) {
    const float* xg = x + g * gs;
    __m256 vmax = _mm256_setzero_ps();
    int bad = 0;
    for (int i = 0; i < gs; i += 8) {
      __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + i));
      bad |= _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ));
      vmax = _mm256_max_ps(vmax, v);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float amax = 0.f;
    for (float l : lanes) amax = max_like_vec(amax, l);
    GroupQ p = group_params(amax, bad != 0);
    __m256i vsum = _mm256_setzero_si256();
    const __m256 inv = _mm256_set1_ps(p.inv);
    for (int i = 0; i < gs; i += 8) {
      __m256i q = _mm256_setzero_si256();
      if (!p.zero) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xg + i), inv),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
        q = _mm256_cvtps_epi32(r);
      }
      vsum = _mm256_add_epi32(vsum, q);
      alignas(32) int32_t qs[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(qs), q);
      for (int j = 0; j < 8; ++j) xq[g * gs + i + j] = static_cast<int8_t>(qs[j]);
    }
    alignas(32) int32_t sums[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), vsum);
    int32_t total = 0;
    for (int32_t v : sums) total += v;
    ascale[g] = p.scale;
    asum[g] = static_cast<float>(total);
  }
}
#endif

}  // namespace

void quantize_row(const float* x, int64_t k, int group_size, int8_t* xq, float* ascale, float* asum, Isa isa) {
  isa = resolve(isa);
#if LLMQ_X86
  if (isa == Isa::kAvx512Vnni) return quantize_row_avx512(x, k, group_size, xq, ascale, asum);
  if (isa == Isa::kAvx2) return quantize_row_avx2(x, k, group_size, xq, ascale, asum);
#endif
  quantize_row_scalar(x, k, group_size, xq, ascale, asum);
}

// ---------------------------------------------------------------- GEMM tile

namespace {

#ifndef LLMQ_MAXM
#define LLMQ_MAXM 6
#endif
// Tokens per register block (the tile kernel is instantiated for 1..kMaxM).
constexpr int kMaxM = LLMQ_MAXM;

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// count scale/bias values of w from element `at` on, as float32 (bfloat16 widened exactly).
inline void sb_load_scalar(const QMatrix& w, int64_t at, int count, float* out) {
  if (!w.sb16) {
    std::memcpy(out, w.sb + at, count * sizeof(float));
    return;
  }
  for (int i = 0; i < count; ++i) {
    const uint32_t bits = static_cast<uint32_t>(w.sb16[at + i]) << 16;
    std::memcpy(out + i, &bits, 4);
  }
}

// Scalar specification of the tile: int32 dot per group, then
//   acc = fma(float(dot), scale * a, fma(bias, a * asum, acc)).
void gemm_tile_scalar(const QMatrix& w, const int64_t* tiles, int nt, const int8_t* const* xq,
                      const float* const* ascale, const float* const* asum, int m, float* out) {
  const int64_t groups = w.groups();
  const int gs = w.group_size;
  const int per_step = w.bits == 4 ? 8 : 4;
  const int steps = gs / per_step;
  for (int t = 0; t < nt; ++t) {
    const uint8_t* wq = w.qdata + tiles[t] * w.tile_qbytes();
    const int64_t sb0 = tiles[t] * w.tile_sbfloats();
    for (int i = 0; i < m; ++i) {
      float acc[16] = {0};
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot[16] = {0};
        for (int s = 0; s < steps; ++s) {
          const uint8_t* blk = wq + (g * steps + s) * 64;
          const int8_t* xa = xq[i] + g * gs + s * per_step;
          for (int r = 0; r < 16; ++r) {
            for (int j = 0; j < 4; ++j) {
              const uint8_t b = blk[r * 4 + j];
              if (w.bits == 8) {
                dot[r] += static_cast<int32_t>(b) * xa[j];
              } else {
                dot[r] += static_cast<int32_t>(b & 0x0F) * xa[j];
                dot[r] += static_cast<int32_t>(b >> 4) * xa[4 + j];
              }
            }
          }
        }
        const float a = ascale[i][g];
        const float as = a * asum[i][g];
        float sc[32];
        sb_load_scalar(w, sb0 + g * 32, 32, sc);
        for (int r = 0; r < 16; ++r)
          acc[r] = std::fma(static_cast<float>(dot[r]), sc[r] * a, std::fma(sc[16 + r], as, acc[r]));
      }
      std::memcpy(out + i * nt * 16 + t * 16, acc, sizeof(acc));
    }
  }
}

#if LLMQ_X86
// Bytes ahead of the current position each weight stream is prefetched (decode reads the
// weights once, from DRAM; the hardware prefetcher alone leaves one thread latency-bound).
#ifndef LLMQ_PF
#define LLMQ_PF 2048
#endif
constexpr int kPrefetchBytes = LLMQ_PF;

// 16 scale/bias values of w from element `at` on, as float32 (bfloat16: zero-extend, shift).
LLMQ_AVX512 inline __m512 sb_load16_avx512(const QMatrix& w, int64_t at) {
  if (!w.sb16) return _mm512_loadu_ps(w.sb + at);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.sb16 + at));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Register block: NT tiles x M tokens of int32 dot products per group; the fp32
// accumulators live in `out` (L1) and are updated once per group, which keeps the inner
// loop within the 32 zmm registers. With M == 1 the low and high nibbles accumulate in
// separate registers so the dpbusd latency chain is halved.
template <int M, int NT, int BITS>
LLMQ_AVX512 void tile_avx512(const QMatrix& w, const int64_t* tiles, const int8_t* const* xq,
                             const float* const* ascale, const float* const* asum, float* out) {
  const int64_t groups = w.groups();
  const int gs = w.group_size;
  constexpr int kPerStep = BITS == 4 ? 8 : 4;
  constexpr bool kSplit = (M == 1 && BITS == 4);
  const int steps = gs / kPerStep;
  const uint8_t* wq[NT];
  int64_t sb0[NT];
  for (int t = 0; t < NT; ++t) {
    wq[t] = w.qdata + tiles[t] * w.tile_qbytes();
    sb0[t] = tiles[t] * w.tile_sbfloats();
  }
  const int8_t* xr[M];
  for (int i = 0; i < M; ++i) xr[i] = xq[i];
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < M; ++i)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + i * NT * 16 + t * 16, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[NT][M];
    __m512i dot2[NT];
    for (int t = 0; t < NT; ++t) {
      dot2[t] = _mm512_setzero_si512();
      for (int i = 0; i < M; ++i) dot[t][i] = _mm512_setzero_si512();
    }
    const uint8_t* wg[NT];
    for (int t = 0; t < NT; ++t) wg[t] = wq[t] + g * steps * 64;
    const int64_t kbase = g * gs;
    for (int s = 0; s < steps; ++s) {
      const int64_t k0 = kbase + s * kPerStep;
      for (int t = 0; t < NT; ++t) {
        _mm_prefetch(reinterpret_cast<const char*>(wg[t] + s * 64 + kPrefetchBytes), _MM_HINT_T0);
        const __m512i wv = _mm512_loadu_si512(wg[t] + s * 64);
        if (BITS == 4) {
          const __m512i lo = _mm512_and_si512(wv, low4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(wv, 4), low4);
          if (kSplit) {
            dot[t][0] = _mm512_dpbusd_epi32(dot[t][0], lo, _mm512_set1_epi32(load_i32(xr[0] + k0)));
            dot2[t] = _mm512_dpbusd_epi32(dot2[t], hi, _mm512_set1_epi32(load_i32(xr[0] + k0 + 4)));
          } else {
            for (int i = 0; i < M; ++i) {
              dot[t][i] = _mm512_dpbusd_epi32(dot[t][i], lo, _mm512_set1_epi32(load_i32(xr[i] + k0)));
              dot[t][i] = _mm512_dpbusd_epi32(dot[t][i], hi, _mm512_set1_epi32(load_i32(xr[i] + k0 + 4)));
            }
          }
        } else {
          for (int i = 0; i < M; ++i)
            dot[t][i] = _mm512_dpbusd_epi32(dot[t][i], wv, _mm512_set1_epi32(load_i32(xr[i] + k0)));
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      if (kSplit) dot[t][0] = _mm512_add_epi32(dot[t][0], dot2[t]);
      const __m512 sc = sb_load16_avx512(w, sb0[t] + g * 32);
      const __m512 bi = sb_load16_avx512(w, sb0[t] + g * 32 + 16);
      for (int i = 0; i < M; ++i) {
        const float a = ascale[i][g];
        const float as = a * asum[i][g];
        float* o = out + i * NT * 16 + t * 16;
        __m512 tmp = _mm512_fmadd_ps(bi, _mm512_set1_ps(as), _mm512_loadu_ps(o));
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][i]), _mm512_mul_ps(sc, _mm512_set1_ps(a)), tmp));
      }
    }
  }
}

template <int NT, int BITS>
void tile_dispatch_m(const QMatrix& w, const int64_t* tiles, const int8_t* const* xq, const float* const* ascale,
                     const float* const* asum, int m, float* out) {
  switch (m) {
    case 1: return tile_avx512<1, NT, BITS>(w, tiles, xq, ascale, asum, out);
    case 2: return tile_avx512<2, NT, BITS>(w, tiles, xq, ascale, asum, out);
    case 3: return tile_avx512<3, NT, BITS>(w, tiles, xq, ascale, asum, out);
    case 4: return tile_avx512<4, NT, BITS>(w, tiles, xq, ascale, asum, out);
#if LLMQ_MAXM > 4
    case 5: return tile_avx512<5, NT, BITS>(w, tiles, xq, ascale, asum, out);
    case 6: return tile_avx512<6, NT, BITS>(w, tiles, xq, ascale, asum, out);
#endif
#if LLMQ_MAXM > 6
    case 7: return tile_avx512<7, NT, BITS>(w, tiles, xq, ascale, asum, out);
    case 8: return tile_avx512<8, NT, BITS>(w, tiles, xq, ascale, asum, out);
#endif
  }
}

void gemm_tile_avx512(const QMatrix& w, const int64_t* tiles, int nt, const int8_t* const* xq,
                      const float* const* ascale, const float* const* asum, int m, float* out) {
  if (w.bits == 4) {
    if (nt == 2) return tile_dispatch_m<2, 4>(w, tiles, xq, ascale, asum, m, out);
    return tile_dispatch_m<1, 4>(w, tiles, xq, ascale, asum, m, out);
  }
  if (nt == 2) return tile_dispatch_m<2, 8>(w, tiles, xq, ascale, asum, m, out);
  return tile_dispatch_m<1, 8>(w, tiles, xq, ascale, asum, m, out);
}
#endif

#if LLMQ_X86
// AVX2 + FMA: the u8 x s8 dot of 4 bytes per 32-bit lane is maddubs (to s16 pairs) + madd
// (to s32). maddubs saturates at 2*255*127 > 32767, so INT8 weights are split into nibbles
// (dot = 16*dot(hi) + dot(lo)); INT4 products cannot saturate (2*15*127). Exact, like VNNI.
// One tile = two 8-row halves; tokens in register blocks of up to 2.
LLMQ_AVX2 inline __m256i dot4_avx2(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

// 8 scale/bias values of w from element `at` on, as float32 (bfloat16: zero-extend, shift).
LLMQ_AVX2 inline __m256 sb_load8_avx2(const QMatrix& w, int64_t at) {
  if (!w.sb16) return _mm256_loadu_ps(w.sb + at);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sb16 + at));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int M, int BITS>
LLMQ_AVX2 void tile_avx2(const QMatrix& w, int64_t tile, const int8_t* const* xq, const float* const* ascale,
                         const float* const* asum, float* out, int ldo) {
  const int64_t groups = w.groups();
  const int gs = w.group_size;
  constexpr int kPerStep = BITS == 4 ? 8 : 4;
  const int steps = gs / kPerStep;
  const uint8_t* wq = w.qdata + tile * w.tile_qbytes();
  const int64_t sb0 = tile * w.tile_sbfloats();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[M][2];
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i d0[M][2], d1[M][2];  // INT4: lo/hi nibble k's; INT8: lo/hi nibble of each weight
    for (int i = 0; i < M; ++i)
      for (int h = 0; h < 2; ++h) d0[i][h] = d1[i][h] = _mm256_setzero_si256();
    for (int s = 0; s < steps; ++s) {
      const int64_t k0 = g * gs + s * kPerStep;
      _mm_prefetch(reinterpret_cast<const char*>(wq + (g * steps + s) * 64 + kPrefetchBytes), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + (g * steps + s) * 64 + h * 32));
        const __m256i lo = _mm256_and_si256(wv, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low4);
        for (int i = 0; i < M; ++i) {
          const __m256i xa = _mm256_set1_epi32(load_i32(xq[i] + k0));
          if (BITS == 4) {
            d0[i][h] = dot4_avx2(d0[i][h], lo, xa);
            d1[i][h] = dot4_avx2(d1[i][h], hi, _mm256_set1_epi32(load_i32(xq[i] + k0 + 4)));
          } else {
            d0[i][h] = dot4_avx2(d0[i][h], lo, xa);
            d1[i][h] = dot4_avx2(d1[i][h], hi, xa);
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 sc = sb_load8_avx2(w, sb0 + g * 32 + h * 8);
      const __m256 bi = sb_load8_avx2(w, sb0 + g * 32 + 16 + h * 8);
      for (int i = 0; i < M; ++i) {
        const __m256i dot = BITS == 4 ? _mm256_add_epi32(d0[i][h], d1[i][h])
                                      : _mm256_add_epi32(d0[i][h], _mm256_slli_epi32(d1[i][h], 4));
        const float a = ascale[i][g];
        const float as = a * asum[i][g];
        __m256 tmp = _mm256_fmadd_ps(bi, _mm256_set1_ps(as), acc[i][h]);
        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sc, _mm256_set1_ps(a)), tmp);
      }
    }
  }
  for (int i = 0; i < M; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + i * ldo + h * 8, acc[i][h]);
}

void gemm_tile_avx2(const QMatrix& w, const int64_t* tiles, int nt, const int8_t* const* xq, const float* const* ascale,
                    const float* const* asum, int m, float* out) {
  const int ldo = nt * 16;
  for (int t = 0; t < nt; ++t)
    for (int i = 0; i < m; i += 2) {
      const int mm = m - i >= 2 ? 2 : 1;
      float* o = out + i * ldo + t * 16;
      if (w.bits == 4) {
        if (mm == 2) tile_avx2<2, 4>(w, tiles[t], xq + i, ascale + i, asum + i, o, ldo);
        else tile_avx2<1, 4>(w, tiles[t], xq + i, ascale + i, asum + i, o, ldo);
      } else {
        if (mm == 2) tile_avx2<2, 8>(w, tiles[t], xq + i, ascale + i, asum + i, o, ldo);
        else tile_avx2<1, 8>(w, tiles[t], xq + i, ascale + i, asum + i, o, ldo);
      }
    }
}
#endif

void gemm_tile_resolved(const QMatrix& w, const int64_t* tiles, int nt, const int8_t* const* xq,
                        const float* const* ascale, const float* const* asum, int m, float* out, Isa isa) {
#if LLMQ_X86
  if (isa == Isa::kAvx512Vnni) return gemm_tile_avx512(w, tiles, nt, xq, ascale, asum, m, out);
  if (isa == Isa::kAvx2) return gemm_tile_avx2(w, tiles, nt, xq, ascale, asum, m, out);
#endif
  gemm_tile_scalar(w, tiles, nt, xq, ascale, asum, m, out);
}

// Two adjacent tiles (gate and up, or a pair of w2 tiles) for m activation rows into
// out [m][32]. With little reuse per weight byte (m <= 2) the tiles are read one after the
// other: memory sees one sequential stream instead of two interleaved short ones.
void gemm_tile_pair(const QMatrix& w, const int64_t* tiles, const int8_t* const* xq, const float* const* ascale,
                    const float* const* asum, int m, float* out, Isa isa) {
  if (m > 2) return gemm_tile_resolved(w, tiles, 2, xq, ascale, asum, m, out, isa);
  alignas(64) float part[2 * 16];
  for (int t = 0; t < 2; ++t) {
    gemm_tile_resolved(w, tiles + t, 1, xq, ascale, asum, m, part, isa);
    for (int i = 0; i < m; ++i) std::memcpy(out + i * 32 + t * 16, part + i * 16, 16 * sizeof(float));
  }
}

}  // namespace

void gemm_tile(const QMatrix& w, const int64_t* tiles, int nt, const int8_t* const* xq, const float* const* ascale,
               const float* const* asum, int m, float* out, Isa isa) {
  if (nt < 1 || nt > 2 || m < 1 || m > kMaxM)
    throw std::invalid_argument("gemm_tile: nt must be 1..2 and m 1.." + std::to_string(kMaxM));
  std::string err = check_layout(w.n, w.k, w.bits, w.group_size);
  if (!err.empty()) throw std::invalid_argument(err);
  gemm_tile_resolved(w, tiles, nt, xq, ascale, asum, m, out, resolve(isa));
}

// ---------------------------------------------------------------- router

namespace {

// logits[t][e] for a block of up to 4 tokens x 4 weight rows; 16 lane-wise fma chains per
// pair, then the 16 lanes summed in order (so all paths agree exactly).
void router_block_scalar(const float* const* xs, int nx, const float* const* ws, int nw, int64_t d, float* out,
                         int64_t ldo) {
  for (int a = 0; a < nx; ++a)
    for (int b = 0; b < nw; ++b) {
      float lanes[16] = {0};
      for (int64_t k = 0; k < d; k += 16)
        for (int l = 0; l < 16; ++l) lanes[l] = std::fma(xs[a][k + l], ws[b][k + l], lanes[l]);
      float s = 0.f;
      for (int l = 0; l < 16; ++l) s += lanes[l];
      out[a * ldo + b] = s;
    }
}

#if LLMQ_X86
template <int NX, int NW>
LLMQ_AVX512 void router_block_avx512_t(const float* const* xs, const float* const* ws, int64_t d, float* out,
                                       int64_t ldo) {
  __m512 acc[NX][NW];
  for (int a = 0; a < NX; ++a)
    for (int b = 0; b < NW; ++b) acc[a][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < d; k += 16) {
    __m512 xv[NX], wv[NW];
    for (int a = 0; a < NX; ++a) xv[a] = _mm512_loadu_ps(xs[a] + k);
    for (int b = 0; b < NW; ++b) wv[b] = _mm512_loadu_ps(ws[b] + k);
    for (int a = 0; a < NX; ++a)
      for (int b = 0; b < NW; ++b) acc[a][b] = _mm512_fmadd_ps(xv[a], wv[b], acc[a][b]);
  }
  for (int a = 0; a < NX; ++a)
    for (int b = 0; b < NW; ++b) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc[a][b]);
      float s = 0.f;
      for (int l = 0; l < 16; ++l) s += lanes[l];
      out[a * ldo + b] = s;
    }
}

template <int NX>
void router_block_avx512_nw(const float* const* xs, const float* const* ws, int nw, int64_t d, float* out,
                            int64_t ldo) {
  switch (nw) {
    case 1: return router_block_avx512_t<NX, 1>(xs, ws, d, out, ldo);
    case 2: return router_block_avx512_t<NX, 2>(xs, ws, d, out, ldo);
    case 3: return router_block_avx512_t<NX, 3>(xs, ws, d, out, ldo);
    default: return router_block_avx512_t<NX, 4>(xs, ws, d, out, ldo);
  }
}

void router_block_avx512(const float* const* xs, int nx, const float* const* ws, int nw, int64_t d, float* out,
                         int64_t ldo) {
  switch (nx) {
    case 1: return router_block_avx512_nw<1>(xs, ws, nw, d, out, ldo);
    case 2: return router_block_avx512_nw<2>(xs, ws, nw, d, out, ldo);
    case 3: return router_block_avx512_nw<3>(xs, ws, nw, d, out, ldo);
    default: return router_block_avx512_nw<4>(xs, ws, nw, d, out, ldo);
  }
}

// AVX2: each 16-lane partial sum of the AVX-512 version is two 8-lane halves here, so
// the per-lane fma chains and the final in-order lane sum are the same.
template <int NX, int NW>
LLMQ_AVX2 void router_block_avx2_t(const float* const* xs, const float* const* ws, int64_t d, float* out, int64_t ldo) {
  __m256 acc[NX][NW][2];
  for (int a = 0; a < NX; ++a)
    for (int b = 0; b < NW; ++b) acc[a][b][0] = acc[a][b][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < d; k += 16)
    for (int h = 0; h < 2; ++h) {
      __m256 xv[NX], wv[NW];
      for (int a = 0; a < NX; ++a) xv[a] = _mm256_loadu_ps(xs[a] + k + 8 * h);
      for (int b = 0; b < NW; ++b) wv[b] = _mm256_loadu_ps(ws[b] + k + 8 * h);
      for (int a = 0; a < NX; ++a)
        for (int b = 0; b < NW; ++b) acc[a][b][h] = _mm256_fmadd_ps(xv[a], wv[b], acc[a][b][h]);
    }
  for (int a = 0; a < NX; ++a)
    for (int b = 0; b < NW; ++b) {
      alignas(32) float lanes[16];
      _mm256_store_ps(lanes, acc[a][b][0]);
      _mm256_store_ps(lanes + 8, acc[a][b][1]);
      float s = 0.f;
      for (int l = 0; l < 16; ++l) s += lanes[l];
      out[a * ldo + b] = s;
    }
}

void router_block_avx2(const float* const* xs, int nx, const float* const* ws, int nw, int64_t d, float* out,
                       int64_t ldo) {
  // 2 x 2 blocks keep the 8 accumulators in the 16 ymm registers
  for (int a = 0; a < nx; a += 2)
    for (int b = 0; b < nw; b += 2) {
      const int na = nx - a >= 2 ? 2 : 1, nb = nw - b >= 2 ? 2 : 1;
      float* o = out + a * ldo + b;
      if (na == 2 && nb == 2) router_block_avx2_t<2, 2>(xs + a, ws + b, d, o, ldo);
      else if (na == 2) router_block_avx2_t<2, 1>(xs + a, ws + b, d, o, ldo);
      else if (nb == 2) router_block_avx2_t<1, 2>(xs + a, ws + b, d, o, ldo);
      else router_block_avx2_t<1, 1>(xs + a, ws + b, d, o, ldo);
    }
}

LLMQ_AVX2 void axpy32_avx2(float w, const float* y, float* o) {
  const __m256 wv = _mm256_set1_ps(w);
  for (int c = 0; c < 32; c += 8)
    _mm256_storeu_ps(o + c, _mm256_fmadd_ps(wv, _mm256_loadu_ps(y + c), _mm256_loadu_ps(o + c)));
}

// o[c] = fma(w, y[c], o[c]) for 32 columns.
LLMQ_AVX512 void axpy32_avx512(float w, const float* y, float* o) {
  const __m512 wv = _mm512_set1_ps(w);
  _mm512_storeu_ps(o, _mm512_fmadd_ps(wv, _mm512_loadu_ps(y), _mm512_loadu_ps(o)));
  _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(wv, _mm512_loadu_ps(y + 16), _mm512_loadu_ps(o + 16)));
}
#endif

void axpy32(float w, const float* y, float* o, Isa isa) {
#if LLMQ_X86
  if (isa == Isa::kAvx512Vnni) return axpy32_avx512(w, y, o);
  if (isa == Isa::kAvx2) return axpy32_avx2(w, y, o);
#endif
  (void)isa;
  for (int c = 0; c < 32; ++c) o[c] = std::fma(w, y[c], o[c]);
}

void router_block(const float* const* xs, int nx, const float* const* ws, int nw, int64_t d, float* out, int64_t ldo,
                  Isa isa) {
#if LLMQ_X86
  if (isa == Isa::kAvx512Vnni) return router_block_avx512(xs, nx, ws, nw, d, out, ldo);
  if (isa == Isa::kAvx2) return router_block_avx2(xs, nx, ws, nw, d, out, ldo);
#endif
  router_block_scalar(xs, nx, ws, nw, d, out, ldo);
}

inline float sigmoid_scalar(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// Top-k of one token. Keys: the logit (softmax) or sigmoid(logit) + bias (sigmoid); NaN
// keys rank as -inf; ties go to the lower expert index. Output sorted by key, descending.
void route_token(const float* logits, const MoEArgs& a, int32_t* idx, float* wts, float* key_buf) {
  const int64_t e_count = a.experts, k = a.top_k;
  for (int64_t e = 0; e < e_count; ++e) {
    float key = a.score == ScoreFunc::kSoftmax ? logits[e] : sigmoid_scalar(logits[e]);
    if (a.score == ScoreFunc::kSigmoid && a.expert_bias) key += a.expert_bias[e];
    key_buf[e] = std::isnan(key) ? -std::numeric_limits<float>::infinity() : key;
  }
  int64_t n = 0;
  for (int64_t e = 0; e < e_count; ++e) {
    const float key = key_buf[e];
    if (n == k && !(key > key_buf[idx[k - 1]])) continue;  // strict: earlier index wins ties
    int64_t pos = n < k ? n++ : k - 1;
    while (pos > 0 && key > key_buf[idx[pos - 1]]) {
      idx[pos] = idx[pos - 1];
      --pos;
    }
    idx[pos] = static_cast<int32_t>(e);
  }
  if (a.score == ScoreFunc::kSoftmax) {
    // softmax over the chosen logits (== softmax over all, then renormalised over the top-k)
    const float top = logits[idx[0]];
    float total = 0.f;
    for (int64_t j = 0; j < k; ++j) total += (wts[j] = std::exp(logits[idx[j]] - top));
    for (int64_t j = 0; j < k; ++j) wts[j] = wts[j] / total * a.route_scale;
  } else {
    float total = 0.f;
    for (int64_t j = 0; j < k; ++j) total += (wts[j] = sigmoid_scalar(logits[idx[j]]));
    for (int64_t j = 0; j < k; ++j) wts[j] = wts[j] / total * a.route_scale;
  }
}

// ---------------------------------------------------------------- validation

void check_matrix(const QMatrix& m, int64_t n, int64_t k, const char* what) {
  if (!m.qdata || (!m.sb && !m.sb16)) throw std::invalid_argument(std::string(what) + ": null buffer");
  if (m.sb && m.sb16) throw std::invalid_argument(std::string(what) + ": both float32 and bfloat16 scale/bias given");
  if (m.n != n || m.k != k)
    throw std::invalid_argument(std::string(what) + ": expected [" + std::to_string(n) + ", " + std::to_string(k) +
                                "], got [" + std::to_string(m.n) + ", " + std::to_string(m.k) + "]");
  std::string err = check_layout(m.n, m.k, m.bits, m.group_size);
  if (!err.empty()) throw std::invalid_argument(std::string(what) + ": " + err);
}

void validate(const MoEArgs& a) {
  if (a.tokens < 0) throw std::invalid_argument("tokens must be >= 0");
  if (!a.x && a.tokens > 0) throw std::invalid_argument("x is null");
  if (!a.router) throw std::invalid_argument("router weight is null");
  if (a.experts <= 0) throw std::invalid_argument("num_experts must be positive");
  if (a.top_k < 1 || a.top_k > a.experts)
    throw std::invalid_argument("top_k=" + std::to_string(a.top_k) +
                                " must be in [1, num_experts=" + std::to_string(a.experts) + "]");
  if (a.hidden <= 0 || a.hidden % 16) throw std::invalid_argument("hidden size must be a multiple of 16");
  const int64_t f = a.w2.k;
  check_matrix(a.w13, 2 * f, a.hidden, "w13");
  check_matrix(a.w2, a.hidden, f, "w2");
  if (a.shared_w13.qdata) {
    const int64_t fs = a.shared_w2.k;
    check_matrix(a.shared_w13, 2 * fs, a.hidden, "shared w13");
    check_matrix(a.shared_w2, a.hidden, fs, "shared w2");
  }
  if (a.num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
}

// Asks for `count` consecutive tiles (from `tile`) of expert e of w to be brought into L2.
inline void prefetch_tiles(const QMatrix& w, int64_t e, int64_t tile, int count) {
  const char* q = reinterpret_cast<const char*>(w.qdata + e * w.matrix_qbytes() + tile * w.tile_qbytes());
  const int64_t qbytes = count * w.tile_qbytes();
  for (int64_t off = 0; off < qbytes; off += 64) __builtin_prefetch(q + off, 0, 2);
  const int64_t sb_at = e * w.matrix_sbfloats() + tile * w.tile_sbfloats();
  const char* sb = w.sb16 ? reinterpret_cast<const char*>(w.sb16 + sb_at) : reinterpret_cast<const char*>(w.sb + sb_at);
  const int64_t sbbytes = count * w.tile_sbfloats() * w.sb_elem_bytes();
  for (int64_t off = 0; off < sbbytes; off += 64) __builtin_prefetch(sb + off, 0, 2);
}

// Rows of the next register block when `left` rows remain: blocks of near-equal size
// (7 rows -> 4 + 3, not 6 + 1), since a 1-row block reuses each weight load only once.
inline int block_rows(int64_t left) {
  const int64_t blocks = (left + kMaxM - 1) / kMaxM;
  return static_cast<int>((left + blocks - 1) / blocks);
}

// Reused between calls (guarded by the pool's call mutex) so steady-state calls allocate nothing.
struct Workspace {
  std::vector<float> logits, keys, wts, slot_w, shared_w, y, h, h_scale, h_sum, hs, hs_scale, hs_sum;
  std::vector<float> x_scale, x_sum, xs_scale, xs_sum;
  std::vector<int8_t> xq, xsq, hq, hsq;
  std::vector<int32_t> idx, slot_tok;
  std::vector<int64_t> offsets, active, tok_slots, tok_fill;
};

template <typename T>
T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

Workspace& workspace() {
  static Workspace* ws = new Workspace();
  return *ws;
}

void route_all(const MoEArgs& a, Isa isa, Workspace& ws, bool shared_gate) {
  const int64_t t_count = a.tokens, e_count = a.experts, d = a.hidden;
  const int64_t rows = e_count + (shared_gate ? 1 : 0);
  float* logits = grow(ws.logits, t_count * rows);
  // Items: 4-token blocks x 32-row blocks.
  const int64_t tb = (t_count + 3) / 4, eb = (rows + 31) / 32;
  ThreadPool::instance().parallel_for(tb * eb, a.num_threads, [&](int64_t item) {
    const int64_t t0 = (item / eb) * 4, r0 = (item % eb) * 32;
    const int nx = static_cast<int>(std::min<int64_t>(4, t_count - t0));
    const float* xs[4];
    for (int i = 0; i < nx; ++i) xs[i] = a.x + (t0 + i) * d;
    for (int64_t r = r0; r < std::min(rows, r0 + 32); r += 4) {
      const int nw = static_cast<int>(std::min<int64_t>(4, std::min(rows, r0 + 32) - r));
      const float* wrows[4];
      for (int j = 0; j < nw; ++j) wrows[j] = (r + j < e_count) ? a.router + (r + j) * d : a.shared_gate;
      router_block(xs, nx, wrows, nw, d, logits + t0 * rows + r, rows, isa);
    }
  });
}

}  // namespace

void route(const MoEArgs& args, int32_t* idx, float* weights) {
  validate(args);
  std::lock_guard<std::mutex> lock(ThreadPool::instance().call_mutex());
  Workspace& ws = workspace();
  Isa isa = resolve(args.isa);
  route_all(args, isa, ws, false);
  float* keys = grow(ws.keys, args.experts);
  for (int64_t t = 0; t < args.tokens; ++t)
    route_token(ws.logits.data() + t * args.experts, args, idx + t * args.top_k, weights + t * args.top_k, keys);
}

// ---------------------------------------------------------------- the op

namespace {
// LLMQ_MOE_PROFILE=1 prints per-phase wall times to stderr (for tuning; off by default).
struct PhaseTimer {
  bool on;
  std::chrono::steady_clock::time_point last;
  char buf[256];
  int len = 0;
  PhaseTimer() : on(std::getenv("LLMQ_MOE_PROFILE") != nullptr), last(std::chrono::steady_clock::now()) { buf[0] = 0; }
  void mark(const char* name) {
    if (!on) return;
    auto now = std::chrono::steady_clock::now();
    len += std::snprintf(buf + len, sizeof(buf) - len, " %s %.3f", name,
                         std::chrono::duration<double, std::milli>(now - last).count());
    last = now;
  }
  ~PhaseTimer() {
    if (on) std::fprintf(stderr, "moe_ffn ms:%s\n", buf);
  }
};
}  // namespace

void moe_ffn(const MoEArgs& a, float* out) {
  validate(a);
  PhaseTimer timer;
  const Isa isa = resolve(a.isa);
  std::lock_guard<std::mutex> lock(ThreadPool::instance().call_mutex());
  ThreadPool& pool = ThreadPool::instance();
  Workspace& ws = workspace();
  const int64_t T = a.tokens, D = a.hidden, E = a.experts, K = a.top_k, F = a.w2.k;
  if (T == 0) return;
  const bool shared = a.shared_w13.qdata != nullptr;
  const bool shared_gate = shared && a.shared_gate != nullptr;
  const int64_t Fs = shared ? a.shared_w2.k : 0;
  const int64_t rows = E + (shared_gate ? 1 : 0);
  const int nthreads = a.num_threads;

  // 1. router logits (+ the shared expert's gate logit as an extra row)
  route_all(a, isa, ws, shared_gate);
  timer.mark("router");

  // 2. activation quantization for the routed (and, if its groups differ, the shared) w13
  const int gs13 = a.w13.group_size;
  const int64_t g13 = D / gs13;
  int8_t* xq = grow(ws.xq, T * D);
  float* x_scale = grow(ws.x_scale, T * g13);
  float* x_sum = grow(ws.x_sum, T * g13);
  const bool separate_shared_q = shared && a.shared_w13.group_size != gs13;
  const int gss = shared ? a.shared_w13.group_size : gs13;
  const int64_t gsh = D / gss;
  int8_t* xsq = separate_shared_q ? grow(ws.xsq, T * D) : xq;
  float* xs_scale = separate_shared_q ? grow(ws.xs_scale, T * gsh) : x_scale;
  float* xs_sum = separate_shared_q ? grow(ws.xs_sum, T * gsh) : x_sum;

  // 3. scores and top-k per token (parallel over token blocks), quantization alongside
  int32_t* idx = grow(ws.idx, T * K);
  float* wts = grow(ws.wts, T * K);
  const int64_t tblocks = (T + 7) / 8;
  float* keys = grow(ws.keys, tblocks * E);  // one E-sized scratch row per block of tokens
  pool.parallel_for(tblocks, nthreads, [&](int64_t b) {
    float* kb = keys + b * E;
    for (int64_t t = b * 8; t < std::min(T, b * 8 + 8); ++t) {
      route_token(ws.logits.data() + t * rows, a, idx + t * K, wts + t * K, kb);
      quantize_row(a.x + t * D, D, gs13, xq + t * D, x_scale + t * g13, x_sum + t * g13, isa);
      if (separate_shared_q) quantize_row(a.x + t * D, D, gss, xsq + t * D, xs_scale + t * gsh, xs_sum + t * gsh, isa);
    }
  });

  timer.mark("topk+quant");
  // 4. counting sort of (token, slot) by expert; slot order inside an expert follows the token
  int64_t* offsets = grow(ws.offsets, E + 1);
  std::fill(offsets, offsets + E + 1, 0);
  for (int64_t i = 0; i < T * K; ++i) ++offsets[idx[i] + 1];
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  int32_t* slot_tok = grow(ws.slot_tok, T * K);
  float* slot_w = grow(ws.slot_w, T * K);
  {
    int64_t* active = grow(ws.active, E);  // reused as fill cursors here
    std::copy(offsets, offsets + E, active);
    for (int64_t i = 0; i < T * K; ++i) {
      const int64_t p = active[idx[i]]++;
      slot_tok[p] = static_cast<int32_t>(i / K);
      slot_w[p] = wts[i];
    }
  }
  int64_t* active = ws.active.data();
  int64_t n_active = 0;
  for (int64_t e = 0; e < E; ++e)
    if (offsets[e + 1] > offsets[e]) active[n_active++] = e;
  // shared expert weight per token: sigmoid(gate logit), or 1
  float* shared_w = nullptr;
  if (shared) {
    shared_w = grow(ws.shared_w, T);
    for (int64_t t = 0; t < T; ++t) shared_w[t] = shared_gate ? sigmoid_scalar(ws.logits[t * rows + E]) : 1.0f;
  }

  // 5. phase 1: h = silu(x W1^T) * (x W3^T), per (expert, 16-row tile); slots in blocks of 4
  float* h = grow(ws.h, T * K * F);
  float* hs = shared ? grow(ws.hs, T * Fs) : nullptr;
  const int64_t ftiles = F / 16, fstiles = Fs / 16;
  const int64_t items1 = n_active * ftiles + (shared ? fstiles : 0);
  pool.parallel_for(items1, nthreads, [&](int64_t item) {
    const bool is_shared = item >= n_active * ftiles;
    QMatrix w;
    int64_t j, first, count, fdim;
    const int8_t* q;
    const float *qs, *qsum;
    int64_t gstride;
    if (!is_shared) {
      const int64_t e = active[item / ftiles];
      j = item % ftiles;
      w = a.w13.advanced(e * a.w13.matrix_qbytes(), e * a.w13.matrix_sbfloats());
      first = offsets[e];
      count = offsets[e + 1] - first;
      fdim = F;
      q = xq, qs = x_scale, qsum = x_sum, gstride = g13;
    } else {
      j = item - n_active * ftiles;
      w = a.shared_w13;
      first = 0;
      count = T;
      fdim = Fs;
      q = xsq, qs = xs_scale, qsum = xs_sum, gstride = gsh;
    }
    const int64_t tiles[2] = {2 * j, 2 * j + 1};  // gate block j, up block j (adjacent)
    // Bring the next item's tile pair towards L2 while this one computes (decode is bound
    // by DRAM latency otherwise).
    if (item + 1 < items1) {
      const int64_t nx = item + 1;
      if (nx < n_active * ftiles) prefetch_tiles(a.w13, active[nx / ftiles], 2 * (nx % ftiles), 2);
      else prefetch_tiles(a.shared_w13, 0, 2 * (nx - n_active * ftiles), 2);
    }
    float* hbuf = is_shared ? hs : h;
    for (int64_t b = 0, m = 0; b < count; b += m) {
      m = block_rows(count - b);
      const int8_t* rows_q[kMaxM];
      const float *rows_s[kMaxM], *rows_sum[kMaxM];
      for (int i = 0; i < m; ++i) {
        const int64_t tok = is_shared ? b + i : slot_tok[first + b + i];
        rows_q[i] = q + tok * D;
        rows_s[i] = qs + tok * gstride;
        rows_sum[i] = qsum + tok * gstride;
      }
      alignas(64) float gu[kMaxM * 32];
      gemm_tile_pair(w, tiles, rows_q, rows_s, rows_sum, static_cast<int>(m), gu, isa);
      for (int i = 0; i < m; ++i) swiglu16(gu + i * 32, gu + i * 32 + 16, hbuf + (first + b + i) * fdim + j * 16, isa);
    }
  });

  timer.mark("w13");
  // 6. quantize h for w2 (routed slots, then shared rows)
  const int gs2 = a.w2.group_size;
  const int64_t g2 = F / gs2;
  int8_t* hq = grow(ws.hq, T * K * F);
  float* h_scale = grow(ws.h_scale, T * K * g2);
  float* h_sum = grow(ws.h_sum, T * K * g2);
  const int gs2s = shared ? a.shared_w2.group_size : gs2;
  const int64_t g2s = shared ? Fs / gs2s : 0;
  int8_t* hsq = shared ? grow(ws.hsq, T * Fs) : nullptr;
  float* hs_scale = shared ? grow(ws.hs_scale, T * g2s) : nullptr;
  float* hs_sum = shared ? grow(ws.hs_sum, T * g2s) : nullptr;
  const int64_t rows_total = T * K + (shared ? T : 0);
  pool.parallel_for((rows_total + 15) / 16, nthreads, [&](int64_t b) {
    for (int64_t r = b * 16; r < std::min(rows_total, b * 16 + 16); ++r) {
      if (r < T * K) quantize_row(h + r * F, F, gs2, hq + r * F, h_scale + r * g2, h_sum + r * g2, isa);
      else {
        const int64_t t = r - T * K;
        quantize_row(hs + t * Fs, Fs, gs2s, hsq + t * Fs, hs_scale + t * g2s, hs_sum + t * g2s, isa);
      }
    }
  });

  timer.mark("quant_h");
  // 7. phase 2: w2 GEMMs and the weighted sum over each token's experts, always in the same
  //    order (routed experts ascending, then the shared expert), so both schedules below
  //    give bit-identical results.
  auto w2_block = [&](const QMatrix& w, const int64_t* tiles, int64_t first, int64_t count, const int8_t* q,
                      const float* qs, const float* qsum, int64_t fdim, int64_t gstride, auto&& consume) {
    for (int64_t b = 0, m = 0; b < count; b += m) {
      m = block_rows(count - b);
      const int8_t* rows_q[kMaxM];
      const float *rows_s[kMaxM], *rows_sum[kMaxM];
      for (int i = 0; i < m; ++i) {
        const int64_t r = first + b + i;
        rows_q[i] = q + r * fdim;
        rows_s[i] = qs + r * gstride;
        rows_sum[i] = qsum + r * gstride;
      }
      alignas(64) float y[kMaxM * 32];
      gemm_tile_pair(w, tiles, rows_q, rows_s, rows_sum, static_cast<int>(m), y, isa);
      for (int i = 0; i < m; ++i) consume(first + b + i, y + i * 32);
    }
  };
  const int64_t slots = T * K + (shared ? T : 0);
  const int64_t cpairs = D / 32;
  const bool by_expert = a.schedule == Schedule::kByExpert ||
                         (a.schedule == Schedule::kAuto && slots * D <= (int64_t{1} << 21));
  if (by_expert) {
    // Few tokens (decode): items are (expert, 32 columns), so a thread walks each expert's
    // w2 as one contiguous stream; results go to y[slot] and a second pass sums them per token.
    float* y = grow(ws.y, slots * D);
    const int64_t items2 = (n_active + (shared ? 1 : 0)) * cpairs;
    pool.parallel_for(items2, nthreads, [&](int64_t item) {
      const int64_t ai = item / cpairs, jp = item % cpairs;
      const int64_t tiles[2] = {2 * jp, 2 * jp + 1};
      if (item + 1 < items2) {
        const int64_t an = (item + 1) / cpairs, jn = (item + 1) % cpairs;
        if (an < n_active) prefetch_tiles(a.w2, active[an], 2 * jn, 2);
        else prefetch_tiles(a.shared_w2, 0, 2 * jn, 2);
      }
      if (ai < n_active) {
        const int64_t e = active[ai];
        const QMatrix w = a.w2.advanced(e * a.w2.matrix_qbytes(), e * a.w2.matrix_sbfloats());
        w2_block(w, tiles, offsets[e], offsets[e + 1] - offsets[e], hq, h_scale, h_sum, F, g2,
                 [&](int64_t r, const float* v) { std::memcpy(y + r * D + jp * 32, v, 32 * sizeof(float)); });
      } else {
        w2_block(a.shared_w2, tiles, 0, T, hsq, hs_scale, hs_sum, Fs, g2s,
                 [&](int64_t r, const float* v) { std::memcpy(y + (T * K + r) * D + jp * 32, v, 32 * sizeof(float)); });
      }
    });
    timer.mark("w2");
    // Each token's slots in expert order: slot positions are sorted by expert already.
    int64_t* tok_slots = grow(ws.tok_slots, T * K);
    int64_t* fill = grow(ws.tok_fill, T);
    std::fill(fill, fill + T, 0);
    for (int64_t p = 0; p < T * K; ++p) tok_slots[slot_tok[p] * K + fill[slot_tok[p]]++] = p;
    pool.parallel_for((T + 3) / 4, nthreads, [&](int64_t b) {
      for (int64_t t = b * 4; t < std::min(T, b * 4 + 4); ++t) {
        float* o = out + t * D;
        std::memset(o, 0, D * sizeof(float));
        for (int64_t j = 0; j < K; ++j) {
          const int64_t p = tok_slots[t * K + j];
          for (int64_t c = 0; c < D; c += 32) axpy32(slot_w[p], y + p * D + c, o + c, isa);
        }
        if (shared)
          for (int64_t c = 0; c < D; c += 32) axpy32(shared_w[t], y + (T * K + t) * D + c, o + c, isa);
      }
    });
    timer.mark("sum");
    return;
  }
  // Many tokens (prefill): items are 32 output columns; each walks every active expert's
  // tile pair and scatters into its own columns of out (no atomics).
  pool.parallel_for(cpairs, nthreads, [&](int64_t jp) {
    const int64_t tiles[2] = {2 * jp, 2 * jp + 1};
    const int64_t col = jp * 32;
    for (int64_t t = 0; t < T; ++t) std::memset(out + t * D + col, 0, 32 * sizeof(float));
    for (int64_t ai = 0; ai < n_active; ++ai) {
      const int64_t e = active[ai];
      const QMatrix w = a.w2.advanced(e * a.w2.matrix_qbytes(), e * a.w2.matrix_sbfloats());
      // The next expert's tile pair lives elsewhere in memory: start fetching it now.
      if (ai + 1 < n_active) prefetch_tiles(a.w2, active[ai + 1], 2 * jp, 2);
      else if (shared) prefetch_tiles(a.shared_w2, 0, 2 * jp, 2);
      w2_block(w, tiles, offsets[e], offsets[e + 1] - offsets[e], hq, h_scale, h_sum, F, g2,
               [&](int64_t r, const float* v) { axpy32(slot_w[r], v, out + slot_tok[r] * D + col, isa); });
    }
    if (shared)
      w2_block(a.shared_w2, tiles, 0, T, hsq, hs_scale, hs_sum, Fs, g2s,
               [&](int64_t r, const float* v) { axpy32(shared_w[r], v, out + r * D + col, isa); });
  });
  timer.mark("w2");
}

}  // namespace llmq_moe

// ---------------------------------------------------------------- dense linear

namespace llmq_moe {

void dense_linear(const float* x, int64_t tokens, const QMatrix& w, int64_t n_out, int num_threads, Isa isa_req,
                  float* out) {
  const std::string err = check_layout(w.n, w.k, w.bits, w.group_size);
  if (!err.empty()) throw std::invalid_argument("dense_linear: " + err);
  if (!w.qdata || (!w.sb && !w.sb16)) throw std::invalid_argument("dense_linear: null weight buffer");
  if (w.sb && w.sb16) throw std::invalid_argument("dense_linear: both float32 and bfloat16 scale/bias given");
  if (n_out <= w.n - 16 || n_out > w.n)
    throw std::invalid_argument("dense_linear: n_out=" + std::to_string(n_out) + " does not fit " +
                                std::to_string(w.n) + " packed rows (expected " + std::to_string(w.n - 15) + ".." +
                                std::to_string(w.n) + ")");
  if (tokens < 0) throw std::invalid_argument("dense_linear: tokens must be >= 0");
  if (num_threads < 1) throw std::invalid_argument("dense_linear: num_threads must be >= 1");
  if (tokens == 0) return;
  if (!x || !out) throw std::invalid_argument("dense_linear: null x or out");
  const Isa isa = resolve(isa_req);
  std::lock_guard<std::mutex> lock(ThreadPool::instance().call_mutex());
  ThreadPool& pool = ThreadPool::instance();
  Workspace& ws = workspace();
  const int64_t T = tokens, K = w.k, G = w.groups();
  const int gs = w.group_size;

  // 1. int8 activations per row and weight group
  int8_t* xq = grow(ws.xq, T * K);
  float* x_scale = grow(ws.x_scale, T * G);
  float* x_sum = grow(ws.x_sum, T * G);
  pool.parallel_for((T + 7) / 8, num_threads, [&](int64_t b) {
    for (int64_t t = b * 8; t < std::min(T, b * 8 + 8); ++t)
      quantize_row(x + t * K, K, gs, xq + t * K, x_scale + t * G, x_sum + t * G, isa);
  });

  // 2. one item per 32 output columns (a tile pair; the last may be a single tile), all tokens
  const int64_t tiles = w.n / 16, pairs = (tiles + 1) / 2;
  pool.parallel_for(pairs, num_threads, [&](int64_t p) {
    const int64_t tl[2] = {2 * p, 2 * p + 1};
    const int nt = (2 * p + 1 < tiles) ? 2 : 1;
    if (p + 1 < pairs) prefetch_tiles(w, 0, 2 * (p + 1), static_cast<int>(std::min<int64_t>(2, tiles - 2 * (p + 1))));
    const int64_t col = p * 32;
    const int64_t ncols = std::min<int64_t>(nt * 16, n_out - col);
    for (int64_t b = 0, m = 0; b < T; b += m) {
      m = block_rows(T - b);
      const int8_t* rows_q[kMaxM];
      const float *rows_s[kMaxM], *rows_sum[kMaxM];
      for (int i = 0; i < m; ++i) {
        rows_q[i] = xq + (b + i) * K;
        rows_s[i] = x_scale + (b + i) * G;
        rows_sum[i] = x_sum + (b + i) * G;
      }
      alignas(64) float y[kMaxM * 32];
      if (nt == 2) gemm_tile_pair(w, tl, rows_q, rows_s, rows_sum, static_cast<int>(m), y, isa);
      else gemm_tile_resolved(w, tl, 1, rows_q, rows_s, rows_sum, static_cast<int>(m), y, isa);
      for (int i = 0; i < m; ++i) std::memcpy(out + (b + i) * n_out + col, y + i * nt * 16, ncols * sizeof(float));
    }
  });
}

}  // namespace llmq_moe
