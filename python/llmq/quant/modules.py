"""nn.Modules that hold canonical quantized weights and dequantize them inside forward.

The quantized fields are buffers, so they appear in state_dict and in a torch.export graph
as uint8/float32 constants, and the unpack + dequantize is part of the graph (plain shifts,
masks, multiplies). Buffer names (documented in docs/formats.md):

    weight_qdata  uint8   [N, K*bits/8]   canonical packed q (LSB-first along K)
    weight_scale  float32 [N, K/group]    canonical scale
    weight_bias   float32 [N, K/group]    canonical ADDITIVE group bias (w = scale*q + bias);
                                          not the Linear's output bias, which stays `bias`

forward dequantizes in float32 as fl(fl(q*scale) + bias): exportable and portable, at most
about one float32 rounding of |scale*q| plus one of |w| away from `dequantize()`'s exact value.
That dequantize path is the reference. A compiled kernel may serve QuantizedLinear.forward
instead (`set_linear_kernel`; llmq.ops installs the dense INT4/INT8 kernel when its extension
loads): only in eager CPU inference (not while tracing/exporting, not when x requires grad),
only for the weights its `pack` accepts, and never while `reference_linears()` is active.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmq.quant.formats import GroupQuantizedWeight, get_format, packed_row_bytes
from llmq.quant.quantize import quantize_weight
from llmq.quant.recipe import QuantConfig


class LinearKernel(Protocol):
    """A compiled y = x W^T for canonical quantized weights (see set_linear_kernel)."""

    def pack(self, qw: GroupQuantizedWeight) -> Optional[Any]:
        """The kernel's form of `qw`, or None when the kernel does not take this format/shape."""

    def linear(self, x: torch.Tensor, packed: Any) -> torch.Tensor:
        """x [..., K] (float32 or bfloat16, CPU) -> [..., N] in x's dtype, without the Linear's bias."""


_linear_kernel: Optional[LinearKernel] = None
_reference_only = 0


def set_linear_kernel(kernel: Optional[LinearKernel]) -> Optional[LinearKernel]:
    """Install (or with None remove) the kernel QuantizedLinear.forward uses; returns the old one."""
    global _linear_kernel
    old, _linear_kernel = _linear_kernel, kernel
    return old


def linear_kernel() -> Optional[LinearKernel]:
    """The installed kernel (None: every QuantizedLinear dequantizes)."""
    return _linear_kernel


@contextlib.contextmanager
def reference_linears() -> Iterator[None]:
    """Inside, every QuantizedLinear takes the dequantize path (the reference), kernel or not."""
    global _reference_only
    _reference_only += 1
    try:
        yield
    finally:
        _reference_only -= 1


def kernel_for(x: torch.Tensor) -> Optional[LinearKernel]:
    """The installed kernel if it may serve input x here (eager CPU inference, fp32/bf16, not tracing,
    not inside reference_linears()), else None: dequantize."""
    if _linear_kernel is None or _reference_only or x.device.type != "cpu" or x.requires_grad:
        return None
    if x.dtype not in (torch.float32, torch.bfloat16) or x.numel() == 0:
        return None
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return None
    return _linear_kernel


