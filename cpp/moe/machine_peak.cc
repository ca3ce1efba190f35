// Register-only throughput loops that measure this machine's peak arithmetic rate per
// instruction set, so the benchmark can report kernels as a fraction of what the cores can
// do (not of a datasheet number). Each loop keeps 12 independent accumulators to cover
// latency; ops are counted as 2 per multiply-accumulate.
#include "machine_peak.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace llmq_moe {
namespace {

constexpr int kAcc = 12;
constexpr int64_t kIters = 1 << 16;

#if defined(__x86_64__)
// Every instruction set the loops below use: the one loop is compiled for all of them, and each caller
// runs it only where the CPU has the instruction its `step` issues (measure_peak_gops checks).
#define LLMQ_PEAK_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,avx512vnni,fma")))

// kAcc accumulators, each stepped kIters times by `step` (one instruction doing `macs`
// multiply-accumulates); returns ops done; `sink` keeps the result alive. Integer steps see the
// accumulators' bits as int32 lanes (the casts cost no instruction).
template <class Step>
LLMQ_PEAK_TARGET double peak_loop(float* sink, int macs, Step step) {
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  for (int64_t it = 0; it < kIters; ++it)
    for (int i = 0; i < kAcc; ++i) acc[i] = step(acc[i]);
  __m512 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm512_add_ps(s, acc[i]);
  *sink = _mm512_reduce_add_ps(s);
  return 2.0 * macs * kAcc * kIters;
}

__attribute__((target("avx512f,fma"))) double loop_fp32(float* sink) {
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.0001f);
  return peak_loop(sink, 16, [=](__m512 acc) LLMQ_PEAK_TARGET { return _mm512_fmadd_ps(acc, a, b); });
}

__attribute__((target("avx512f,avx512bf16"))) double loop_bf16(float* sink) {
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3a80);
  return peak_loop(sink, 32, [=](__m512 acc) LLMQ_PEAK_TARGET { return _mm512_dpbf16_ps(acc, a, b); });
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) double loop_vnni(float* sink) {
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  return peak_loop(sink, 64, [=](__m512 acc) LLMQ_PEAK_TARGET {
    return _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(acc), a, b));
  });
}
#endif

}  // namespace

double measure_peak_gops(const std::string& kind, int threads, double seconds) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  double (*fn)(float*) = nullptr;
  if (kind == "fp32_fma" && __builtin_cpu_supports("avx512f")) fn = loop_fp32;
  if (kind == "bf16_dot" && __builtin_cpu_supports("avx512bf16")) fn = loop_bf16;
  if (kind == "int8_vnni" && __builtin_cpu_supports("avx512vnni")) fn = loop_vnni;
  if (!fn) throw std::invalid_argument("no AVX-512 peak loop for '" + kind + "' on this CPU");
  std::vector<double> ops(threads, 0.0);
  std::vector<float> sinks(threads * 16);
  auto start = std::chrono::steady_clock::now();
  auto work = [&](int t) {
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds)
      ops[t] += fn(&sinks[t * 16]);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double total = 0;
  for (double o : ops) total += o;
  return total / elapsed * 1e-9;
#else
  (void)kind, (void)threads, (void)seconds;
  throw std::invalid_argument("peak loops exist for x86-64 AVX-512 only");
#endif
}

#if defined(__x86_64__)
namespace {
// Sums n bytes (a multiple of 256) in 64-byte loads; with kPrefetch > 0 each 256-byte step
// also prefetches that far ahead, as the MoE kernel's decode loop does. The probe keeps the
// better of the two so the measured "limit" is never below what the kernel's own access
// pattern can draw from memory (on this VM the prefetching loop reads ~5% faster).
template <int kPrefetch>
__attribute__((target("avx512f"))) int64_t sum_bytes_avx512(const char* p, int64_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 256 <= n; i += 256) {
    if (kPrefetch > 0)
      for (int c = 0; c < 256; c += 64) _mm_prefetch(p + i + kPrefetch + c, _MM_HINT_T0);
    a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 192));
  }
  return _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
}
}  // namespace
#endif

double measure_read_gbps(int threads, int64_t bytes, int repeats) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx512f")) throw std::invalid_argument("read loop needs AVX-512");
  std::vector<char> buf(bytes);
  const int64_t part = bytes / threads / 256 * 256;
  // first touch by the reading threads (pages land where they are read)
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { std::memset(buf.data() + t * part, t + 1, part); });
  for (auto& th : pool) th.join();
  double best = 0;
  std::vector<int64_t> sinks(threads);
  for (int r = 0; r < repeats; ++r) {
    pool.clear();
    auto start = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t, r] {
        // alternate the plain and the prefetching loop (the end of a part is never prefetched past
        // the buffer: part is a multiple of 256 and the prefetch hint does not fault)
        sinks[t] = (r % 2) ? sum_bytes_avx512<512>(buf.data() + t * part, part)
                           : sum_bytes_avx512<0>(buf.data() + t * part, part);
      });
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(part) * threads / s * 1e-9);
  }
  return best;
#else
  (void)threads, (void)bytes, (void)repeats;
  throw std::invalid_argument("read loop exists for x86-64 AVX-512 only");
#endif
}

}  // namespace llmq_moe
