"""End to end: the embedded default of each model through quantize_and_save's own path.

Thresholds are issue 6's acceptance bars (logits cosine >= 0.95 for INT4, >= 0.99 for INT8).
"""

import hashlib
import os

import pytest
import torch

from llmq.checkpoint import load_bundle
from llmq.quant import GroupQuantizedWeight
from models.gemma3.architecture import ARCHITECTURE as GEMMA3
from models.gemma4.architecture import ARCHITECTURE as GEMMA4
from models.pipeline.default_model import write_default_checkpoint
from models.pipeline.quantize_and_save import UsageError, run
from models.qwen.architecture import ARCHITECTURE as QWEN


def _run(arch, tmp_path, recipe, out="out", checkpoint=None, backend="bundle", use_moe_op=False):
    return run(arch, checkpoint=checkpoint, recipe=recipe, backend=backend, out=str(tmp_path / out), resume=True,
               max_shard_size=1 << 20, verify=True, seed=0, progress=False, use_moe_op=use_moe_op)


@pytest.mark.parametrize("arch,recipe,min_cosine", [
    (QWEN, "int4", 0.95), (QWEN, "int8", 0.99), (QWEN, "mixed", 0.95),
    (GEMMA4, "int4", 0.95), (GEMMA4, "int8", 0.99), (GEMMA4, "mixed", 0.95),
])
def test_embedded_default_quality(arch, recipe, min_cosine, tmp_path):
    result = _run(arch, tmp_path, recipe)
    print(f"{arch.name} {recipe}: cosine {result['cosine']:.5f} SQNR {result['sqnr_db']:.1f} dB")
    assert result["quantized"] > 0
    assert result["bytes_out"] < result["bytes_in"]
    assert result["cosine"] >= min_cosine


