"""--backend=mlx outputs, for every preset of the three llmq architectures:

- exact: every quantized tensor of the folder, dequantized by mx.dequantize in float32, equals element by
  element llmq's canonical dequantization (what a bundle holds) of the effective recipe, the preset as
  the MLX backend stores it (MlxBackend.recipe_for: MLX groups from the start; the storage's 16-bit
  scales). The int8 presets' whole-row groups are the case that regrouping got wrong.
- nvfp4 too (the generic nvfp4 preset, its FP8 embedding rule as int8 g32: MLX has no FP8 mode): MLX's
  nvfp4 mode stores no global scale, so the MLX backend quantizes nvfp4 with granularity "block" (global
  scale 1, e4m3 block scales over block amax / 6), and mx.dequantize(mode="nvfp4") equals it exactly.
- run as written: `mlx_lm.load` + a forward + greedy `generate` in a `python -I` child process in which
  llmq cannot be imported (llmq.consumer_run); its logits equal llmq's float32 quantized model's within
  the arithmetic of the same weights: mlx-lm computes in the scales' bfloat16 (unit roundoff 2^-9), which
  moves the tiny models' logits by a relative RMS of up to ~0.05 (cosine 0.9987 measured on the Qwen
  MoE's linear attention, > 0.9997 on the Gemmas): cosine >= 0.995, where one misread tensor gives less.
"""

import json
import os

import numpy as np
import pytest
import torch

from llmq.backend import get_backend, storage_of, with_scale_dtypes
from llmq.consumer_run import run_consumer
from llmq.quant import dequantize, quantize_weight
from models.gemma3.architecture import ARCHITECTURE as GEMMA3
from models.gemma4.architecture import ARCHITECTURE as GEMMA4
from models.pipeline.default_model import write_default_checkpoint, write_tiny_tokenizer
from models.pipeline.quantize_and_save import model_tensors, run
from models.pipeline.quantized_model import build_quantized_model
from models.qwen.architecture import ARCHITECTURE as QWEN

mx = pytest.importorskip("mlx.core", reason="the MLX runtime (mlx, or mlx[cpu] on Linux) is not installed here")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed here")

from llmq_mlx.mlx_lm_models import naming_for  # noqa: E402

ARCHS = (GEMMA3, GEMMA4, QWEN)
CASES = [(arch, preset) for arch in ARCHS for preset in list(arch.presets) + ["nvfp4"]]
PROMPT = list(range(3, 19))
NEW_TOKENS = 4
BF16_MIN_COSINE = 0.995  # same weights, mlx-lm's bfloat16 arithmetic (module docstring)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for arch in ARCHS:
        folder = write_default_checkpoint(arch, str(tmp_path_factory.mktemp(arch.name) / "ckpt"), seed=0)
        write_tiny_tokenizer(folder, arch.tiny_hf_config().get("vocab_size")
                             or arch.tiny_hf_config()["text_config"]["vocab_size"])
        out[arch.name] = folder
    return out


def _mlx_arrays(folder):
    arrays = {}
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            arrays.update(mx.load(os.path.join(folder, f)))
    return arrays


def _recipe(arch, preset, tmp_path):
    """(the recipe, what --recipe is given): the architecture's preset, or nvfp4 with int8 embeddings."""
    if preset in arch.presets:
        return arch.presets[preset], preset
    import dataclasses

    from llmq.quant import QuantRecipe
    from llmq.quant.presets import INT8_G32, PRESETS

    rules = [dataclasses.replace(r, config=INT8_G32) if r.config is not None and r.config.format == "fp8" else r
             for r in PRESETS[preset].rules]
    recipe = QuantRecipe(rules)
    path = str(tmp_path / f"{preset}.json")
    recipe.to_file(path)
    return recipe, path


@pytest.mark.parametrize("arch,preset", CASES, ids=[f"{a.name}-{p}" for a, p in CASES])
def test_mlx_folder_holds_the_bundle_values_and_runs_in_mlx_lm(arch, preset, checkpoints, tmp_path):
    checkpoint = checkpoints[arch.name]
    recipe, recipe_arg = _recipe(arch, preset, tmp_path)
    result = run(arch, checkpoint=checkpoint, recipe=recipe_arg, backend="mlx", out=str(tmp_path / "mlx"), resume=True,
                 max_shard_size=1 << 20, verify=False, seed=0, progress=False)
    folder = result["bundle"]
    hf_config = json.load(open(os.path.join(checkpoint, "config.json")))
    model_config = arch.config_from_hf(hf_config)
    backend = get_backend("mlx")
    effective = with_scale_dtypes(backend.recipe_for(recipe), storage_of(backend, None))
    bound = effective.bind(arch.num_layers(model_config))
    naming = naming_for(hf_config)
    arrays = _mlx_arrays(folder)
    quant = json.load(open(os.path.join(folder, "config.json")))["quantization"]

    # llmq's canonical values of the effective recipe, in mlx-lm's names (the naming map splits experts)
    checked, quantized_values = 0, {}
    for name, value in model_tensors(arch, checkpoint, model_config):
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        config = bound.get_config(module) if name.endswith(".weight") or "experts" in name else None
        q = quantize_weight(value, config, name=name) if config is not None else value
        # llmq's quantized model: every quantized weight as its exact float32 values (canonical dequantize)
        quantized_values[name] = q if isinstance(q, torch.Tensor) else dequantize(q, torch.float32)
        for mlx_name, mlx_value in naming.mlx_tensors(name, q):
            if config is None:
                continue
            mlx_module = mlx_name[: -len(".weight")] if mlx_name.endswith(".weight") else mlx_name
            params = quant.get(mlx_module, quant)
            mode = params.get("mode", "affine")
            assert mode == ("nvfp4" if config.format == "nvfp4" else "affine"), (mlx_module, mode)
            if mode == "affine":
                w, s, b = (arrays[f"{mlx_module}.{r}"] for r in ("weight", "scales", "biases"))
                got = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=params["group_size"],
                                    bits=params["bits"])
            else:  # FP mode: uint8 scale bytes, no biases
                assert f"{mlx_module}.biases" not in arrays, mlx_module
                w, s = (arrays[f"{mlx_module}.{r}"] for r in ("weight", "scales"))
                got = mx.dequantize(w, s, group_size=params["group_size"], bits=params["bits"], mode=mode,
                                    dtype=mx.float32)
            want = dequantize(mlx_value, torch.float32)
            assert torch.equal(torch.from_numpy(np.array(got)), want), mlx_module
            checked += 1
    assert checked >= result["quantized"] > 0

    # mlx-lm as its user runs it, against llmq's model on the same quantized weights
    tried = run_consumer("mlx-lm", folder, PROMPT, new_tokens=NEW_TOKENS, prompt_text="The capital of France is")
    assert tried.ok, tried.line()
    assert len(tried.tokens) == NEW_TOKENS and isinstance(tried.text, str)
    model = build_quantized_model(arch.build_model(model_config, device="meta"), quantized_values).float()
    with torch.no_grad():
        ours = model(torch.tensor([PROMPT]))[0].float()
    cosine = torch.nn.functional.cosine_similarity(ours.double().flatten(), tried.logits.double().flatten(), dim=0)
    assert cosine.item() >= BF16_MIN_COSINE, cosine.item()
