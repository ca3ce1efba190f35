"""Format family "int": the one canonical in-memory form of group-wise integer weights.

Every reader (GGUF, torchao, our own quantizer) converts *into* this form and every
packer (MLX, CUDA, the MoE kernel) converts *out of* it, so conversions are written
once per edge instead of once per pair. See docs/formats.md for the full contract.

    w[..., n, k] = scale[..., n, k // group_size] * q[..., n, k] + bias[..., n, k // group_size]

* q is unsigned, in [0, 2**bits).
* qdata is uint8 [..., N, K * bits / 8]: each row is a little-endian, LSB-first bit
  stream, element k occupying bits [k*bits, (k+1)*bits). For 4-bit this puts element 2i
  in the low nibble of byte i (MLX, ModelOpt and compressed-tensors order); for 2-, 3-,
  5-, 6-bit it is MLX's packing.
* scale and bias are float32 [..., N, K / group_size]. The bias is *additive* (not a
  zero point), so symmetric, asymmetric, float-zero (HQQ) and GGUF K-quant blocks all
  fit exactly.
* dequantize evaluates scale*q + bias exactly (float64) and rounds once to float32.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Dict, Optional, Tuple

import torch

from llmq.quant.formats.base import Format, Layout, RowQuantizer
from llmq.quant.formats.hf_export import HFExport, ct_weights

SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)


@dataclasses.dataclass(frozen=True)
class GroupQuantizedWeight:
    """A group-wise integer weight in the canonical convention (see module docstring).

    Not a torch.Tensor subclass on purpose: it is a plain, inspectable container that
    converters and packers read field by field. Leading dimensions (e.g. stacked
    experts [E, N, K]) are carried through unchanged.
    """

    qdata: torch.Tensor  # uint8 [..., N, K*bits/8]
    scale: torch.Tensor  # float32 [..., N, K/group_size]
    bias: torch.Tensor  # float32 [..., N, K/group_size]
    bits: int
    group_size: int
    shape: Tuple[int, ...]  # logical (unpacked) shape [..., N, K]
    dtype: torch.dtype = torch.bfloat16  # dtype of the original high-precision weight

    def __post_init__(self):
        validate_layout(self)

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def out_features(self) -> int:
        return self.shape[-2] if len(self.shape) >= 2 else 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qdata, self.scale, self.bias))


def packed_row_bytes(k: int, bits: int) -> int:
    """Bytes one packed row of k elements occupies; k*bits must be a whole number of bytes."""
    if (k * bits) % 8:
        raise ValueError(f"{k} elements of {bits} bits do not fill whole bytes")
    return k * bits // 8


def validate_layout(w: GroupQuantizedWeight) -> None:
    """Raise ValueError if the fields disagree with each other (cheap, shape-only)."""
    if w.bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={w.bits} unsupported; expected one of {SUPPORTED_BITS}")
    if len(w.shape) < 1:
        raise ValueError("a quantized weight needs at least one dimension")
    k = w.shape[-1]
    lead = tuple(w.shape[:-1]) if len(w.shape) >= 2 else (1,)
    if w.group_size <= 0 or k % w.group_size:
        raise ValueError(f"group_size={w.group_size} does not divide K={k}")
    expect_q = lead + (packed_row_bytes(k, w.bits),)
    expect_s = lead + (k // w.group_size,)
    if w.qdata.dtype != torch.uint8 or tuple(w.qdata.shape) != expect_q:
        raise ValueError(f"qdata must be uint8 {list(expect_q)}, got {w.qdata.dtype} {list(w.qdata.shape)}")
    for name in ("scale", "bias"):
        t = getattr(w, name)
        if t.dtype != torch.float32 or tuple(t.shape) != expect_s:
            raise ValueError(f"{name} must be float32 {list(expect_s)}, got {t.dtype} {list(t.shape)}")


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integers q[..., K] (any integer dtype, values < 2**bits) into the
    canonical LSB-first uint8 bit stream [..., K*bits/8]."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} unsupported; expected one of {SUPPORTED_BITS}")
    k = q.shape[-1]
    nbytes = packed_row_bytes(k, bits)
    if bits == 8:
        return q.to(torch.uint8).contiguous()
    if bits in (2, 4):
        per = 8 // bits
        v = q.to(torch.uint8).reshape(*q.shape[:-1], k // per, per)
        out = torch.zeros(v.shape[:-1], dtype=torch.uint8)
        for j in range(per):
            out |= v[..., j] << (j * bits)
        return out
    # General widths: lay out 8 elements (= `bits` bytes) at a time as one 64-bit word.
    if k % 8:
        raise ValueError(f"{bits}-bit packing needs K divisible by 8, got K={k}")
    v = q.to(torch.int64).reshape(*q.shape[:-1], k // 8, 8)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j in range(8):
        word |= v[..., j] << (j * bits)
    out = torch.stack([((word >> (8 * b)) & 0xFF) for b in range(bits)], dim=-1)
    return out.to(torch.uint8).reshape(*q.shape[:-1], nbytes)


def unpack_bits(qdata: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [..., K*bits/8] -> uint8 [..., K]."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} unsupported; expected one of {SUPPORTED_BITS}")
    if qdata.shape[-1] != packed_row_bytes(k, bits):
        raise ValueError(f"packed rows hold {qdata.shape[-1]} bytes, expected {packed_row_bytes(k, bits)} for K={k}")
    if bits == 8:
        return qdata.to(torch.uint8)
    mask = (1 << bits) - 1
    if bits in (2, 4):
        per = 8 // bits
        parts = [(qdata >> (j * bits)) & mask for j in range(per)]
        return torch.stack(parts, dim=-1).reshape(*qdata.shape[:-1], k)
    b = qdata.to(torch.int64).reshape(*qdata.shape[:-1], k // 8, bits)
    word = torch.zeros(b.shape[:-1], dtype=torch.int64)
    for j in range(bits):
        word |= b[..., j] << (8 * j)
    parts = [(word >> (j * bits)) & mask for j in range(8)]
    return torch.stack(parts, dim=-1).reshape(*qdata.shape[:-1], k).to(torch.uint8)


# Rows are dequantized this many elements at a time: the exact float64 evaluation needs
# ~25 bytes of scratch per element, so a block costs ~25 MiB whatever the tensor's size
# (a 262k x 5.4k embedding would otherwise need ~30 GB on top of its output).
DEQUANT_BLOCK_ELEMENTS = 1 << 20


def dequantize_canonical(w: GroupQuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """scale*q + bias evaluated exactly in float64, rounded once to float32 (then to dtype).

    Works through whole rows in blocks of about DEQUANT_BLOCK_ELEMENTS elements, so transient
    memory is bounded by the block, not the tensor; the result is identical either way."""
    k, g = w.shape[-1], w.group_size
    rows = math.prod(w.shape[:-1]) if len(w.shape) >= 2 else 1
    out = torch.empty((rows, k), dtype=dtype)
    if rows == 0 or k == 0:
        return out.reshape(w.shape)
    qdata = w.qdata.reshape(rows, -1)
    scale, bias = w.scale.reshape(rows, -1, 1), w.bias.reshape(rows, -1, 1)
    step = max(1, DEQUANT_BLOCK_ELEMENTS // k)
    for r in range(0, rows, step):
        q = unpack_bits(qdata[r:r + step], w.bits, k).to(torch.float64).reshape(-1, k // g, g)
        q.mul_(scale[r:r + step].to(torch.float64)).add_(bias[r:r + step].to(torch.float64))
        out[r:r + step] = q.to(torch.float32).reshape(-1, k).to(dtype)
    return out.reshape(w.shape)


# --------------------------------------------------------------------------------------------
# Hugging Face export: compressed-tensors "pack-quantized"
# --------------------------------------------------------------------------------------------


def _bytes_to_int32_words(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [R, B] LSB-first bit stream -> int32 [R, ceil(B/4)] little-endian words."""
    pad = (-rows.shape[-1]) % 4
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    words = rows.contiguous().view(torch.int32)
    if sys.byteorder != "little":
        raise RuntimeError("compressed-tensors packing assumes a little-endian machine")
    return words