def unpack_bits_graph(qdata: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """formats.unpack_bits written with device-agnostic, export-friendly ops only (no
    freshly allocated tensors): uint8 [..., K*bits/8] -> int32 [..., K]."""
    mask = (1 << bits) - 1
    lead = qdata.shape[:-1]
    if bits == 8:
        return qdata.to(torch.int32)
    if bits in (2, 4):
        per = 8 // bits
        b = qdata.to(torch.int32)
        parts = [(b >> (j * bits)) & mask for j in range(per)]
        return torch.stack(parts, dim=-1).reshape(*lead, k)
    b = qdata.to(torch.int64).reshape(*lead, k // 8, bits)
    word = b[..., 0]
    for j in range(1, bits):
        word = word | (b[..., j] << (8 * j))
    parts = [(word >> (j * bits)) & mask for j in range(8)]
    return torch.stack(parts, dim=-1).reshape(*lead, k).to(torch.int32)


def dequantize_graph(qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int, group_size: int, k: int) -> torch.Tensor:
    """float32 scale*q + bias for rows of canonical fields, in export-friendly ops."""
    q = unpack_bits_graph(qdata, bits, k).to(torch.float32)
    q = q.reshape(*q.shape[:-1], k // group_size, group_size)
    w = q * scale.unsqueeze(-1) + bias.unsqueeze(-1)
    return w.reshape(*w.shape[:-2], k)


def _quantize_int(weight: torch.Tensor, config: QuantConfig, name: str) -> GroupQuantizedWeight:
    """The canonical weight of a float module's `weight` (formats with a quantized module only)."""
    if not get_format(config.format).has_quantized_module:
        raise NotImplementedError(f"{name}: no quantized module for format {config.format!r} yet (only 'int')")
    return quantize_weight(weight.detach(), config, name=f"{name}.weight")


class _QuantizedWeightMixin:
    """Shared buffers and conversions of the quantized modules."""

    def _register_quantized(self, n: int, k: int, bits: int, group_size: int, dtype: torch.dtype, device=None) -> None:
        if k % group_size:
            raise ValueError(f"group_size={group_size} does not divide K={k}")
        self.bits = bits
        self.group_size = group_size
        self.weight_dtype = dtype
        g = k // group_size
        self.register_buffer("weight_qdata", torch.zeros(n, packed_row_bytes(k, bits), dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.ones(n, g, dtype=torch.float32, device=device))
        self.register_buffer("weight_bias", torch.zeros(n, g, dtype=torch.float32, device=device))

    def _apply(self, fn, *args, **kwargs):
        # .float() / .to(dtype) / .half() change the dtype the module computes in, as a float weight's
        # would (QuantizedEmbedding's output follows it: a float32 model then runs in float32 throughout)
        self.weight_dtype = fn(torch.empty(0, dtype=self.weight_dtype)).dtype
        return super()._apply(fn, *args, **kwargs)  # type: ignore[misc]

    def _set_quantized(self, qw: GroupQuantizedWeight) -> None:
        if len(qw.shape) != 2:
            raise ValueError(f"{type(self).__name__} needs a 2-D quantized weight, got shape {list(qw.shape)}")
        self.weight_qdata.copy_(qw.qdata)
        self.weight_scale.copy_(qw.scale)
        self.weight_bias.copy_(qw.bias)

    def _dequantized(self, k: int, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float32 [n, k] weight (rows `ids` only where given), in export-friendly ops."""
        q, s, b = self.weight_qdata, self.weight_scale, self.weight_bias
        if ids is not None:
            q, s, b = q[ids], s[ids], b[ids]
        return dequantize_graph(q, s, b, self.bits, self.group_size, k)

    def quantized_weight(self) -> GroupQuantizedWeight:
        """The canonical weight this module holds (views of its buffers, on CPU)."""
        n, g = self.weight_scale.shape
        return GroupQuantizedWeight(
            qdata=self.weight_qdata.cpu(),
            scale=self.weight_scale.cpu(),
            bias=self.weight_bias.cpu(),
            bits=self.bits,
            group_size=self.group_size,
            shape=(n, g * self.group_size),
            dtype=self.weight_dtype,
        )


class QuantizedLinear(_QuantizedWeightMixin, nn.Module):
    """y = x @ dequant(W).T + b with W stored in the canonical group-quantized form."""

    def __init__(self, in_features: int, out_features: int, *, bits: int, group_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self._register_quantized(out_features, in_features, bits, group_size, dtype, device)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_quantized(cls, qw: GroupQuantizedWeight, bias: Optional[torch.Tensor] = None) -> "QuantizedLinear":
        n, k = qw.shape if len(qw.shape) == 2 else (None, None)
        if n is None:
            raise ValueError(f"QuantizedLinear needs a 2-D [out, in] weight, got shape {list(qw.shape)}")
        m = cls(k, n, bits=qw.bits, group_size=qw.group_size, bias=bias is not None, dtype=qw.dtype)
        m._set_quantized(qw)
        if bias is not None:
            m.bias.data = bias.detach().clone()
        return m

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig, *, name: str = "<linear>") -> "QuantizedLinear":
        return cls.from_quantized(_quantize_int(linear.weight, config, name), linear.bias)

    def _packed_for(self, kernel: LinearKernel) -> Optional[Any]:
        """The kernel's form of this weight, packed once and repacked if the buffers change."""
        bufs = (self.weight_qdata, self.weight_scale, self.weight_bias)
        key = (id(kernel),) + tuple((b.data_ptr(), b._version) for b in bufs)
        cached = self.__dict__.get("_kernel_packed")
        if cached is None or cached[0] != key:
            cached = (key, kernel.pack(self.quantized_weight()))
            self.__dict__["_kernel_packed"] = cached
        return cached[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = kernel_for(x)
        packed = None if kernel is None else self._packed_for(kernel)
        if kernel is not None and packed is not None:
            y = kernel.linear(x, packed)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        w = self._dequantized(self.in_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w.to(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


class QuantizedEmbedding(_QuantizedWeightMixin, nn.Module):
    """Embedding lookup that dequantizes only the looked-up rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, bits: int, group_size: int,
                 dtype: torch.dtype = torch.bfloat16, padding_idx: Optional[int] = None, device=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self._register_quantized(num_embeddings, embedding_dim, bits, group_size, dtype, device)

    @classmethod
    def from_quantized(cls, qw: GroupQuantizedWeight, padding_idx: Optional[int] = None) -> "QuantizedEmbedding":
        if len(qw.shape) != 2:
            raise ValueError(f"QuantizedEmbedding needs a 2-D [num, dim] weight, got shape {list(qw.shape)}")
        m = cls(qw.shape[0], qw.shape[1], bits=qw.bits, group_size=qw.group_size, dtype=qw.dtype, padding_idx=padding_idx)
        m._set_quantized(qw)
        return m

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, config: QuantConfig, *, name: str = "<embedding>") -> "QuantizedEmbedding":
        return cls.from_quantized(_quantize_int(emb.weight, config, name), emb.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._dequantized(self.embedding_dim, ids).to(self.weight_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, group_size={self.group_size}"
