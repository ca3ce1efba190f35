"""Checkpoint I/O: stream tensors in (safetensors, HF folders, GGUF), stream bundles out.

Public API (see docs/checkpoint.md):
    iter_checkpoint, load_checkpoint, checkpoint_names,   -- readers
    checkpoint_shapes, checkpoint_stored_types
    save_bundle, load_bundle, iter_bundle, read_manifest -- the quantized output bundle
    source_files, side_file, side_files, TOKENIZER_FILES -- a checkpoint's side files, checked
    CheckpointError and its subclasses                    -- the only errors readers raise
"""

from llmq.checkpoint.bundle import (
    BASE_BUNDLE_VERSION,
    BUNDLE_VERSION,
    SOURCE_FILES,
    BundleWriter,
    save_bundle,
    source_files,
)
from llmq.checkpoint.bundle_reader import iter_bundle, load_bundle, read_manifest
from llmq.checkpoint.errors import (
    BundleVersionError,
    CheckpointError,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    MissingTensorsError,
    NonFiniteWeightError,
    OutputBusyError,
    OutputWriteError,
    ResumeMismatchError,
    TensorMismatchError,
    UnsupportedCheckpointError,
)
from llmq.checkpoint.gguf_import import read_gguf_metadata
from llmq.checkpoint.reader import (
    LoadResult,
    checkpoint_names,
    checkpoint_shapes,
    checkpoint_stored_types,
    iter_checkpoint,
    load_checkpoint,
)
from llmq.checkpoint.side_files import TOKENIZER_FILES, side_file, side_files

__all__ = [
    "BASE_BUNDLE_VERSION",
    "BUNDLE_VERSION",
    "SOURCE_FILES",
    "TOKENIZER_FILES",
    "BundleVersionError",
    "BundleWriter",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "CorruptCheckpointError",
    "LoadResult",
    "MissingTensorsError",
    "NonFiniteWeightError",
    "OutputBusyError",
    "OutputWriteError",
    "ResumeMismatchError",
    "TensorMismatchError",
    "UnsupportedCheckpointError",
    "checkpoint_names",
    "checkpoint_shapes",
    "checkpoint_stored_types",
    "iter_bundle",
    "iter_checkpoint",
    "load_bundle",
    "load_checkpoint",
    "read_gguf_metadata",
    "read_manifest",
    "save_bundle",
    "side_file",
    "side_files",
    "source_files",
]
