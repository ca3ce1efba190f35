// See fp_quant.h. Every float operation below mirrors one in python/llmq/quant/fp.py (named
// in the comments); built with -ffp-contract=off and without -ffast-math so each rounds
// exactly like torch's float32 kernels. Row work lives in always-inline templates
// (run_impl) that are instantiated once per ISA (run_base / run_avx2 / run_avx512), so every
// path is the same source, vectorised by the compiler for its target.
#include "fp_quant.h"
#include "quant_kernel.h"

#if defined(__x86_64__)
#define LLMQ_FP_X86 1
#endif
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace llmq_quant {
namespace {

#define FPQ_INLINE inline __attribute__((always_inline))

constexpr float kE4M3Max = 448.0f;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr int64_t kMinElementsPerThread = 1 << 16;
constexpr int kE8M0Bias = 127;

FPQ_INLINE uint32_t bits_of(float f) { return __builtin_bit_cast(uint32_t, f); }
FPQ_INLINE float float_of(uint32_t u) { return __builtin_bit_cast(float, u); }

// Converts n elements starting at `start` to float32 (exact for all three types) into buf;
// float32 input is used in place.
template <InputType T>
FPQ_INLINE const float* load_row(const void* base, int64_t start, int64_t n, float* buf) {
  if constexpr (T == InputType::kFloat32) {
    (void)n;
    (void)buf;
    return static_cast<const float*>(base) + start;
  } else if constexpr (T == InputType::kBFloat16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + start;
    for (int64_t i = 0; i < n; ++i) buf[i] = float_of(static_cast<uint32_t>(p[i]) << 16);
    return buf;
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + start;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t h = p[i];
      const uint32_t sign = (h & 0x8000u) << 16, mag = h & 0x7FFFu, exp = mag >> 10;
      // normal: rebias 15 -> 127; Inf/NaN: exponent all ones again; subnormal: man * 2^-24
      const uint32_t normal = (mag << 13) + (112u << 23) + (exp == 0x1Fu ? (112u << 23) : 0u);
      const float sub = static_cast<float>(static_cast<int32_t>(mag)) * 5.9604644775390625e-08f;
      const uint32_t u = exp == 0 ? bits_of(sub) : normal;
      buf[i] = float_of(u | sign);
    }
    return buf;
  }
}

// Largest |x| as its float32 bit pattern (the bit order of non-negative floats is their
// order); >= kInfBits means a NaN or Inf is present. torch's abs().amax() is the same number.
FPQ_INLINE uint32_t amax_bits(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = bits_of(x[i]) & 0x7FFFFFFFu;
    m = u > m ? u : m;
  }
  return m;
}

// float32 -> float8_e4m3fn byte, round to nearest even, sign kept (torch's .to(float8_e4m3fn)
// on |x| <= 448). Below 2^-6 the result is subnormal: adding 2^14 (whose ulp is 2^-9, the
// subnormal step) rounds |x| / 2^-9 to an integer in the low mantissa bits; the subnormal
// codes 0..8 are that integer (8 is the smallest normal, 2^-6). Above, the float32 mantissa
// is rounded to 3 bits on the bit pattern and the exponent rebiased 127 -> 7.
FPQ_INLINE uint8_t e4m3_code(float x) {
  const uint32_t u = bits_of(x);
  const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
  const uint32_t small = bits_of(float_of(a) + 16384.0f) - 0x46800000u;
  const uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);
  const uint32_t normal = (r >> 20) - (120u << 3);
  const uint32_t code = a < (121u << 23) ? small : normal;
  return static_cast<uint8_t>(code | sign);
}

FPQ_INLINE float e4m3_value(uint8_t c) {
  const uint32_t exp = (c >> 3) & 0xFu, man = c & 7u;
  const float mag = exp == 0 ? static_cast<float>(static_cast<int32_t>(man)) * 0.001953125f
                             : float_of(((exp + 120u) << 23) | (man << 20));
  return (c & 0x80u) ? -mag : mag;
}

