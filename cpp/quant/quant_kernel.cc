// See quant_kernel.h. The portable and AVX2 paths go group by group (min/max sweep,
// group_params, quantize sweep); the AVX-512 path goes row by row and computes the
// parameters of 16 groups per vector (params_avx512, lane-wise the same operations as
// group_params). All paths pack with pack_row except AVX-512 4-bit, which packs in registers.
// Built with -ffp-contract=off and without -ffast-math: every float operation below must
// round exactly like the torch reference in python/llmq/quant/quantize.py.
#include "quant_kernel.h"

#include "cpp/common/bits.h"

#include <sys/mman.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define LLMQ_QUANT_X86 1
#endif
#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace llmq_quant {
namespace {

// Below this many elements, starting threads costs more than it saves.
constexpr int64_t kMinElementsPerThread = 1 << 16;

using llmq_bits::bits_to_float;
using llmq_bits::float_to_bits;

// IEEE binary16 -> binary32, exact (the portable path; the vector paths use F16C).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // Inf / NaN
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24, exact in float32
  const float v = static_cast<float>(man) * 5.9604644775390625e-08f;
  return sign ? -v : v;
}

template <InputType T>
inline float load_scalar(const void* base, int64_t i) {
  if constexpr (T == InputType::kFloat32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (T == InputType::kBFloat16) {
    return bits_to_float(static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16);
  } else {
    return half_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

// Per-group quantization parameters: q = clamp(round(x * inv) + add, 0, qmax).
// (For symmetric groups the reference clamps to [-2^(b-1), 2^(b-1)-1] and then adds
// 2^(b-1); on the small integers round() yields here that is the same number.)
struct GroupParams {
  float scale, bias, inv, add;
};

// torchao-compatible qparams from a group's float32 min and max (both finite).
// Returns false if the asymmetric scale overflows float32.
inline bool group_params(float xmin, float xmax, int bits, bool symmetric, GroupParams* p) {
  const float min_neg = std::min(xmin, 0.0f);
  const float max_pos = std::max(xmax, 0.0f);
  if (symmetric) {
    const int offset = 1 << (bits - 1);
    const float amax = std::max(-min_neg, max_pos);
    // float(qmax - qmin) / 2 = (2^b - 1) / 2, exact in float32
    float scale = amax / (static_cast<float>((1 << bits) - 1) / 2.0f);
    scale = std::max(scale, FLT_MIN);
    p->scale = scale;
    p->inv = 1.0f / scale;
    p->add = static_cast<float>(offset);
    p->bias = scale * -static_cast<float>(offset);
    return true;
  }
  const float qmax = static_cast<float>((1 << bits) - 1);
  float scale = (max_pos - min_neg) / qmax;
  scale = std::max(scale, FLT_MIN);
  // Round the mantissa to 24-bits significant bits (ties to even) on the bit pattern, so
  // that bias = -zero*scale is exact (quantize.round_scale_mantissa).
  const int drop = bits;
  uint32_t u = float_to_bits(scale);
  const uint32_t lsb = (u >> drop) & 1u;
  u = (u + ((1u << (drop - 1)) - 1u) + lsb) & ~((1u << drop) - 1u);
  scale = bits_to_float(u);
  if (!std::isfinite(scale)) return false;
  float zero = 0.0f - std::nearbyint(min_neg / scale);
  zero = std::min(std::max(zero, 0.0f), qmax);
  p->scale = scale;
  p->inv = 1.0f / scale;
  p->add = zero;
  p->bias = 0.0f - zero * scale;  // +0.0 when zero == 0
  return true;
}

// Parameters from a given scale (and integer zero when asymmetric): the same formulas as
// group_params after its scale / zero choice.
inline GroupParams given_params(float scale, float zero, int bits, bool symmetric) {
  GroupParams p;
  p.scale = scale;
  p.inv = 1.0f / scale;
  if (symmetric) {
    p.add = static_cast<float>(1 << (bits - 1));
    p.bias = scale * -static_cast<float>(1 << (bits - 1));
  } else {
    p.add = zero;
    p.bias = 0.0f - zero * scale;
  }
  return p;
}

inline uint8_t quantize_one(float x, const GroupParams& p, float qmax) {
  float r = std::nearbyint(x * p.inv) + p.add;
  r = std::min(std::max(r, 0.0f), qmax);
  return static_cast<uint8_t>(static_cast<int>(r));
}

// ---------------------------------------------------------------- portable sweeps
template <InputType T>
bool minmax_scalar(const void* w, int64_t begin, int64_t end, float* mn, float* mx) {
  float lo = *mn, hi = *mx;
  bool nan = false;
  for (int64_t i = begin; i < end; ++i) {
    const float x = load_scalar<T>(w, i);
    nan |= (x != x);
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  *mn = lo;
  *mx = hi;
  return !nan;
}

template <InputType T>
void quantize_scalar(const void* w, int64_t begin, int64_t end, const GroupParams& p, float qmax, uint8_t* q) {
  for (int64_t i = begin; i < end; ++i) q[i - begin] = quantize_one(load_scalar<T>(w, i), p, qmax);
}

#if LLMQ_QUANT_X86
// ---------------------------------------------------------------- AVX2 (+F16C) sweeps
template <InputType T>
__attribute__((target("avx2,f16c"))) inline __m256 load8(const void* base, int64_t i) {
  if constexpr (T == InputType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else if constexpr (T == InputType::kBFloat16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_cvtph_ps(h);
  }
}

template <InputType T>
__attribute__((target("avx2,f16c"))) bool minmax_avx2(const void* w, int64_t begin, int64_t end, float* mn, float* mx) {
  __m256 vmin = _mm256_set1_ps(INFINITY), vmax = _mm256_set1_ps(-INFINITY);
  __m256 vnan = _mm256_setzero_ps();  // x - x is +0 for finite x, NaN for NaN/Inf
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 x = load8<T>(w, i);
    vmin = _mm256_min_ps(vmin, x);
    vmax = _mm256_max_ps(vmax, x);
    vnan = _mm256_or_ps(vnan, _mm256_sub_ps(x, x));
  }
  alignas(32) float lo[8], hi[8], bad[8];
  _mm256_store_ps(lo, vmin);
  _mm256_store_ps(hi, vmax);
  _mm256_store_ps(bad, vnan);
  float a = *mn, b = *mx;
  bool ok = true;
  for (int j = 0; j < 8; ++j) {
    a = std::min(a, lo[j]);
    b = std::max(b, hi[j]);
    ok &= float_to_bits(bad[j]) == 0;
  }
  *mn = a;
  *mx = b;
  return minmax_scalar<T>(w, i, end, mn, mx) && ok;
}

template <InputType T>
__attribute__((target("avx2,f16c"))) void quantize_avx2(const void* w, int64_t begin, int64_t end, const GroupParams& p,
                                                        float qmax, uint8_t* q) {
  const __m256 vinv = _mm256_set1_ps(p.inv), vadd = _mm256_set1_ps(p.add);
  const __m256 vlo = _mm256_setzero_ps(), vhi = _mm256_set1_ps(qmax);
  auto codes = [&](int64_t i) __attribute__((target("avx2,f16c"))) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(load8<T>(w, i), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(r, vadd), vlo), vhi);
    return _mm256_cvtps_epi32(r);  // exact: r is a small integer
  };
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m256i a = codes(i), b = codes(i + 8);
    // packs interleaves 128-bit lanes: a0-3 b0-3 a4-7 b4-7; restore order, then to bytes
    const __m256i ab = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(ab), _mm256_extracti128_si256(ab, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + (i - begin)), bytes);
  }
  for (; i + 8 <= end; i += 8) {
    const __m256i a = codes(i);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + (i - begin)), _mm_packus_epi16(w16, w16));
  }
  quantize_scalar<T>(w, i, end, p, qmax, q + (i - begin));
}

