"""Write a folder that mlx-lm loads offline with `mlx_lm.load(folder)`.

Input is a stream of `(mlx_name, value)` pairs, already in MLX-native naming (the model
pipelines own the HF -> MLX key maps, e.g. qwen3_5_moe's conv1d [C, K, 1] and +1 norms):

* `value` a torch.Tensor: written as is (kept in high precision);
* `value` an `MLXQuantizedWeight` (or a canonical `GroupQuantizedWeight`, packed here
  with scales and biases in `scale_dtype` where it holds them exactly, else in the first of
  WIDER_SCALE_DTYPES that does: a GGUF Q4_0's float16 scales stay 16-bit):
  `mlx_name` is the weight's name,
  `<module>.weight` (or just `<module>`), and `<module>.weight/.scales/.biases` are written;
* `value` llmq's mxfp4 / mxfp8 weight (llmq.quant.formats.mx.MXWeight): written in MLX's mode
  of that name (`.weight` uint32 words of the same code bytes, `.scales` the uint8 E8M0 bytes, no
  biases: affine.pack_mlx_fp); llmq's nvfp4 with global scale 1 in MLX's nvfp4 mode (others refused: affine.NVFP4_GLOBAL_SCALE_REFUSAL);

Output:

    model.safetensors                 (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
    config.json                       the given config plus "quantization" (and its mirror
                                      "quantization_config", as mlx-lm writes it)
    tokenizer files                   copied through

"quantization" holds the most common (group_size, bits, mode) as the global default,
an entry `{"group_size", "bits", "mode"}` for every module that differs, and `false` for
every module whose 2-D+ `.weight` was kept in high precision, so mlx-lm never guesses.

Each tensor is written to its shard as it arrives (llmq.checkpoint.shard_file), so memory
holds one tensor, whatever the shard size. The folder is built in `<out>.partial`
(llmq.checkpoint.workfolder: locked from the start, so a second run into the same folder is
refused before any work; fsynced; one rename) and renamed into place when complete: an
interrupted run never leaves a folder that looks finished, and the next run clears what it left
(no resume). Same input -> byte-identical files.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple, Union

import torch

from llmq.checkpoint.fileio import copy_file, write_error, write_file_atomic
from llmq.checkpoint.shard_file import ShardRotation, StreamingShardFile, hf_shard_names
from llmq.checkpoint.workfolder import WorkFolder
from llmq.quant.formats import GroupQuantizedWeight
from llmq.quant.storage import narrowest_exact

from .affine import MLXQuantizedWeight, pack_mlx_affine, pack_mlx_fp

DEFAULT_MAX_SHARD_BYTES = 5 << 30  # mlx-lm's own shard size
# Scales a weight's scale dtype cannot hold exactly are written in the first of these that does.
WIDER_SCALE_DTYPES = (torch.float16, torch.float32)
TensorLike = Union[torch.Tensor, MLXQuantizedWeight, GroupQuantizedWeight]


def _module_path(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def quantization_section(params: Dict[str, Dict[str, object]], kept: Sequence[str]) -> Optional[dict]:
    """Build config.json's "quantization" from per-module params and the kept module paths.

    Returns None when nothing is quantized (mlx-lm then loads a plain model).
    """
    if not params:
        return None
    counts = collections.Counter(tuple(sorted(p.items())) for p in params.values())
    # most common first; ties go to the first module written (Counter keeps insertion order)
    default = dict(counts.most_common(1)[0][0])
    section: Dict[str, object] = {
        "group_size": default["group_size"],
        "bits": default["bits"],
        "mode": default["mode"],
    }
    for path, p in params.items():
        if p != default:
            section[path] = dict(p)
    for path in kept:
        if path in params:
            continue
        section[path] = False
    return section


class _ShardWriter:
    """Writes each tensor into the open shard as it arrives (llmq.checkpoint.shard_file: one
    tensor in memory at a time) and starts a new shard whenever the next one would overflow."""

    def __init__(self, folder: Path, rotation: ShardRotation, fsync: bool):
        self.folder = folder
        self.rotation = rotation
        self.fsync = fsync
        self.open: Optional[StreamingShardFile] = None
        self.shard_files = []  # temporary names, in order
        self.weight_map: Dict[str, int] = {}  # tensor name -> shard index
        self.total_bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.weight_map:
            raise ValueError(f"tensor {name!r} written twice")
        if self.rotation.must_rotate(self.open, name, t):
            self.flush()
        if self.open is None:
            self.open = StreamingShardFile(str(self.folder / f"shard-{len(self.shard_files):05d}.partial"),
                                           self.rotation.reserve, {"format": "mlx"})
        self.open.add(name, t)
        self.weight_map[name] = len(self.shard_files)
        self.total_bytes += t.numel() * t.element_size()

    def flush(self) -> None:
        shard, self.open = self.open, None
        if shard is None:
            return
        try:
            shard.close(fsync=self.fsync)
        except BaseException:
            shard.discard()
            raise
        self.shard_files.append(Path(shard.path))

    def abort(self) -> None:
        """Stop the open shard's writer thread and drop its file."""
        shard, self.open = self.open, None
        if shard is not None:
            shard.discard()

    def finish(self) -> Sequence[str]:
        """Flush, give the shards their final names, write the index if sharded."""
        self.flush()
        n = len(self.shard_files)
        if n == 0:
            raise ValueError("no tensors were written")
        names = hf_shard_names(n)
        for tmp, final in zip(self.shard_files, names):
            try:
                os.replace(tmp, self.folder / final)
            except OSError as e:
                raise write_error(e, str(tmp), "renaming the shard") from None
        if n > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": {k: names[i] for k, i in sorted(self.weight_map.items())},
            }
            write_file_atomic(str(self.folder / "model.safetensors.index.json"),
                              (json.dumps(index, indent=2) + "\n").encode(), fsync=self.fsync)
        return names