// fp.py e2m1_encode: the code of |x| counts the midpoints it lies above; ties (0.75, 1.75,
// 3.5 inclusive, the others exclusive) go to the even code; +0 when it rounds to zero.
FPQ_INLINE uint8_t e2m1_code(float x) {
  const float m = std::fabs(x);
  const uint32_t code = static_cast<uint32_t>(m > 0.25f) + static_cast<uint32_t>(m >= 0.75f) +
                        static_cast<uint32_t>(m > 1.25f) + static_cast<uint32_t>(m >= 1.75f) +
                        static_cast<uint32_t>(m > 2.5f) + static_cast<uint32_t>(m >= 3.5f) +
                        static_cast<uint32_t>(m > 5.0f);
  const uint32_t sign = (x < 0.0f && code != 0) ? 8u : 0u;
  return static_cast<uint8_t>(code | sign);
}

FPQ_INLINE float clamp_e4m3(float y) {
  y = y < -kE4M3Max ? -kE4M3Max : y;  // torch clamp(-448, 448)
  return y > kE4M3Max ? kE4M3Max : y;
}

// fp.py _positive: a non-positive scale (an all-zero group, or an underflow) becomes 1.0.
FPQ_INLINE float positive(float s) { return s > 0.0f ? s : 1.0f; }

// fp.py mx_exponent: exact ceil(log2(amax / emax)), the quotient in float64 (normal there for
// every finite float32 amax > 0), clamped to [-127, 127]; -127 for amax 0. ceil(log2 v) of a
// normal double is its unbiased exponent, plus one unless the mantissa bits are all zero.
FPQ_INLINE int mx_exponent(float amax, double emax) {
  const uint64_t u = __builtin_bit_cast(uint64_t, static_cast<double>(amax) / emax);
  int e = static_cast<int>(u >> 52) - 1023 + ((u & 0xFFFFFFFFFFFFFull) != 0 ? 1 : 0);
  e = amax > 0.0f ? e : -kE8M0Bias;
  e = e < -kE8M0Bias ? -kE8M0Bias : e;
  return e > kE8M0Bias ? kE8M0Bias : e;
}

// 2^p as a float32 for p in [-127, 127] (2^-127 is the one subnormal).
FPQ_INLINE float pow2(int p) {
  return p > -127 ? float_of(static_cast<uint32_t>(p + 127) << 23) : float_of(0x00400000u);
}

FPQ_INLINE void fp8_row(const float* x, int64_t n, float scale, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = e4m3_code(clamp_e4m3(x[i] / scale));  // x / scale, clamp, cast
}

// out[i] = codes[2i] | codes[2i+1] << 4. With v = codes[2i] | codes[2i+1] << 8 (one 16-bit
// load on a little-endian host), that byte is the low byte of v | v >> 4 (codes are below 16),
// which vectorises without a byte shuffle.
FPQ_INLINE void pack_fp4(const uint8_t* codes, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n / 2; ++i) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint16_t v;
    std::memcpy(&v, codes + 2 * i, 2);
#else
    const uint16_t v = static_cast<uint16_t>(codes[2 * i] | (codes[2 * i + 1] << 8));
#endif
    out[i] = static_cast<uint8_t>(v | (v >> 4));
  }
}

enum class Op { kAmax, kFp8Rows, kFp8Bands, kMx, kNvfp4 };

struct Job {
  const MatrixArgs* a = nullptr;
  Op op = Op::kAmax;
  int64_t rows_per_group = 1;            // rows per tensor scale / global scale (kAmax, kFp8Rows, kNvfp4)
  std::atomic<uint32_t>* amax = nullptr;  // kAmax: one per group
  Fp8Granularity gran = Fp8Granularity::kTensor;
  bool compute = false;
  float* scale = nullptr;        // FP8 scales / NVFP4 global scales
  uint8_t* out = nullptr;        // FP8 bytes / MX and NVFP4 codes
  uint8_t* block_out = nullptr;  // MX e8m0 / NVFP4 e4m3 block scales
  bool fp4 = false;
  std::atomic<int>* bad = nullptr;

