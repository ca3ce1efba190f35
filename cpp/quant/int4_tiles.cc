#include "int4_tiles.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "quant_kernel.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LLMQ_TILES_X86 1
#endif

namespace llmq_quant {
namespace {

inline uint64_t load64(const uint8_t* p) {
  uint64_t x;
  std::memcpy(&x, p, 8);  // canonical bytes are a little-endian stream; hosts here are little-endian
  return x;
}

// One canonical 64-bit word x holds k = 16u .. 16u+15 (nibble j = k - 16u). Fragment byte
// (odd, tq) takes k = 16u + 2tq + odd (low nibble) and k + 8 (high nibble):
//   odd 0: low nibbles of the low word's bytes | low nibbles of the high word's bytes << 4
//   odd 1: the high nibbles likewise.
inline uint32_t odd0(uint64_t x) { return static_cast<uint32_t>((x & 0x0F0F0F0Full) | ((x >> 28) & 0xF0F0F0F0ull)); }
inline uint32_t odd1(uint64_t x) {
  return static_cast<uint32_t>(((x >> 4) & 0x0F0F0F0Full) | ((x >> 32) & 0xF0F0F0F0ull));
}

// Byte tq of the lane word for lane 4*nr + tq is byte tq of word r (r = 2*odd + tile):
// a 4x4 byte transpose of (r0, r1, r2, r3).
inline void transpose4(uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3, uint32_t out[4]) {
  for (int tq = 0; tq < 4; ++tq) {
    const int s = 8 * tq;
    out[tq] = ((r0 >> s) & 0xFFu) | (((r1 >> s) & 0xFFu) << 8) | (((r2 >> s) & 0xFFu) << 16) |
              (((r3 >> s) & 0xFFu) << 24);
  }
}

// The 16 canonical bytes of words u, u+1 (x0 = a0..a7, x1 = b0..b7) -> the four lane words
// (tq = 0..3). Scalar reference of pack16_ssse3.
inline void pack16_scalar(const uint8_t* in, uint32_t lanes[4]) {
  const uint64_t x0 = load64(in), x1 = load64(in + 8);
  transpose4(odd0(x0), odd0(x1), odd1(x0), odd1(x1), lanes);
}

#ifdef LLMQ_TILES_X86
// Lane word tq, byte r: r = 0: odd0(x0), 1: odd0(x1), 2: odd1(x0), 3: odd1(x1), each byte
// (low nibble of byte j) | (low nibble of byte j + 4) << 4 for odd 0, the high nibbles for
// odd 1, with j = tq (x0) or 8 + tq (x1). pshufb gathers those nibbles from the
// low-nibble and high-nibble vectors (index 0x80 gives 0).
__attribute__((target("ssse3"))) inline __m128i pack16_ssse3(const uint8_t* in) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
  const char Z = static_cast<char>(0x80);
  // output byte 4*tq + r; low nibble from byte j, high nibble from byte j + 4
  const __m128i lo_from_lo = _mm_setr_epi8(0, 8, Z, Z, 1, 9, Z, Z, 2, 10, Z, Z, 3, 11, Z, Z);
  const __m128i lo_from_hi = _mm_setr_epi8(Z, Z, 0, 8, Z, Z, 1, 9, Z, Z, 2, 10, Z, Z, 3, 11);
  const __m128i hi_from_lo = _mm_setr_epi8(4, 12, Z, Z, 5, 13, Z, Z, 6, 14, Z, Z, 7, 15, Z, Z);
  const __m128i hi_from_hi = _mm_setr_epi8(Z, Z, 4, 12, Z, Z, 5, 13, Z, Z, 6, 14, Z, Z, 7, 15);
  const __m128i low = _mm_or_si128(_mm_shuffle_epi8(lo, lo_from_lo), _mm_shuffle_epi8(hi, lo_from_hi));
  const __m128i high = _mm_or_si128(_mm_shuffle_epi8(lo, hi_from_lo), _mm_shuffle_epi8(hi, hi_from_hi));
  return _mm_or_si128(low, _mm_slli_epi16(high, 4));  // nibbles < 16: no carry across bytes
}

// One (row, ks) block writes words o[tq * half_t + i], tq = 0..3, i < half_t: 16*half_t
// contiguous bytes. The per-i results (one word per tq) are transposed in registers so that
// every store is a whole 16-byte vector.
__attribute__((target("ssse3"))) void pack_row_ssse3(const uint8_t* in, int64_t ks_count, int t, int32_t* out) {
  const int half_t = t / 2;
  const bool stream = half_t == 4 && reinterpret_cast<uintptr_t>(out) % 64 == 0;
  for (int64_t ks = 0; ks < ks_count; ++ks) {
    const uint8_t* src = in + 8 * t * ks;
    __m128i* o = reinterpret_cast<__m128i*>(out + ks * 32 * half_t);
    if (half_t == 1) {
      _mm_storeu_si128(o, pack16_ssse3(src));
    } else if (half_t == 2) {
      const __m128i r0 = pack16_ssse3(src), r1 = pack16_ssse3(src + 16);
      _mm_storeu_si128(o, _mm_unpacklo_epi32(r0, r1));      // tq 0, 1: (i0, i1) each
      _mm_storeu_si128(o + 1, _mm_unpackhi_epi32(r0, r1));  // tq 2, 3
    } else {  // half_t == 4: a 4x4 transpose of 32-bit words
      const __m128i r0 = pack16_ssse3(src), r1 = pack16_ssse3(src + 16);
      const __m128i r2 = pack16_ssse3(src + 32), r3 = pack16_ssse3(src + 48);
      const __m128i a = _mm_unpacklo_epi32(r0, r1), b = _mm_unpacklo_epi32(r2, r3);
      const __m128i c = _mm_unpackhi_epi32(r0, r1), d = _mm_unpackhi_epi32(r2, r3);
      if (stream) {  // one whole aligned cache line: bypass the cache (no read-for-ownership)
        _mm_stream_si128(o, _mm_unpacklo_epi64(a, b));
        _mm_stream_si128(o + 1, _mm_unpackhi_epi64(a, b));
        _mm_stream_si128(o + 2, _mm_unpacklo_epi64(c, d));
        _mm_stream_si128(o + 3, _mm_unpackhi_epi64(c, d));
      } else {
        _mm_storeu_si128(o, _mm_unpacklo_epi64(a, b));      // tq 0: i 0..3
        _mm_storeu_si128(o + 1, _mm_unpackhi_epi64(a, b));  // tq 1
        _mm_storeu_si128(o + 2, _mm_unpacklo_epi64(c, d));  // tq 2
        _mm_storeu_si128(o + 3, _mm_unpackhi_epi64(c, d));  // tq 3
      }
    }
  }
}
#endif

// One row's words for every ks; out points at (ks = 0, lane 4*nr, i = 0) of its tile.
void pack_row_scalar(const uint8_t* in, int64_t ks_count, int t, int32_t* out) {
  const int half_t = t / 2;
  for (int64_t ks = 0; ks < ks_count; ++ks) {
    int32_t* o = out + ks * 32 * half_t;
    for (int i = 0; i < half_t; ++i) {
      uint32_t lanes[4];
      pack16_scalar(in + 8 * (t * ks + 2 * i), lanes);
      for (int tq = 0; tq < 4; ++tq) o[tq * half_t + i] = static_cast<int32_t>(lanes[tq]);
    }
  }
}

// 8-row tiles [first, last) of the flattened (batch, ceil(n/8)) tile list.
void pack_tiles(const uint8_t* src, int64_t n, int64_t kbytes, int t, int32_t* dst, int64_t tiles_per_matrix,
                int64_t first, int64_t last, bool simd) {
  const int64_t ks_count = kbytes * 2 / (16 * t);
  const int half_t = t / 2;
  const int64_t tile_words = ks_count * 32 * half_t;
  for (int64_t tile = first; tile < last; ++tile) {
    const int64_t b = tile / tiles_per_matrix, nt = tile % tiles_per_matrix;
    int32_t* out = dst + tile * tile_words;
    for (int nr = 0; nr < 8; ++nr) {
      const int64_t row = 8 * nt + nr;
      if (row >= n) {  // padding rows: zero words
        for (int64_t ks = 0; ks < ks_count; ++ks)
          for (int tq = 0; tq < 4; ++tq)
            std::memset(out + (ks * 32 + 4 * nr + tq) * half_t, 0, sizeof(int32_t) * half_t);
        continue;
      }
      const uint8_t* in = src + (b * n + row) * kbytes;
#ifdef LLMQ_TILES_X86
      if (simd) {
        pack_row_ssse3(in, ks_count, t, out + 4 * nr * half_t);
        continue;
      }
#endif
      pack_row_scalar(in, ks_count, t, out + 4 * nr * half_t);
    }
  }
#ifdef LLMQ_TILES_X86
  if (simd) _mm_sfence();  // streaming stores are visible before the caller (or join) reads them
#endif
}

}  // namespace