// ---------------------------------------------------------------- AVX-512 sweeps
template <InputType T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c"))) inline __m512 load16(const void* base, int64_t i) {
  if constexpr (T == InputType::kFloat32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else if constexpr (T == InputType::kBFloat16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    return _mm512_cvtph_ps(h);
  }
}

template <InputType T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c"))) bool minmax_avx512(const void* w, int64_t begin,
                                                                                      int64_t end, float* mn,
                                                                                      float* mx) {
  __m512 vmin = _mm512_set1_ps(INFINITY), vmax = _mm512_set1_ps(-INFINITY);
  __m512i vnan = _mm512_setzero_si512();
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 x = load16<T>(w, i);
    vmin = _mm512_min_ps(vmin, x);
    vmax = _mm512_max_ps(vmax, x);
    vnan = _mm512_or_si512(vnan, _mm512_castps_si512(_mm512_sub_ps(x, x)));
  }
  alignas(64) float lo[16], hi[16];
  alignas(64) uint32_t bad[16];
  _mm512_store_ps(lo, vmin);
  _mm512_store_ps(hi, vmax);
  _mm512_store_si512(bad, vnan);
  float a = *mn, b = *mx;
  bool ok = true;
  for (int j = 0; j < 16; ++j) {
    a = std::min(a, lo[j]);
    b = std::max(b, hi[j]);
    ok &= bad[j] == 0;
  }
  *mn = a;
  *mx = b;
  return minmax_scalar<T>(w, i, end, mn, mx) && ok;
}

