// Unit test of the quantization kernel (plain asserts; exit code 0 = pass):
//   * a hand-checked row (half-to-even ties, LSB-first nibble order),
//   * every ISA path this CPU has == a straightforward per-element reference written here,
//     bit for bit, over bits 2..8, both modes, three input types, odd group sizes,
//   * NaN/Inf and overflowing ranges are reported, bad arguments rejected,
//   * count_nonfinite agrees with std::isnan / std::isinf on all three input types.
//   g++ -O2 -std=c++17 -ffp-contract=off cpp/quant/quant_kernel_test.cc cpp/quant/quant_kernel.cc -lpthread
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "cpp/common/bits.h"
#include "cpp/common/check.h"
#include "quant_kernel.h"

using namespace llmq_quant;

using llmq_bits::bits_to_float;
using llmq_bits::float_to_bits;
struct Result {
  std::vector<uint8_t> q;
  std::vector<float> scale, bias;
};

// The rules of docs/formats.md section 4, one element at a time, unpacked then packed bit by bit.
static Result reference(const std::vector<float>& w, int64_t rows, int64_t k, int bits, int64_t gs, bool sym) {
  const int64_t groups = k / gs;
  Result r;
  r.q.assign(rows * k * bits / 8, 0);
  r.scale.resize(rows * groups);
  r.bias.resize(rows * groups);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      float lo = 0.0f, hi = 0.0f;  // min(min, 0), max(max, 0)
      for (int64_t j = 0; j < gs; ++j) {
        const float x = w[i * k + g * gs + j];
        if (x < lo) lo = x;
        if (x > hi) hi = x;
      }
      float scale, add;
      if (sym) {
        const float amax = -lo > hi ? -lo : hi;
        scale = amax / ((float)((1 << bits) - 1) / 2.0f);
        if (scale < FLT_MIN) scale = FLT_MIN;
        add = (float)(1 << (bits - 1));
        r.bias[i * groups + g] = scale * -add;
      } else {
        scale = (hi - lo) / (float)((1 << bits) - 1);
        if (scale < FLT_MIN) scale = FLT_MIN;
        // keep 24-bits significant bits, nearest, ties to even (via the bit pattern)
        const uint32_t u = float_to_bits(scale), ulp = 1u << bits, rest = u & (ulp - 1), base = u - rest;
        const bool up = rest > ulp / 2 || (rest == ulp / 2 && (base & ulp));
        scale = bits_to_float(up ? base + ulp : base);
        add = -std::nearbyint(lo / scale) + 0.0f;
        if (add < 0) add = 0;
        if (add > (float)((1 << bits) - 1)) add = (float)((1 << bits) - 1);
        r.bias[i * groups + g] = 0.0f - add * scale;
      }
      r.scale[i * groups + g] = scale;
      const float inv = 1.0f / scale;
      for (int64_t j = 0; j < gs; ++j) {
        float v = std::nearbyint(w[i * k + g * gs + j] * inv) + add;
        v = v < 0 ? 0 : (v > (float)((1 << bits) - 1) ? (float)((1 << bits) - 1) : v);
        const uint32_t q = (uint32_t)v;
        const int64_t bit0 = (i * k + g * gs + j) * bits;  // rows are whole bytes, so global = row-local
        for (int b = 0; b < bits; ++b)
          if (q >> b & 1) r.q[(bit0 + b) / 8] |= (uint8_t)(1u << ((bit0 + b) % 8));
      }
    }
  return r;
}

static uint16_t to_bf16(float f) { return (uint16_t)(float_to_bits(f) >> 16); }  // truncation: any bf16 will do

static Status run(const void* w, InputType t, int64_t rows, int64_t k, int bits, int64_t gs, bool sym, Isa isa,
                  int threads, Result* out) {
  out->q.assign(rows * k * bits / 8, 0xAA);
  out->scale.assign(rows * (k / gs), -1.0f);
  out->bias.assign(rows * (k / gs), -1.0f);
  QuantizeArgs a;
  a.w = w;
  a.input = t;
  a.rows = rows;
  a.k = k;
  a.bits = bits;
  a.group_size = gs;
  a.symmetric = sym;
  a.qdata = out->q.data();
  a.scale = out->scale.data();
  a.bias = out->bias.data();
  a.threads = threads;
  a.isa = isa;
  return quantize(a);
}

static bool same(const Result& a, const Result& b) {
  if (a.q != b.q || a.scale.size() != b.scale.size()) return false;
  for (size_t i = 0; i < a.scale.size(); ++i)
    if (float_to_bits(a.scale[i]) != float_to_bits(b.scale[i]) || float_to_bits(a.bias[i]) != float_to_bits(b.bias[i]))
      return false;
  return true;
}

