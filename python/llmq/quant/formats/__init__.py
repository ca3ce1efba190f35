"""llmq.quant.formats: one module per weight-format family behind one interface (`Format`,
base.py) and a registry by name. docs/formats.md describes the interface and how to add one.

    int_affine.py  "int"              group-wise integer affine, the canonical form (GroupQuantizedWeight)
    fp8.py         "fp8"              e4m3, per tensor / channel / 128x128 block
    mx.py          "mxfp4", "mxfp8"   OCP microscaling
    nvfp4.py       "nvfp4"            NVIDIA FP4
    gguf_blocks.py GGUF block types   import only: rearranged into "int" exactly
    gguf_quant.py  "q4_0" .. "q6_k"   quantized under GGUF block constraints (canonical "int" values)

The canonical integer helpers stay importable from here (``from llmq.quant.formats import
GroupQuantizedWeight, pack_bits, ...``). The codecs the families share (bit packing, E2M1/E8M0,
scale rounding, input checks) are llmq.quant.codecs.
"""

from llmq.quant.codecs import SUPPORTED_BITS, pack_bits, packed_row_bytes, unpack_bits
from llmq.quant.formats.base import (
    Format,
    first_of_alike,
    format_names,
    format_of,
    get_format,
    is_quantized,
    nbytes_of,
    register_format,
    unregister_format,
)
from llmq.quant.formats.fp8 import FP8Format
from llmq.quant.formats.gguf_blocks import GGUFBlockFormat
from llmq.quant.formats.gguf_quant import GGUFQuantFormat
from llmq.quant.formats.int_affine import (
    DEQUANT_BLOCK_ELEMENTS,
    GroupQuantizedWeight,
    IntAffineFormat,
    dequantize_canonical,
    validate_layout,
)
from llmq.quant.formats.mx import MXFormat
from llmq.quant.formats.nvfp4 import NVFP4Format

# The registrations: one line per family.
register_format(IntAffineFormat())
register_format(FP8Format())
register_format(MXFormat())
register_format(NVFP4Format())
register_format(GGUFBlockFormat())
register_format(GGUFQuantFormat())

__all__ = [
    "Format", "register_format", "unregister_format", "get_format", "format_of", "format_names", "is_quantized", "nbytes_of",
    "first_of_alike",
    "GroupQuantizedWeight", "SUPPORTED_BITS", "DEQUANT_BLOCK_ELEMENTS", "dequantize_canonical", "pack_bits",
    "unpack_bits", "packed_row_bytes", "validate_layout",
]