template <InputType T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c"))) void quantize_avx512(const void* w, int64_t begin,
                                                                                        int64_t end,
                                                                                        const GroupParams& p,
                                                                                        float qmax, uint8_t* q) {
  const __m512 vinv = _mm512_set1_ps(p.inv), vadd = _mm512_set1_ps(p.add);
  const __m512 vlo = _mm512_setzero_ps(), vhi = _mm512_set1_ps(qmax);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(load16<T>(w, i), vinv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(r, vadd), vlo), vhi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + (i - begin)), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
  }
  quantize_scalar<T>(w, i, end, p, qmax, q + (i - begin));
}

#endif  // LLMQ_QUANT_X86

// Per-thread buffers for one row: group minima/maxima/parameters, unpacked codes.
struct RowScratch {
  std::vector<float> mn, mx, inv, add;
  std::vector<uint8_t> codes;
};

// ---------------------------------------------------------------- packing
// Unpacked codes q[k] -> the canonical LSB-first bit stream (formats.pack_bits).
void pack_row(const uint8_t* q, int64_t k, int bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, q, k);
  } else if (bits == 4) {
    for (int64_t i = 0; i < k / 2; ++i) out[i] = static_cast<uint8_t>(q[2 * i] | (q[2 * i + 1] << 4));
  } else if (bits == 2) {
    for (int64_t i = 0; i < k / 4; ++i)
      out[i] = static_cast<uint8_t>(q[4 * i] | (q[4 * i + 1] << 2) | (q[4 * i + 2] << 4) | (q[4 * i + 3] << 6));
  } else {  // 3, 5, 6, 7 bits: 8 codes fill `bits` bytes exactly (k % 8 == 0 checked)
    for (int64_t i = 0; i < k / 8; ++i) {
      uint64_t word = 0;
      for (int j = 0; j < 8; ++j) word |= static_cast<uint64_t>(q[8 * i + j]) << (j * bits);
      for (int b = 0; b < bits; ++b) out[i * bits + b] = static_cast<uint8_t>(word >> (8 * b));
    }
  }
}

#if LLMQ_QUANT_X86
// ---------------------------------------------------------------- AVX-512 rows
// Whole rows at a time: sweep 1 stores every group's min/max, the parameters of 16 groups
// are then computed in one vector (the same IEEE operations as group_params, lane-wise),
// and sweep 2 (from L1) quantizes and, for 4-bit, packs nibbles in registers.
#define LLMQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))