static void test_hand_checked_row() {
  // scale = 7.5 / 7.5 = 1: w + 8 rounded half to even, nibbles LSB first
  std::vector<float> w(16);
  for (int i = 0; i < 16; ++i) w[i] = -7.5f + i;
  Result r;
  CHECK(run(w.data(), InputType::kFloat32, 1, 16, 4, 16, true, Isa::kAuto, 1, &r) == Status::kOk, "status");
  // round(-7.5..7.5) = -8,-6,-6,-4,-4,-2,-2,0,0,2,2,4,4,6,6,8 -> +8, clamp 15
  const uint8_t want[8] = {0x20, 0x42, 0x64, 0x86, 0xA8, 0xCA, 0xEC, 0xFE};
  CHECK(std::memcmp(r.q.data(), want, 8) == 0, "packed row %02x %02x ...", r.q[0], r.q[1]);
  CHECK(r.scale[0] == 1.0f && r.bias[0] == -8.0f, "scale %g bias %g", r.scale[0], r.bias[0]);
}

static void test_paths_match_reference() {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ed(-130, 100);
  const Isa best = detect_isa();
  const struct {
    int64_t k, gs;
  } layouts[] = {{64, 16}, {96, 32}, {96, 24}, {128, 128}, {40, 40}, {512, 64}};
  for (const auto& l : layouts)
    for (int bits = 2; bits <= 8; ++bits)
      for (int sym = 0; sym <= 1; ++sym) {
        const int64_t rows = 9, k = l.k, gs = l.gs;
        std::vector<float> w(rows * k);
        for (int64_t i = 0; i < rows; ++i) {
          const float mag = std::ldexp(1.0f, ed(rng) / (i % 3 == 0 ? 1 : 8));  // some rows subnormal/tiny
          for (int64_t j = 0; j < k; ++j) w[i * k + j] = (i == 4 ? 0.0f : nd(rng) * mag);
        }
        // the bf16 input and its exact float32 value
        std::vector<uint16_t> wb(w.size());
        std::vector<float> wbf(w.size());
        for (size_t i = 0; i < w.size(); ++i) {
          wb[i] = to_bf16(w[i]);
          wbf[i] = bits_to_float((uint32_t)wb[i] << 16);
        }
        const Result want = reference(w, rows, k, bits, gs, sym), want_bf = reference(wbf, rows, k, bits, gs, sym);
        for (int isa = 1; isa <= (int)best; ++isa)
          for (int threads : {1, 3}) {
            Result got;
            CHECK(run(w.data(), InputType::kFloat32, rows, k, bits, gs, sym, (Isa)isa, threads, &got) == Status::kOk &&
                      same(got, want),
                  "fp32 k=%ld gs=%ld bits=%d sym=%d isa=%s", (long)k, (long)gs, bits, sym, isa_name((Isa)isa));
            CHECK(
                run(wb.data(), InputType::kBFloat16, rows, k, bits, gs, sym, (Isa)isa, threads, &got) == Status::kOk &&
                    same(got, want_bf),
                "bf16 k=%ld gs=%ld bits=%d sym=%d isa=%s", (long)k, (long)gs, bits, sym, isa_name((Isa)isa));
          }
      }
}

static void test_float16_input() {
  // binary16 values whose float32 value is known exactly: i/64 for |i| < 2048, and subnormals
  std::vector<uint16_t> h;
  std::vector<float> f;
  for (int i = -1000; i < 1048; i += 1) {
    const float v = i / 64.0f;
    uint16_t bits = 0;
    if (v != 0.0f) {
      int e;
      const float m = std::frexp(std::fabs(v), &e);  // v = m * 2^e, m in [0.5, 1)
      bits = (uint16_t)(((e - 1 + 15) << 10) | ((uint32_t)(m * 2048.0f) & 0x3ff));
      if (v < 0) bits |= 0x8000;
    }
    h.push_back(bits);
    f.push_back(v);
  }
  h.resize(2048 - 32);
  f.resize(2048 - 32);
  for (int i = 0; i < 32; ++i) {  // subnormals: i * 2^-24
    h.push_back((uint16_t)i);
    f.push_back(std::ldexp((float)i, -24));
  }
  const Result want = reference(f, 16, 128, 4, 32, false);
  for (int isa = 1; isa <= (int)detect_isa(); ++isa) {
    Result got;
    CHECK(
        run(h.data(), InputType::kFloat16, 16, 128, 4, 32, false, (Isa)isa, 2, &got) == Status::kOk && same(got, want),
        "fp16 isa=%s", isa_name((Isa)isa));
  }
}