def write_mlx_lm_folder(
    out_dir: Union[str, Path],
    tensors: Iterable[Tuple[str, TensorLike]],
    config: dict,
    *,
    tokenizer_files: Iterable[Union[str, Path]] = (),
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    fsync: bool = True,
    add_files: Optional[Callable[[str], None]] = None,
    scale_dtype: torch.dtype = torch.float32,
) -> Path:
    """Write an mlx-lm model folder (see the module docstring) and return its path.

    `config` is the model's config.json content in mlx-lm's terms (`model_type` and
    the model's hyper-parameters); any "quantization" in it is replaced by the one
    derived from the tensors. Existing `out_dir` is an error unless `overwrite`. fsync: every file
    and the folder are fsynced before the rename that publishes them. add_files(folder): called
    with the work folder before the publish; what it writes there is published with the folder.
    """
    out = Path(out_dir)
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError("config must be a dict with a 'model_type' mlx-lm knows (e.g. 'llama', 'qwen3_moe')")
    rotation = ShardRotation(max_shard_bytes)
    tokenizer_files = [Path(p) for p in tokenizer_files]
    for p in tokenizer_files:
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file {p} does not exist")
        if p.name in ("config.json",) or p.name.startswith("model"):
            raise ValueError(f"tokenizer file {p} would overwrite the model's own {p.name}")

    # <out>.partial, locked until published (llmq.checkpoint.workfolder): another run into the same
    # folder is refused before any work; what a killed run left there is cleared (no resume).
    work = WorkFolder(out, writer="mlx", overwrite=overwrite, fsync=fsync)
    try:
        work.clear()
        work.write_journal({})
        tmp = Path(work.path)
        shards = _ShardWriter(tmp, rotation, fsync)
        params: Dict[str, Dict[str, object]] = {}
        kept = []
        for name, value in tensors:
            if isinstance(value, GroupQuantizedWeight):
                # a weight quantized for scale_dtype holds it; an imported one (a GGUF block) may need wider
                dtype = narrowest_exact(value, (scale_dtype,) + WIDER_SCALE_DTYPES)
                value = pack_mlx_affine(value, name=name, scale_dtype=dtype)
            elif getattr(value, "format", None) in ("mxfp4", "mxfp8", "nvfp4"):  # llmq's FP containers
                value = pack_mlx_fp(value, name=name)
            if isinstance(value, MLXQuantizedWeight):
                module = _module_path(name)
                for key, t in value.named_tensors(module).items():
                    shards.add(key, t)
                params[module] = value.quant_params
            elif isinstance(value, torch.Tensor):
                shards.add(name, value)
                if name.endswith(".weight") and value.dim() >= 2:
                    kept.append(_module_path(name))
            else:
                raise TypeError(
                    f"{name}: expected a torch.Tensor, MLXQuantizedWeight or GroupQuantizedWeight, "
                    f"got {type(value).__name__}"
                )
        names = shards.finish()

        cfg = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
        section = quantization_section(params, kept)
        if section is not None:
            cfg["quantization"] = section
            cfg["quantization_config"] = section
        write_file_atomic(str(tmp / "config.json"), (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode(),
                          fsync=fsync)
        for p in tokenizer_files:
            copy_file(str(p), str(tmp / p.name), fsync=fsync)
        if add_files is not None:
            add_files(str(tmp))
        work.publish(synced=names)
    except BaseException:
        if "shards" in locals():
            shards.abort()
        work.discard()
        raise
    return out