// Parameters for groups [0, n) from mn/mx; false if a range overflows float32.
LLMQ_AVX512 bool params_avx512(const float* mn, const float* mx, int64_t n, int bits, bool symmetric, float* scale,
                               float* bias, float* inv, float* add) {
  const __m512 zero = _mm512_setzero_ps(), fmin = _mm512_set1_ps(FLT_MIN), one = _mm512_set1_ps(1.0f);
  int64_t g = 0;
  for (; g + 16 <= n; g += 16) {
    const __m512 min_neg = _mm512_min_ps(_mm512_loadu_ps(mn + g), zero);
    const __m512 max_pos = _mm512_max_ps(_mm512_loadu_ps(mx + g), zero);
    __m512 sc, bi, ad;
    if (symmetric) {
      const float offset = static_cast<float>(1 << (bits - 1));
      const __m512 amax = _mm512_max_ps(_mm512_sub_ps(zero, min_neg), max_pos);
      sc = _mm512_div_ps(amax, _mm512_set1_ps(static_cast<float>((1 << bits) - 1) / 2.0f));
      sc = _mm512_max_ps(sc, fmin);
      ad = _mm512_set1_ps(offset);
      bi = _mm512_mul_ps(sc, _mm512_set1_ps(-offset));
    } else {
      const __m512 qmax = _mm512_set1_ps(static_cast<float>((1 << bits) - 1));
      sc = _mm512_max_ps(_mm512_div_ps(_mm512_sub_ps(max_pos, min_neg), qmax), fmin);
      __m512i u = _mm512_castps_si512(sc);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, bits), _mm512_set1_epi32(1));
      u = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32((1 << (bits - 1)) - 1)), lsb);
      u = _mm512_and_si512(u, _mm512_set1_epi32(~((1 << bits) - 1)));
      sc = _mm512_castsi512_ps(u);
      // finite <=> exponent field not all ones
      const __m512i expo = _mm512_and_si512(u, _mm512_set1_epi32(0x7f800000));
      if (_mm512_cmpeq_epi32_mask(expo, _mm512_set1_epi32(0x7f800000))) return false;
      const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(min_neg, sc), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      ad = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(zero, r), zero), qmax);
      bi = _mm512_sub_ps(zero, _mm512_mul_ps(ad, sc));
    }
    _mm512_storeu_ps(scale + g, sc);
    _mm512_storeu_ps(bias + g, bi);
    _mm512_storeu_ps(inv + g, _mm512_div_ps(one, sc));
    _mm512_storeu_ps(add + g, ad);
  }
  for (; g < n; ++g) {
    GroupParams p;
    if (!group_params(mn[g], mx[g], bits, symmetric, &p)) return false;
    scale[g] = p.scale;
    bias[g] = p.bias;
    inv[g] = p.inv;
    add[g] = p.add;
  }
  return true;
}

template <InputType T>
LLMQ_AVX512 inline __m512i codes16(const void* w, int64_t i, __m512 vinv, __m512 vadd, __m512 vhi) {
  __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(load16<T>(w, i), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  r = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(r, vadd), _mm512_setzero_ps()), vhi);
  return _mm512_cvtps_epi32(r);
}

