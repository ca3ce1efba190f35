#include "int4_tiles.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "quant_kernel.h"

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
inline uint32_t odd0(uint64_t x) {
  return static_cast<uint32_t>((x & 0x0F0F0F0Full) | ((x >> 28) & 0xF0F0F0F0ull));
}
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

// 8-row tiles [first, last) of the flattened (batch, ceil(n/8)) tile list.
void pack_tiles(const uint8_t* src, int64_t n, int64_t kbytes, int t, int32_t* dst, int64_t tiles_per_matrix,
                int64_t first, int64_t last) {
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
      for (int64_t ks = 0; ks < ks_count; ++ks) {
        int32_t* o = out + (ks * 32 + 4 * nr) * half_t;
        for (int i = 0; i < half_t; ++i) {
          const int64_t u = static_cast<int64_t>(t) * ks + 2 * i;  // 16-element word of tile 0
          const uint64_t x0 = load64(in + 8 * u), x1 = load64(in + 8 * (u + 1));
          uint32_t lanes[4];
          transpose4(odd0(x0), odd0(x1), odd1(x0), odd1(x1), lanes);
          for (int tq = 0; tq < 4; ++tq) o[tq * half_t + i] = static_cast<int32_t>(lanes[tq]);
        }
      }
    }
  }
}

}  // namespace

void pack_int4_mma_tiles(const uint8_t* src, int64_t batch, int64_t n, int64_t kbytes, int t, int32_t* dst,
                         int threads) {
  if (t != 2 && t != 4 && t != 8) throw std::invalid_argument("inner_k_tiles must be 2, 4 or 8, got " + std::to_string(t));
  if (batch < 0 || n < 0 || kbytes < 0 || (kbytes * 2) % (16 * t))
    throw std::invalid_argument("K=" + std::to_string(kbytes * 2) + " is not a multiple of 16*inner_k_tiles");
  const int64_t tiles_per_matrix = (n + 7) / 8, total = batch * tiles_per_matrix;
  if (total == 0 || kbytes == 0) return;
  if (threads <= 0) threads = default_threads();
  // At least ~1 MiB of input per thread: smaller jobs are not worth a thread start.
  const int64_t min_tiles = std::max<int64_t>(1, (1 << 20) / (8 * kbytes));
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, total / min_tiles));
  if (parts == 1) {
    pack_tiles(src, n, kbytes, t, dst, tiles_per_matrix, 0, total);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t p = 1; p < parts; ++p)
    pool.emplace_back(pack_tiles, src, n, kbytes, t, dst, tiles_per_matrix, total * p / parts,
                      total * (p + 1) / parts);
  pack_tiles(src, n, kbytes, t, dst, tiles_per_matrix, 0, total / parts);
  for (auto& th : pool) th.join();
}

}  // namespace llmq_quant
