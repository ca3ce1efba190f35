// GGUF (llama.cpp) quantized blocks -> llmq's canonical integer form, torch-free and threaded.
//
// Bit-identical to the Python reference python/llmq/quant/formats/gguf_blocks.py (_decode_blocks +
// packing): per block, the unsigned codes q (LSB-first, `bits` per element, the canonical packing
// of llmq.quant.formats.pack_bits), a float32 scale and an additive float32 bias per group, so
// that scale * q + bias is the value gguf-py's dequantizer computes. The scale/bias table is in
// python/llmq/checkpoint/gguf_import.py's docstring; block layouts are ggml's ggml-common.h.
//
// Every block's packed codes take block*bits/8 whole bytes and its groups are consecutive, so a
// run of blocks decodes into consecutive output bytes/floats whatever the tensor's row length:
// a caller may decode a tensor in block-aligned chunks.
#pragma once

#include <cstdint>
#include <string>

namespace llmq_quant {

enum class GgufBlockType { kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K };

struct GgufBlockInfo {
  int block;        // elements per block
  int block_bytes;  // bytes per block in the file
  int bits;         // canonical bits per element
  int group;        // canonical group size (elements per scale/bias)
};

// False (and *out untouched) for a name that is not one of the types above ("Q4_0", ..., "Q2_K", ..., "Q6_K").
bool parse_gguf_block_type(const std::string& name, GgufBlockType* out);
GgufBlockInfo gguf_block_info(GgufBlockType type);

// Decodes n_blocks consecutive blocks at `blocks` (n_blocks * block_bytes bytes) into
// qdata (n_blocks * block * bits / 8 bytes), scale and bias (n_blocks * block / group floats
// each), splitting the blocks over `threads` threads (0: default_threads(); small inputs use
// fewer). Never fails: every bit pattern is a valid block (NaN/Inf float16 fields give
// NaN/Inf scales, which the caller's non-finite check reports).
void decode_gguf_blocks(GgufBlockType type, const uint8_t* blocks, int64_t n_blocks, uint8_t* qdata, float* scale,
                        float* bias, int threads);

}  // namespace llmq_quant
