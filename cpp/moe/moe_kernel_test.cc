// Unit test for the packing and the GEMM tile (plain asserts; exit code 0 = pass).
//   g++ -O2 -std=c++17 cpp/moe/moe_kernel_test.cc cpp/moe/moe_kernel.cc cpp/moe/thread_pool.cc -lpthread
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cpp/common/check.h"
#include "moe_kernel.h"
#include "thread_pool.h"

using namespace llmq_moe;

struct Canonical {
  int64_t n, k;
  int bits, gs;
  std::vector<uint8_t> q;       // unpacked values [n, k]
  std::vector<uint8_t> packed;  // canonical LSB-first stream [n, k*bits/8]
  std::vector<float> scale, bias;
};

static Canonical random_canonical(int64_t n, int64_t k, int bits, int gs, std::mt19937& rng) {
  Canonical c{n, k, bits, gs, {}, {}, {}, {}};
  std::uniform_int_distribution<int> qd(0, (1 << bits) - 1);
  std::uniform_real_distribution<float> sd(0.001f, 0.02f), bd(-0.5f, 0.5f);
  c.q.resize(n * k);
  for (auto& v : c.q) v = static_cast<uint8_t>(qd(rng));
  c.packed.assign(n * k * bits / 8, 0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < k; ++i) {
      const uint8_t v = c.q[r * k + i];
      if (bits == 8) c.packed[r * k + i] = v;
      else c.packed[r * k / 2 + i / 2] |= static_cast<uint8_t>(v << (4 * (i & 1)));
    }
  c.scale.resize(n * (k / gs));
  c.bias.resize(n * (k / gs));
  for (auto& v : c.scale) v = sd(rng);
  for (auto& v : c.bias) v = bd(rng);
  return c;
}

// A canonical matrix in the kernel's tiled layout; `m` points into q and sb.
struct Packed {
  QMatrix m;
  std::vector<uint8_t> q;
  std::vector<float> sb;
};

static Packed pack(const Canonical& c) {
  Packed p;
  p.m.n = c.n, p.m.k = c.k, p.m.bits = c.bits, p.m.group_size = c.gs;
  p.q.resize(p.m.matrix_qbytes());
  p.sb.resize(p.m.matrix_sbfloats());
  pack_matrix(c.packed.data(), c.scale.data(), c.bias.data(), c.n, c.k, c.bits, c.gs, p.q.data(), p.sb.data());
  p.m.qdata = p.q.data();
  p.m.sb = p.sb.data();
  return p;
}

// Packing: every element lands where the header's formula says.
static void test_pack(int bits, int gs, std::mt19937& rng) {
  const int64_t n = 32, k = 4 * gs;
  Canonical c = random_canonical(n, k, bits, gs, rng);
  Packed p = pack(c);
  const std::vector<uint8_t>& q = p.q;
  const std::vector<float>& sb = p.sb;
  const int64_t groups = k / gs, per = bits == 4 ? 8 : 4, steps = gs / per;
  for (int64_t row = 0; row < n; ++row)
    for (int64_t col = 0; col < k; ++col) {
      const int64_t t = row / 16, r = row % 16, g = col / gs, s = (col % gs) / per, j = (col % gs) % per;
      const uint8_t byte = q[((t * groups + g) * steps + s) * 64 + r * 4 + (j % 4)];
      const int got = bits == 8 ? byte : (j < 4 ? (byte & 0xF) : (byte >> 4));
      CHECK(got == c.q[row * k + col], "pack bits=%d gs=%d row=%ld col=%ld", bits, gs, (long)row, (long)col);
    }
  for (int64_t row = 0; row < n; ++row)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t base = (row / 16 * groups + g) * 32 + row % 16;
      CHECK(sb[base] == c.scale[row * groups + g] && sb[base + 16] == c.bias[row * groups + g], "pack sb");
    }
}

// The vector paths this CPU can run (each must match the scalar path bit for bit).
static std::vector<Isa> fast_isas() {
  std::vector<Isa> out;
  if (detect_isa() == Isa::kAvx512Vnni) out = {Isa::kAvx2, Isa::kAvx512Vnni};
  else if (detect_isa() == Isa::kAvx2) out = {Isa::kAvx2};
  return out;
}

