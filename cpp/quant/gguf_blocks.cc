#include "gguf_blocks.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "../common/bits.h"
#include "quant_kernel.h"

namespace llmq_quant {

namespace {

// IEEE float16 (little-endian bytes) -> float32, exactly (numpy's astype(float32): subnormals
// normalised, Inf kept, a NaN's payload shifted into the float's mantissa).
inline float half_at(const uint8_t* p) {
  const uint32_t h = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) return llmq_bits::bits_to_float(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {  // zero or subnormal: man * 2^-24 is exact in float32
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return llmq_bits::bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

// Codes are built eight at a time in 64-bit words (one code per byte) and packed with three
// merge steps: neighbouring fields are joined in 16-, then 32-, then 64-bit lanes (the same
// steps as the numpy reference's swar_pack).
constexpr uint64_t kM0F = 0x0F0F0F0F0F0F0F0FULL, kM01 = 0x0101010101010101ULL, kM03 = 0x0303030303030303ULL;

inline uint64_t load64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

// Bit i of `b` -> bit 0 of byte i.
inline uint64_t spread_bits(uint32_t b) {
  return ((((b & 0xFFu) * kM01) & 0x8040201008040201ULL) + 0x7F7F7F7F7F7F7F7FULL) >> 7 & kM01;
}

constexpr uint64_t lane_mask(int width, int lane) {
  uint64_t m = 0;
  for (int i = 0; i < 64 / lane; ++i) m |= ((uint64_t{1} << width) - 1) << (i * lane);
  return m;
}

// Eight codes of BITS bits, one per byte of w -> the LSB-first stream in the low 8*BITS bits.
template <int BITS>
inline uint64_t pack8(uint64_t w) {
  constexpr uint64_t m16 = lane_mask(BITS, 16), m32 = lane_mask(2 * BITS, 32), m64 = lane_mask(4 * BITS, 64);
  w = (w & m16) | ((w >> (8 - BITS)) & (m16 << BITS));
  w = (w & m32) | ((w >> (16 - 2 * BITS)) & (m32 << (2 * BITS)));
  w = (w & m64) | ((w >> (32 - 4 * BITS)) & (m64 << (4 * BITS)));
  return w;
}

// WORDS words of eight codes -> WORDS*BITS output bytes. Whole 8-byte stores go to a local
// buffer (each overlapping the next one's start), then one fixed-size copy: nothing is
// stored past the block's own output bytes.
template <int BITS, int WORDS>
inline void pack_words(const uint64_t* w, uint8_t* out) {
  uint8_t tmp[WORDS * BITS + 8];
  for (int k = 0; k < WORDS; ++k) {
    const uint64_t p = pack8<BITS>(w[k]);
    std::memcpy(tmp + k * BITS, &p, 8);
  }
  std::memcpy(out, tmp, WORDS * BITS);
}

// GGUF 4-bit chunk of m bytes (low nibbles: elements 0..m-1, high: m..2m-1) -> canonical 4-bit
// bytes (byte i: element 2i low, 2i+1 high), m/2 ... m output bytes covering 2m elements.
inline void pack_nibble_halves(const uint8_t* qs, int m, uint8_t* out) {
  for (int i = 0; i < m / 2; ++i) out[i] = (qs[2 * i] & 0x0F) | (qs[2 * i + 1] << 4);
  for (int i = 0; i < m / 2; ++i) out[m / 2 + i] = (qs[2 * i] >> 4) | (qs[2 * i + 1] & 0xF0);
}

// The 12-byte K-quant field -> eight 6-bit scales and mins.
inline void k_scale_min(const uint8_t* s, float* sc, float* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = static_cast<float>(s[j] & 0x3F);
    mn[j] = static_cast<float>(s[j + 4] & 0x3F);
    sc[j + 4] = static_cast<float>((s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30));
    mn[j + 4] = static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
  }
}

// One block of each type: codes into q (packed), per-group scale / bias.
inline void block_q4_01(const uint8_t* b, bool with_min, uint8_t* q, float* scale, float* bias) {
  const float d = half_at(b);
  *scale = d;
  *bias = with_min ? half_at(b + 2) : -8.0f * d;
  pack_nibble_halves(b + (with_min ? 4 : 2), 16, q);
}

inline void block_q5_01(const uint8_t* b, bool with_min, uint8_t* q, float* scale, float* bias) {
  const float d = half_at(b);
  *scale = d;
  *bias = with_min ? half_at(b + 2) : -16.0f * d;
  const uint8_t* qh = b + (with_min ? 4 : 2);
  const uint8_t* qs = qh + 4;
  uint32_t h;  // bit j: the high bit of element j
  std::memcpy(&h, qh, 4);
  const uint64_t lo0 = load64(qs), lo1 = load64(qs + 8);  // low nibbles: elements 0..15, high: 16..31
  const uint64_t w[4] = {(lo0 & kM0F) | (spread_bits(h) << 4), (lo1 & kM0F) | (spread_bits(h >> 8) << 4),
                         ((lo0 >> 4) & kM0F) | (spread_bits(h >> 16) << 4),
                         ((lo1 >> 4) & kM0F) | (spread_bits(h >> 24) << 4)};
  pack_words<5, 4>(w, q);
}

inline void block_q8_0(const uint8_t* b, uint8_t* q, float* scale, float* bias) {
  const float d = half_at(b);
  *scale = d;
  *bias = -128.0f * d;
  for (int j = 0; j < 32; ++j) q[j] = b[2 + j] ^ 0x80;  // int8 + 128 == flip the sign bit
}

// Q2_K / Q3_K: 64 bytes of 2-bit fields (per half of 128 elements, bits 2s..2s+1 of byte j hold
// element 128 h + 32 s + j), plus for Q3_K the high bit of element 32 i + j at bit i of mask byte j.
template <int BITS>
inline void two_bit_words(const uint8_t* qs, const uint8_t* hmask, uint8_t* q) {
  uint64_t w[32];
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int k = 0; k < 4; ++k) {
        uint64_t v = (load64(qs + 32 * h + 8 * k) >> (2 * s)) & kM03;
        if (BITS == 3) v |= ((load64(hmask + 8 * k) >> (4 * h + s)) & kM01) << 2;
        w[16 * h + 4 * s + k] = v;
      }
  pack_words<BITS, 32>(w, q);
}

inline void block_q2_k(const uint8_t* b, uint8_t* q, float* scale, float* bias) {
  const float d = half_at(b + 80), dmin = half_at(b + 82);
  for (int g = 0; g < 16; ++g) {  // byte g: scale (low nibble) and min (high) of elements 16 g ..
    scale[g] = d * static_cast<float>(b[g] & 0x0F);
    bias[g] = -(dmin * static_cast<float>(b[g] >> 4));
  }
  two_bit_words<2>(b + 16, nullptr, q);
}

inline void block_q3_k(const uint8_t* b, uint8_t* q, float* scale, float* bias) {
  const uint8_t* s = b + 96;  // scale 4 t + j: a nibble of byte j (+4 for t odd), top bits at 2 t of byte 8 + j
  const float d = half_at(b + 108);
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < 4; ++j) {
      const int nib = t < 2 ? s[j + 4 * t] & 0x0F : s[j + 4 * (t - 2)] >> 4;
      const int sc = nib | (((s[8 + j] >> (2 * t)) & 3) << 4);
      scale[4 * t + j] = d * static_cast<float>(sc - 32);
      bias[4 * t + j] = -4.0f * scale[4 * t + j];
    }
  two_bit_words<3>(b + 32, b, q);
}

inline void block_qk45(const uint8_t* b, bool five, uint8_t* q, float* scale, float* bias) {
  const float d = half_at(b), dmin = half_at(b + 2);
  float sc[8], mn[8];
  k_scale_min(b + 4, sc, mn);
  for (int g = 0; g < 8; ++g) {
    scale[g] = d * sc[g];
    bias[g] = -(dmin * mn[g]);
  }
  const uint8_t* qs = b + (five ? 48 : 16);  // 4 chunks of 32 bytes: 64 elements each
  if (!five) {
    for (int c = 0; c < 4; ++c) pack_nibble_halves(qs + 32 * c, 32, q + 32 * c);
    return;
  }
  const uint8_t* qh = b + 16;  // bit i of byte j: the high bit of element 32 i + j
  uint64_t hw[4], w[32];
  for (int k = 0; k < 4; ++k) hw[k] = load64(qh + 8 * k);
  for (int c = 0; c < 4; ++c)
    for (int k = 0; k < 4; ++k) {  // elements 64 c + 8 k .. (low nibbles) and 64 c + 32 + 8 k .. (high)
      const uint64_t l = load64(qs + 32 * c + 8 * k);
      w[8 * c + k] = (l & kM0F) | (((hw[k] >> (2 * c)) & kM01) << 4);
      w[8 * c + 4 + k] = ((l >> 4) & kM0F) | (((hw[k] >> (2 * c + 1)) & kM01) << 4);
    }
  pack_words<5, 32>(w, q);
}

inline void block_q6_k(const uint8_t* b, uint8_t* q, float* scale, float* bias) {
  const uint8_t *ql = b, *qh = b + 128;
  const float d = half_at(b + 208);
  for (int g = 0; g < 16; ++g) {
    scale[g] = d * static_cast<float>(static_cast<int8_t>(b[192 + g]));
    bias[g] = -32.0f * scale[g];
  }
  uint64_t w[32];
  for (int h = 0; h < 2; ++h)  // halves of 128 elements: 64 low-nibble bytes, 32 high-bit bytes
    for (int k = 0; k < 4; ++k) {
      // bits 2s..2s+1 of qh byte j: the high bits of element 128 h + 32 s + j
      const uint64_t hb = load64(qh + 32 * h + 8 * k);
      const uint64_t l0 = load64(ql + 64 * h + 8 * k), l1 = load64(ql + 64 * h + 32 + 8 * k);
      w[16 * h + k] = (l0 & kM0F) | ((hb & kM03) << 4);
      w[16 * h + 4 + k] = (l1 & kM0F) | (((hb >> 2) & kM03) << 4);
      w[16 * h + 8 + k] = ((l0 >> 4) & kM0F) | (((hb >> 4) & kM03) << 4);
      w[16 * h + 12 + k] = ((l1 >> 4) & kM0F) | (((hb >> 6) & kM03) << 4);
    }
  pack_words<6, 32>(w, q);
}

// Blocks [b0, b1) with one block decoder (the type's switch is outside the loop).
template <typename Block>
void decode_loop(const GgufBlockInfo& info, const uint8_t* blocks, int64_t b0, int64_t b1, uint8_t* qdata, float* scale,
                 float* bias, Block block) {
  const int qbytes = info.block * info.bits / 8, groups = info.block / info.group;
  for (int64_t i = b0; i < b1; ++i)
    block(blocks + i * info.block_bytes, qdata + i * qbytes, scale + i * groups, bias + i * groups);
}

void decode_range(GgufBlockType type, const GgufBlockInfo& info, const uint8_t* blocks, int64_t b0, int64_t b1,
                  uint8_t* qdata, float* scale, float* bias) {
  auto run = [&](auto block) { decode_loop(info, blocks, b0, b1, qdata, scale, bias, block); };
  using u8 = uint8_t;
  switch (type) {
    case GgufBlockType::kQ4_0:
      run([](const u8* b, u8* q, float* s, float* m) { block_q4_01(b, false, q, s, m); });
      break;
    case GgufBlockType::kQ4_1:
      run([](const u8* b, u8* q, float* s, float* m) { block_q4_01(b, true, q, s, m); });
      break;
    case GgufBlockType::kQ5_0:
      run([](const u8* b, u8* q, float* s, float* m) { block_q5_01(b, false, q, s, m); });
      break;
    case GgufBlockType::kQ5_1:
      run([](const u8* b, u8* q, float* s, float* m) { block_q5_01(b, true, q, s, m); });
      break;
    case GgufBlockType::kQ8_0: run([](const u8* b, u8* q, float* s, float* m) { block_q8_0(b, q, s, m); }); break;
    case GgufBlockType::kQ2_K: run([](const u8* b, u8* q, float* s, float* m) { block_q2_k(b, q, s, m); }); break;
    case GgufBlockType::kQ3_K: run([](const u8* b, u8* q, float* s, float* m) { block_q3_k(b, q, s, m); }); break;
    case GgufBlockType::kQ4_K:
      run([](const u8* b, u8* q, float* s, float* m) { block_qk45(b, false, q, s, m); });
      break;
    case GgufBlockType::kQ5_K: run([](const u8* b, u8* q, float* s, float* m) { block_qk45(b, true, q, s, m); }); break;
    case GgufBlockType::kQ6_K: run([](const u8* b, u8* q, float* s, float* m) { block_q6_k(b, q, s, m); }); break;
  }
}

}  // namespace

