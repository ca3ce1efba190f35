"""Synthetic checkpoints with the real shapes of a large model and fewer layers.

    bazel run //models/pipeline:write_real_shapes -- --model=gemma4_31b --layers=4 --out=$PWD/g4-31b-4l
    bazel run //models/pipeline:write_real_shapes -- --model=qwen3_5_35b_a3b --layers=8 --out=$PWD/q35-8l

The config is the model's real config.json (models/gemma4/configs/gemma4_31b.json,
models/qwen/configs/qwen3_5_35b_a3b.json) with every dimension kept and the text model cut to
--layers layers: the real layer-type pattern, the last layer forced to full attention so every
layer kind (and the largest layer) is there at any count. Tensors are the model's own names
(`Architecture.to_hf_tensors`: Qwen's experts per expert, as released), bf16, with the value
statistics of the embedded tiny default model of the same layer count and types
(`Architecture.prepare_default`: a random model that behaves like a trained one): 1-D tensors
(norms, layer scalars, Qwen's A_log/dt_bias) take the tiny model's constant, or its mean and
spread; matrices are normal with the tiny's std times sqrt(tiny fan-in / real fan-in), so every
layer keeps the tiny model's activation scale. Normal values come from a pool (`Normals`), at
memory speed. The folder gets a byte-level BPE tokenizer
(default_model.write_tiny_tokenizer, the model's vocabulary size) for --calibration_text.

Written tensor by tensor (llmq.export.shards.ShardWriter, 4 GiB shards); a tensor above 64 Mi
elements (the embedding, Qwen's untied head) is generated and written by blocks of rows, so the
generator holds at most about 256 MB of tensor data whatever the model.

--grow_from=<folder>: the same checkpoint at more layers without drawing again: every tensor is
copied from the folder (one this program wrote for the same model, fewer layers), a layer from the
source layer of the same index where that one has the same type, else from the first source layer of
its type (same shapes, same statistics); the embedding and head as they are. Byte copies at disk
speed, where drawing tens of GB takes tens of minutes on a loaded machine; the layers are then
repeats, which changes nothing the bench measures (shapes, sizes, memory, time per layer).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from absl import app, flags

from llmq.checkpoint.shard_file import placeholder
from llmq.export.shards import ShardWriter
from models.pipeline.arch import Architecture
from models.pipeline.default_model import write_tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = {  # name: (architecture module, real config)
    "gemma4_31b": ("models.gemma4.architecture", "models/gemma4/configs/gemma4_31b.json"),
    "qwen3_5_35b_a3b": ("models.qwen.architecture", "models/qwen/configs/qwen3_5_35b_a3b.json"),
}
BLOCK_ELEMENTS = 1 << 26  # rows generated at a time for large tensors (64 Mi elements = 256 MB fp32)
SHARD_BYTES = 4 << 30
_EXPERT = re.compile(r"\.experts\.\d+\.")


def _architecture(model: str) -> Architecture:
    import importlib

    return importlib.import_module(MODELS[model][0]).ARCHITECTURE


def _cut(text: Dict, layers: int) -> None:
    """Cut a text config dict to `layers` layers in place (per-layer fields transformers derives from
    the layer types are dropped, so they are derived again)."""
    text["layer_types"] = layer_types(text["layer_types"], layers)
    text["num_hidden_layers"] = layers
    text.pop("per_layer_config", None)


def layer_types(types: List[str], layers: int) -> List[str]:
    """The real pattern cut to `layers`, the last layer full attention."""
    if layers < 1:
        raise ValueError(f"--layers must be >= 1, got {layers}")
    out = list(types[:layers])
    out[-1] = "full_attention"
    return out


def real_config(model: str, layers: int) -> Dict:
    """The model's real config.json dict with its text model cut to `layers` layers."""
    with open(os.path.join(REPO, MODELS[model][1])) as f:
        hf = json.load(f)
    _cut(hf.get("text_config", hf), layers)
    return hf