class IntAffineHFExport(HFExport):
    """Integer weights as compressed-tensors pack-quantized: ``weight_packed`` int32 words of the
    LSB-first stream of q_signed + 2**(b-1) (our unsigned q), ``weight_scale``, optional
    ``weight_zero_point`` (packed along N), ``weight_shape``; w = (q_signed - zp) * scale.

    Exact only when the additive bias is -2**(b-1)*scale (symmetric) or -zero*scale with an
    integer zero (asymmetric); otherwise (e.g. HQQ float zeros) the weight is refused."""

    styles = ("compressed-tensors",)
    asymmetric = True
    stacked = False

    def normalize(self, spec, where):
        if spec.style != "compressed-tensors":
            raise ValueError(f"{where}: integer weights are exported in the compressed-tensors style (pack-quantized)"
                             "; ModelOpt's INT4 AWQ layout is not supported")
        out = super().normalize(spec, where)
        if spec.bits not in SUPPORTED_BITS:
            raise ValueError(f"{where}: int bits={spec.bits} unsupported; expected 2..8")
        if spec.group_size is not None and spec.group_size <= 0:
            raise ValueError(f"{where}: int group_size must be positive or None (per channel)")
        return out

    def roles(self, spec):
        roles = {"weight": "weight_packed", "scale": "weight_scale"}
        if not spec.symmetric:
            roles["zero_point"] = "weight_zero_point"
        roles["shape"] = "weight_shape"
        return roles

    def dtypes(self, spec):
        return {"weight": torch.int32, "scale": torch.float32, "zero_point": torch.int32, "shape": torch.int64}

    def shapes(self, spec, n, k):
        scale = (n, k // (spec.group_size or k))
        shapes = {"weight": (n, -(-k * spec.bits // 32)), "scale": scale}
        if not spec.symmetric:
            shapes["zero_point"] = (-(-n * spec.bits // 32), scale[1])
        shapes["shape"] = (2,)
        return shapes

    def compressed_tensors_scheme(self, spec):
        gs = spec.group_size
        w = ct_weights(spec, type="int", strategy="group" if gs else "channel", group_size=gs, block_structure=None)
        return {"format": "pack-quantized", "weights": w, "input_activations": None, "output_activations": None}

    def from_compressed_tensors(self, scheme):
        w = scheme.get("weights") or {}
        if scheme.get("format") != "pack-quantized" or w.get("type") != "int" or w.get("strategy") not in ("group", "channel"):
            return None
        return {"format": "int", "bits": w.get("num_bits"), "group_size": w.get("group_size") if w.get("strategy") == "group" else None,
                "symmetric": bool(w.get("symmetric", True))}

    def quantize(self, weight, spec, state):
        from llmq.quant.quantize import quantize_weight  # quantize.py imports this package
        from llmq.quant.recipe import QuantConfig

        config = QuantConfig(format="int", bits=spec.bits, group_size=spec.group_size, symmetric=spec.symmetric)
        return quantize_weight(weight, config, name=f"{spec.module}.weight")

    def to_tensors(self, q, spec, state, dtype):
        where = f"{spec.module}.weight"
        if len(q.shape) != 2:
            raise ValueError(f"{where}: pack-quantized export takes 2-D weights, got shape {list(q.shape)}")
        if q.bits != spec.bits or q.group_size != (spec.group_size or q.shape[-1]):
            raise ValueError(f"{where}: quantized with bits={q.bits} group_size={q.group_size}, spec says bits={spec.bits} group_size={spec.group_size}")
        n, k = q.shape
        half = 1 << (q.bits - 1)
        out = {"weight": _bytes_to_int32_words(q.qdata)}
        if spec.symmetric:
            if not torch.equal(q.bias, -half * q.scale):
                raise ValueError(f"{where}: bias is not -{half}*scale, so the weight is not symmetric; export it with symmetric=False")
        else:
            zero = -(q.bias.double() / q.scale.double())
            zr = zero.round()
            if not (torch.equal(zero, zr) and bool(((zr >= 0) & (zr < 2 * half)).all()) and torch.equal((-zr * q.scale.double()).float(), q.bias)):
                raise ValueError(f"{where}: bias/scale is not an integer zero point in [0, {2 * half})"
                                 "; the weight (e.g. HQQ float zeros) has no exact pack-quantized form")
            zp = zr.to(torch.uint8).t().contiguous()  # [G, N]: packed along the output dimension
            padded = torch.nn.functional.pad(zp, (0, (-n) % 32))
            words = _bytes_to_int32_words(pack_bits(padded, q.bits))[:, : -(-n * q.bits // 32)]
            out["zero_point"] = words.t().contiguous()
        out["scale"] = q.scale.to(dtype or torch.float32)
        out["shape"] = torch.tensor([n, k], dtype=torch.int64)
        return out

    def dequantize(self, t, spec):
        w, s = t["weight"], t["scale"]
        n, k = (int(v) for v in t["shape"].tolist())
        half = 1 << (spec.bits - 1)
        row_bytes = k * spec.bits // 8
        qdata = w.contiguous().view(torch.uint8)[:, :row_bytes]
        scale = s.float()
        if spec.symmetric:
            bias = -half * scale
        else:
            if (n * spec.bits) % 8:
                raise ValueError(f"{spec.module}: zero points of {n} rows at {spec.bits} bits do not fill whole bytes")
            zbytes = t["zero_point"].t().contiguous().view(torch.uint8)[:, : n * spec.bits // 8]
            zero = unpack_bits(zbytes, spec.bits, n).t()
            bias = -(zero.float() * scale)
        gq = GroupQuantizedWeight(qdata=qdata, scale=scale, bias=bias, bits=spec.bits, group_size=k // scale.shape[1], shape=(n, k))
        return dequantize_canonical(gq)


class IntAffineFormat(Format):
    """Group-wise integer affine weights (w = scale*q + bias), quantized by llmq.quant.quantize."""

    family = "int"
    names = ("int",)
    container = GroupQuantizedWeight
    has_quantized_module = True
    methods = ("minmax", "search", "hqq")  # llmq.quant.quantize / search / hqq
    importance_methods = ("hqq", "search")
    hf_export = IntAffineHFExport()
    # Bundles store this family as {"kind": "group_quantized", "bits", "group_size", ...}, the
    # record every bundle version has used for it (so integer bundles stay byte-identical).
    bundle_kind = "group_quantized"

    def validate_config(self, config: Any) -> None:
        gs = config.group_size
        if gs is not None and (not isinstance(gs, int) or isinstance(gs, bool) or gs <= 0):
            raise ValueError(f"QuantConfig.group_size must be a positive int, -1 or None (whole row), got {gs!r}")
        if config.bits not in SUPPORTED_BITS:
            raise ValueError(f"QuantConfig.bits={config.bits} unsupported for format 'int'; expected one of {SUPPORTED_BITS}")
        if config.scale_dtype != torch.float32:
            raise ValueError(
                f"QuantConfig.scale_dtype={config.scale_dtype} unsupported for format 'int'; the canonical form stores float32 scales"
            )

    def shape_problem(self, config: Any, shape: Tuple[int, ...]) -> Optional[str]:
        k = shape[-1]
        gs = config.group_size_for(k)
        return None if gs > 0 and k % gs == 0 else f"group_size={gs} does not divide the input dimension K={k}"

    def quantize(self, w: torch.Tensor, config: Any, *, name: str = "<tensor>",
                 importance: Optional[torch.Tensor] = None) -> GroupQuantizedWeight:
        from llmq.quant.quantize import quantize_int_weight  # quantize.py imports this package

        return quantize_int_weight(w, config, name=name, importance=importance)

    def dequantize(self, value: GroupQuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_canonical(value, dtype)

    def params(self, value: GroupQuantizedWeight) -> Dict[str, Any]:
        return {"bits": value.bits, "group_size": value.group_size}

    def stored(self, value: GroupQuantizedWeight) -> Dict[str, torch.Tensor]:
        return {"qdata": value.qdata, "scale": value.scale, "bias": value.bias}

    def rebuild(self, name, params, shape, dtype, stored) -> GroupQuantizedWeight:
        return GroupQuantizedWeight(qdata=stored["qdata"], scale=stored["scale"], bias=stored["bias"],
                                    bits=params.get("bits"), group_size=params.get("group_size"),
                                    shape=tuple(shape), dtype=dtype)

    def packed_bits(self, value: GroupQuantizedWeight, config: Any) -> int:
        """Codes plus a 16-bit scale per group, and a 16-bit zero point when asymmetric, as MLX and
        GGUF store them (the canonical form's float32 scale and bias are wider)."""
        groups = value.scale.numel()
        return math.prod(value.shape) * value.bits + groups * (16 if config.symmetric else 32)

    def layout(self, name, params, shape) -> Layout:
        lead = tuple(shape[:-1]) if len(shape) >= 2 else (1,)
        k, bits, gs = shape[-1], params["bits"], params["group_size"]
        return {"qdata": (torch.uint8, lead + (packed_row_bytes(k, bits),)),
                "scale": (torch.float32, lead + (k // gs,)), "bias": (torch.float32, lead + (k // gs,))}

    def to_torchao(self, value: GroupQuantizedWeight):
        from llmq.quant.torchao_interop import to_torchao  # torchao is optional

        return to_torchao(value)

    def row_quantizer(self, config: Any, shape: Tuple[int, ...], *, name: str = "<tensor>"):
        """Method "minmax" (the default) is group-wise inside each row: any block of rows gives its
        rows of the whole result. The search and hqq methods are quantized whole."""
        if config.method != "minmax" or len(shape) != 2:
            return None
        return RowQuantizer(lambda block, amax: self.quantize(block, config, name=name))

    def native_kernel_available(self) -> bool:
        from llmq.quant._native import native_kernel_available

        return native_kernel_available()
