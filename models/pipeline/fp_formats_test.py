"""quantize_and_save with floating-point recipes: quantize, save the bundle, reload and verify
(embedded default); backends that cannot hold a format refuse it before any work."""

import json
import os
import subprocess
import sys

import pytest
import torch

from llmq.checkpoint import load_bundle, read_manifest
from llmq.quant import QuantConfig, dequantize, format_of, quantize_weight
from llmq.quant.formats.fp8 import FP8Weight
from llmq.quant.formats.nvfp4 import NVFP4Weight
from models.pipeline.default_model import write_default_checkpoint
from models.pipeline.quantize_and_save import UsageError, model_tensors, run
from models.qwen.architecture import ARCHITECTURE as QWEN

KEEP = [  # what the int4 preset keeps in high precision (norms, convs, router, embeddings)
    {"pattern": "(.*\\.)?(embed_tokens|lm_head)", "config": None},
    {"pattern": ".*\\.mlp\\.(gate|shared_expert_gate)", "config": None},
    {"pattern": ".*(norm|conv1d).*", "config": None},
]
CONFIGS = {
    "fp8": ({"format": "fp8", "bits": 8, "group_size": None}, FP8Weight, 0.999),
    "nvfp4": ({"format": "nvfp4", "bits": 4, "group_size": 16}, NVFP4Weight, 0.98),
}


def recipe_file(tmp_path, fmt):
    path = tmp_path / f"{fmt}.json"
    path.write_text(json.dumps({"rules": KEEP + [{"pattern": ".*", "config": CONFIGS[fmt][0]}]}))
    return str(path)


def _run(tmp_path, recipe, backend="bundle", out="out"):
    return run(QWEN, checkpoint=None, recipe=recipe, backend=backend, out=str(tmp_path / out), resume=True,
               max_shard_size=1 << 20, verify=True, seed=0, progress=False)


@pytest.mark.parametrize("fmt", sorted(CONFIGS))
def test_fp_recipe_end_to_end(tmp_path, fmt):
    _, container, min_cosine = CONFIGS[fmt]
    result = _run(tmp_path, recipe_file(tmp_path, fmt))
    assert result["quantized"] > 0 and result["bytes_out"] < result["bytes_in"]
    assert result["cosine"] >= min_cosine  # the reloaded bundle runs, close to the unquantized model
    tensors = load_bundle(result["bundle"])
    quantized = {n: v for n, v in tensors.items() if format_of(v) is not None}
    assert len(quantized) == result["quantized"]
    assert all(isinstance(v, container) for v in quantized.values())
    assert read_manifest(result["bundle"])["format_version"] == 3
    # what was saved is bit for bit what the format's quantizer gives for the original weight
    folder = write_default_checkpoint(QWEN, str(tmp_path / "ckpt"), seed=0)
    config = QWEN.config_from_hf(json.load(open(os.path.join(folder, "config.json"))))
    original = dict(model_tensors(QWEN, folder, config))
    recipe_config = QuantConfig.from_dict(CONFIGS[fmt][0])
    for name in list(quantized)[:4]:
        want = quantize_weight(original[name], recipe_config, name=name)
        assert torch.equal(dequantize(quantized[name], torch.float32), dequantize(want, torch.float32)), name


@pytest.mark.parametrize("backend", ["mlx", "cuda"])
def test_backends_without_fp_refuse_before_any_work(tmp_path, backend):
    # MLX writes nvfp4 (its own mode, block scales only) but has no per-channel FP8; CUDA takes int only
    fmt = {"mlx": "fp8", "cuda": "nvfp4"}[backend]
    refusal = {"mlx": r"recipe rule '\.\*': format 'fp8' cannot be written by --backend mlx; it takes int, mxfp4",
               "cuda": r"recipe rule '\.\*': format 'nvfp4' cannot be written by --backend cuda; it takes int"}
    with pytest.raises(UsageError, match=refusal[backend]):
        _run(tmp_path, recipe_file(tmp_path, fmt), backend=backend)
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.partial")


def test_cli_refusal_is_one_line_exit_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    main = ("from models.pipeline.quantize_and_save import main_for; "  # what models/qwen/quantize_and_save.py runs
            "from models.qwen.architecture import ARCHITECTURE; main_for(ARCHITECTURE)")
    proc = subprocess.run([sys.executable, "-c", main, "--backend=mlx",
                           f"--recipe={recipe_file(tmp_path, 'fp8')}", f"--out={tmp_path / 'out'}"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "recipe rule '.*': format 'fp8' cannot be written by --backend mlx" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "out")