template <InputType T>
LLMQ_AVX512 Status row_avx512(const QuantizeArgs& a, const void* row, uint8_t* out, float* scale, float* bias,
                              const float* given_sc, const float* given_z, RowScratch* s) {
  const int64_t k = a.k, gs = a.group_size, groups = k / gs;
  const bool whole_vectors = gs % 16 == 0;
  if (given_sc) {
    for (int64_t g = 0; g < groups; ++g) {
      const GroupParams p = given_params(given_sc[g], given_z ? given_z[g] : 0.0f, a.bits, a.symmetric);
      scale[g] = p.scale;
      bias[g] = p.bias;
      s->inv[g] = p.inv;
      s->add[g] = p.add;
    }
  } else {
    // sweep 1: min / max per group, NaN/Inf anywhere in the row
    if (whole_vectors) {
      __m512i vnan = _mm512_setzero_si512();
      for (int64_t g = 0; g < groups; ++g) {
        __m512 vmin = _mm512_set1_ps(INFINITY), vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t i = g * gs; i < (g + 1) * gs; i += 16) {
          const __m512 x = load16<T>(row, i);
          vmin = _mm512_min_ps(vmin, x);
          vmax = _mm512_max_ps(vmax, x);
          vnan = _mm512_or_si512(vnan, _mm512_castps_si512(_mm512_sub_ps(x, x)));  // +0 iff finite
        }
        s->mn[g] = _mm512_reduce_min_ps(vmin);
        s->mx[g] = _mm512_reduce_max_ps(vmax);
      }
      if (_mm512_test_epi32_mask(vnan, vnan)) return Status::kNotFinite;
    } else {
      for (int64_t g = 0; g < groups; ++g) {
        float mn = INFINITY, mx = -INFINITY;
        if (!minmax_avx512<T>(row, g * gs, (g + 1) * gs, &mn, &mx)) return Status::kNotFinite;
        s->mn[g] = mn;
        s->mx[g] = mx;
      }
    }
    for (int64_t g = 0; g < groups; ++g)
      if (!std::isfinite(s->mn[g]) || !std::isfinite(s->mx[g])) return Status::kNotFinite;
    if (!params_avx512(s->mn.data(), s->mx.data(), groups, a.bits, a.symmetric, scale, bias, s->inv.data(),
                       s->add.data()))
      return Status::kRangeOverflow;
  }
  // sweep 2: quantize (and pack)
  const float qmax = static_cast<float>((1 << a.bits) - 1);
  const __m512 vhi = _mm512_set1_ps(qmax);
  if (a.bits == 4 && whole_vectors) {
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 vinv = _mm512_set1_ps(s->inv[g]), vadd = _mm512_set1_ps(s->add[g]);
      for (int64_t i = g * gs; i < (g + 1) * gs; i += 16) {
        const __m512i c = codes16<T>(row, i, vinv, vadd, vhi);
        // per 64-bit lane (lo, hi): low byte of lo | hi << 4 is the packed pair
        const __m512i pairs = _mm512_or_si512(c, _mm512_srli_epi64(c, 28));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i / 2), _mm512_cvtepi64_epi8(pairs));
      }
    }
    return Status::kOk;
  }
  uint8_t* q = a.bits == 8 ? out : s->codes.data();
  for (int64_t g = 0; g < groups; ++g) {
    GroupParams p{scale[g], bias[g], s->inv[g], s->add[g]};
    quantize_avx512<T>(row, g * gs, (g + 1) * gs, p, qmax, q + g * gs);
  }
  if (a.bits != 8) pack_row(q, k, a.bits, out);
  return Status::kOk;
}

#endif  // LLMQ_QUANT_X86

// ---------------------------------------------------------------- rows
using MinMaxFn = bool (*)(const void*, int64_t, int64_t, float*, float*);
using QuantFn = void (*)(const void*, int64_t, int64_t, const GroupParams&, float, uint8_t*);

struct Sweeps {
  MinMaxFn minmax;
  QuantFn quant;
};

template <InputType T>
Sweeps sweeps_for(Isa isa) {
#if LLMQ_QUANT_X86
  if (isa == Isa::kAvx512) return {&minmax_avx512<T>, &quantize_avx512<T>};
  if (isa == Isa::kAvx2) return {&minmax_avx2<T>, &quantize_avx2<T>};
#endif
  (void)isa;
  return {&minmax_scalar<T>, &quantize_scalar<T>};
}

Sweeps select_sweeps(InputType t, Isa isa) {
  return dispatch_input(t, [isa](auto type) { return sweeps_for<decltype(type)::value>(isa); });
}

// Outputs are usually freshly allocated, so writing them first-touches every page; with
// 4 KiB pages those faults cost more than the quantization itself. Ask for huge pages on the
// 2 MiB-aligned interior of a large output (a hint only: the memory stays the caller's).
void advise_huge_pages(void* p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

size_t element_size(InputType t) { return t == InputType::kFloat32 ? 4 : 2; }

using RowFn = Status (*)(const QuantizeArgs&, const void*, uint8_t*, float*, float*, const float*, const float*,
                         RowScratch*);

RowFn avx512_row_for(InputType t) {
#if !LLMQ_QUANT_X86
  (void)t;
  return nullptr;
#else
  switch (t) {
    case InputType::kBFloat16: return &row_avx512<InputType::kBFloat16>;
    case InputType::kFloat16: return &row_avx512<InputType::kFloat16>;
    default: return &row_avx512<InputType::kFloat32>;
  }
#endif
}

// One row through the per-group sweeps (portable and AVX2 paths).
Status row_by_groups(const QuantizeArgs& a, const Sweeps& s, const void* row, uint8_t* out, float* scale, float* bias,
                     const float* given_sc, const float* given_z, RowScratch* scratch) {
  const int64_t k = a.k, gs = a.group_size, groups = k / gs;
  const float qmax = static_cast<float>((1 << a.bits) - 1);
  uint8_t* q = a.bits == 8 ? out : scratch->codes.data();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = g * gs, end = begin + gs;
    GroupParams p;
    if (given_sc) {
      p = given_params(given_sc[g], given_z ? given_z[g] : 0.0f, a.bits, a.symmetric);
    } else {
      float mn = INFINITY, mx = -INFINITY;
      if (!s.minmax(row, begin, end, &mn, &mx) || !std::isfinite(mn) || !std::isfinite(mx)) return Status::kNotFinite;
      if (!group_params(mn, mx, a.bits, a.symmetric, &p)) return Status::kRangeOverflow;
    }
    s.quant(row, begin, end, p, qmax, q + begin);
    scale[g] = p.scale;
    bias[g] = p.bias;
  }
  if (a.bits != 8) pack_row(q, k, a.bits, out);
  return Status::kOk;
}

