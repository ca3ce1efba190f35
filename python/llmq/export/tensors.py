"""The tensors one quantized weight becomes in a Hugging Face checkpoint, and back.

`export_quantized_weight_tensors(weight, spec, state)` turns a float weight (or an already
quantized llmq container) into the named tensors of `spec.style` (ModelOpt or
compressed-tensors). `dequantize_exported_tensors` reads them back with each reader's own
formula, which is how the tests check that what we write means what we intended.
"""

from __future__ import annotations

import sys
from typing import Dict, Mapping, Optional

import torch

from llmq.quant import fp
from llmq.quant.formats import GroupQuantizedWeight, dequantize_canonical, format_of, pack_bits, unpack_bits
from llmq.export.spec import ExportState, WeightExportSpec, compute_export_state


def _check_weight(weight, spec: WeightExportSpec) -> None:
    if isinstance(weight, torch.Tensor):
        if weight.dim() not in (2, 3):
            raise ValueError(f"{spec.module}: expected a 2-D [out, in] or stacked 3-D [experts, out, in] weight, got shape {list(weight.shape)}")
        if spec.format == "int" and weight.dim() != 2:
            raise ValueError(f"{spec.module}: integer export takes 2-D weights; split stacked experts first (got shape {list(weight.shape)})")
        return
    fmt = format_of(weight)  # the format registry names what a container holds
    got = fmt.name_of(weight) if fmt is not None else None
    if got != spec.format:
        raise ValueError(f"{spec.module}: spec says {spec.format}, got a {type(weight).__name__}{' ' + got if got else ''}")


def nvfp4_global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's weight_scale_2 from a weight amax: amax / (6*448), 1.0 where amax == 0."""
    g = amax.float() / (fp.FP4_E2M1_MAX * fp.FP8_E4M3_MAX)
    return torch.where(g > 0, g, torch.ones_like(g))


def fp8_tensor_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    s = amax.float() / fp.FP8_E4M3_MAX
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_for_spec(weight: torch.Tensor, spec: WeightExportSpec, state: ExportState):
    """Quantize a float weight as `spec` says, using the (possibly merged) state's scales."""
    name = f"{spec.module}.weight"
    if spec.format == "nvfp4":
        return fp.quantize_nvfp4(weight, name=name, global_scale=nvfp4_global_scale_from_amax(state.weight_amax))
    if spec.format in fp.MX_FORMATS:
        return fp.quantize_mx(weight, spec.format, name=name)
    if spec.format == "fp8":
        scale = fp8_tensor_scale_from_amax(state.weight_amax) if spec.granularity == "tensor" else None
        return fp.quantize_fp8(weight, spec.granularity, name=name, scale=scale)
    from llmq.quant.quantize import quantize_weight  # the integer quantizer (format "int")
    from llmq.quant.recipe import QuantConfig

    config = QuantConfig(format="int", bits=spec.bits, group_size=spec.group_size, symmetric=spec.symmetric)
    return quantize_weight(weight, config, name=name)


