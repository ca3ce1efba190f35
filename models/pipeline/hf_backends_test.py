"""--backend=hf-modelopt / hf-compressed-tensors through quantize_and_save: both models, the embedded
default and GGUF input, FP and mixed recipes; what the folder holds is what the format's quantizer
gives for the original weight; the command line's summary, --help and refusals; and a run leaves the
global presets as they were."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from llmq.backend import backend_names
from llmq.export import dequantize_exported_tensors, make_spec
from llmq.quant import PRESETS, QuantConfig, dequantize, load_recipe, quantize_weight
from llmq_hf.backend import read_folder
from models.gemma4.architecture import ARCHITECTURE as GEMMA4
from models.pipeline.default_model import write_default_checkpoint
from models.pipeline.quantize_and_save import UsageError, model_tensors, run
from models.qwen.architecture import ARCHITECTURE as QWEN

# NVFP4 experts, FP8 (per channel) attention and first/last layers, MXFP8 elsewhere.
FP_MIXED = {"name": "fp-mixed", "rules": [
    {"pattern": "(.*\\.)?(embed_tokens|lm_head)", "config": None},
    {"pattern": ".*\\.mlp\\.(gate|shared_expert_gate)", "config": None},
    {"pattern": ".*(norm|conv1d).*", "config": None},
    {"pattern": ".*\\.mlp\\.experts\\.(gate_up_proj|down_proj)", "config": {"format": "nvfp4", "bits": 4, "group_size": 16}},
    {"pattern": ".*\\.(self_attn|linear_attn)\\..*", "config": {"format": "fp8", "bits": 8, "group_size": None}},
    {"pattern": ".*", "config": {"format": "fp8", "bits": 8, "group_size": None}, "layers": [0, -1]},
    {"pattern": ".*", "config": {"format": "mxfp8", "bits": 8, "group_size": 32}},
]}


def _run(arch, tmp_path, backend, recipe, checkpoint=None, out="out", verify=True, **kw):
    return run(arch, checkpoint=checkpoint, recipe=recipe, backend=backend, out=str(tmp_path / out), resume=True,
               max_shard_size=1 << 20, verify=verify, seed=0, progress=False, **kw)


def _fp_mixed(tmp_path):
    path = tmp_path / "fp-mixed.json"
    path.write_text(json.dumps(FP_MIXED))
    return str(path)


@pytest.mark.parametrize("arch,backend,recipe,min_cosine", [
    (QWEN, "hf-modelopt", "fp8", 0.98),
    (QWEN, "hf-compressed-tensors", "nvfp4", 0.98),
    (QWEN, "hf-compressed-tensors", "fp-mixed", 0.98),
    (GEMMA4, "hf-compressed-tensors", "mxfp4", 0.9),
    (GEMMA4, "hf-modelopt", "fp8", 0.99),
], ids=lambda v: getattr(v, "name", v))
def test_hf_backend_writes_what_the_quantizer_gives(arch, backend, recipe, min_cosine, tmp_path):
    recipe_arg = _fp_mixed(tmp_path) if recipe == "fp-mixed" else recipe
    result = _run(arch, tmp_path, backend, recipe_arg)
    assert result["verification_failure"] is None and result["cosine"] >= min_cosine
    assert 0 < result["bytes_out"] < result["bytes_in"]
    folder = result["bundle"]
    config = json.load(open(os.path.join(folder, "config.json")))
    qc = config["quantization_config"]
    style = backend[len("hf-"):]
    assert qc["quant_method"] == ("modelopt" if style == "modelopt" else "compressed-tensors")
    assert os.path.isfile(os.path.join(folder, "hf_quant_config.json")) == (style == "modelopt")

    # Independent of the backend's reload: each exported module, read back by its style's formula, equals
    # the format's own quantizer on the original weight (NVFP4 shares a global scale between siblings:
    # its dequantized values are compared to the quantizer with that scale's amax, through the writer's spec).
    ckpt = write_default_checkpoint(arch, str(tmp_path / "ckpt"), seed=0)
    hf_config = json.load(open(os.path.join(ckpt, "config.json")))
    model_config = arch.config_from_hf(hf_config)
    original = {}
    for name, value in model_tensors(arch, ckpt, model_config):
        original.update(arch.to_hf_tensors(name, value))
    bound = load_recipe(recipe_arg, presets=arch.presets).bind(arch.num_layers(model_config))
    tensors = read_folder(folder)
    checked = 0
    for module in sorted(n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")):
        fused = module
        if ".experts." in module:
            prefix, leaf = module.rsplit(".", 2)[0], module.rsplit(".", 1)[1]
            fused = f"{prefix}.{'down_proj' if leaf == 'down_proj' else 'gate_up_proj'}"
        cfg = bound.get_config(fused)
        assert cfg is not None, module
        if cfg.format == "nvfp4":
            continue
        spec = make_spec(module, cfg, style=style)
        got = dequantize_exported_tensors({n: tensors[n] for n in spec.tensor_names().values()}, spec)
        want = dequantize(quantize_weight(original[module + ".weight"], cfg), torch.float32)
        assert torch.equal(got.float(), want), module
        checked += 1
    assert checked > 0 or recipe == "nvfp4"


def test_nvfp4_folder_decompresses_with_compressed_tensors(tmp_path):
    """compressed-tensors' own decompressor reads the folder's NVFP4 modules to our dequantized values
    (it unpacks FP4 to bf16: agreement to bf16 rounding)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    result = _run(QWEN, tmp_path, "hf-compressed-tensors", "nvfp4", verify=False)
    folder = result["bundle"]
    qc = QuantizationConfig.model_validate(json.load(open(os.path.join(folder, "config.json")))["quantization_config"])
    tensors = read_folder(folder)
    modules = sorted(n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale"))
    for module in modules[:: max(1, len(modules) // 6)]:
        (scheme,) = [g for g in qc.config_groups.values() if any(match_name(module, t) for t in g.targets)]
        local = {n[len(module) + 1:]: t for n, t in tensors.items() if n.rsplit(".", 1)[0] == module}
        theirs = BaseCompressor.get_value_from_registry(scheme.format).decompress(local, scheme)["weight"]
        spec = make_spec(module, QuantConfig(format="nvfp4", bits=4, group_size=16), style="compressed-tensors")
        ours = dequantize_exported_tensors({n: tensors[n] for n in spec.tensor_names().values()}, spec)
        assert torch.allclose(theirs.float(), ours, rtol=2 ** -7, atol=0), module


@pytest.mark.parametrize("arch,backend,recipe", [(QWEN, "hf-compressed-tensors", "nvfp4"),
                                                 (GEMMA4, "hf-modelopt", "mxfp8")], ids=lambda v: getattr(v, "name", v))
def test_gguf_input(arch, backend, recipe, tmp_path):
    from models.pipeline.gguf_input_test import _write_gguf

    path = tmp_path / "model.gguf"
    _write_gguf(arch, path)
    result = _run(arch, tmp_path, backend, recipe, checkpoint=str(path))
    assert result["verification_failure"] is None and result["cosine"] >= 0.98
    files = set(os.listdir(result["bundle"]))
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files)


def test_refusals_before_any_work(tmp_path):
    with pytest.raises(UsageError, match=r"format 'int' cannot be written by --backend hf-modelopt; it takes fp8"):
        _run(QWEN, tmp_path, "hf-modelopt", "int4")
    known = re.escape(", ".join(backend_names()))  # every registered backend, the bundle first
    with pytest.raises(UsageError, match=rf"--backend: backend 'hf' unknown; expected one of {known}$"):
        _run(QWEN, tmp_path, "hf", "nvfp4")
    # the nvfp4 preset's first rule MLX cannot hold: its FP8 embedding (llmq.quant.presets.embedding_config)
    with pytest.raises(UsageError, match=r"format 'fp8' cannot be written by --backend mlx; it takes int"):
        _run(GEMMA4, tmp_path, "mlx", "nvfp4")
    with pytest.raises(UsageError, match=r"^--backend hf-modelopt: recipe rule .* is nvfp4, which ModelOpt's readers "
                                         r".* load only with a calibrated input_scale \(W4A4\)"):
        _run(QWEN, tmp_path, "hf-modelopt", "nvfp4")
    assert not os.listdir(tmp_path)


def test_a_run_leaves_the_global_presets_alone(tmp_path):
    generic = PRESETS["int4"]
    assert QWEN.presets["int4"] is not generic
    _run(QWEN, tmp_path, "bundle", "int4", verify=False)
    assert load_recipe("int4") is generic and PRESETS["int4"] is generic
    assert load_recipe("int4", presets=QWEN.presets) is QWEN.presets["int4"]


def _cli(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    main = ("from models.pipeline.quantize_and_save import main_for; "  # what models/gemma4/quantize_and_save.py runs
            "from models.gemma4.architecture import ARCHITECTURE; main_for(ARCHITECTURE)")
    return subprocess.run([sys.executable, "-c", main, *args], capture_output=True, text=True, env=env, timeout=300)


def test_cli_writes_then_refuses_an_existing_out_and_lists_backends(tmp_path):
    out = tmp_path / "ct"
    proc = _cli(tmp_path, "--backend=hf-compressed-tensors", "--recipe=nvfp4", f"--out={out}", "--noverify")
    assert proc.returncode == 0, proc.stderr
    assert "hf-compressed-tensors" in proc.stdout and "quantized modules" in proc.stdout
    assert "compressed-tensors style" in proc.stdout
    assert json.load(open(out / "config.json"))["quantization_config"]["quant_method"] == "compressed-tensors"
    again = _cli(tmp_path, "--backend=hf-compressed-tensors", "--recipe=nvfp4", f"--out={out}", "--noverify")
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert "already exists; remove it or pick another --out" in again.stderr
    helped = _cli(tmp_path, "--help")
    assert helped.returncode == 0
    for name in ("bundle", "cuda", "mlx", "hf-modelopt", "hf-compressed-tensors"):
        assert f"\n  {name} " in helped.stdout, name


@pytest.mark.parametrize("arch,backend,recipe", [
    (QWEN, "hf-compressed-tensors", "fp-mixed"),
    (GEMMA4, "hf-modelopt", "mxfp8"),
    (GEMMA4, "hf-compressed-tensors", "nvfp4"),
], ids=lambda v: getattr(v, "name", v))
def test_row_blocks_write_the_files_of_whole_tensors(arch, backend, recipe, tmp_path, monkeypatch):
    """The HF exports take large tensors as row blocks (run.ROW_BLOCK_BYTES); with 1 KiB blocks
    every file of the folder is byte for byte that of whole tensors."""
    from llmq.quant.row_blocks import RowBlocks
    from models.pipeline import inputs, run as run_module

    recipe_arg = _fp_mixed(tmp_path) if recipe == "fp-mixed" else recipe
    checkpoint = write_default_checkpoint(arch, str(tmp_path / "ckpt"), seed=4)
    real, seen, folders = inputs.iter_checkpoint, [], {}

    def spy(*args, **kwargs):
        for name, value in real(*args, **kwargs):
            seen.append(isinstance(value, RowBlocks))
            yield name, value

    monkeypatch.setattr(inputs, "iter_checkpoint", spy)
    for label, block in (("whole", 1 << 40), ("blocks", 1024)):
        monkeypatch.setattr(run_module, "ROW_BLOCK_BYTES", block)
        folders[label] = _run(arch, tmp_path, backend, recipe_arg, checkpoint=checkpoint, out=label,
                              verify=False)["bundle"]
    assert sum(seen) >= 10  # the second run's large tensors came as row blocks

    def files(folder):
        return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}

    whole, blocks = files(folders["whole"]), files(folders["blocks"])
    assert sorted(whole) == sorted(blocks) and any(n.endswith(".safetensors") for n in whole)
    assert [n for n in whole if whole[n] != blocks[n]] == []