def test_qwen_fused_experts_are_quantized_stacks(tmp_path):
    result = _run(QWEN, tmp_path, "int4")
    tensors = load_bundle(result["bundle"])
    experts = {n: v for n, v in tensors.items() if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    assert len(experts) == 2 * 4  # two stacks per layer, four layers
    for name, value in experts.items():
        assert isinstance(value, GroupQuantizedWeight), name
        assert value.shape[0] == 16 and value.bits == 4, name
    kept = [n for n in tensors if "embed_tokens" in n or n.endswith(".mlp.gate.weight") or "norm" in n]
    assert kept and all(isinstance(tensors[n], torch.Tensor) for n in kept)


def _digest(folder):
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()


def test_same_input_same_bytes(tmp_path):
    checkpoint = write_default_checkpoint(QWEN, str(tmp_path / "ckpt"), seed=3)
    first = _run(QWEN, tmp_path, "mixed", out="a", checkpoint=checkpoint)["bundle"]
    second = _run(QWEN, tmp_path, "mixed", out="b", checkpoint=checkpoint)["bundle"]
    assert _digest(first) == _digest(second)


def test_bad_recipe_and_missing_folder_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="neither a known preset"):
        _run(QWEN, tmp_path, "no-such-recipe")
    with pytest.raises(UsageError, match="no such folder"):
        _run(QWEN, tmp_path, "int4", checkpoint=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no config.json"):
        _run(QWEN, tmp_path, "int4", checkpoint=str(tmp_path / "empty"))


def test_cuda_backend_packs_tinygemm_tiles_and_reloads(tmp_path):
    result = _run(QWEN, tmp_path, "int4", backend="cuda")
    tensors = load_bundle(result["bundle"])
    qdata = tensors["model.layers.0.mlp.experts.gate_up_proj.tinygemm_qdata"]
    assert qdata.dtype == torch.int32 and qdata.shape[0] == 16  # per-expert tiles, experts leading
    assert tensors["model.layers.0.mlp.experts.gate_up_proj.tinygemm_scale_and_zero"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.experts.gate_up_proj" not in tensors
    # Only bf16 rounding of scale and zero separates it from the canonical bundle's quality.
    assert result["cosine"] >= 0.95
    canonical = _run(QWEN, tmp_path, "int4", out="canonical")
    assert abs(result["cosine"] - canonical["cosine"]) < 1e-3


@pytest.mark.parametrize("recipe", ["int4", "mixed"])
def test_moe_op_path_tracks_eager_quantized_path(recipe, tmp_path):
    """The fused kernel quantizes activations to int8 per row and group (docs/moe_kernel.md):
    about 1.6% relative error per MoE block at worst (~36 dB). Four blocks in a row add up to
    about 30 dB; 25 dB leaves room for amplification through the layers. Weight bits are the
    same ones the eager path uses (the swap repacks, it never re-quantizes)."""
    result = _run(QWEN, tmp_path, recipe, use_moe_op=True)["moe_op"]
    print(f"{recipe}: op vs eager cosine {result['cosine']:.6f} SQNR {result['sqnr_db']:.1f} dB")
    assert result["blocks"] == 4
    assert result["sqnr_db"] >= 25.0
    assert result["cosine"] >= 0.999


@pytest.mark.parametrize("bad", ["--bogus", "--backend=tpu", "--max_shard_size=abc"])
def test_bad_flags_are_one_line_and_exit_2(bad, capsys):
    from models.pipeline.quantize_and_save import parse_flags_or_exit

    with pytest.raises(SystemExit) as exit_info:
        parse_flags_or_exit(["quantize_and_save", bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_progress_total_counts_what_the_stream_yields(tmp_path):
    """The bar's total is the merged model-layout tensors (72 for the tiny Qwen), not the
    checkpoint's per-expert HF tensors (4 layers x 16 experts x 3 more)."""
    result = _run(QWEN, tmp_path, "int4")
    assert result["progress_total"] == result["tensors"] == 72


def test_verify_failure_fails_the_run_and_moves_the_output_aside(tmp_path, capsys):
    kwargs = dict(checkpoint=None, recipe="int4", backend="bundle", resume=True, max_shard_size=1 << 20,
                  verify=True, seed=0, progress=False)
    # No INT4 model reaches cosine 1.0: the bar set there stands for "clearly broken".
    with pytest.raises(UsageError, match=r"--verify: logits cosine 0\.\d+ is under 1\.0.*moved to .*\.failed"):
        run(QWEN, out=str(tmp_path / "strict"), verify_min_cosine=1.0, **kwargs)
    assert not (tmp_path / "strict").exists() and (tmp_path / "strict.failed").is_dir()
    assert "verification          FAILED" in capsys.readouterr().out
    warned = run(QWEN, out=str(tmp_path / "warn"), verify_min_cosine=1.0, verify_warn_only=True, **kwargs)
    assert warned["verification_failure"] and (tmp_path / "warn").is_dir()
    assert "warning: --verify" in capsys.readouterr().err


def test_verdict_refuses_non_finite_and_nan():
    from models.pipeline.verify import verdict

    good = {"cosine": 0.99, "finite_reference": True, "finite_quantized": True}
    assert verdict(good, min_cosine=0.9) is None
    assert "NaN" in verdict(dict(good, cosine=float("nan")), min_cosine=0.9)
    assert "not finite" in verdict(dict(good, finite_quantized=False), min_cosine=0.9)
    assert "not finite" in verdict(dict(good, finite_reference=False), min_cosine=0.9)
    assert "under 0.9" in verdict(dict(good, cosine=0.2), min_cosine=0.9)


def test_embedded_default_says_its_output_is_deleted(capsys):
    result = run(QWEN, checkpoint=None, recipe="int8", backend="bundle", out=None, resume=True,
                 max_shard_size=1 << 20, verify=False, seed=0, progress=False)
    printed = capsys.readouterr().out
    assert f"output goes to {result['bundle']}, a temporary folder deleted at exit" in printed
    assert not os.path.exists(result["bundle"])  # as it said


def test_recipe_that_quantizes_nothing_warns(tmp_path, capsys):
    empty = tmp_path / "empty.json"
    empty.write_text('{"rules": []}')
    result = _run(QWEN, tmp_path, str(empty))
    assert result["quantized"] == 0
    err = capsys.readouterr().err
    assert "no rule quantizes any of the model's 72 tensors" in err and str(empty) in err


@pytest.mark.parametrize("arch,recipe", [(QWEN, "mixed"), (GEMMA4, "mixed"), (GEMMA3, "int4-e8")],
                         ids=["qwen", "gemma4", "gemma3"])
def test_row_blocks_write_the_bytes_of_whole_tensors(arch, recipe, tmp_path, monkeypatch):
    """The bundle backend takes large tensors as row blocks (ROW_BLOCK_BYTES); with blocks of
    1 KiB (so every matrix, per-expert ones too, arrives in blocks) the bundle's tensor files
    are byte for byte those of whole tensors, and verification passes."""
    from llmq.quant.row_blocks import RowBlocks
    from models.pipeline import inputs, run as run_module

    checkpoint = write_default_checkpoint(arch, str(tmp_path / "ckpt"), seed=5)
    monkeypatch.setattr(run_module, "ROW_BLOCK_BYTES", 1 << 40)  # never: every tensor whole
    whole = _run(arch, tmp_path, recipe, out="whole", checkpoint=checkpoint)
    seen = []
    real = inputs.iter_checkpoint

    def spy(*args, **kwargs):
        for name, value in real(*args, **kwargs):
            seen.append(isinstance(value, RowBlocks))
            yield name, value

    monkeypatch.setattr(inputs, "iter_checkpoint", spy)
    monkeypatch.setattr(run_module, "ROW_BLOCK_BYTES", 1024)
    blocks = _run(arch, tmp_path, recipe, out="blocks", checkpoint=checkpoint)
    assert sum(seen) >= 10  # the write pass's large tensors came as row blocks
    assert _digest(blocks["bundle"]) == _digest(whole["bundle"])
    assert (blocks["tensors"], blocks["quantized"], blocks["bytes_in"], blocks["bytes_out"]) == \
        (whole["tensors"], whole["quantized"], whole["bytes_in"], whole["bytes_out"])
    assert blocks["cosine"] == whole["cosine"] and blocks["verification_failure"] is None
