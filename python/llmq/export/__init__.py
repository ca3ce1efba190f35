"""Hugging Face quantized export: per-weight specs, the tensors a weight becomes, the
quantization configs, and streaming writers for ModelOpt- and compressed-tensors-style folders.
See docs/export.md."""

from llmq.export.quant_config import (
    build_compressed_tensors_config,
    build_hf_quantization_config,
    build_modelopt_hf_quant_config,
)
from llmq.export.readback import ExportReport, consumer_warnings, read_export, verify_export
from llmq.export.shards import ShardWriter
from llmq.export.spec import (
    ExportState,
    WeightExportSpec,
    compute_export_state,
    make_spec,
    merge_export_states,
    select_export_state,
)
from llmq.export.tensors import dequantize_exported_tensors, export_quantized_weight_tensors
from llmq.export.writer import ExportSummary, iter_module_weights, write_hf_quantized_checkpoint

__all__ = [
    "ExportReport",
    "ExportState",
    "ExportSummary",
    "ShardWriter",
    "WeightExportSpec",
    "build_compressed_tensors_config",
    "build_hf_quantization_config",
    "build_modelopt_hf_quant_config",
    "compute_export_state",
    "consumer_warnings",
    "dequantize_exported_tensors",
    "export_quantized_weight_tensors",
    "iter_module_weights",
    "make_spec",
    "merge_export_states",
    "read_export",
    "select_export_state",
    "verify_export",
    "write_hf_quantized_checkpoint",
]
