// Fused quantized MoE FFN kernel: torch-free C++ on raw buffers.
//
// The op computes, for every token t of x [T, D]:
//   logits = x W_router^T                       (fp32)
//   choose top_k experts, weights from the score function
//   out[t] = sum_{chosen e} w_e * W2_e (silu(W1_e x) * W3_e x)
//          + [shared] sigmoid(x . g_shared) * W2_s (silu(W1_s x) * W3_s x)
// with W1/W3 (gate/up, fused as w13 [2F, D]) and W2 [D, F] group-wise INT4/INT8.
//
// Packed ("tiled") weight layout, per matrix W [N, K] (N % 16 == 0, K % gs == 0,
// gs % 32 == 0), G = K / gs groups per row, S = steps per group:
//   INT4: S = gs / 8, each step holds 8 k of 16 rows in 64 bytes;
//   INT8: S = gs / 4, each step holds 4 k of 16 rows in 64 bytes.
//   qdata byte index ((tile * G + g) * S + s) * 64 + r * 4 + j, tile = n / 16, r = n % 16:
//     INT4: low nibble = q[n, g*gs + 8s + j], high nibble = q[n, g*gs + 8s + 4 + j]  (j < 4)
//     INT8: byte       = q[n, g*gs + 4s + j]
//   sb index ((tile * G + g) * 2 + c) * 16 + r:  c = 0 scale[n, g], c = 1 bias[n, g], as
//     float32, or as bfloat16 bit patterns (the compact variant: 4 instead of 8 bytes per
//     group and row, 5.6% fewer bytes at INT4 group 128, 17% at group 32).
// So one 64-byte load is 16 output rows x 4 (INT8) or 8 (INT4) inputs, the operand shape
// of an AVX-512 VNNI dot product with a broadcast activation dword.
// For w13 [2F, D] the tiles alternate: tile 2j holds gate rows 16j..16j+15 and tile 2j+1
// up rows 16j..16j+15 (HF's gate_up_proj rows F+16j..), so each SwiGLU pair is adjacent.
//
// Numerical contract (the scalar, AVX2 and AVX-512 VNNI paths give bitwise identical results):
//   * activations (x, and the SwiGLU output h) are quantized per row and per weight
//     group: a = amax/127 (fp32), xq = round_half_even(x * (127/amax)) in [-127, 127];
//     the matmul is exactly W_deq . (a * xq) with W_deq = scale*q + bias (scale and bias
//     being the packed values: with bfloat16 sb, the bfloat16-rounded ones), computed as
//     sum_g fma(int_dot_g, scale*a, fma(bias, a*sum(xq_g), acc)) in fp32.
//   * router logits are fp32 dot products (16 partial sums, then summed in order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace llmq_moe {

// Instruction-set paths, chosen at run time.
enum class Isa : int { kAuto = 0, kScalar = 1, kAvx512Vnni = 2, kAvx2 = 3 };

// Best path this CPU supports.
Isa detect_isa();
const char* isa_name(Isa isa);

// One packed weight matrix (or a stack of E of them laid out back to back).
struct QMatrix {
  const uint8_t* qdata = nullptr;  // tiled, see above
  const float* sb = nullptr;       // tiled scale/bias as float32, or
  const uint16_t* sb16 = nullptr;  // ... as bfloat16 bits (exactly one of the two is set)
  int64_t n = 0;                   // output rows (multiple of 16)
  int64_t k = 0;                   // inputs (multiple of group_size)
  int bits = 4;                    // 4 or 8
  int group_size = 32;             // multiple of 32

  int64_t groups() const { return k / group_size; }
  int64_t tile_qbytes() const { return 16 * k * bits / 8; }
  int64_t tile_sbfloats() const { return groups() * 32; }  // sb elements per tile (either type)
  int64_t matrix_qbytes() const { return (n / 16) * tile_qbytes(); }
  int64_t matrix_sbfloats() const { return (n / 16) * tile_sbfloats(); }
  int sb_elem_bytes() const { return sb16 ? 2 : 4; }

  // A matrix (or a stack) over caller-owned buffers: `sb` is bfloat16 bits when sb_bf16, else float32.
  static QMatrix over(const uint8_t* qdata, const void* sb, bool sb_bf16, int64_t n, int64_t k, int64_t bits,
                      int64_t group_size) {
    QMatrix m;
    m.qdata = qdata;
    if (sb_bf16) m.sb16 = static_cast<const uint16_t*>(sb);
    else m.sb = static_cast<const float*>(sb);
    m.n = n;
    m.k = k;
    m.bits = static_cast<int>(bits);
    m.group_size = static_cast<int>(group_size);
    return m;
  }
  // The same matrix `elems` sb elements further on (e.g. the next expert of a stack).
  QMatrix advanced(int64_t qbytes, int64_t elems) const {
    QMatrix m = *this;
    m.qdata += qbytes;
    if (m.sb16) m.sb16 += elems;
    else m.sb += elems;
    return m;
  }
};

// Returns an empty string if (n, k, bits, group_size) is a layout this kernel packs,
// else a message saying what is wrong.
std::string check_layout(int64_t n, int64_t k, int64_t bits, int64_t group_size);