// Quantize rows [r0, r1); stops early once any thread has failed.
void quantize_rows(const QuantizeArgs& a, Isa isa, int64_t r0, int64_t r1, std::atomic<int>* status) {
  const int64_t k = a.k, groups = k / a.group_size, row_bytes = k * a.bits / 8;
  const Sweeps sweeps = select_sweeps(a.input, isa);
  const RowFn fast_row = isa == Isa::kAvx512 ? avx512_row_for(a.input) : nullptr;
  RowScratch scratch;
  scratch.codes.resize(k);
  for (auto* v : {&scratch.mn, &scratch.mx, &scratch.inv, &scratch.add}) v->resize(groups);
  const char* base = static_cast<const char*>(a.w);
  const size_t esize = element_size(a.input);
  for (int64_t r = r0; r < r1; ++r) {
    if (status->load(std::memory_order_relaxed) != 0) return;
    const void* row = base + static_cast<size_t>(r) * k * esize;
    uint8_t* out = a.qdata + r * row_bytes;
    float* scale = a.scale + r * groups;
    float* bias = a.bias + r * groups;
    const float* given_sc = a.given_scale ? a.given_scale + r * groups : nullptr;
    const float* given_z = a.given_zero && !a.symmetric ? a.given_zero + r * groups : nullptr;
    const Status st = fast_row ? fast_row(a, row, out, scale, bias, given_sc, given_z, &scratch)
                               : row_by_groups(a, sweeps, row, out, scale, bias, given_sc, given_z, &scratch);
    if (st != Status::kOk) {
      status->store(static_cast<int>(st));
      return;
    }
  }
}

}  // namespace

int default_threads() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

Isa detect_isa() {
#if !LLMQ_QUANT_X86
  return Isa::kScalar;
#else
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return Isa::kAvx2;
  return Isa::kScalar;
#endif
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kScalar: return "scalar";
    default: return "auto";
  }
}

std::string check_threads_isa(const MatrixArgs& a) {
  if (a.threads < 0) return "threads must be >= 0";
  const Isa best = detect_isa();
  if (a.isa != Isa::kAuto && static_cast<int>(a.isa) > static_cast<int>(best))
    return std::string("isa ") + isa_name(a.isa) + " is not supported by this CPU (best: " + isa_name(best) + ")";
  return "";
}

std::string check_args(const QuantizeArgs& a) {
  if (a.bits < 2 || a.bits > 8) return "bits=" + std::to_string(a.bits) + " unsupported (expected 2..8)";
  if (a.rows < 0 || a.k <= 0) return "expected rows >= 0 and k > 0";
  if (a.group_size <= 0 || a.k % a.group_size)
    return "group_size=" + std::to_string(a.group_size) + " does not divide K=" + std::to_string(a.k);
  if ((a.k * a.bits) % 8 || (a.bits != 2 && a.bits != 4 && a.bits != 8 && a.k % 8))
    return "K=" + std::to_string(a.k) + " cannot be packed at " + std::to_string(a.bits) + " bits";
  if (a.rows > 0 && (!a.w || !a.qdata || !a.scale || !a.bias)) return "null pointer argument";
  if (a.rows > 0 && !a.symmetric && a.given_scale && !a.given_zero) return "given_scale without given_zero";
  return check_threads_isa(a);
}

