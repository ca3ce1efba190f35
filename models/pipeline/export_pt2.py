"""torch.export of a quantized model's prefill and decode steps, saved as .pt2 and checked against eager.

The cache becomes plain tensors of fixed shape (a model's export_pt2.py describes them as a
`StaticCacheLayout`), so the two steps are pure functions:

    prefill(input_ids [1, S])                      -> (logits [1, S, V], cache)
    decode(input_ids [1, 1], position [], cache)   -> (logits [1, 1, V], cache')

`cache` is a tuple of tensors in `layout.entries` order (also written to `<out>/cache_layout.json`).
Both steps call the model's own forward with a `ModelCache` whose layer states are views of those
tensors, so eager and exported run the same module code. Quantized weights stay uint8 buffers in
the graph and are dequantized by graph ops (llmq.quant.modules), which `check_quantized_storage`
verifies on the exported program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from absl import app, flags
from torch import nn

from llmq.checkpoint import CheckpointError, load_bundle
from llmq.quant import QuantizedEmbedding, QuantizedLinear
from llmq.quant.modules import dequantize_graph
from models.common.cache import ModelCache, StaticKVCache
from models.pipeline import gguf_input, inputs, quantize_and_save
from models.pipeline.agreement import format_table
from models.pipeline.arch import Architecture
from models.pipeline.quantized_model import _StackedQuantized, build_quantized_model

# --checkpoint, --recipe, --out and --seed are quantize_and_save's flags (so is --use_moe_quantized_op, if it
# defines it); the rest are this binary's.
FLAGS = flags.FLAGS
flags.DEFINE_string("bundle", None, "A bundle written by quantize_and_save (needs --checkpoint for its config.json). "
                    "Omit both to quantize the embedded default tiny model first.")
flags.DEFINE_integer("max_seq_len", 128, "Capacity of the static KV cache (prompt + generated tokens).", lower_bound=2)
flags.DEFINE_integer("decode_steps", 4, "Decode steps to run and compare after the prefill.", lower_bound=0)
flags.DEFINE_integer("prompt_len", 8, "Length of the random check prompt (and the traced prefill example).",
                     lower_bound=1)
flags.DEFINE_boolean("float32", True, "Cast the model's dense tensors (bf16 in a bundle of an HF checkpoint) to "
                     "float32 before export, so activations and the cache are float32; quantized weights stay uint8. "
                     "--nofloat32 keeps the bundle's dtypes (bf16 activations).")

# Agreement tolerance, in units of eps(compute dtype) * max|logit|. Eager and graph run the same aten
# ops in the same order except where eager is data-dependent: Qwen's routed experts run their GEMMs on
# the routed rows only, the graph on every row (zero-weighted), so BLAS may block the K-reductions
# differently and each MoE layer's output may move by a few roundings; the model-cache cross-check
# attends over the grown cache instead of the fixed capacity, with the same effect on softmax sums.
# Measured: 0 for Gemma 4, <= 3.4 for the tiny Qwen (float32). 16 leaves 4x headroom; the bugs this
# guards against (a stale position, a wrong cache slot, a window off by one) move logits by >= 1e-3
# relative, about 10^4 eps in float32.
TOLERANCE_EPS = 16
if "overwrite" not in FLAGS:  # quantize_and_save may define it too (same meaning: replace an existing --out)
    flags.DEFINE_boolean("overwrite", False, "Replace the files of an existing --out folder.")
if "use_moe_quantized_op" not in FLAGS:  # quantize_and_save may define it too (same meaning: use the op)
    flags.DEFINE_boolean("use_moe_quantized_op", False, "Swap MoE blocks for torch.ops.llmq.quantized_moe_ffn "
                         "(llmq.ops; needs the compiled kernel) before export.")


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One cache tensor: its name (e.g. layers.3.keys), shape with batch 1, dtype."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype


class StaticCacheLayout:
    """How a model's per-layer cache states map to a flat tuple of fixed-shape tensors.

    A model's export_pt2.py subclasses it: `entries` lists the tensors; `prefill_states()` gives the
    fresh per-layer states a prefill from position 0 starts with; `decode_states(tensors, position)`
    wraps the tensors as states for one decode step; `tensors_of(states)` reads them back.
    """

    entries: List[CacheEntry]

    def prefill_states(self) -> list:
        raise NotImplementedError

    def decode_states(self, tensors: Sequence[torch.Tensor], position: torch.Tensor) -> list:
        raise NotImplementedError

    def tensors_of(self, states: list) -> Tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def to_json(self) -> List[Dict]:
        return [{"name": e.name, "shape": list(e.shape), "dtype": str(e.dtype).replace("torch.", "")}
                for e in self.entries]


class AttentionKVCacheLayout(StaticCacheLayout):
    """`layers.N.keys`, `layers.N.values` [1, H_kv, max_seq_len, head_dim] for every layer N of
    `model.model.layers` (each with `self_attn.num_kv_heads` and `self_attn.head_dim`), indexed by absolute
    position, in the embedding's dtype. Sliding-window layers use the same full-length buffers: attention's
    position mask hides what lies outside the window (max_seq_len slots per sliding layer rather than
    `sliding_window`, and no ring-buffer bookkeeping). The layout of every attention-only model (Gemma 3, 4)."""

    def __init__(self, model: nn.Module, max_seq_len: int):
        self.max_seq_len = max_seq_len
        self.entries = []
        embed = model.model.embed_tokens
        dtype = embed.weight_dtype if hasattr(embed, "weight_dtype") else embed.weight.dtype
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            shape = (1, attn.num_kv_heads, max_seq_len, attn.head_dim)
            self.entries += [CacheEntry(f"layers.{i}.keys", shape, dtype), CacheEntry(f"layers.{i}.values", shape, dtype)]

    def prefill_states(self) -> list:
        return [StaticKVCache(torch.zeros(k.shape, dtype=k.dtype), torch.zeros(v.shape, dtype=v.dtype), 0,
                              attend_cached=False)
                for k, v in zip(self.entries[::2], self.entries[1::2])]

    def decode_states(self, tensors: Sequence[torch.Tensor], position: torch.Tensor) -> list:
        return [StaticKVCache(k, v, position) for k, v in zip(tensors[::2], tensors[1::2])]

    def tensors_of(self, states: list) -> Tuple[torch.Tensor, ...]:
        return tuple(t for state in states for t in (state.keys, state.values))


class PrefillStep(nn.Module):
    """prefill(input_ids [1, S]) -> (logits [1, S, V], cache tensors)."""

    def __init__(self, model: nn.Module, layout: StaticCacheLayout):
        super().__init__()
        self.model = model
        self.layout = layout

    def forward(self, input_ids: torch.Tensor):
        states = self.layout.prefill_states()
        logits = self.model(input_ids, cache=ModelCache(layers=states, position=0))
        return logits, self.layout.tensors_of(states)


class DecodeStep(nn.Module):
    """decode(input_ids [1, 1], position 0-d int64, cache tensors) -> (logits [1, 1, V], new cache tensors).

    `position` is the absolute index of the token (the prompt length for the first step); it must
    stay below the cache capacity (max_seq_len)."""

    def __init__(self, model: nn.Module, layout: StaticCacheLayout):
        super().__init__()
        self.model = model
        self.layout = layout

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor, cache: Tuple[torch.Tensor, ...]):
        states = self.layout.decode_states(cache, position)
        # A copy: the model advances ModelCache.position in place, which must not write to the caller's tensor.
        logits = self.model(input_ids, cache=ModelCache(layers=states, position=position.clone()))
        return logits, self.layout.tensors_of(states)


def example_cache(layout: StaticCacheLayout) -> Tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(e.shape, dtype=e.dtype) for e in layout.entries)


@torch.no_grad()
def export_steps(model: nn.Module, layout: StaticCacheLayout, *, prompt_len: int, max_seq_len: int,
                 dynamic_prompt: bool):
    """torch.export both steps; returns (prefill program, decode program).

    With `dynamic_prompt`, the prompt length is a dynamic dim in [1, max_seq_len - 1]; otherwise the
    prefill program takes exactly `prompt_len` tokens."""
    model.eval()
    prompt = torch.zeros(1, prompt_len, dtype=torch.long)
    dynamic = None
    if dynamic_prompt:
        dynamic = {"input_ids": {1: torch.export.Dim("prompt_len", min=1, max=max_seq_len - 1)}}
    prefill = torch.export.export(PrefillStep(model, layout), (prompt,), dynamic_shapes=dynamic, strict=False)
    token = torch.zeros(1, 1, dtype=torch.long)
    position = torch.tensor(prompt_len, dtype=torch.long)
    decode = torch.export.export(DecodeStep(model, layout), (token, position, example_cache(layout)), strict=False)
    return prefill, decode


def save_programs(prefill, decode, layout: StaticCacheLayout, out: str, meta: Dict) -> Dict[str, str]:
    os.makedirs(out, exist_ok=True)
    paths = {"prefill": os.path.join(out, "prefill.pt2"), "decode": os.path.join(out, "decode.pt2")}
    torch.export.save(prefill, paths["prefill"])
    torch.export.save(decode, paths["decode"])
    with open(os.path.join(out, "cache_layout.json"), "w") as f:
        json.dump({**meta, "cache": layout.to_json()}, f, indent=1)
    return paths


# ---------------------------------------------------------------------------------------------
# What the exported programs hold


# Buffers of llmq.ops' QuantizedMoEBlock (kernel tile layout, llmq/ops/packing.py): uint8 [E, rows/16, 16*K*bits/8].
_MOE_OP_QDATA = ("w13_qdata", "w2_qdata", "shared_w13_qdata", "shared_w2_qdata")


def quantized_buffers(model: nn.Module) -> Dict[str, Tuple[torch.Tensor, object]]:
    """{name of each quantized weight's uint8 buffer: (qdata, float32 dequantized weight)} of a model.

    For the MoE op's tile-packed experts the second item is the dense [E, N, K] shape instead
    (their dequantization lives in the C++ kernel)."""
    found = {}
    for name, module in model.named_modules():
        for attr in _MOE_OP_QDATA:
            qdata = module._buffers.get(attr)
            if qdata is not None:
                bits = module.shared_bits if attr.startswith("shared") else module.bits
                found[f"{name}.{attr}"] = (qdata, (qdata.shape[0], qdata.shape[1] * 16, qdata.shape[2] * 8 // (16 * bits)))
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            k = module.weight_scale.shape[-1] * module.group_size
            w = dequantize_graph(module.weight_qdata, module.weight_scale, module.weight_bias, module.bits,
                                 module.group_size, k)
            found[f"{name}.weight_qdata"] = (module.weight_qdata, w)
        elif isinstance(module, _StackedQuantized):
            w = dequantize_graph(module.qdata, module.scale, module.bias, module.bits, module.group_size, module.k)
            found[f"{name}.qdata"] = (module.qdata, w)
    return found


def program_tensors(program) -> Dict[str, torch.Tensor]:
    """Every tensor an ExportedProgram carries: parameters, buffers and lifted constants."""
    tensors = dict(program.state_dict)
    tensors.update({f"<constant>{k}": v for k, v in program.constants.items() if isinstance(v, torch.Tensor)})
    return tensors


def storage_bytes(program) -> Dict[str, int]:
    """Bytes of the program's tensors by dtype name."""
    totals: Dict[str, int] = {}
    for t in program_tensors(program).values():
        key = str(t.dtype).replace("torch.", "")
        totals[key] = totals.get(key, 0) + t.numel() * t.element_size()
    return totals


def check_quantized_storage(program, model: nn.Module, prefix: str = "model.") -> int:
    """Raise unless every quantized weight of `model` is a uint8 tensor of `program` (same bytes) and
    no float tensor of `program` is a dense copy of one; returns how many were checked."""
    tensors = program_tensors(program)
    expected = quantized_buffers(model)
    if not expected:
        raise ValueError("the model has no quantized weights to check")
    floats = [(n, t) for n, t in tensors.items() if t.is_floating_point()]
    for name, (qdata, dense) in expected.items():
        held = tensors.get(prefix + name)
        if held is None:
            raise ValueError(f"exported program has no tensor {prefix + name} (quantized weight buffer)")
        if held.dtype != torch.uint8 or not torch.equal(held, qdata):
            raise ValueError(f"{prefix + name}: expected the uint8 quantized bytes, got {held.dtype} {list(held.shape)}")
        for other, t in floats:
            if isinstance(dense, tuple):  # MoE op experts: any float tensor of the dense shape is a copy
                if tuple(t.shape) == dense:
                    raise ValueError(f"exported program holds {other}, a dense float tensor of quantized {name}'s shape")
            elif t.shape == dense.shape and torch.allclose(t.float(), dense, rtol=0,
                                                           atol=1e-6 * dense.abs().max().item()):
                raise ValueError(f"exported program holds {other}, a dense float copy of quantized {name}")
    return len(expected)


# ---------------------------------------------------------------------------------------------
# Running and comparing


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@torch.no_grad()
def compare_steps(model: nn.Module, layout: StaticCacheLayout, prefill_program: nn.Module, decode_program: nn.Module,
                  prompt: torch.Tensor, decode_steps: int) -> Dict:
    """Run prefill + `decode_steps` greedy decode steps three ways and report max |logit diff|:

    - `exported`: the loaded programs vs the same steps in eager (same module code);
    - `model_cache`: the eager steps vs the model's own `forward(..., cache=model.new_cache())` path,
      which grows its caches in Python (an independent implementation of the cache bookkeeping).
    Tokens are the eager steps' greedy choices, fed to all three."""
    prefill_eager, decode_eager = PrefillStep(model, layout), DecodeStep(model, layout)
    logits, cache = prefill_eager(prompt)
    got_logits, got_cache = prefill_program(prompt)
    own_cache = model.new_cache()
    own_logits = model(prompt, cache=own_cache)
    result = {"exported": [_max_diff(logits, got_logits)], "model_cache": [_max_diff(logits, own_logits)],
              "exported_vs_model_cache": [_max_diff(got_logits, own_logits)],
              "logit_scale": logits.abs().max().item(), "dtype": logits.dtype, "tokens": []}
    position = prompt.shape[1]
    for _ in range(decode_steps):
        token = logits[:, -1:].argmax(-1)
        result["tokens"].append(int(token))
        pos = torch.tensor(position, dtype=torch.long)
        logits, cache = decode_eager(token, pos, cache)
        got_logits, got_cache = decode_program(token, pos, tuple(got_cache))
        own_logits = model(token, cache=own_cache)
        result["exported"].append(_max_diff(logits, got_logits))
        result["model_cache"].append(_max_diff(logits, own_logits))
        result["exported_vs_model_cache"].append(_max_diff(got_logits, own_logits))
        position += 1
    result["cache_max_diff"] = max((_max_diff(a, b) for a, b in zip(cache, got_cache)), default=0.0)
    result["cache_scale"] = max((t.abs().max().item() for t in cache), default=0.0)
    return result


# ---------------------------------------------------------------------------------------------
# The job


def load_quantized_model(arch: Architecture, *, bundle: Optional[str], checkpoint: Optional[str], recipe: Optional[str],
                         seed: int, workdir: str) -> Tuple[nn.Module, str]:
    """The quantized model in eager, from `bundle` + the config of `checkpoint` (HF folder or .gguf), or (no
    bundle) from `checkpoint` (None: the embedded default) quantized with `recipe` into `workdir` (a GGUF's
    quantized tensors dequantized exactly and quantized by the recipe too); returns (model, bundle path)."""
    if bundle is None:  # a GGUF's own codes (K-quants, 5/6-bit) are requantized by the recipe, which names the format
        result = quantize_and_save.run(arch, checkpoint=checkpoint, recipe=recipe, backend="bundle",
                                       out=os.path.join(workdir, "bundle"), resume=False, max_shard_size=2 << 30,
                                       verify=False, seed=seed, progress=False,
                                       requantize_gguf=gguf_input.is_gguf(checkpoint))
        bundle = result["bundle"]
    elif checkpoint is None:
        raise quantize_and_save.UsageError("--bundle needs --checkpoint (the HF folder or .gguf it was quantized from)")
    elif not os.path.isdir(bundle):
        raise quantize_and_save.UsageError(f"--bundle {bundle}: no such folder")
    if checkpoint is None:
        hf_config = arch.tiny_hf_config()
    else:
        hf_config = inputs.open_input(arch, checkpoint, inputs.check_path(arch, checkpoint)).hf_config
    try:
        config = arch.config_from_hf(hf_config)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise quantize_and_save.UsageError(f"config.json: not a supported {arch.name} config ({e})") from None
    model = build_quantized_model(arch.build_model(config, device="meta"), load_bundle(bundle))
    return model, bundle


def _dequantized_linear(lin: QuantizedLinear) -> torch.Tensor:
    return dequantize_graph(lin.weight_qdata, lin.weight_scale, lin.weight_bias, lin.bits, lin.group_size,
                            lin.in_features)


def to_float32(model: nn.Module) -> nn.Module:
    """Dense floating tensors -> float32 (quantized uint8 buffers untouched; their scales already are)."""
    model.float()
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            module.weight_dtype = torch.float32
    return model


def _graph_nodes(program) -> int:
    return sum(1 for _ in program.graph.nodes)


def run(arch: Architecture, make_layout: Callable[[nn.Module, int], StaticCacheLayout], *, dynamic_prompt: bool,
        bundle: Optional[str] = None, checkpoint: Optional[str] = None, recipe: Optional[str] = None,
        out: Optional[str] = None, max_seq_len: int = 128, decode_steps: int = 4, prompt_len: int = 8, seed: int = 0,
        float32: bool = True, use_moe_quantized_op: bool = False, quiet: bool = False, overwrite: bool = False) -> Dict:
    """Build the quantized model, export, save, load, compare; returns the numbers it printed.

    An existing non-empty `out` is refused before any work unless `overwrite`."""
    if out is not None and os.path.exists(out) and not overwrite and (not os.path.isdir(out) or os.listdir(out)):
        raise quantize_and_save.UsageError(f"--out {out} already exists; pass --overwrite to replace its files")
    if prompt_len + decode_steps > max_seq_len:
        raise quantize_and_save.UsageError(f"--prompt_len {prompt_len} + --decode_steps {decode_steps} exceeds "
                                           f"--max_seq_len {max_seq_len} (the cache capacity)")
    recipe = recipe or arch.default_recipe
    with tempfile.TemporaryDirectory(prefix=f"llmq-export-{arch.name}-") as workdir:
        out = out or tempfile.mkdtemp(prefix=f"llmq-export-{arch.name}-")  # kept: the .pt2 files are the product
        log = (lambda *a: None) if quiet else print
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            model, bundle_path = load_quantized_model(arch, bundle=bundle, checkpoint=checkpoint, recipe=recipe,
                                                      seed=seed, workdir=workdir)
        if float32:
            to_float32(model)
        moe_op_blocks: List[str] = []
        if use_moe_quantized_op:
            from models.pipeline.moe_op_swap import swap_in_moe_op

            moe_op_blocks = swap_in_moe_op(model, "--use_moe_quantized_op")
        layout = make_layout(model, max_seq_len)
        start = time.perf_counter()
        prefill, decode = export_steps(model, layout, prompt_len=prompt_len, max_seq_len=max_seq_len,
                                       dynamic_prompt=dynamic_prompt)
        export_seconds = time.perf_counter() - start
        meta = {"architecture": arch.name, "recipe": recipe, "max_seq_len": max_seq_len,
                "prefill": "input_ids [1, S] -> (logits [1, S, V], cache)"
                           + ("" if dynamic_prompt else f", S = {prompt_len}"),
                "decode": "input_ids [1, 1], position [] int64, cache -> (logits [1, 1, V], cache)"}
        paths = save_programs(prefill, decode, layout, out, meta)
        loaded = {step: torch.export.load(path) for step, path in paths.items()}
        checked = check_quantized_storage(loaded["prefill"], model)
        check_quantized_storage(loaded["decode"], model)
        loaded_prefill, loaded_decode = loaded["prefill"].module(), loaded["decode"].module()
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=g)
        diffs = compare_steps(model, layout, loaded_prefill, loaded_decode, prompt, decode_steps)

        prefill_bytes, decode_bytes = storage_bytes(loaded["prefill"]), storage_bytes(loaded["decode"])
        ops_in_graph = sorted({str(n.target) for n in loaded["decode"].graph.nodes if "llmq" in str(n.target)})
        rows = [
            ("architecture", arch.name),
            ("recipe", recipe),
            ("bundle", bundle_path + (" (temporary)" if bundle is None else "")),
            ("output", out),
            ("cache", f"{len(layout.entries)} tensors, capacity {max_seq_len}"),
            ("prefill input", f"[1, S], S dynamic in [1, {max_seq_len - 1}]" if dynamic_prompt
             else f"[1, {prompt_len}] (fixed)"),
            ("export time", f"{export_seconds:.1f} s"),
            ("graph nodes prefill/decode", f"{_graph_nodes(prefill)} / {_graph_nodes(decode)}"),
            (".pt2 bytes prefill/decode",
             f"{os.path.getsize(paths['prefill']):,} / {os.path.getsize(paths['decode']):,}"),
            ("constants prefill", _format_bytes(prefill_bytes)),
            ("constants decode", _format_bytes(decode_bytes)),
            ("quantized weights uint8", f"{checked} checked, no dense float copies"),
        ]
        if use_moe_quantized_op:
            rows.append(("MoE op blocks", f"{len(moe_op_blocks)}; in graph: {', '.join(ops_in_graph) or 'none'}"))
        tolerance = TOLERANCE_EPS * torch.finfo(diffs["dtype"]).eps * diffs["logit_scale"]
        worst = max(max(diffs["exported"]), max(diffs["model_cache"]))
        rows.append(("max |logit|", f"{diffs['logit_scale']:.3f} ({str(diffs['dtype']).replace('torch.', '')})"))
        for i, (exp, own) in enumerate(zip(diffs["exported"], diffs["model_cache"])):
            label = "prefill" if i == 0 else f"decode {i}"
            rows.append((f"max |diff| {label}", f"exported vs eager {exp:.2e}; eager vs model cache {own:.2e}"))
        rows.append(("agreement", f"{'OK' if worst <= tolerance else 'FAILED'}: max |diff| {worst:.2e}, "
                                  f"tolerance {tolerance:.2e} ({TOLERANCE_EPS} eps * max|logit|)"))
        log(format_table(rows))
        return {"ok": worst <= tolerance, "tolerance": tolerance, "paths": paths, "out": out, "diffs": diffs,
                "bytes_prefill": prefill_bytes,
                "bytes_decode": decode_bytes, "quantized_checked": checked, "moe_op_blocks": moe_op_blocks,
                "ops_in_graph": ops_in_graph, "layout": layout, "model": model,
                "programs": (loaded_prefill, loaded_decode), "loaded": loaded}


