"""A checkpoint folder's side files (config.json, tokenizer files, generation_config.json,
chat_template.jinja, ...): what a writer copies into its output next to the weights.

The rule is the shards' (`allowed_root`, which llmq.checkpoint.tensor_sources also asks): a side
file is a regular file inside the checkpoint folder (a Hugging Face hub cache snapshot: inside that
model's cache folder, whose blobs its links point at). One that is a link resolving anywhere else (a local secret,
``/proc/self/environ``), or not a regular file (a FIFO, a device, a folder), is refused with one
line naming it: it is never read, so never copied into a bundle, an HF folder or an MLX folder.
"""

from __future__ import annotations

import os
import stat
from typing import Iterable, List, Optional

from llmq.checkpoint.errors import UnsupportedCheckpointError

# Files a tokenizer loader may read (transformers, mlx-lm); carried from a checkpoint when present.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja", "generation_config.json",
)


def allowed_root(folder: str) -> str:
    """The folder that shard files (after following symlinks) must stay inside.

    Normally the checkpoint folder itself. A Hugging Face hub cache snapshot
    (``.../models--org--name/snapshots/<revision>/``, the layout ``snapshot_download`` and
    transformers write) holds symlinks into ``../../blobs/``: for it the root is that model's
    cache folder ``models--org--name/``, so links into its blobs are followed and anything
    further out is still refused.
    """
    real = os.path.realpath(folder)
    snapshots = os.path.dirname(real)
    model_cache = os.path.dirname(snapshots)
    if (os.path.basename(snapshots) == "snapshots" and os.path.basename(model_cache).startswith("models--")
            and os.path.isdir(os.path.join(model_cache, "blobs"))):
        return model_cache
    return real


def side_file(folder: os.PathLike, name: str) -> Optional[str]:
    """``folder/name`` if it is there and allowed (module docstring), None if it is not there;
    UnsupportedCheckpointError (one line naming it) if it is there but not allowed."""
    folder = os.fspath(folder)
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        return None
    root = allowed_root(os.fspath(folder))
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise UnsupportedCheckpointError(f"is a link to {real}, outside the checkpoint folder; side files must be "
                                         "regular files inside it", path=path)
    try:
        mode = os.stat(real).st_mode
    except OSError as e:  # a dangling link
        raise UnsupportedCheckpointError(f"cannot be read ({e.strerror}); side files must be regular files inside "
                                         "the checkpoint folder", path=path) from None
    if not stat.S_ISREG(mode):
        raise UnsupportedCheckpointError("is not a regular file; side files must be regular files inside the "
                                         "checkpoint folder", path=path)
    return path


def side_files(folder: os.PathLike, names: Iterable[str]) -> List[str]:
    """The allowed paths of those of ``names`` the folder has, in order (``side_file`` each)."""
    return [p for p in (side_file(folder, n) for n in names) if p is not None]