static void test_errors() {
  for (int isa = 1; isa <= (int)detect_isa(); ++isa) {
    for (float bad : {NAN, INFINITY, -INFINITY}) {
      std::vector<float> w(4 * 64, 0.5f);
      w[2 * 64 + 37] = bad;
      Result r;
      CHECK(run(w.data(), InputType::kFloat32, 4, 64, 4, 32, true, (Isa)isa, 2, &r) == Status::kNotFinite,
            "non-finite %g not reported (isa=%s)", bad, isa_name((Isa)isa));
    }
    std::vector<float> w(64, 0.0f);
    w[3] = -3e38f;
    w[40] = 3e38f;
    Result r;
    CHECK(run(w.data(), InputType::kFloat32, 1, 64, 4, 64, false, (Isa)isa, 1, &r) == Status::kRangeOverflow,
          "overflowing range not reported (isa=%s)", isa_name((Isa)isa));
  }
  QuantizeArgs a;
  a.k = 48;
  a.rows = 1;
  a.group_size = 32;
  CHECK(!check_args(a).empty(), "group size not dividing K accepted");
  a.group_size = 16;
  a.bits = 3;
  a.k = 20;
  CHECK(!check_args(a).empty(), "3-bit with K not a multiple of 8 accepted");
  bool threw = false;
  try {
    quantize(a);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw, "quantize accepted bad arguments");
}

// Random finite values with NaN/Inf of both signs and every mantissa kind sprinkled in, over
// lengths that straddle the 16384-element block; counted via std::isnan / std::isinf on the
// float32 value (bf16/fp16 widened exactly).
static void test_count_nonfinite() {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> val(-3.0f, 3.0f);
  const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, bits_to_float(0x7F800001u), bits_to_float(0xFFC12345u)};
  for (int64_t n : {0, 1, 31, 16384, 16385, 70000}) {
    std::vector<float> w(n);
    std::vector<uint16_t> b(n), h(n);
    int64_t want_nan = 0, want_inf = 0;
    for (int64_t i = 0; i < n; ++i) {
      w[i] = (gen() % 97 == 0) ? specials[gen() % 6] : val(gen);
      want_nan += std::isnan(w[i]);
      want_inf += std::isinf(w[i]);
      b[i] = static_cast<uint16_t>(float_to_bits(w[i]) >> 16);  // truncation keeps specials special
    }
    NonFiniteCounts c = count_nonfinite(w.data(), InputType::kFloat32, n);
    CHECK(c.nan == want_nan && c.inf == want_inf, "fp32 n=%lld: %lld/%lld vs %lld/%lld", (long long)n, (long long)c.nan,
          (long long)c.inf, (long long)want_nan, (long long)want_inf);
    // bf16: counted on the truncated values themselves (0x7F800001, a NaN, truncates to Inf)
    int64_t bn = 0, bi = 0, hn = 0, hi = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float wb = bits_to_float(static_cast<uint32_t>(b[i]) << 16);
      bn += std::isnan(wb);
      bi += std::isinf(wb);
      // fp16 patterns: exponent field (bits 10..14) all ones <=> special
      h[i] = static_cast<uint16_t>(gen());
      const bool special = (h[i] & 0x7C00) == 0x7C00;
      hn += special && (h[i] & 0x03FF);
      hi += special && !(h[i] & 0x03FF);
    }
    c = count_nonfinite(b.data(), InputType::kBFloat16, n);
    CHECK(c.nan == bn && c.inf == bi && bn + bi == want_nan + want_inf, "bf16 n=%lld: %lld/%lld vs %lld/%lld",
          (long long)n, (long long)c.nan, (long long)c.inf, (long long)bn, (long long)bi);
    c = count_nonfinite(h.data(), InputType::kFloat16, n);
    CHECK(c.nan == hn && c.inf == hi, "fp16 n=%lld: %lld/%lld vs %lld/%lld", (long long)n, (long long)c.nan,
          (long long)c.inf, (long long)hn, (long long)hi);
  }
}

int main() {
  std::printf("best isa: %s\n", isa_name(detect_isa()));
  test_hand_checked_row();
  test_paths_match_reference();
  test_float16_input();
  test_errors();
  test_count_nonfinite();
  if (check_failures()) {
    std::fprintf(stderr, "%d failure(s)\n", check_failures());
    return 1;
  }
  std::printf("all passed\n");
  return 0;
}