def _format_bytes(totals: Dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(totals.items()))


def common_flags() -> Dict:
    """The flags every export binary passes to its run(), relative paths taken from the user's cwd."""
    user_path = quantize_and_save._user_path
    recipe = FLAGS.recipe
    if recipe and os.path.sep in recipe:
        recipe = user_path(recipe)
    return dict(bundle=user_path(FLAGS.bundle), checkpoint=user_path(FLAGS.checkpoint), recipe=recipe,
                out=user_path(FLAGS.out), max_seq_len=FLAGS.max_seq_len, decode_steps=FLAGS.decode_steps,
                prompt_len=FLAGS.prompt_len, seed=FLAGS.seed)


def export_main(run_once: Callable[[Dict], int], errors: Tuple[type, ...]) -> None:
    """absl entry point: run_once(common_flags()) -> exit status; `errors` become one line and status 2."""

    def _main(argv):
        if len(argv) > 1:
            print(f"error: unexpected arguments {argv[1:]} (flags are --name=value)", file=sys.stderr)
            return 2
        try:
            return run_once(common_flags())
        except errors as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    app.run(lambda argv: sys.exit(_main(argv)), flags_parser=quantize_and_save.parse_flags_or_exit)


def main_for(arch: Architecture, make_layout: Callable[[nn.Module, int], StaticCacheLayout], *,
             dynamic_prompt: bool) -> None:
    """absl entry point of a model's export binary."""

    def run_once(flags: Dict) -> int:
        result = run(arch, make_layout, dynamic_prompt=dynamic_prompt, float32=FLAGS.float32,
                     use_moe_quantized_op=FLAGS.use_moe_quantized_op, overwrite=FLAGS.overwrite, **flags)
        if not result["ok"]:
            print("error: the exported programs' logits differ from eager beyond the tolerance", file=sys.stderr)
            return 1
        return 0

    export_main(run_once, (quantize_and_save.UsageError, CheckpointError, ValueError))
