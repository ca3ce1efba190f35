"""Canonical GroupQuantizedWeight -> the MoE kernel's tiled layout (cpp/moe/moe_kernel.h).

Layout of one matrix W [N, K] (N % 16 == 0, K % group_size == 0, group_size % 32 == 0),
G = K / group_size groups, S = group_size / 8 (INT4) or / 4 (INT8) steps per group:
  qdata uint8 [N/16, 16*K*bits/8]: for tile t, group g, step s, row r (n = 16t + r), byte j < 4
      offset ((g*S + s)*64 + r*4 + j) inside the tile holds
      INT4: q[n, g*gs + 8s + j] | q[n, g*gs + 8s + 4 + j] << 4,   INT8: q[n, g*gs + 4s + j]
  sb float32 [N/16, G*32]: offset g*32 + r is scale[n, g], g*32 + 16 + r is bias[n, g];
      or bfloat16 (scale_dtype=torch.bfloat16): the same values rounded to nearest even,
      half the bytes (decode reads 5.6% fewer bytes at INT4 group 128, 17% at group 32),
      and the op then computes with exactly those rounded scales and biases.
A stack of experts adds a leading E dimension. w13 arrives as [2F, D] with gate rows then up
rows (Hugging Face's fused gate_up_proj); pack_moe_experts reorders its 16-row blocks to
gate 0, up 0, gate 1, up 1, ... so each SwiGLU tile pair is adjacent in memory (decode
then reads one sequential stream per expert).
Written in torch (no extension needed); the C++ packer (`pack_matrix`) implements the same
spec and the tests check that they agree.
"""

from __future__ import annotations

import dataclasses

import torch

from llmq.quant.formats import GroupQuantizedWeight, unpack_bits

KERNEL_BITS = (4, 8)
SCALE_DTYPES = (torch.float32, torch.bfloat16)


def check_kernel_layout(n: int, k: int, bits: int, group_size: int, name: str) -> None:
    """Raise ValueError naming `name` unless [n, k] with (bits, group_size) fits the kernel."""
    if bits not in KERNEL_BITS:
        raise ValueError(f"{name}: the MoE kernel takes INT4 or INT8 weights, got bits={bits}")
    if group_size <= 0 or group_size % 32:
        raise ValueError(f"{name}: group_size must be a positive multiple of 32, got {group_size}")
    if k % group_size:
        raise ValueError(f"{name}: group_size {group_size} does not divide the input dimension {k}")
    if n % 16:
        raise ValueError(f"{name}: output dimension {n} is not a multiple of 16")


def _check_scale_dtype(scale_dtype) -> None:
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be torch.float32 or torch.bfloat16, got {scale_dtype}")


