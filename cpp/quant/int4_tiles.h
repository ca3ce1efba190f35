// Canonical 4-bit weights -> m16n8k16 "B fragment" tiles (the int32 layout of torch's
// _weight_int4pack_mm, a.k.a. tinygemm), one pass over the bytes. Bit-identical to
// backends/cuda/llmq_cuda/tinygemm.py's torch reference (tile_pack_canonical_bytes), which
// documents the layout; checked by backends/cuda/tinygemm_test.py.
#pragma once

#include <cstdint>

namespace llmq_quant {

// src: `batch` matrices of `n` rows, each row `kbytes` canonical bytes (k = 2m in the low
// nibble of byte m), contiguous. dst: int32 [batch, ceil(n/8), kbytes*2/(16*t), 32, t/2],
// contiguous; rows past n within the last 8-row tile are written as zeros. t (inner k tiles)
// must be 2, 4 or 8 and kbytes*2 a multiple of 16*t. Work is split over `threads` threads
// (0 = default_threads()). allow_simd = false forces the portable scalar path (the SSSE3
// path, used where the CPU has it, gives the same bytes; both are tested). Throws
// std::invalid_argument on bad sizes.
void pack_int4_mma_tiles(const uint8_t* src, int64_t batch, int64_t n, int64_t kbytes, int t, int32_t* dst, int threads,
                         bool allow_simd = true);

}  // namespace llmq_quant