void pack_int4_mma_tiles(const uint8_t* src, int64_t batch, int64_t n, int64_t kbytes, int t, int32_t* dst, int threads,
                         bool allow_simd) {
#ifdef LLMQ_TILES_X86
  __builtin_cpu_init();
  const bool simd = allow_simd && __builtin_cpu_supports("ssse3");
#else
  const bool simd = false;
  (void)allow_simd;
#endif
  if (t != 2 && t != 4 && t != 8)
    throw std::invalid_argument("inner_k_tiles must be 2, 4 or 8, got " + std::to_string(t));
  if (batch < 0 || n < 0 || kbytes < 0 || (kbytes * 2) % (16 * t))
    throw std::invalid_argument("K=" + std::to_string(kbytes * 2) + " is not a multiple of 16*inner_k_tiles");
  const int64_t tiles_per_matrix = (n + 7) / 8, total = batch * tiles_per_matrix;
  if (total == 0 || kbytes == 0) return;
  if (threads <= 0) threads = default_threads();
  // At least ~1 MiB of input per thread: smaller jobs are not worth a thread start.
  const int64_t min_tiles = std::max<int64_t>(1, (1 << 20) / (8 * kbytes));
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, total / min_tiles));
  if (parts == 1) {
    pack_tiles(src, n, kbytes, t, dst, tiles_per_matrix, 0, total, simd);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t p = 1; p < parts; ++p)
    pool.emplace_back(pack_tiles, src, n, kbytes, t, dst, tiles_per_matrix, total * p / parts, total * (p + 1) / parts,
                      simd);
  pack_tiles(src, n, kbytes, t, dst, tiles_per_matrix, 0, total / parts, simd);
  for (auto& th : pool) th.join();
}

}  // namespace llmq_quant
