"""The one error type every checkpoint reader and writer raises.

Callers (quantize_and_save, the models' loaders) catch ``CheckpointError`` and print
one line; the subclasses exist so tests and tools can tell the kinds apart. Every
message names the file, the tensor where there is one, and what was expected.
"""

from __future__ import annotations

import os
from typing import Optional


class CheckpointError(ValueError):
    """Base class: anything wrong with a checkpoint or bundle on disk or in flight."""

    def __init__(self, message: str, *, path: Optional[str | os.PathLike] = None, tensor: Optional[str] = None):
        parts = []
        if path is not None:
            parts.append(str(path))
        if tensor is not None:
            parts.append(f"tensor {tensor!r}")
        prefix = ": ".join(parts)
        super().__init__(f"{prefix}: {message}" if prefix else message)
        self.path = None if path is None else str(path)
        self.tensor = tensor


class CheckpointNotFoundError(CheckpointError):
    """The path, a shard named by an index, or a manifest file does not exist."""


class CorruptCheckpointError(CheckpointError):
    """The bytes on disk do not form a valid file: truncated, bad header, offsets out of range, overlaps."""


class UnsupportedCheckpointError(CheckpointError):
    """A well-formed file we refuse: pickles, unknown GGUF tensor types, unknown dtypes."""


class TensorMismatchError(CheckpointError):
    """A tensor's shape or dtype disagrees with what the model, index or manifest expects."""


class MissingTensorsError(CheckpointError):
    """load_checkpoint found tensors the model needs but the checkpoint lacks, or the reverse."""


class NonFiniteWeightError(CheckpointError):
    """A weight holds NaN or Inf and the policy is to refuse it."""


class ChecksumError(CheckpointError):
    """A bundle shard's size or checksum (BLAKE3; SHA-256 in format 1) differs from the manifest's."""


class BundleVersionError(CheckpointError):
    """The bundle manifest's format version is newer than, or unknown to, this reader."""


class ResumeMismatchError(CheckpointError):
    """An interrupted bundle cannot be resumed because the input or settings changed."""


class OutputWriteError(CheckpointError):
    """Writing the output failed (a full disk reads "<path>: No space left on device"); the
    ``.partial`` folder is kept for a resume and nothing is published."""


class OutputBusyError(CheckpointError):
    """Another run holds the lock on the same output folder."""