// GEMM tile: against float64 sum_k (scale*q + bias) * (a*xq) from the canonical values,
// and every ISA path bit-identical to the scalar one.
static void test_tile(int bits, int gs, int nt, int mcount, std::mt19937& rng) {
  const int64_t n = 64, k = 4 * gs;
  Canonical c = random_canonical(n, k, bits, gs, rng);
  Packed p = pack(c);
  const QMatrix& m = p.m;
  const std::vector<float>& sb = p.sb;
  std::normal_distribution<float> xd(0.f, 1.f);
  const int64_t groups = k / gs;
  std::vector<float> x(mcount * k), as(mcount * groups), asum(mcount * groups);
  std::vector<int8_t> xq(mcount * k);
  for (auto& v : x) v = xd(rng);
  const int8_t* rows[4];
  const float *srows[4], *sumrows[4];
  for (int i = 0; i < mcount; ++i) {
    quantize_row(x.data() + i * k, k, gs, xq.data() + i * k, as.data() + i * groups, asum.data() + i * groups,
                 Isa::kScalar);
    rows[i] = xq.data() + i * k;
    srows[i] = as.data() + i * groups;
    sumrows[i] = asum.data() + i * groups;
  }
  const int64_t tiles[2] = {1, 3};
  std::vector<float> out(mcount * nt * 16), out_fast(mcount * nt * 16);
  gemm_tile(m, tiles, nt, rows, srows, sumrows, mcount, out.data(), Isa::kScalar);
  for (int i = 0; i < mcount; ++i)
    for (int t = 0; t < nt; ++t)
      for (int r = 0; r < 16; ++r) {
        const int64_t row = tiles[t] * 16 + r;
        double ref = 0, mag = 0;
        for (int64_t col = 0; col < k; ++col) {
          const int64_t g = col / gs;
          const double xv = static_cast<double>(as[i * groups + g]) * xq[i * k + col];
          const double ws = static_cast<double>(c.scale[row * groups + g]) * c.q[row * k + col];
          ref += (ws + c.bias[row * groups + g]) * xv;
          mag += (std::fabs(ws) + std::fabs(c.bias[row * groups + g])) * std::fabs(xv);
        }
        const double got = out[i * nt * 16 + t * 16 + r];
        // fp32: 2 fma per group, groups summed in order
        const double tol = 4.0 * (groups + 2) * 1.1920929e-07 * mag;
        CHECK(std::fabs(got - ref) <= tol, "tile bits=%d gs=%d m=%d: got %g want %g", bits, gs, i, got, ref);
      }
  for (Isa isa : fast_isas()) {
    gemm_tile(m, tiles, nt, rows, srows, sumrows, mcount, out_fast.data(), isa);
    CHECK(out == out_fast, "isa %s differs from scalar (bits=%d gs=%d nt=%d m=%d)", isa_name(isa), bits, gs, nt,
          mcount);
    std::vector<int8_t> xq2(k);
    std::vector<float> as2(groups), sum2(groups);
    quantize_row(x.data(), k, gs, xq2.data(), as2.data(), sum2.data(), isa);
    CHECK(std::equal(xq2.begin(), xq2.end(), xq.begin()) && as2 == std::vector<float>(as.begin(), as.begin() + groups),
          "quantize_row differs between paths (%s)", isa_name(isa));
  }
  // bfloat16 scale/bias: the same result, bit for bit on every path, as float32 scale/bias
  // holding the bfloat16-rounded values (round to nearest even, done here independently).
  std::vector<uint16_t> sb16(sb.size());
  std::vector<float> sb_rounded(sb.size());
  for (size_t i = 0; i < sb.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &sb[i], 4);
    u += 0x7FFF + ((u >> 16) & 1);
    sb16[i] = static_cast<uint16_t>(u >> 16);
    const uint32_t back = static_cast<uint32_t>(sb16[i]) << 16;
    std::memcpy(&sb_rounded[i], &back, 4);
  }
  QMatrix m16 = m, mr = m;
  m16.sb = nullptr;
  m16.sb16 = sb16.data();
  mr.sb = sb_rounded.data();
  std::vector<Isa> all = fast_isas();
  all.push_back(Isa::kScalar);
  for (Isa isa : all) {
    std::vector<float> o16(out.size()), orr(out.size());
    gemm_tile(m16, tiles, nt, rows, srows, sumrows, mcount, o16.data(), isa);
    gemm_tile(mr, tiles, nt, rows, srows, sumrows, mcount, orr.data(), isa);
    CHECK(o16 == orr, "bf16 scale/bias differ from their float32 widening (isa %s, bits=%d gs=%d nt=%d m=%d)",
          isa_name(isa), bits, gs, nt, mcount);
  }
}

// Every item runs exactly once per call, also when calls are tiny and back to back (the
// case where a helper wakes up after the caller has closed the job).
static void test_pool() {
  std::vector<std::atomic<int>> hits(1000);
  for (int round = 0; round < 50; ++round)
    ThreadPool::instance().parallel_for(1000, 3, [&](int64_t i) { hits[i].fetch_add(1); });
  for (auto& h : hits) CHECK(h.load() == 50, "parallel_for ran an item %d times in 50 rounds", h.load());
  std::vector<std::atomic<int>> small(3);
  for (int round = 0; round < 20000; ++round)
    ThreadPool::instance().parallel_for(3, 3, [&](int64_t i) { small[i].fetch_add(1); });
  for (auto& h : small) CHECK(h.load() == 20000, "small parallel_for: %d of 20000", h.load());
}

int main() {
  std::mt19937 rng(1234);
  for (int bits : {4, 8})
    for (int gs : {32, 64, 128}) {
      test_pack(bits, gs, rng);
      for (int nt : {1, 2})
        for (int m = 1; m <= 4; ++m) test_tile(bits, gs, nt, m, rng);
    }
  CHECK(!check_layout(32, 96, 4, 64).empty(), "gs not dividing K accepted");
  CHECK(!check_layout(24, 64, 4, 32).empty(), "N %% 16 != 0 accepted");
  CHECK(!check_layout(32, 64, 3, 32).empty(), "3-bit accepted");
  test_pool();
  std::printf("isa: %s, %s\n", isa_name(detect_isa()), check_failures() ? "FAILED" : "all passed");
  return check_failures() ? 1 : 0;
}