def _tiny_stats(arch: Architecture, types: List[str]) -> Dict[str, Tuple[float, float, int, bool]]:
    """name template -> (mean, std, fan-in, constant) of the embedded tiny model with these layer types."""
    tiny = arch.tiny_hf_config()
    tiny["layer_types"] = list(types)
    _cut(tiny, len(types))
    torch.manual_seed(0)
    model = arch.build_model(arch.config_from_hf(tiny), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        arch.prepare_default(model)
    stats = {}
    for name, tensor in model.state_dict().items():
        for hf_name, t in arch.to_hf_tensors(name, tensor).items():
            key = _EXPERT.sub(".experts.*.", hf_name)
            if key in stats or not t.is_floating_point():
                continue
            t = t.double()
            fan_in = math.prod(t.shape[1:]) if t.dim() >= 2 else 1
            constant = bool((t == t.flatten()[0]).all()) if t.numel() else True
            stats[key] = (t.mean().item(), t.std().item() if t.numel() > 1 else 0.0, fan_in, constant)
    return stats


def planned_tensors(arch: Architecture, hf_config: Dict) -> Iterator[Tuple[str, torch.Size, torch.dtype]]:
    """(checkpoint name, shape, dtype) of every tensor, from the model built on the meta device."""
    config = arch.config_from_hf(hf_config)
    model = arch.build_model(config, device="meta")
    for name, tensor in model.state_dict().items():
        if getattr(config, "tie_word_embeddings", False) and name == "lm_head.weight":
            continue
        for hf_name, t in arch.to_hf_tensors(name, tensor).items():
            yield hf_name, t.shape, t.dtype


class Normals:
    """Normal values at memory speed: a pool of POOL standard normal draws, scaled once per distinct
    (std, mean) and rounded to bf16, handed out as runs of RUN values from random offsets with random
    signs (a sign flip is exact in bf16). Drawing tens of GB with torch.randn takes tens of minutes on a
    shared 2-core machine; for quantizing and timing, values normal in distribution are what matters,
    and runs of 64 Ki values out of 16 Mi draws repeat nothing a group or a row would notice."""

    POOL = 1 << 24
    RUN = 1 << 16

    def __init__(self, gen: torch.Generator):
        self.gen = gen
        self.pool = torch.randn(self.POOL, generator=gen)
        self._scaled: Dict[Tuple[float, float], torch.Tensor] = {}

    def draw(self, shape, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        """bf16 tensor of `shape`, normal(mean, std) (sign flips make mean != 0 symmetric about -mean too:
        callers pass mean 0 for matrices; small vectors come from torch.randn)."""
        numel = math.prod(shape)
        if numel < self.RUN:
            return (torch.randn(tuple(shape), generator=self.gen) * std + mean).to(torch.bfloat16)
        key = (std, mean)
        if key not in self._scaled:
            if len(self._scaled) > 4:
                self._scaled.clear()
            self._scaled[key] = (self.pool * std + mean).to(torch.bfloat16)
        pool = self._scaled[key]
        out = torch.empty(numel, dtype=torch.bfloat16)
        runs = (numel + self.RUN - 1) // self.RUN
        offsets = torch.randint(0, self.POOL - self.RUN, (runs,), generator=self.gen).tolist()
        signs = torch.randint(0, 2, (runs,), generator=self.gen).tolist()
        for i, (off, flip) in enumerate(zip(offsets, signs)):
            n = min(self.RUN, numel - i * self.RUN)
            dst, src = out[i * self.RUN:i * self.RUN + n], pool[off:off + n]
            if flip and mean == 0.0:
                torch.neg(src, out=dst)
            else:
                dst.copy_(src)
        return out.reshape(tuple(shape))


def _values(stat, shape, rows: slice, normals: Normals) -> torch.Tensor:
    """bf16 values of `rows` of a tensor of `shape` with the tiny model's statistics `stat`."""
    mean, std, tiny_fan_in, constant = stat
    shape = (rows.stop - rows.start,) + tuple(shape[1:]) if len(shape) else ()
    if constant:
        return torch.full(shape, mean).to(torch.bfloat16)
    if len(shape) >= 2:
        std = std * math.sqrt(tiny_fan_in / math.prod(shape[1:]))
        mean = 0.0
    return normals.draw(shape, std, mean)


_LAYER = re.compile(r"\.layers\.(\d+)\.")


class _Source:
    """Tensors of a checkpoint this program wrote, read by name or by blocks of rows (--grow_from)."""

    def __init__(self, folder: str, types: List[str]):
        from safetensors import safe_open

        with open(os.path.join(folder, "config.json")) as f:
            hf = json.load(f)
        src_types = hf.get("text_config", hf)["layer_types"]
        self.layer: Dict[int, int] = {}
        for i, kind in enumerate(types):
            same = [j for j, t in enumerate(src_types) if t == kind]
            if not same:
                raise ValueError(f"--grow_from={folder}: no layer of type {kind!r} to copy (its layer types: {src_types})")
            self.layer[i] = i if i < len(src_types) and src_types[i] == kind else same[0]
        self.files = {}
        for file in sorted(os.listdir(folder)):
            if file.endswith(".safetensors"):
                handle = safe_open(os.path.join(folder, file), "pt")
                self.files.update({name: handle for name in handle.keys()})

    def name(self, name: str) -> str:
        m = _LAYER.search(name)
        if m is None:
            return name
        return name[:m.start(1)] + str(self.layer[int(m.group(1))]) + name[m.end(1):]

    def rows(self, name: str, rows: slice) -> torch.Tensor:
        src = self.name(name)
        if src not in self.files:
            raise ValueError(f"--grow_from: the source checkpoint has no tensor {src!r} (for {name})")
        return self.files[src].get_slice(src)[rows.start:rows.stop]

    def tensor(self, name: str) -> torch.Tensor:
        src = self.name(name)
        if src not in self.files:
            raise ValueError(f"--grow_from: the source checkpoint has no tensor {src!r} (for {name})")
        return self.files[src].get_tensor(src)


def write_real_shapes(model: str, layers: int, out: str, *, seed: int = 0, hf_config=None,
                      grow_from: Optional[str] = None) -> Dict[str, int]:
    """Write the checkpoint folder; returns {"tensors": n, "bytes": tensor bytes}. hf_config: another
    config of the architecture instead of the real one (tests), its layer types cut the same way.
    grow_from: copy every tensor from that folder instead of drawing it (see the module docstring)."""
    arch = _architecture(model)
    if hf_config is None:
        hf_config = real_config(model, layers)
    else:
        hf_config = json.loads(json.dumps(hf_config))
        _cut(hf_config.get("text_config", hf_config), layers)
    text = hf_config.get("text_config", hf_config)
    stats = _tiny_stats(arch, text["layer_types"])
    source = _Source(grow_from, text["layer_types"]) if grow_from else None
    os.makedirs(out, exist_ok=True)
    shards = ShardWriter(out, SHARD_BYTES)
    normals = Normals(torch.Generator().manual_seed(seed))
    count = 0
    for name, shape, dtype in planned_tensors(arch, hf_config):
        key = _EXPERT.sub(".experts.*.", name)
        if key not in stats:
            raise ValueError(f"{name}: no tensor of this name in the tiny {arch.name} model to take its statistics from")
        out_dtype = torch.bfloat16 if dtype.is_floating_point else dtype
        numel = math.prod(shape)
        if numel > BLOCK_ELEMENTS and len(shape) >= 2:
            rows = shape[0]
            step = max(1, BLOCK_ELEMENTS // math.prod(shape[1:]))

            def parts(name=name, shape=shape, rows=rows, step=step, key=key, out_dtype=out_dtype):
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    yield r0, r1, {name: (_values(stats[key], shape, slice(r0, r1), normals) if source is None
                                          else source.rows(name, slice(r0, r1)).to(out_dtype))}

            if shards.add_row_blocks([(name, placeholder(out_dtype, shape))], rows, parts):
                count += 1
                continue
        value = (_values(stats[key], shape, slice(0, shape[0] if len(shape) else 0), normals) if source is None
                 else source.tensor(name))
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"--grow_from: {name} has shape {list(value.shape)} there, expected {list(shape)}")
        shards.add(name, value.to(out_dtype).contiguous())  # (non-float tensors: exact small values)
        count += 1
    shards.close()
    progress = os.path.join(out, ShardWriter.JOURNAL)
    if os.path.exists(progress):
        os.remove(progress)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
        f.write("\n")
    write_tiny_tokenizer(out, text["vocab_size"])
    return {"tensors": count, "bytes": shards.total_bytes}


def main(argv):
    del argv
    fl = flags.FLAGS
    if not fl.out:
        raise app.UsageError("--out is required")
    tiny = _architecture(fl.model).tiny_hf_config() if fl.tiny else None
    result = write_real_shapes(fl.model, fl.layers, fl.out, seed=fl.seed, hf_config=tiny, grow_from=fl.grow_from)
    print(f"{fl.out}: {fl.model} with {fl.layers} layers, {result['tensors']} tensors, {result['bytes']:,} bytes")


def _define_flags() -> None:  # only as a program: the module is also imported by bench_real_shapes
    flags.DEFINE_enum("model", "gemma4_31b", sorted(MODELS), "Which real config.")
    flags.DEFINE_integer("layers", 4, "Decoder layers to write.", lower_bound=1)
    flags.DEFINE_string("out", None, "Output folder (created).")
    flags.DEFINE_integer("seed", 0, "Seed of the random values.")
    flags.DEFINE_string("grow_from", None, "Copy the tensors from this checkpoint of the same model with fewer "
                        "layers instead of drawing them (see the module docstring).")
    flags.DEFINE_boolean("tiny", False, "The architecture's embedded tiny config instead of the real one (smoke tests).")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