def pack_matrix_tiles(w: GroupQuantizedWeight, name: str = "weight", scale_dtype: torch.dtype = torch.float32):
    """[..., N, K] canonical -> (qdata uint8 [..., N/16, 16*K*bits/8], sb [..., N/16, 32*K/gs] in scale_dtype)."""
    _check_scale_dtype(scale_dtype)
    *lead, n, k = w.shape
    bits, gs = w.bits, w.group_size
    check_kernel_layout(n, k, bits, gs, name)
    g = k // gs
    per_step = 8 if bits == 4 else 4
    steps = gs // per_step
    q = unpack_bits(w.qdata, bits, k).reshape(*lead, n // 16, 16, g, steps, per_step)
    if bits == 4:
        q = q[..., :4] | (q[..., 4:] << 4)
    nd = len(lead)
    # [..., t, r, g, s, j] -> [..., t, g, s, r, j]
    perm = list(range(nd)) + [nd, nd + 2, nd + 3, nd + 1, nd + 4]
    qdata = q.permute(perm).reshape(*lead, n // 16, 16 * k * bits // 8).contiguous()
    sb = torch.stack([w.scale, w.bias], dim=-1)  # [..., N, G, 2]
    sb = sb.reshape(*lead, n // 16, 16, g, 2).permute(list(range(nd)) + [nd, nd + 2, nd + 3, nd + 1])
    return qdata, sb.reshape(*lead, n // 16, g * 32).to(torch.float32).to(scale_dtype).contiguous()


def linear_layout_problem(w: GroupQuantizedWeight) -> str:
    """Why the dense kernel cannot take `w` ("" when it can): INT4/INT8, 2-D, group a multiple
    of 32 dividing K (whole-row groups included). N need not be a multiple of 16 (padded)."""
    if len(w.shape) != 2:
        return f"a dense linear needs a 2-D weight, got shape {list(w.shape)}"
    n, k = w.shape
    if w.bits not in KERNEL_BITS:
        return f"the kernel takes INT4 or INT8 weights, got bits={w.bits}"
    if w.group_size <= 0 or w.group_size % 32 or k % w.group_size:
        return f"group_size {w.group_size} is not a multiple of 32 dividing K={k}"
    return ""


@dataclasses.dataclass(frozen=True)
class PackedLinear:
    """One dense weight [N, K] in the kernel layout, rows padded to a multiple of 16."""

    qdata: torch.Tensor  # uint8 [ceil(N/16), 16*K*bits/8]
    sb: torch.Tensor  # float32 or bfloat16 [ceil(N/16), 32*K/gs]
    out_features: int  # N (the padded rows' outputs are dropped)
    in_features: int  # K
    bits: int
    group_size: int

    @property
    def nbytes(self) -> int:
        return self.qdata.numel() + self.sb.numel() * self.sb.element_size()


def pack_linear(w: GroupQuantizedWeight, name: str = "weight", scale_dtype: torch.dtype = torch.float32) -> PackedLinear:
    """Canonical [N, K] -> the tiled layout for llmq::quantized_linear (rows padded with zero codes,
    scales and biases to a multiple of 16, so the padding computes zeros)."""
    problem = linear_layout_problem(w)
    if problem:
        raise ValueError(f"{name}: {problem}")
    n, k = w.shape
    pad = -n % 16
    if pad:
        w = GroupQuantizedWeight(
            qdata=torch.cat([w.qdata, w.qdata.new_zeros(pad, w.qdata.shape[1])]),
            scale=torch.cat([w.scale, w.scale.new_zeros(pad, w.scale.shape[1])]),
            bias=torch.cat([w.bias, w.bias.new_zeros(pad, w.bias.shape[1])]),
            bits=w.bits, group_size=w.group_size, shape=(n + pad, k), dtype=w.dtype,
        )
    qdata, sb = pack_matrix_tiles(w, name, scale_dtype)
    return PackedLinear(qdata, sb, n, k, w.bits, w.group_size)


@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """A stack of E SwiGLU experts in the kernel layout: w13 [E, 2F, D] and w2 [E, D, F]."""

    w13_qdata: torch.Tensor  # uint8 [E, 2F/16, 16*D*bits/8]
    w13_sb: torch.Tensor  # float32 or bfloat16 [E, 2F/16, 32*D/gs]
    w2_qdata: torch.Tensor  # uint8 [E, D/16, 16*F*bits/8]
    w2_sb: torch.Tensor  # same dtype as w13_sb, [E, D/16, 32*F/gs]
    bits: int
    group_size: int

    @property
    def num_experts(self) -> int:
        return self.w13_qdata.shape[0]

    @property
    def intermediate(self) -> int:
        return self.w13_qdata.shape[1] * 8

    @property
    def hidden(self) -> int:
        return self.w2_qdata.shape[1] * 16

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13_qdata, self.w13_sb, self.w2_qdata, self.w2_sb))


def pack_moe_experts(w13: GroupQuantizedWeight, w2: GroupQuantizedWeight,
                     scale_dtype: torch.dtype = torch.float32) -> PackedExperts:
    """Pack canonical gate+up w13 [E, 2F, D] and down w2 [E, D, F] (or [2F, D] / [D, F] for
    one expert, e.g. the shared one, which becomes E = 1) for `quantized_moe_ffn`.

    scale_dtype=torch.bfloat16 stores scales and biases rounded to bfloat16: fewer bytes to
    read per decoded token, at the cost of exactness (each weight moves by at most
    2^-9 * (|scale*q| + |bias|), small next to the quantization step scale/2)."""
    _check_scale_dtype(scale_dtype)
    if len(w13.shape) == 2 and len(w2.shape) == 2:
        w13 = _unsqueeze(w13)
        w2 = _unsqueeze(w2)
    if len(w13.shape) != 3 or len(w2.shape) != 3:
        raise ValueError(f"w13 and w2 must be [E, 2F, D] and [E, D, F], got {list(w13.shape)} and {list(w2.shape)}")
    e, two_f, d = w13.shape
    if two_f % 2:
        raise ValueError(f"w13 [E, 2F, D] has an odd row count {two_f}")
    f = two_f // 2
    if tuple(w2.shape) != (e, d, f):
        raise ValueError(f"w2 must be [E={e}, D={d}, F={f}] to match w13 {list(w13.shape)}, got {list(w2.shape)}")
    if (w13.bits, w13.group_size) != (w2.bits, w2.group_size):
        raise ValueError(
            f"w13 ({w13.bits}-bit, group {w13.group_size}) and w2 ({w2.bits}-bit, group {w2.group_size}) "
            "must share bits and group size"
        )
    check_kernel_layout(f, d, w13.bits, w13.group_size, "w13 (gate/up half)")
    w13_q, w13_sb = pack_matrix_tiles(_permute_rows(w13, gate_up_block_order(f)), "w13", scale_dtype)
    w2_q, w2_sb = pack_matrix_tiles(w2, "w2", scale_dtype)
    return PackedExperts(w13_q, w13_sb, w2_q, w2_sb, w13.bits, w13.group_size)


def gate_up_block_order(f: int) -> torch.Tensor:
    """Row order of the packed w13: source row of packed row i ([gate; up] -> blocks of 16 alternating)."""
    return torch.arange(2 * f).reshape(2, f // 16, 16).permute(1, 0, 2).reshape(-1)


def _permute_rows(w: GroupQuantizedWeight, order: torch.Tensor) -> GroupQuantizedWeight:
    return GroupQuantizedWeight(w.qdata[..., order, :], w.scale[..., order, :], w.bias[..., order, :],
                                w.bits, w.group_size, w.shape, w.dtype)


def unpack_moe_w13(qdata: torch.Tensor, sb: torch.Tensor, bits: int, group_size: int, shape) -> GroupQuantizedWeight:
    """Packed w13 back to the canonical [E, 2F, D] with gate rows then up rows."""
    w = unpack_matrix_tiles(qdata, sb, bits, group_size, shape)
    return _permute_rows(w, torch.argsort(gate_up_block_order(shape[-2] // 2)))


def _unsqueeze(w: GroupQuantizedWeight) -> GroupQuantizedWeight:
    return GroupQuantizedWeight(
        qdata=w.qdata.unsqueeze(0), scale=w.scale.unsqueeze(0), bias=w.bias.unsqueeze(0),
        bits=w.bits, group_size=w.group_size, shape=(1,) + tuple(w.shape), dtype=w.dtype,
    )


def pack_with_kernel(w: GroupQuantizedWeight, kernel=None):
    """The C++ packer's output for the same input (used to cross-check the two)."""
    from llmq.ops.kernel_loader import load_kernel

    kernel = kernel or load_kernel()
    *lead, n, k = w.shape
    batch = 1
    for s in lead:
        batch *= s
    qd = w.qdata.contiguous()
    sc, bi = w.scale.contiguous(), w.bias.contiguous()
    out_q = torch.empty(*lead, n // 16, 16 * k * w.bits // 8, dtype=torch.uint8)
    out_sb = torch.empty(*lead, n // 16, 32 * (k // w.group_size), dtype=torch.float32)
    kernel.pack(qd.data_ptr(), sc.data_ptr(), bi.data_ptr(), batch, n, k, w.bits, w.group_size,
                out_q.data_ptr(), out_sb.data_ptr())
    return out_q, out_sb




def unpack_matrix_tiles(qdata: torch.Tensor, sb: torch.Tensor, bits: int, group_size: int, shape) -> GroupQuantizedWeight:
    """Inverse of pack_matrix_tiles: the tiled layout back to the canonical form of `shape` [..., N, K]."""
    from llmq.quant.formats import pack_bits

    *lead, n, k = shape
    g = k // group_size
    per_step = 8 if bits == 4 else 4
    steps = group_size // per_step
    nd = len(lead)
    q = qdata.reshape(*lead, n // 16, g, steps, 16, 4)
    if bits == 4:
        q = torch.cat([q & 0x0F, q >> 4], dim=-1)
    # [..., t, g, s, r, j] -> [..., t, r, g, s, j]
    q = q.permute(list(range(nd)) + [nd, nd + 3, nd + 1, nd + 2, nd + 4]).reshape(*lead, n, k)
    s = sb.reshape(*lead, n // 16, g, 2, 16).permute(list(range(nd)) + [nd, nd + 3, nd + 1, nd + 2])
    s = s.reshape(*lead, n, g, 2).to(torch.float32)  # bfloat16 sb widens exactly
    return GroupQuantizedWeight(pack_bits(q, bits), s[..., 0].contiguous(), s[..., 1].contiguous(), bits, group_size,
                                tuple(shape))