def export_quantized_weight_tensors(weight, spec: WeightExportSpec, state: Optional[ExportState] = None, dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """name -> tensor for one module's quantized weight, in spec.style's names/dtypes/shapes.

    weight: a float tensor [N, K] (or stacked [E, N, K] for the FP formats: every output then
    gains a leading E), or an llmq container (FP8Weight, MXWeight, NVFP4Weight,
    GroupQuantizedWeight) that is converted without requantizing.
    state: the export state (from compute_export_state / merge_export_states); computed
    from the weight when omitted.
    dtype: dtype of the integer formats' weight_scale (default float32, which keeps the
    canonical scales exact).
    """
    _check_weight(weight, spec)
    if isinstance(weight, torch.Tensor):
        if state is None:
            state = compute_export_state(weight, spec)
        q = quantize_for_spec(weight, spec, state)
    else:
        q = weight
        if state is None:
            state = ExportState()
        if spec.static_input_scale and state.input_amax is None:
            raise ValueError(f"{spec.module}: static_input_scale needs state.input_amax")
    names = spec.tensor_names()
    ct = spec.style == "compressed-tensors"
    out: Dict[str, torch.Tensor] = {}
    if spec.format == "nvfp4":
        out[names["weight"]] = q.codes
        out[names["scale"]] = q.block_scale
        g = q.global_scale
        out[names["global_scale"]] = (1.0 / g).reshape(g.shape + (1,)) if ct else g
    elif spec.format in fp.MX_FORMATS:
        out[names["weight"]] = q.codes.view(torch.float8_e4m3fn) if spec.format == "mxfp8" else q.codes
        out[names["scale"]] = q.scale_e8m0
    elif spec.format == "fp8":
        scale = q.scale
        if spec.granularity == "tensor" and ct:
            scale = scale.reshape(scale.shape + (1,))
        elif spec.granularity == "channel" and not ct:
            scale = scale.squeeze(-1)
        out[names["weight"]] = q.data
        out[names["scale"]] = scale
    else:
        out.update(_int_to_pack_quantized(q, spec, dtype or torch.float32))
    if spec.static_input_scale:
        a = state.input_amax.float()
        if spec.format == "fp8":
            s = a / fp.FP8_E4M3_MAX
        else:
            s = a / (fp.FP4_E2M1_MAX * fp.FP8_E4M3_MAX)
            if ct:
                s = 1.0 / s
        out[names["input_scale"]] = s.reshape((1,) if ct else ())
    return {k: v.contiguous() for k, v in out.items()}


def _bytes_to_int32_words(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [R, B] LSB-first bit stream -> int32 [R, ceil(B/4)] little-endian words."""
    pad = (-rows.shape[-1]) % 4
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    words = rows.contiguous().view(torch.int32)
    if sys.byteorder != "little":
        raise RuntimeError("compressed-tensors packing assumes a little-endian machine")
    return words


def _int_to_pack_quantized(q: GroupQuantizedWeight, spec: WeightExportSpec, scale_dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Canonical int (w = scale*q + bias) -> compressed-tensors pack-quantized, exactly.

    compressed-tensors stores q_signed + 2^(b-1) as a dense LSB-first int32 bit stream and
    computes w = (q_signed - zp) * scale, so our unsigned q is already its stored value; the
    additive bias must equal -2^(b-1)*scale (symmetric) or -zero*scale with an integer zero
    (asymmetric), otherwise the weight (e.g. HQQ float zeros) has no exact pack-quantized form.
    """
    where = f"{spec.module}.weight"
    if len(q.shape) != 2:
        raise ValueError(f"{where}: pack-quantized export takes 2-D weights, got shape {list(q.shape)}")
    if q.bits != spec.bits or q.group_size != (spec.group_size or q.shape[-1]):
        raise ValueError(f"{where}: quantized with bits={q.bits} group_size={q.group_size}, spec says bits={spec.bits} group_size={spec.group_size}")
    n, k = q.shape
    half = 1 << (q.bits - 1)
    names = spec.tensor_names()
    out = {names["weight"]: _bytes_to_int32_words(q.qdata)}
    if spec.symmetric:
        if not torch.equal(q.bias, -half * q.scale):
            raise ValueError(f"{where}: bias is not -{half}*scale, so the weight is not symmetric; export it with symmetric=False")
    else:
        zero = -(q.bias.double() / q.scale.double())
        zr = zero.round()
        if not (torch.equal(zero, zr) and bool(((zr >= 0) & (zr < 2 * half)).all()) and torch.equal((-zr * q.scale.double()).float(), q.bias)):
            raise ValueError(f"{where}: bias/scale is not an integer zero point in [0, {2 * half}); the weight (e.g. HQQ float zeros) has no exact pack-quantized form")
        zp = zr.to(torch.uint8).t().contiguous()  # [G, N]: packed along the output dimension
        padded = torch.nn.functional.pad(zp, (0, (-n) % 32))
        words = _bytes_to_int32_words(pack_bits(padded, q.bits))[:, : -(-n * q.bits // 32)]
        out[names["zero_point"]] = words.t().contiguous()
    out[names["scale"]] = q.scale.to(scale_dtype)
    out[names["shape"]] = torch.tensor([n, k], dtype=torch.int64)
    return out


# --------------------------------------------------------------------------------------------
# Reading our own exports back (each reader's formula)
# --------------------------------------------------------------------------------------------


def dequantize_exported_tensors(tensors: Mapping[str, torch.Tensor], spec: WeightExportSpec) -> torch.Tensor:
    """float32 weight from a module's exported tensors, by the formula the spec's reader uses.

    ModelOpt / vLLM / TensorRT-LLM: NVFP4 value * (float(weight_scale) * weight_scale_2);
    compressed-tensors: value * (float(weight_scale) / weight_global_scale). FP8, MX and int
    are single exact products, identical in both styles.
    """
    names = spec.tensor_names()
    try:
        t = {role: tensors[name] for role, name in names.items() if role != "input_scale"}
    except KeyError as e:
        raise ValueError(f"{spec.module}: exported tensor {e.args[0]!r} missing") from None
    w, s = t["weight"], t["scale"]
    ct = spec.style == "compressed-tensors"
    if spec.format == "nvfp4":
        k = w.shape[-1] * 2
        vals = fp.e2m1_decode(fp.unpack_fp4(w)).reshape(*w.shape[:-1], k // 16, 16)
        g = t["global_scale"].float()
        if ct:
            g = g.reshape(g.shape[:-1])
            scale = s.float() / g.reshape(g.shape + (1, 1))
        else:
            scale = s.float() * g.reshape(g.shape + (1, 1))
        return (vals * scale.unsqueeze(-1)).reshape(*w.shape[:-1], k)
    if spec.format in fp.MX_FORMATS:
        codes = w.view(torch.uint8)
        shape = tuple(w.shape[:-1]) + (w.shape[-1] * (2 if spec.format == "mxfp4" else 1),)
        return fp.dequantize_fp(fp.MXWeight(codes=codes, scale_e8m0=s, fmt=spec.format, shape=shape))
    if spec.format == "fp8":
        x = w.float()
        if spec.granularity == "block128":
            n, k = w.shape[-2:]
            tiles = x.reshape(*w.shape[:-2], n // 128, 128, k // 128, 128)
            return (tiles * s[..., :, None, :, None]).reshape(w.shape)
        if spec.granularity == "channel":
            return x * (s if ct else s.unsqueeze(-1))
        return x * s.reshape(s.shape[: w.dim() - 2] + (1, 1))
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