bool parse_gguf_block_type(const std::string& name, GgufBlockType* out) {
  static const std::pair<const char*, GgufBlockType> kNames[] = {
      {"Q4_0", GgufBlockType::kQ4_0}, {"Q4_1", GgufBlockType::kQ4_1}, {"Q5_0", GgufBlockType::kQ5_0},
      {"Q5_1", GgufBlockType::kQ5_1}, {"Q8_0", GgufBlockType::kQ8_0}, {"Q2_K", GgufBlockType::kQ2_K},
      {"Q3_K", GgufBlockType::kQ3_K}, {"Q4_K", GgufBlockType::kQ4_K}, {"Q5_K", GgufBlockType::kQ5_K},
      {"Q6_K", GgufBlockType::kQ6_K}};
  for (const auto& [n, t] : kNames)
    if (name == n) {
      *out = t;
      return true;
    }
  return false;
}

GgufBlockInfo gguf_block_info(GgufBlockType type) {
  switch (type) {
    case GgufBlockType::kQ4_0: return {32, 18, 4, 32};
    case GgufBlockType::kQ4_1: return {32, 20, 4, 32};
    case GgufBlockType::kQ5_0: return {32, 22, 5, 32};
    case GgufBlockType::kQ5_1: return {32, 24, 5, 32};
    case GgufBlockType::kQ8_0: return {32, 34, 8, 32};
    case GgufBlockType::kQ2_K: return {256, 84, 2, 16};
    case GgufBlockType::kQ3_K: return {256, 110, 3, 16};
    case GgufBlockType::kQ4_K: return {256, 144, 4, 32};
    case GgufBlockType::kQ5_K: return {256, 176, 5, 32};
    case GgufBlockType::kQ6_K: return {256, 210, 6, 16};
  }
  return {0, 0, 0, 0};
}

void decode_gguf_blocks(GgufBlockType type, const uint8_t* blocks, int64_t n_blocks, uint8_t* qdata, float* scale,
                        float* bias, int threads) {
  const GgufBlockInfo info = gguf_block_info(type);
  if (threads <= 0) threads = default_threads();
  // At least ~1 MiB of blocks per thread: smaller jobs are not worth a thread start.
  const int64_t min_blocks = std::max<int64_t>(1, (int64_t{1} << 20) / info.block_bytes);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, n_blocks / min_blocks));
  if (parts == 1) {
    decode_range(type, info, blocks, 0, n_blocks, qdata, scale, bias);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = (n_blocks + parts - 1) / parts;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t b0 = p * per, b1 = std::min(n_blocks, b0 + per);
    if (b0 < b1) pool.emplace_back(decode_range, type, std::cref(info), blocks, b0, b1, qdata, scale, bias);
  }
  for (auto& t : pool) t.join();
}

}  // namespace llmq_quant
