"""Sizes are bytes on disk: for every backend that runs here, the bits per weight quantize_and_save
prints (and its error report, and --budget_bits_per_weight) are the quantized tensors' bytes in the
written safetensors files x 8 / their weights, counted here from the files' own headers. And the
MLX folder holds llmq's values exactly: mx.dequantize of its arrays equals llmq's dequantize of the
same weight quantized with the recipe (16-bit scales chosen by the methods, not rounded after)."""

import json
import os
import struct

import numpy as np
import pytest
import torch

from llmq.backend import get_backend, storage_of, with_scale_dtypes
from llmq.quant import QuantRecipe, dequantize, quantize_weight
from models.gemma4.architecture import ARCHITECTURE as GEMMA4
from models.pipeline.default_model import write_default_checkpoint
from models.pipeline.quantize_and_save import run
from models.qwen.architecture import ARCHITECTURE as QWEN

# per backend: (the suffix that marks a quantized weight `<module>`, the suffixes of all its entries)
_BUNDLE = [(".weight.qdata", (".weight.qdata", ".weight.scale", ".weight.bias")),
           (".qdata", (".qdata", ".scale", ".bias"))]  # fused expert stacks: `<p>.experts.gate_up_proj.qdata`
ENTRIES = {
    "bundle": _BUNDLE,
    "cuda": [(".weight.tinygemm_qdata", (".weight.tinygemm_qdata", ".weight.tinygemm_scale_and_zero",
                                         ".weight.tinygemm_shape"))] + _BUNDLE,
    "mlx": [(".scales", (".weight", ".scales", ".biases"))],
    "hf-compressed-tensors": [(".weight_packed", (".weight_packed", ".weight_scale", ".weight_zero_point",
                                                  ".weight_shape", ".weight_global_scale"))],
    "hf-modelopt": [(".weight_scale", (".weight", ".weight_scale", ".weight_scale_2", ".input_scale"))],
}


