"""The MLX backend (--backend=mlx): the quantized stream -> a folder that `mlx_lm.load(folder)` runs.

mlx-lm's names, layouts and config.json per model live in `llmq_mlx.mlx_lm_models` (one module
per mlx-lm model file, found by the HF config's model_type); `llmq_mlx.write_mlx_lm_folder` packs
canonical weights to MLX affine tensors, writes "quantization" (per-layer overrides, `false` for
kept layers) and flushes shards as they fill. `check_consumer` loads the folder with mlx-lm
itself and compares its logits, so what is verified is what a user of the folder gets.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from llmq.backend import Backend, BackendError, WriteJob, register_backend
from llmq.checkpoint import TOKENIZER_FILES, side_files
from llmq.quant import GroupQuantizedWeight
from llmq.quant.storage import Storage, group_tensors
from llmq_mlx.affine import FP_MODE_PARAMS
from llmq_mlx.mlx_lm_models import naming_for

Value = Union[torch.Tensor, GroupQuantizedWeight]

_TOKENIZER_PROPER = ("tokenizer.json", "tokenizer.model", "vocab.json")


def tokenizer_files(folder: str) -> List[str]:
    """The tokenizer files present in a checkpoint folder (possibly none); one that links outside
    the folder is refused (llmq.checkpoint.side_files)."""
    return side_files(folder, TOKENIZER_FILES)


def has_tokenizer(folder: str) -> bool:
    """Whether the folder holds a tokenizer proper (not just its config files)."""
    return any(os.path.isfile(os.path.join(folder, f)) for f in _TOKENIZER_PROPER)


def mlx_stream(items: Iterable[Tuple[str, Value]], naming, float_dtype: Optional[torch.dtype] = None
               ) -> Iterator[Tuple[str, Value]]:
    """Pipeline (name, value) pairs -> mlx-lm (name, value) pairs, one tensor at a time.

    `naming`: a module of llmq_mlx.mlx_lm_models. `float_dtype` casts the tensors kept in high
    precision (None: as the checkpoint stores them). Quantized weights stay canonical; the writer
    packs them (exactly: 16-bit scales where the quantizer chose them so, else float32).
    """
    for name, value in items:
        for mlx_name, mlx_value in naming.mlx_tensors(name, value):
            if float_dtype is not None and isinstance(mlx_value, torch.Tensor) and mlx_value.is_floating_point():
                mlx_value = mlx_value.to(float_dtype)
            yield mlx_name, mlx_value


def mlx_scale_dtype(hf_config: Optional[dict]) -> torch.dtype:
    """The dtype MLX folders hold scales and biases in: the model's dtype as mlx-lm's convert takes
    it (config.json "torch_dtype", else text_config's "dtype"): float16 for a float16 or float32 model
    (mlx-lm keeps float32 scales for a float32 model; llmq writes 16 bits there too), bfloat16 for a
    bfloat16 model and where the config names no dtype (mlx-lm then keeps the checkpoint's, bfloat16
    for today's checkpoints)."""
    hf_config = hf_config or {}
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else {}
    name = hf_config.get("torch_dtype") or hf_config.get("dtype") or text.get("dtype") or text.get("torch_dtype")
    return torch.float16 if str(name).replace("torch.", "") in ("float16", "float32") else torch.bfloat16


def mlx_storage(config: Any, scale_dtype: torch.dtype) -> Storage:
    """What an MLX folder holds for a weight quantized with `config`: uint32 words of codes, and a
    scale and a bias per MLX group (the largest of 32/64/128 the canonical group repeats) in
    `scale_dtype`, for symmetric formats too; scales `scale_dtype` cannot hold exactly (a GGUF block
    imported as it is) in the first of float16, float32 that does (the writer's WIDER_SCALE_DTYPES)."""
    from llmq_mlx.mlx_lm_writer import WIDER_SCALE_DTYPES
    from llmq_mlx.regroup import fallback_params, mlx_group_size_for

    if config.format in FP_MODE_PARAMS:  # MLX's mode of that name: uint32 code words, uint8 scale bytes per group
        bits, group = FP_MODE_PARAMS[config.format]

        def fp_tensors(dtype: torch.dtype, shape):
            lead, k = tuple(shape[:-1]), shape[-1]
            return {"weight": (torch.uint32, lead + (k * bits // 32,)), "scales": (torch.uint8, lead + (k // group,))}

        return Storage(scale_dtype=scale_dtype, tensors=fp_tensors)

    def tensors(dtype: torch.dtype, shape):
        k = shape[-1]
        bits = config.bits
        try:
            group = mlx_group_size_for(config.group_size_for(k), k)
        except ValueError:  # an imported block MLX cannot hold: re-quantized as `_representable` does,
            bits, group = fallback_params(config.bits, config.group_size_for(k), k)
            dtype = scale_dtype  # with scales chosen in the folder's scale dtype (never widened)
        return group_tensors(bits, group, code_dtype=torch.uint32)(dtype, shape)

    return Storage(scale_dtype=scale_dtype, tensors=tensors, widen_to=WIDER_SCALE_DTYPES)


def write_mlx_folder(out: str, items: Iterable[Tuple[str, Value]], hf_config: dict, model_config: Any, *,
                     tokenizer: Sequence[str] = (), max_shard_bytes: int = 5 << 30,
                     float_dtype: Optional[torch.dtype] = None, overwrite: bool = False,
                     add_files: Optional[Callable[[str], None]] = None,
                     scale_dtype: Optional[torch.dtype] = None) -> Path:
    """Write the mlx-lm folder of the model `hf_config` describes from the pipeline's quantized stream;
    returns its path. ValueError where mlx-lm has no model for the config's model_type. Scales and
    biases are written in `scale_dtype` (default: mlx_scale_dtype(hf_config)) where it holds them exactly."""
    from llmq_mlx import write_mlx_lm_folder

    naming = naming_for(hf_config)
    if naming is None:
        raise ValueError(f"mlx-lm naming for model_type {hf_config.get('model_type')!r} unknown "
                         "(llmq_mlx.mlx_lm_models)")
    config = naming.mlx_config(hf_config, model_config)
    return write_mlx_lm_folder(out, mlx_stream(items, naming, float_dtype), config, tokenizer_files=tokenizer,
                               max_shard_bytes=max_shard_bytes, overwrite=overwrite, add_files=add_files,
                               scale_dtype=scale_dtype or mlx_scale_dtype(hf_config))


def load_mlx_model(folder: Union[str, Path]):
    """`mlx_lm.load(folder)` (model, tokenizer); without tokenizer files only the model (tokenizer None)."""
    import mlx_lm
    from mlx_lm.utils import load_model

    if has_tokenizer(str(folder)):
        return mlx_lm.load(str(folder))
    model, _ = load_model(Path(folder))
    return model, None


def mlx_logits(model, prompt: torch.Tensor) -> torch.Tensor:
    """Prefill logits [T, V] (float32) of an mlx-lm model for one prompt [1, T], through its own cache
    (rotating caches for sliding windows, as generation uses them)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.array(prompt.to(torch.int64).numpy().astype(np.int32))
    out = model(ids, cache=make_prompt_cache(model))
    return torch.from_numpy(np.array(out[0].astype(mx.float32)))


def agreement(reference: torch.Tensor, got: torch.Tensor) -> dict:
    """cosine, SQNR (dB) and max |difference| of two logit arrays."""
    import math

    ref, got = reference.double().flatten(), got.double().flatten()
    noise = (ref - got).pow(2).sum().item()
    return {
        "cosine": torch.nn.functional.cosine_similarity(ref, got, dim=0).item(),
        "sqnr_db": math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise),
        "max_abs_error": (ref - got).abs().max().item(),
    }


@torch.no_grad()
def compare_with_mlx(folder: Union[str, Path], reference: torch.nn.Module, quantized: torch.nn.Module,
                     prompt: torch.Tensor, *, float32: bool = True) -> dict:
    """mlx-lm's logits for the folder vs our quantized model (same tensors) and vs the unquantized one.

    With `float32` (default) every model is evaluated in float32 (mlx-lm's float parameters cast with
    `set_dtype`, ours with `.float()`, in place): bf16-compute noise then no longer hides a difference
    between what the folder holds and our quantized model, so "mlx vs ours" checks the export itself.
    """
    model, _ = load_mlx_model(folder)
    if float32:
        import mlx.core as mx

        model.set_dtype(mx.float32)
        reference, quantized = reference.float(), quantized.float()
    got = mlx_logits(model, prompt)
    ours = quantized(prompt)[0].float()
    ref = reference(prompt)[0].float()
    return {"mlx_vs_quantized": agreement(ours, got), "mlx_vs_reference": agreement(ref, got), "float32": float32}


def mlx_config(config: Any) -> Any:
    """The config as MLX holds it. int: its bits (7 -> 8, MLX has no 7-bit mode) and a group of 32, 64 or
    128 quantized as such from the start. A whole row becomes mlx-lm's default group of 64 (MLX stores a
    scale and bias per group of 64 anyway, so the finer group costs nothing against a regrouped row, and
    64 divides every K MLX can group by 64 or 128); a coarser group the largest MLX group that divides
    it; a group no MLX group divides (16, 48) groups of 32. nvfp4: granularity "block" (global scale 1,
    the e4m3 block scales alone: MLX's nvfp4 mode stores no global scale). Other configs unchanged."""
    import dataclasses

    from llmq_mlx.regroup import MLX_BITS, MLX_GROUP_SIZES

    if config is not None and config.format == "nvfp4":
        return config if config.granularity == "block" else dataclasses.replace(config, granularity="block")
    if config is None or config.format != "int":
        return config
    bits = config.bits if config.bits in MLX_BITS else min(b for b in MLX_BITS if b >= config.bits)
    g = config.group_size
    if g is None:
        group = 64
    else:
        group = next((h for h in sorted(MLX_GROUP_SIZES, reverse=True) if g % h == 0), MLX_GROUP_SIZES[0])
    if (bits, group) == (config.bits, g):
        return config
    return dataclasses.replace(config, bits=bits, group_size=group)


def mlx_recipe(recipe: Any) -> Tuple[Any, List[str]]:
    """(the recipe as MLX stores it: every int rule through mlx_config, lines saying what changed)."""
    import dataclasses

    from llmq.quant import QuantRecipe

    rules, changed = [], []
    for rule in recipe.rules:
        config = mlx_config(rule.config)
        if config is not rule.config:
            changed.append(f"{rule.pattern}: {rule.config.describe()} -> {config.describe()}")
        rules.append(dataclasses.replace(rule, config=config))
    return QuantRecipe(rules, num_layers=getattr(recipe, "num_layers", None)), changed


def _representable(stream: Iterable[Tuple[str, Value]], job: WriteJob) -> Iterator[Tuple[str, Value]]:
    """Integer weights MLX cannot hold as they are (a GGUF's 6-bit Q6_K blocks of 16, say) are
    re-quantized from their exact dequantized values in their own size class: the same bit width (7 -> 8)
    in the finest MLX group that divides the row (llmq_mlx.regroup.fallback_params: Q6_K -> 6-bit g32),
    never wider than that and never float; one note says how many."""
    from llmq.quant import QuantConfig, dequantize, quantize_weight
    from llmq_mlx.regroup import MLX_BITS, MLX_GROUP_SIZES, fallback_params

    redone: List[str] = []
    for name, value in stream:
        if isinstance(value, GroupQuantizedWeight) and (value.bits not in MLX_BITS
                                                        or value.group_size not in MLX_GROUP_SIZES):
            bits, group = fallback_params(value.bits, value.group_size, value.shape[-1], name)
            config = QuantConfig(bits=bits, group_size=group, symmetric=False,
                                 scale_dtype=mlx_scale_dtype(job.hf_config))
            value = quantize_weight(dequantize(value, torch.float32), config, name=name)
            redone.append(f"{name} -> {config.describe()}")
        yield name, value
    if redone:
        print(f"note: --backend mlx: {len(redone)} imported weight(s) had a bit width or group size MLX cannot hold "
              f"and were re-quantized from their exact dequantized values at their own bit width (e.g. {redone[0]})")


class MlxBackend(Backend):
    """--backend=mlx (see the module docstring)."""

    name = "mlx"
    description = ("a folder mlx_lm.load runs (MLX affine int weights, mxfp4/mxfp8/nvfp4 in MLX's modes of those "
                   "names; mlx-lm names and config.json)")
    # MLX affine weights are integer; llmq's mxfp4/mxfp8 are MLX's modes byte for byte, and so is nvfp4
    # quantized with global scale 1 (MLX's QuantizedLinear has none: recipe_for asks for granularity "block")
    accepts_formats = ("int", "mxfp4", "mxfp8", "nvfp4")
    takes_float = False
    checks_consumer = True  # mlx_lm.load runs the folder
    needs_tokenizer_files = True  # a GGUF input's tokenizer is written out as files for mlx_lm.load
    needs_model = "mlx-lm's tensor names and config per model_type come from llmq's model code (llmq_mlx.mlx_lm_models)"

    # The text check's prompt and length (models.common.text_check; a backend imports no model code).
    text_prompt = "The capital of France is"
    text_tokens = 24

    def __init__(self):
        self._kept: Dict[str, Dict[str, Value]] = {}  # out -> the tensors written there, for reload
        self._regrouped: List[str] = []  # what recipe_for changed in the last recipe it was given

    def recipe_for(self, recipe: Any) -> Any:
        """The recipe as MLX stores it (mlx_recipe): groups MLX holds (32/64/128) quantized as such, nvfp4
        with global scale 1, so the folder holds exactly the values this recipe gives, with no regrouping or
        rescaling; the summary says what changed."""
        recipe, self._regrouped = mlx_recipe(recipe)
        return recipe

    def summary(self, path: str, job: WriteJob) -> List[Tuple[str, str]]:
        rows = [("recipe as MLX stores it", line) for line in self._regrouped]
        formats = {r.config.format for r in getattr(job.recipe, "rules", ()) if r.config is not None}
        if "int" in formats or not formats or job.source_kind == "gguf":  # a GGUF's imported blocks are int
            scale = str(mlx_scale_dtype(job.hf_config)).replace("torch.", "")
            rows.append(("MLX values", f"int weights quantized in MLX groups with {scale} scales and biases: the folder "
                                       "holds exactly llmq's values for this recipe (mx.dequantize in float32)"))
        if formats & {"mxfp4", "mxfp8"}:
            rows.append(("MLX values", "mxfp4/mxfp8 weights in MLX's modes of those names (the same code and E8M0 "
                                       "bytes): exactly llmq's values (mx.dequantize in float32)"))
        if "nvfp4" in formats:
            rows.append(("MLX values", "nvfp4 weights in MLX's nvfp4 mode, quantized with global scale 1 (e4m3 block "
                                       "scales over block amax / 6, no per-tensor scale: MLX stores none): exactly "
                                       "llmq's values (mx.dequantize in float32)"))
        return rows

    def storage(self, config: Any, job: Optional[WriteJob]) -> Storage:
        """16-bit scales and biases (the model's dtype, as mlx-lm writes them: mlx_scale_dtype), one of
        each per group for symmetric formats too: int4 g64 is 4.5 bits per weight, g32 5.0."""
        return mlx_storage(config, mlx_scale_dtype(job.hf_config if job is not None else None))

    def check(self, job: WriteJob) -> None:
        if job.source_kind == "gguf" and not job.tokenizer_files:
            raise BackendError("--backend mlx needs a tokenizer; this GGUF checkpoint carries none "
                               "(no tokenizer.ggml.* metadata)")
        if naming_for(job.hf_config) is None:
            raise BackendError(f"--backend mlx: no MLX export for {job.architecture} (mlx-lm naming for model_type "
                               f"{job.hf_config.get('model_type')!r}: llmq_mlx.mlx_lm_models)")
        if os.path.exists(job.out):
            raise BackendError(f"--out {job.out} already exists; an MLX folder is written whole: remove it or pick "
                               "another --out")

    def write(self, stream: Iterable[Tuple[str, Value]], job: WriteJob) -> str:
        """The folder at job.out; with job.verify the written tensors are kept for reload (the folder is
        mlx-lm's, not a bundle: verification runs our model on the same quantized tensors, and
        check_consumer runs mlx-lm on the folder)."""
        self.check(job)
        if not any(os.path.basename(f) in _TOKENIZER_PROPER for f in job.tokenizer_files):
            print(f"note: the input has no tokenizer files; mlx_lm.load({job.out}) will need them copied in")
        stream = _representable(stream, job)
        kept: Dict[str, Value] = {}
        if job.verify:
            stream = _keep(stream, kept)
        try:
            path = str(write_mlx_folder(job.out, stream, dict(job.hf_config), job.model_config,
                                        tokenizer=job.tokenizer_files, max_shard_bytes=job.max_shard_bytes,
                                        add_files=job.add_files))
        except ValueError as e:  # a config or tensor mlx-lm cannot express (CheckpointError: a failed write)
            from llmq.checkpoint import CheckpointError

            if isinstance(e, CheckpointError):
                raise
            raise BackendError(f"--backend mlx: {e}") from None
        if job.verify:
            self._kept[path] = kept
        return path

    def reload(self, path: str, job: WriteJob) -> Dict[str, Value]:
        if path not in self._kept:
            raise ValueError(f"{path}: an MLX folder is reloaded from the tensors kept while writing it "
                             "(write with job.verify)")
        return self._kept[path]  # read twice: layer by layer, then whole (verify.py)

    def check_consumer(self, path: str, job: WriteJob, reference, quantized, prompt: torch.Tensor):
        """mlx_lm.load(path) in this process: its float32 logits vs our quantized model (same tensors) and vs
        the unquantized one; then mlx-lm as its user runs it, in a process without llmq (llmq.consumer_run):
        load, forward, greedy generation (of the text check's prompt too, where the folder has a tokenizer:
        the summary's quantized greedy text is mlx-lm's)."""
        from llmq.consumer_run import run_consumer

        check = compare_with_mlx(path, reference, quantized, prompt)
        ours, ref = check["mlx_vs_quantized"], check["mlx_vs_reference"]
        rows = [  # all three models evaluated in float32 (see compare_with_mlx)
            ("mlx-lm vs ours (fp32)", f"cosine {ours['cosine']:.6f}, SQNR {ours['sqnr_db']:.1f} dB, "
                                      f"max |diff| {ours['max_abs_error']:.2e}"),
            ("mlx-lm vs unquantized (fp32)", f"cosine {ref['cosine']:.5f}, SQNR {ref['sqnr_db']:.1f} dB"),
        ]
        tried = run_consumer("mlx-lm", path, prompt[0].tolist(), new_tokens=8,
                             prompt_text=self.text_prompt if has_tokenizer(path) else None,
                             new_text_tokens=self.text_tokens)
        line = tried.line()
        result: Dict[str, Any] = {"mlx": check, "consumer": {"consumer": "mlx-lm", "version": tried.version,
                                                             "ok": tried.ok, "error": tried.error,
                                                             "tokens": tried.tokens}}
        if tried.ok:
            got = agreement(quantized(prompt)[0].float(), tried.logits)
            line += f"; logits cosine {got['cosine']:.5f} vs ours"
            result["consumer"]["cosine"] = got["cosine"]
            if tried.text is not None:
                result["consumer_text"] = tried.text
        else:
            result["failure"] = f"mlx-lm could not run {path}: {tried.error}"
        rows.append(("consumer", line))
        return rows, result


def _keep(items, into: Dict):
    """Pass the stream through, remembering each (name, value) in `into`."""
    for name, value in items:
        into[name] = value
        yield name, value


register_backend(MlxBackend())
