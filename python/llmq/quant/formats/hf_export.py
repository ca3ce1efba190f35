"""The optional Hugging Face export hook of a format family (`Format.hf_export`).

A family that can be written into a quantized Hugging Face folder sets ``hf_export`` to an
`HFExport` instance; llmq.export (specs, tensors, quantization_config, read-back) asks the
hook instead of branching on format names. The hook receives a `WeightExportSpec`
(llmq/export/spec.py) duck-typed: ``.module .format .style .bits .group_size .granularity
.symmetric .static_input_scale``; it never imports llmq.export. docs/export.md lists what
each family writes; docs/formats.md says how a new family adds its hook.

Two reader conventions (``style``): "modelopt" (ModelOpt / vLLM / TensorRT-LLM) and
"compressed-tensors". Roles: weight, scale, global_scale, input_scale, zero_point, shape.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

STYLES = ("modelopt", "compressed-tensors")


def scalar_shape(spec: Any) -> Tuple[int, ...]:
    """A per-tensor scale: 0-dim in ModelOpt folders, [1] in compressed-tensors folders."""
    return (1,) if spec.style == "compressed-tensors" else ()


def ct_weights(spec: Any, **fields: Any) -> Dict[str, Any]:
    """A compressed-tensors ``weights`` QuantizationArgs dict: the common fields, then `fields`."""
    return {"num_bits": spec.bits, "symmetric": spec.symmetric, "dynamic": False, **fields}


def modelopt_raw_codes_warning(label: str) -> str:
    """transformers 5.x has no "modelopt" quant_method: it skips the config and loads an unpacked
    8-bit weight (FP8, MXFP8) as its raw codes, scales ignored, without an error (measured:
    docs/export.md, "Consumers tried")."""
    return (f"transformers 5.x from_pretrained loads this ModelOpt {label} folder without error but with the raw {label} "
            "codes as weights (weight_scale ignored); load it with vLLM (quantization='modelopt') or TensorRT-LLM")


class HFExport:
    """What one family writes into a Hugging Face folder, and how its readers decode it.

    Class attributes describe fixed properties; methods receive the (validated) spec. A
    subclass implements `roles`, `dtypes`, `shapes`, `compressed_tensors_scheme`,
    `quantize`, `to_tensors` and `dequantize`; ModelOpt support adds `modelopt_layer_config`
    and `modelopt_groups`.
    """

    styles: Tuple[str, ...] = STYLES  # the reader conventions this family can be written in
    bits: Optional[int] = None  # fixed element width (None: the spec's bits)
    group_size: Optional[int] = None  # fixed block along K (None: the spec's group_size)
    asymmetric: bool = False  # whether a zero point can be written
    static_input_scale: bool = False  # whether a static activation scale can be written
    stacked: bool = True  # takes stacked [E, N, K] experts (else 2-D weights only)

    # ---- spec validation ---------------------------------------------------------------------
    def normalize(self, spec: Any, where: str) -> Dict[str, Any]:
        """Fields of the spec to set (fixed bits / group size ...); raise ValueError naming
        `where` for a spec this family cannot write. Called before the generic checks."""
        out: Dict[str, Any] = {}
        if spec.style not in self.styles:
            raise ValueError(f"{where}: {spec.format} is not exported in the {spec.style} style; expected one of {self.styles}")
        bits = self.fixed_bits(spec)
        if bits is not None and spec.bits != bits:
            out["bits"] = bits
        if self.group_size is not None:
            if spec.group_size not in (None, self.group_size):
                raise ValueError(f"{where}: {spec.format} uses blocks of {self.group_size}, got group_size={spec.group_size}")
            out["group_size"] = self.group_size
        if spec.granularity is not None:
            raise ValueError(f"{where}: {spec.format} takes no granularity, got {spec.granularity!r}")
        return out

    def fixed_bits(self, spec: Any) -> Optional[int]:
        """The element width the format fixes for spec.format (None: the spec's)."""
        return self.bits

    def check(self, spec: Any, where: str) -> None:
        """Family-specific checks after the generic ones (default: none)."""

    # ---- what the checkpoint holds -----------------------------------------------------------
    def roles(self, spec: Any) -> Dict[str, str]:
        """role -> tensor name suffix (after ``<module>.``), in write order, input_scale excluded."""
        raise NotImplementedError

    def input_scale_suffix(self, spec: Any) -> str:
        return "input_scale"

    def dtypes(self, spec: Any) -> Dict[str, torch.dtype]:
        """role -> dtype in the checkpoint (roles not written by this spec may be listed)."""
        raise NotImplementedError

    def shapes(self, spec: Any, n: int, k: int) -> Dict[str, Tuple[int, ...]]:
        """role -> shape for a 2-D weight [n, k] (input_scale excluded)."""
        raise NotImplementedError

    # ---- how configs describe it -------------------------------------------------------------
    def modelopt_layer_config(self, spec: Any) -> Dict[str, Any]:
        """This layer's entry in ModelOpt's ``quantized_layers`` (quant_algo, group_size)."""
        raise ValueError(f"export spec for {spec.module!r}: {spec.format} has no ModelOpt quant_algo")

    def modelopt_groups(self) -> Mapping[str, Any]:
        """quant_algo -> fn(group_size) -> the compressed-tensors-like group description
        ModelOpt writes into config.json for that algorithm."""
        return {}

    def compressed_tensors_scheme(self, spec: Any) -> Dict[str, Any]:
        """{"format", "weights", "input_activations", "output_activations"}."""
        raise NotImplementedError

    def readback_rel_tolerance(self, spec: Any) -> float:
        """Relative difference allowed between the reader's formula and llmq's exact dequantization
        of the same container (0: the formula is exact)."""
        return 0.0

    def rel_rms_bound(self, spec: Any) -> float:
        """A generous bound on ||dequantized - original|| / ||original|| for a correctly quantized
        weight (what read-back flags against a float reference); default by element width."""
        return 0.75 * 2.0 ** (2 - spec.bits)

    # ---- reading a folder's config back (llmq/export/readback.py) -----------------------------
    def from_compressed_tensors(self, scheme: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
        """Spec fields (format, bits, group_size, granularity, symmetric, static_input_scale) for
        a compressed-tensors config group this family writes, else None."""
        return None

    def from_modelopt(self, layer_config: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
        """Spec fields for a ModelOpt layer config ({"quant_algo", "group_size"}) this family
        writes, else None."""
        return None

    def known_misreads(self, fields: Mapping[str, Any], style: str, moe: bool) -> Tuple[str, ...]:
        """One line per known consumer that loads such a folder wrongly without an error (style,
        the model has MoE experts), naming a loader that reads it correctly."""
        return ()

    # ---- numbers -----------------------------------------------------------------------------
    def row_block_rows(self, spec: Any) -> Optional[int]:
        """The row multiple m such that the tensors of any block of m*j whole rows are, row for row,
        those of the whole weight (with the whole weight's state): the writer then quantizes and
        writes a weight too large to hold block by block. None (the default): only whole."""
        return None

    def needs_tensor_amax(self, spec: Any) -> bool:
        """Whether a per-tensor scale derives from the weight amax (shared by fused siblings)."""
        return False

    def input_scale(self, amax: torch.Tensor, spec: Any) -> torch.Tensor:
        """The stored static activation scale for activation amax `amax` (0-dim float32)."""
        raise ValueError(f"{spec.module}: {spec.format} has no static input scale")

    def quantize(self, weight: torch.Tensor, spec: Any, state: Any) -> Any:
        """The llmq container for a float weight, using state's (possibly merged) amax."""
        raise NotImplementedError

    def to_tensors(self, q: Any, spec: Any, state: Any, dtype: Optional[torch.dtype]) -> Dict[str, torch.Tensor]:
        """role -> tensor for container q (input_scale excluded), in write order."""
        raise NotImplementedError

    def dequantize(self, t: Mapping[str, torch.Tensor], spec: Any) -> torch.Tensor:
        """float32 weight from role -> tensor, by the spec's reader's formula."""
        raise NotImplementedError