// What the op kernels' argument checks (moe_torch_op.cc, moe_executorch_op.cc) read of a tensor.
struct ArgTensor {
  std::string dtype;            // as Python prints it, e.g. "torch.uint8"
  std::vector<int64_t> shape;
};

// The check both op kernels make of one packed matrix `name` (w13, w2, shared_w13, shared_w2) of a stack of
// e: its layout (check_layout), <name>_qdata uint8 [e, n/16, 16*k*bits/8] and <name>_sb float32 or bfloat16
// [e, n/16, 32*k/gs]. Returns an empty string when they fit, else the message (worded as check_moe_args in
// python/llmq/ops/moe_op.py words it, without the "quantized_moe_ffn: " prefix).
std::string check_packed_matrix(const ArgTensor& q, const ArgTensor& sb, const std::string& name, int64_t e, int64_t n,
                                int64_t k, int64_t bits, int64_t group_size);

// Canonical -> tiled. q: uint8 [N, K*bits/8] LSB-first bit stream, scale/bias float [N, K/gs].
// out_q: N*K*bits/8 bytes, out_sb: 2*N*K/gs floats. Throws std::invalid_argument on bad layout.
void pack_matrix(const uint8_t* q, const float* scale, const float* bias, int64_t n, int64_t k, int bits,
                 int group_size, uint8_t* out_q, float* out_sb);

// Dynamic int8 activation quantization of one row x[k] with groups of gs.
void quantize_row(const float* x, int64_t k, int group_size, int8_t* xq, float* ascale, float* asum, Isa isa);

// The GEMM tile: out[m][16*nt + r] for m < M tokens and nt < NT tiles (NT in {1, 2},
// M in [1, 4]) of a packed matrix, against quantized activations rows xq[m] (k int8,
// ascale/asum [k/gs]). Exposed for the unit test; the op calls it internally.
void gemm_tile(const QMatrix& w, const int64_t* tiles, int nt, const int8_t* const* xq, const float* const* ascale,
               const float* const* asum, int m, float* out, Isa isa);

// Dense y = x W^T on one packed matrix (the experts' tiles serving a plain linear layer):
// x [tokens, w.k] fp32, out [tokens, n_out] fp32 with w.n - 16 < n_out <= w.n (the packed rows
// beyond n_out are padding, their outputs dropped). Same numerical contract as the op: x is
// quantized per row and weight group to int8, out = W_deq . (a * xq) accumulated in fp32,
// bit-identical on every ISA path and for every thread count. Work items are 32 output
// columns (a tile pair), each run for all tokens in register blocks, so a tile's weights are
// read from memory once per call. Throws std::invalid_argument on a bad layout.
void dense_linear(const float* x, int64_t tokens, const QMatrix& w, int64_t n_out, int num_threads, Isa isa,
                  float* out);

enum class ScoreFunc : int { kSoftmax = 0, kSigmoid = 1 };

// How the w2 phase is split into work items (results are bit-identical either way):
// by (expert, 32 columns) with a per-token sum afterwards (few tokens: each expert's w2 is
// read as one stream), or by 32 output columns across all experts (many tokens: no
// intermediate buffer). kAuto picks by the size of that buffer.
enum class Schedule : int { kAuto = 0, kByExpert = 1, kByColumns = 2 };

struct MoEArgs {
  const float* x = nullptr;             // [T, D]
  int64_t tokens = 0, hidden = 0;       // T, D
  const float* router = nullptr;        // [E, D]
  const float* expert_bias = nullptr;   // [E] or null (selection only, sigmoid scoring)
  int64_t experts = 0, top_k = 1;
  ScoreFunc score = ScoreFunc::kSoftmax;
  float route_scale = 1.0f;
  // Routed experts: w13 is a stack of E matrices [2F, D] (gate/up tiles alternating),
  // w2 of E matrices [D, F].
  QMatrix w13, w2;
  // Optional shared expert (qdata null = none): w13 [2Fs, D], w2 [D, Fs], and an
  // optional sigmoid gate row [D] (null = gate weight 1).
  QMatrix shared_w13, shared_w2;
  const float* shared_gate = nullptr;
  int num_threads = 1;
  Isa isa = Isa::kAuto;
  Schedule schedule = Schedule::kAuto;

  // The routed part over caller-owned buffers (expert_bias may be null); the rest keeps its defaults.
  static MoEArgs routed(const float* x, int64_t tokens, int64_t hidden, const float* router, const float* expert_bias,
                        int64_t experts, int64_t top_k, ScoreFunc score, double route_scale, const QMatrix& w13,
                        const QMatrix& w2) {
    MoEArgs a;  // member by member: the header is also built as C++11 by consumers (no aggregate init here)
    a.x = x;
    a.tokens = tokens;
    a.hidden = hidden;
    a.router = router;
    a.expert_bias = expert_bias;
    a.experts = experts;
    a.top_k = top_k;
    a.score = score;
    a.route_scale = static_cast<float>(route_scale);
    a.w13 = w13;
    a.w2 = w2;
    return a;
  }
};

// Runs the op; out is [T, D] fp32. Throws std::invalid_argument on inconsistent arguments.
void moe_ffn(const MoEArgs& args, float* out);

// Router + scoring + top-k only (for tests): idx/weights [T, top_k], sorted by score.
void route(const MoEArgs& args, int32_t* idx, float* weights);

}  // namespace llmq_moe