def headers(folder):
    """name -> (dtype, shape, bytes) of every tensor in the folder's safetensors files, from their headers."""
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with open(os.path.join(folder, f), "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, meta in header.items():
                if name != "__metadata__":
                    out[name] = (meta["dtype"], meta["shape"], meta["data_offsets"][1] - meta["data_offsets"][0])
    return out


def quantized_entries(backend, tensors):
    """module -> its entries' names, for every module the folder holds quantized (found by the first
    marker of its backend's layouts that its entries carry)."""
    modules = {}
    for name in tensors:
        for marker, suffixes in ENTRIES[backend]:
            if name.endswith(marker):
                module = name[: -len(marker)]
                modules.setdefault(module, [module + s for s in suffixes if module + s in tensors])
                break
    return modules


CASES = [  # (architecture, backend, recipe, budget)
    (GEMMA4, "bundle", "int4", None),
    (GEMMA4, "mlx", "int4", None),
    (GEMMA4, "cuda", "int4", None),
    (GEMMA4, "hf-compressed-tensors", "int4", None),
    (GEMMA4, "hf-compressed-tensors", "nvfp4", None),
    (GEMMA4, "hf-modelopt", "mxfp4", None),
    (QWEN, "bundle", "mixed", None),
    (QWEN, "mlx", "int4", None),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch.name: write_default_checkpoint(arch, str(tmp_path_factory.mktemp(arch.name) / "ckpt"), seed=0)
            for arch in (GEMMA4, QWEN)}


def _run(arch, checkpoint, backend, recipe, budget, out):
    return run(arch, checkpoint=checkpoint, recipe=recipe, backend=backend, out=str(out), resume=True,
               max_shard_size=1 << 20, verify=False, seed=0, progress=False, error_report=True,
               budget_bits_per_weight=budget, budget_method="hqq")


@pytest.mark.parametrize("arch,backend,recipe,budget", CASES,
                         ids=[f"{a.name}-{b}-{r}" + (f"-budget{x}" if x else "") for a, b, r, x in CASES])
def test_summary_bits_are_the_files_bits(tmp_path, checkpoints, arch, backend, recipe, budget):
    _check_sizes(backend, _run(arch, checkpoints[arch.name], backend, recipe, budget, tmp_path / "out"), budget)


def _check_sizes(backend, result, budget):
    """The summary's (and report's, and budget's) bits per weight are the written files' bits."""
    tensors = headers(result["bundle"])
    modules = quantized_entries(backend, tensors)
    assert modules
    if not get_backend(backend).takes_float:  # (a takes_float backend quantizes: the stream carries floats)
        assert len(modules) >= result["quantized"] > 0
    disk_bits = 8 * sum(tensors[e][2] for entries in modules.values() for e in entries)
    assert result["bits_per_weight"] == disk_bits / result["quantized_weights"]
    report = result.get("error_report")
    if report is not None:  # the report counts the same bits over the same weights
        total = report.total()
        if total.numel == result["quantized_weights"]:  # its weights: the original tensors' sizes
            assert total.bits_per_weight == disk_bits / total.numel
        else:  # a GGUF input: the report covers what llmq quantized, not the blocks passed through
            mine = [modules[r.name[: -len(".weight")] if r.name.endswith(".weight") else r.name] for r in report.rows]
            assert total.written_bits == 8 * sum(tensors[e][2] for entries in mine for e in entries)
    if budget is not None:
        assert result["budget"].bits_per_weight == result["bits_per_weight"] <= budget


@pytest.mark.parametrize("backend", ["bundle", "cuda"])
def test_summary_bits_are_the_files_bits_from_a_gguf(tmp_path, backend):
    """GGUF input: its quantized blocks pass through as they are (the test GGUF has no tokenizer, which
    --backend=mlx needs: backends/mlx/storage_test.py checks MLX's wider scales for imported blocks),
    one float matrix meets the recipe; the summary counts what the files hold."""
    from models.pipeline.gguf_input_test import _write_gguf

    path = tmp_path / "model.gguf"
    _write_gguf(GEMMA4, path, leave_float=("blk.0.ffn_gate.weight",))
    _check_sizes(backend, _run(GEMMA4, str(path), backend, "int4", None, tmp_path / "out"), None)


def test_sizes_per_backend_as_documented(tmp_path, checkpoints):
    """int4 g32 symmetric: 6.0 bits per weight in the bundle (float32 scale and bias), 5.0 in an MLX
    folder (16-bit scale and bias), the number docs/backends.md states."""
    recipe = tmp_path / "int4-only.json"  # the matrices only: the preset's 8-bit embedding would change the mean
    recipe.write_text(json.dumps({"rules": [{"pattern": "(.*\\.)?(embed_tokens|lm_head)", "config": None},
                                            {"pattern": ".*norm.*", "config": None},
                                            {"pattern": ".*", "config": {"bits": 4, "group_size": 32}}]}))
    got = {b: _run(GEMMA4, checkpoints[GEMMA4.name], b, str(recipe), None, tmp_path / b)["bits_per_weight"]
           for b in ("bundle", "mlx")}
    assert got == {"bundle": 6.0, "mlx": 5.0}


def _mlx_exact(tmp_path, checkpoint, budget):
    mx = pytest.importorskip("mlx.core", reason="the MLX runtime (mlx[cpu] on Linux) is not installed here")
    from safetensors.torch import load_file

    result = _run(GEMMA4, checkpoint, "mlx", "int4", budget, tmp_path / "mlx")
    _check_sizes("mlx", result, budget)
    folder = result["bundle"]
    if budget is None:
        recipe = GEMMA4.presets["int4"]
    else:
        recipe = QuantRecipe.from_file(os.path.join(folder, "budget_recipe.json"))
    job_free = storage_of(get_backend("mlx"))
    recipe = with_scale_dtypes(recipe, job_free).bind(GEMMA4.num_layers(GEMMA4.config_from_hf(GEMMA4.tiny_hf_config())))
    original = {}
    for f in os.listdir(checkpoint):
        if f.endswith(".safetensors"):
            original.update(load_file(os.path.join(checkpoint, f)))
    quant = json.load(open(os.path.join(folder, "config.json")))["quantization"]
    arrays = {}
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            arrays.update(mx.load(os.path.join(folder, f)))
    checked = 0
    for key in arrays:
        if not key.endswith(".scales"):
            continue
        module = key[: -len(".scales")]
        config = recipe.get_config(module)
        q = quantize_weight(original[module + ".weight"], config, name=module)
        want = dequantize(q, torch.float32)
        params = quant.get(module, quant)
        w, s, b = arrays[module + ".weight"], arrays[module + ".scales"], arrays[module + ".biases"]
        assert s.dtype == b.dtype == mx.bfloat16, key  # the tiny model's config names no dtype: bfloat16
        # mx.dequantize in float32 from the stored arrays is exactly llmq's value (products of 8-bit
        # scales and <= 8-bit codes, and their sums with the biases, are exact in float32). In the
        # scales' own dtype MLX rounds each product and sum to bfloat16: its arithmetic, not the file.
        exact = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=params["group_size"],
                              bits=params["bits"])
        assert torch.equal(torch.from_numpy(np.array(exact)), want), module
        checked += 1
    assert checked == result["quantized"] > 0


def test_mlx_folder_values_are_llmq_values_exactly(tmp_path, checkpoints):
    _mlx_exact(tmp_path, checkpoints[GEMMA4.name], None)


def test_mlx_folder_values_are_llmq_values_exactly_for_a_budget(tmp_path, checkpoints):
    _mlx_exact(tmp_path, checkpoints[GEMMA4.name], 4.5)  # asymmetric hqq candidates: a 16-bit bias too