  Job(const MatrixArgs* args, Op o, float* scales = nullptr, uint8_t* codes = nullptr, uint8_t* blocks = nullptr)
      : a(args), op(o), scale(scales), out(codes), block_out(blocks) {}
};

inline void atomic_max(std::atomic<uint32_t>* a, uint32_t v) {
  uint32_t cur = a->load(std::memory_order_relaxed);
  while (v > cur && !a->compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

// amax_bits of x[0, n) into *m; false, with the job's NaN/Inf flag set, where that is not finite.
FPQ_INLINE bool finite_amax(const Job& j, const float* x, int64_t n, uint32_t* m) {
  *m = amax_bits(x, n);
  if (*m < kInfBits) return true;
  j.bad->store(1);
  return false;
}

// bm[b] = amax_bits of block b (B elements) of x, for `blocks` blocks; false, with the job's
// NaN/Inf flag set, where one is not finite.
template <int B>
FPQ_INLINE bool block_amax(const Job& j, const float* x, int64_t blocks, uint32_t* bm) {
  uint32_t worst = 0;
  for (int64_t bi = 0; bi < blocks; ++bi) {
    bm[bi] = amax_bits(x + bi * B, B);
    worst = bm[bi] > worst ? bm[bi] : worst;
  }
  if (worst < kInfBits) return true;
  j.bad->store(1);
  return false;
}

template <InputType T>
FPQ_INLINE void run_impl(const Job& j, int64_t u0, int64_t u1) {
  const MatrixArgs& a = *j.a;
  const int64_t k = a.k;
  std::vector<float> buf(T == InputType::kFloat32 ? 0 : k);
  std::vector<uint8_t> codes(j.op == Op::kMx || j.op == Op::kNvfp4 ? k : 0);
  float* fb = buf.data();
  switch (j.op) {
    case Op::kAmax: {  // per-group amax over rows [u0, u1)
      int64_t g = u0 / j.rows_per_group;
      uint32_t m = 0;
      for (int64_t r = u0; r < u1; ++r) {
        if (r / j.rows_per_group != g) {
          atomic_max(&j.amax[g], m);
          g = r / j.rows_per_group;
          m = 0;
        }
        const uint32_t rm = amax_bits(load_row<T>(a.w, r * k, k, fb), k);
        m = rm > m ? rm : m;
      }
      atomic_max(&j.amax[g], m);
      return;
    }
    case Op::kFp8Rows: {  // per tensor (given scale per group) or per channel
      for (int64_t r = u0; r < u1; ++r) {
        const float* x = load_row<T>(a.w, r * k, k, fb);
        uint32_t m;
        if (!finite_amax(j, x, k, &m)) return;
        float s;
        if (j.gran == Fp8Granularity::kChannel) {
          if (j.compute) j.scale[r] = positive(float_of(m) / kE4M3Max);  // amax / 448
          s = j.scale[r];
        } else {
          s = j.scale[r / j.rows_per_group];
        }
        fp8_row(x, k, s, j.out + r * k);
      }
      return;
    }
    case Op::kFp8Bands: {  // 128x128 tiles, one band of 128 rows per unit
      const int64_t tiles = k / 128;
      std::vector<uint32_t> tile_amax(tiles);
      for (int64_t b = u0; b < u1; ++b) {
        float* scale = j.scale + b * tiles;
        std::fill(tile_amax.begin(), tile_amax.end(), 0u);
        for (int64_t r = b * 128; r < (b + 1) * 128; ++r) {
          const float* x = load_row<T>(a.w, r * k, k, fb);
          for (int64_t t = 0; t < tiles; ++t) tile_amax[t] = std::max(tile_amax[t], amax_bits(x + t * 128, 128));
        }
        for (int64_t t = 0; t < tiles; ++t) {
          if (tile_amax[t] >= kInfBits) {
            j.bad->store(1);
            return;
          }
          if (j.compute) scale[t] = positive(float_of(tile_amax[t]) / kE4M3Max);
        }
        for (int64_t r = b * 128; r < (b + 1) * 128; ++r) {
          const float* x = load_row<T>(a.w, r * k, k, fb);
          for (int64_t t = 0; t < tiles; ++t) fp8_row(x + t * 128, 128, scale[t], j.out + r * k + t * 128);
        }
      }
      return;
    }
    case Op::kMx: {  // as kNvfp4 below: block amax, block exponents, then elements
      const double emax = j.fp4 ? 6.0 : 448.0;
      const int64_t blocks = k / 32;
      std::vector<uint32_t> bm(blocks);
      std::vector<float> mul(blocks);
      for (int64_t r = u0; r < u1; ++r) {
        const float* x = load_row<T>(a.w, r * k, k, fb);
        uint8_t* e8 = j.block_out + r * blocks;
        if (!block_amax<32>(j, x, blocks, bm.data())) return;
        for (int64_t bi = 0; bi < blocks; ++bi) {
          const int e = mx_exponent(float_of(bm[bi]), emax);
          e8[bi] = static_cast<uint8_t>(e + kE8M0Bias);
          mul[bi] = pow2(-e);  // x / 2^e == x * 2^-e: both are the rounded exact product
        }
        for (int64_t bi = 0; bi < blocks; ++bi) {
          const float* xb = x + bi * 32;
          const float f = mul[bi];
          if (j.fp4) {
            uint8_t* c = codes.data() + bi * 32;
            for (int i = 0; i < 32; ++i) c[i] = e2m1_code(xb[i] * f);
          } else {
            uint8_t* o = j.out + r * k + bi * 32;
            for (int i = 0; i < 32; ++i) o[i] = e4m3_code(clamp_e4m3(xb[i] * f));
          }
        }
        if (j.fp4) pack_fp4(codes.data(), k, j.out + r * (k / 2));
      }
      return;
    }
    case Op::kNvfp4: {
      // One row in three passes the compiler vectorises: block amax; the block scales (s8)
      // and divisors of every block; then codes, two per byte. The arithmetic per element is
      // the reference's, only its order across elements changes.
      const int64_t blocks = k / 16;
      std::vector<uint32_t> bm(blocks);
      std::vector<float> denom(blocks), div(k);
      for (int64_t r = u0; r < u1; ++r) {
        const float* x = load_row<T>(a.w, r * k, k, fb);
        const float g = j.scale[r / j.rows_per_group];
        const float six_g = 6.0f * g;  // FP4_E2M1_MAX * gr
        uint8_t* bs = j.block_out + r * blocks;
        if (!block_amax<16>(j, x, blocks, bm.data())) return;
        for (int64_t bi = 0; bi < blocks; ++bi) {
          float s = float_of(bm[bi]) / six_g;
          s = s == 0.0f ? 1.0f : s;
          s = s < 0.001953125f ? 0.001953125f : s;  // clamp(2^-9, 448)
          s = s > kE4M3Max ? kE4M3Max : s;
          const uint8_t s8 = e4m3_code(s);
          bs[bi] = s8;
          denom[bi] = e4m3_value(s8) * g;  // s8.float() * gr
        }
        // every element's divisor, so the code loop below is one flat loop over the row
        for (int64_t bi = 0; bi < blocks; ++bi)
          for (int i = 0; i < 16; ++i) div[bi * 16 + i] = denom[bi];
        uint8_t* c = codes.data();
        for (int64_t i = 0; i < k; ++i) c[i] = e2m1_code(x[i] / div[i]);
        pack_fp4(c, k, j.out + r * (k / 2));
      }
      return;
    }
  }
}

using Worker = void (*)(const Job&, int64_t, int64_t);

template <InputType T>
void run_base(const Job& j, int64_t u0, int64_t u1) {
  run_impl<T>(j, u0, u1);
}

#if LLMQ_FP_X86
template <InputType T>
__attribute__((target("avx2,f16c"))) void run_avx2(const Job& j, int64_t u0, int64_t u1) {
  run_impl<T>(j, u0, u1);
}

template <InputType T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c"))) void run_avx512(const Job& j, int64_t u0,
                                                                                   int64_t u1) {
  run_impl<T>(j, u0, u1);
}
#endif

template <InputType T>
Worker worker_for_type(Isa isa) {
#if LLMQ_FP_X86
  if (isa == Isa::kAvx512) return &run_avx512<T>;
  if (isa == Isa::kAvx2) return &run_avx2<T>;
#endif
  (void)isa;
  return &run_base<T>;
}

Worker worker_for(InputType t, Isa isa) {
  return dispatch_input(t, [isa](auto type) { return worker_for_type<decltype(type)::value>(isa); });
}

// Runs the job over units [0, units) (rows or bands of elements_per_unit), split into
// contiguous ranges across threads; the calling thread takes the first range.
void parallel_run(const Job& j, int64_t units, int64_t elements_per_unit) {
  if (units <= 0) return;
  const Isa isa = j.a->isa == Isa::kAuto ? detect_isa() : j.a->isa;
  const Worker w = worker_for(j.a->input, isa);
  int threads = j.a->threads > 0 ? j.a->threads : default_threads();
  const int64_t by_size = std::max<int64_t>(1, units * elements_per_unit / kMinElementsPerThread);
  threads = static_cast<int>(std::min<int64_t>({threads, by_size, units}));
  if (threads <= 1) {
    w(j, 0, units);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  const int64_t per = units / threads, extra = units % threads;
  int64_t u0 = per + (extra > 0 ? 1 : 0);
  const int64_t first_end = u0;
  for (int t = 1; t < threads; ++t) {
    const int64_t u1 = u0 + per + (t < extra ? 1 : 0);
    pool.emplace_back(w, std::cref(j), u0, u1);
    u0 = u1;
  }
  w(j, 0, first_end);
  for (auto& th : pool) th.join();
}

// parallel_run with a fresh NaN/Inf flag: kNotFinite if any worker saw one.
Status run_checked(Job j, int64_t units, int64_t elements_per_unit) {
  std::atomic<int> bad{0};
  j.bad = &bad;
  parallel_run(j, units, elements_per_unit);
  return bad.load() ? Status::kNotFinite : Status::kOk;
}

void require(const MatrixArgs& a, int64_t block) {
  const std::string err = check_fp_args(a, block);
  if (!err.empty()) throw std::invalid_argument(err);
}

// Per-group amax of |w| (group = rows_per_group consecutive rows) as float32 values; false
// if a NaN or Inf is present.
bool group_amax(const MatrixArgs& a, int64_t rows_per_group, std::vector<float>* out) {
  const int64_t groups = a.rows / rows_per_group;
  std::vector<std::atomic<uint32_t>> amax(groups);
  for (auto& m : amax) m.store(0);
  Job j(&a, Op::kAmax);
  j.rows_per_group = rows_per_group;
  j.amax = amax.data();
  parallel_run(j, a.rows, a.k);
  out->resize(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const uint32_t m = amax[g].load();
    if (m >= kInfBits) return false;
    (*out)[g] = float_of(m);
  }
  return true;
}

// scale[g] = amax of group g / divisor (1 where that is not positive); false on a NaN or Inf.
bool group_scales(const MatrixArgs& a, int64_t rows_per_group, float divisor, float* scale) {
  std::vector<float> amax;
  if (!group_amax(a, rows_per_group, &amax)) return false;
  for (size_t g = 0; g < amax.size(); ++g) scale[g] = positive(amax[g] / divisor);
  return true;
}

}  // namespace

std::string check_fp_args(const MatrixArgs& a, int64_t block) {
  if (block != 1 && block != 16 && block != 32 && block != 128) return "block must be 1, 16, 32 or 128";
  if (a.rows < 0 || a.k <= 0) return "expected rows >= 0 and k > 0";
  if (a.k % block) return "K=" + std::to_string(a.k) + " is not a multiple of " + std::to_string(block);
  if (a.rows > 0 && !a.w) return "null pointer argument";
  return check_threads_isa(a);
}

Status quantize_fp8(const MatrixArgs& a, Fp8Granularity granularity, int64_t rows_per_scale, bool compute_scale,
                    float* scale, uint8_t* out) {
  require(a, granularity == Fp8Granularity::kBlock128 ? 128 : 1);
  if (granularity == Fp8Granularity::kBlock128 && a.rows % 128)
    throw std::invalid_argument("FP8 block128 needs rows to be a multiple of 128");
  if (granularity == Fp8Granularity::kTensor && (rows_per_scale <= 0 || a.rows % rows_per_scale))
    throw std::invalid_argument("rows_per_scale must divide rows");
  if (a.rows > 0 && (!scale || !out)) throw std::invalid_argument("null pointer argument");
  if (a.rows == 0) return Status::kOk;
  Job j(&a, granularity == Fp8Granularity::kBlock128 ? Op::kFp8Bands : Op::kFp8Rows, scale, out);
  j.gran = granularity;
  j.compute = compute_scale;
  if (granularity == Fp8Granularity::kBlock128) return run_checked(j, a.rows / 128, 128 * a.k);
  if (granularity == Fp8Granularity::kTensor && compute_scale && !group_scales(a, rows_per_scale, kE4M3Max, scale))
    return Status::kNotFinite;
  j.rows_per_group = granularity == Fp8Granularity::kTensor ? rows_per_scale : 1;
  return run_checked(j, a.rows, a.k);
}

Status quantize_mx(const MatrixArgs& a, bool fp4, uint8_t* codes, uint8_t* scale_e8m0) {
  require(a, 32);
  if (a.rows > 0 && (!codes || !scale_e8m0)) throw std::invalid_argument("null pointer argument");
  if (a.rows == 0) return Status::kOk;
  Job j(&a, Op::kMx, nullptr, codes, scale_e8m0);
  j.fp4 = fp4;
  return run_checked(j, a.rows, a.k);
}

Status quantize_nvfp4(const MatrixArgs& a, int64_t rows_per_global, bool compute_global, float* global_scale,
                      uint8_t* codes, uint8_t* block_scale) {
  require(a, 16);
  if (rows_per_global <= 0 || a.rows % rows_per_global) throw std::invalid_argument("rows_per_global must divide rows");
  if (a.rows > 0 && (!codes || !block_scale || !global_scale)) throw std::invalid_argument("null pointer argument");
  if (a.rows == 0) return Status::kOk;
  // nvfp4_global_scale: amax / (6 * 448), 1.0 where that is not positive
  if (compute_global && !group_scales(a, rows_per_global, 2688.0f, global_scale)) return Status::kNotFinite;
  Job j(&a, Op::kNvfp4, global_scale, codes, block_scale);
  j.rows_per_group = rows_per_global;
  return run_checked(j, a.rows, a.k);
}

Status abs_max(const MatrixArgs& a, int64_t rows_per_group, float* amax) {
  require(a, 1);
  if (rows_per_group <= 0 || a.rows % rows_per_group) throw std::invalid_argument("rows_per_group must divide rows");
  if (a.rows > 0 && !amax) throw std::invalid_argument("null pointer argument");
  if (a.rows == 0) return Status::kOk;
  std::vector<float> m;
  if (!group_amax(a, rows_per_group, &m)) return Status::kNotFinite;
  std::copy(m.begin(), m.end(), amax);
  return Status::kOk;
}

uint8_t e4m3_from_float(float x) { return e4m3_code(x); }
float e4m3_to_float(uint8_t code) { return e4m3_value(code); }
uint8_t e2m1_from_float(float x) { return e2m1_code(x); }

}  // namespace llmq_quant