Status quantize(const QuantizeArgs& a) {
  const std::string err = check_args(a);
  if (!err.empty()) throw std::invalid_argument(err);
  if (a.rows == 0) return Status::kOk;
  const Isa isa = a.isa == Isa::kAuto ? detect_isa() : a.isa;
  advise_huge_pages(a.qdata, static_cast<size_t>(a.rows) * a.k * a.bits / 8);
  advise_huge_pages(a.scale, static_cast<size_t>(a.rows) * (a.k / a.group_size) * sizeof(float));
  advise_huge_pages(a.bias, static_cast<size_t>(a.rows) * (a.k / a.group_size) * sizeof(float));
  int threads = a.threads > 0 ? a.threads : default_threads();
  const int64_t by_size = std::max<int64_t>(1, a.rows * a.k / kMinElementsPerThread);
  threads = static_cast<int>(std::min<int64_t>({threads, by_size, a.rows}));
  std::atomic<int> status{0};
  if (threads == 1) {
    quantize_rows(a, isa, 0, a.rows, &status);
  } else {
    std::vector<std::thread> pool;
    pool.reserve(threads - 1);
    const int64_t per = a.rows / threads, extra = a.rows % threads;
    int64_t r0 = 0;
    int64_t first_end = 0;
    for (int t = 0; t < threads; ++t) {
      const int64_t r1 = r0 + per + (t < extra ? 1 : 0);
      if (t == 0) first_end = r1;
      else pool.emplace_back(quantize_rows, std::cref(a), isa, r0, r1, &status);
      r0 = r1;
    }
    quantize_rows(a, isa, 0, first_end, &status);
    for (auto& th : pool) th.join();
  }
  return static_cast<Status>(status.load());
}

void to_float32(const void* data, InputType input, int64_t n, float* out) {
  switch (input) {
    case InputType::kFloat32: std::memcpy(out, data, static_cast<size_t>(n) * sizeof(float)); return;
    case InputType::kBFloat16:
      for (int64_t i = 0; i < n; ++i) out[i] = load_scalar<InputType::kBFloat16>(data, i);
      return;
    case InputType::kFloat16:
      for (int64_t i = 0; i < n; ++i) out[i] = load_scalar<InputType::kFloat16>(data, i);
      return;
  }
}

// -- non-finite scan --------------------------------------------------------------------------

namespace {

// Counts NaN and Inf from raw bit patterns, block by block: `special` = exponent all ones
// (NaN or Inf), `nan` = above the infinity pattern once the sign is masked off. Two
// branch-free compare-and-add reductions in counters as wide as the elements, so the
// baseline (SSE2) build vectorizes them; a block (16384) cannot overflow a 16-bit counter.
template <typename Bits, Bits kAbsMask, Bits kInf>
NonFiniteCounts count_bits(const Bits* x, int64_t n) {
  NonFiniteCounts c;
  constexpr int64_t kBlock = 1 << 14;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    Bits special = 0, nan = 0;
    for (int64_t i = b; i < e; ++i) {
      const Bits a = static_cast<Bits>(x[i] & kAbsMask);
      special = static_cast<Bits>(special + (a >= kInf));
      nan = static_cast<Bits>(nan + (a > kInf));
    }
    c.nan += nan;
    c.inf += static_cast<int64_t>(special) - nan;
  }
  return c;
}

}  // namespace

NonFiniteCounts count_nonfinite(const void* data, InputType input, int64_t n) {
  if (n <= 0) return {};
  switch (input) {
    case InputType::kFloat32:
      return count_bits<uint32_t, 0x7FFFFFFFu, 0x7F800000u>(static_cast<const uint32_t*>(data), n);
    case InputType::kBFloat16: return count_bits<uint16_t, 0x7FFF, 0x7F80>(static_cast<const uint16_t*>(data), n);
    case InputType::kFloat16: return count_bits<uint16_t, 0x7FFF, 0x7C00>(static_cast<const uint16_t*>(data), n);
  }
  return {};
}

}  // namespace llmq_quant
