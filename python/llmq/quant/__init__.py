"""llmq.quant: the format registry (llmq.quant.formats, one module per format family that owns
its container and math), recipes, quantize_weight / dequantize (the front door, quantize.py),
model / stream application, and exact converters at the edges (docs/formats.md).

The torchao converters (`to_torchao`, `from_torchao`, the "int" family's) import torchao on
first use, so that `import llmq.quant` does not import torchao; importing llmq.quant drops torchao's
known-harmless log lines first (llmq/harmless_logs.py).
"""

from llmq import harmless_logs as _harmless_logs
from llmq.quant._native import native_kernel_available
from llmq.quant.formats import (
    Format,
    GroupQuantizedWeight,
    dequantize_canonical,
    format_names,
    format_of,
    get_format,
    is_quantized,
    pack_bits,
    register_format,
    unpack_bits,
)
from llmq.quant.formats.int_affine import from_torchao, to_torchao
from llmq.quant.fuse import fuse_along_output
from llmq.quant.modules import QuantizedEmbedding, QuantizedLinear
from llmq.quant.presets import PRESETS, get_preset, load_recipe, register_preset
from llmq.quant.quantize import dequantize, quantize_weight
from llmq.quant.quantize_model import QuantizationReport, ReportEntry, quantize_model
from llmq.quant.recipe import QuantConfig, QuantRecipe, QuantRule
from llmq.quant.stream import quantize_stream

_harmless_logs.install()  # before any torchao import (all lazy, in the converters)

__all__ = [
    "QuantConfig",
    "QuantRule",
    "QuantRecipe",
    "quantize_weight",
    "quantize_model",
    "quantize_stream",
    "dequantize",
    "fuse_along_output",
    "GroupQuantizedWeight",
    "get_preset",
    "register_preset",
    "load_recipe",
    "PRESETS",
    "QuantizedLinear",
    "QuantizedEmbedding",
    "QuantizationReport",
    "ReportEntry",
    "pack_bits",
    "unpack_bits",
    "dequantize_canonical",
    "to_torchao",
    "from_torchao",
    "native_kernel_available",
    "Format",
    "register_format",
    "get_format",
    "format_of",
    "format_names",
    "is_quantized",
]

