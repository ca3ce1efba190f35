"""Model-free quantization (//models:quantize, models/pipeline/generic.py) on tiny random checkpoints that
transformers writes: Llama, Qwen3, Mistral and two MoEs llmq has no model code for (Qwen3-MoE, Mixtral),
each quantized by the generic presets and verified through transformers' own model class; the streamed
loading checked against transformers' from_pretrained; the command line's refusals, sizes and help."""

import json
import os
import subprocess
import sys

import pytest
import torch

import models.architectures  # noqa: F401  registered: "llmq has model code" and GGUF input
from llmq.checkpoint import iter_checkpoint, load_bundle
from llmq.quant import GroupQuantizedWeight
from models.pipeline.cli_testing import assert_one_line_exit_2, run_main
from models.pipeline.generic import generic_architecture
from models.pipeline.inputs import read_hf_config
from models.pipeline.run import run
from models.pipeline.transformers_model import empty_model, load_streamed, transformers_model_class

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    "llama": dict(COMMON),
    "qwen3": dict(COMMON, head_dim=16),
    "mistral": dict(COMMON, sliding_window=None),
    "qwen3_moe": dict(COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1),
    "mixtral": dict(COMMON, num_local_experts=4, num_experts_per_tok=2),
}


def _checkpoint(root, model_type, seed=0, fields=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = os.path.join(str(root), model_type)
    if not os.path.isdir(folder):
        torch.manual_seed(seed)
        config = AutoConfig.for_model(model_type, **(fields or CONFIGS[model_type]))
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return lambda model_type: _checkpoint(root, model_type)


def _run(folder, out, *, backend="bundle", recipe=None, verify=True, dry_run=False):
    arch = generic_architecture(folder, read_hf_config(folder))
    return run(arch, checkpoint=folder, recipe=recipe, backend=backend, out=str(out), resume=False,
               max_shard_size=1 << 30, verify=verify, seed=0, progress=False, dry_run=dry_run)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_streamed_model_is_transformers_from_pretrained(tiny, model_type):
    """The verification's reference (transformers' class on meta, tensors streamed in, per-expert matrices
    into fused stacks) computes exactly what transformers' own from_pretrained loads."""
    from transformers import AutoModelForCausalLM

    folder = tiny(model_type)
    config, why = transformers_model_class(read_hf_config(folder))
    assert config is not None, why
    streamed = load_streamed(empty_model(config), iter_checkpoint(folder))
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, loaded(input_ids=ids).logits)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_generic_int4_verifies_through_transformers(tiny, tmp_path, model_type, capsys):
    folder = tiny(model_type)
    result = _run(folder, tmp_path / "out")
    printed = capsys.readouterr().out
    assert result["verification_failure"] is None
    assert result["model_class"] == read_hf_config(folder)["architectures"][0]
    # int4 g32 on random weights: logits cosine well above the 0.9 bar, KL small; 8-bit embeddings
    assert result["cosine"] > 0.95 and result["kl"] < 0.05, (result["cosine"], result["kl"])
    assert "through transformers'" in printed
    tensors = load_bundle(result["bundle"])
    assert isinstance(tensors["model.embed_tokens.weight"], GroupQuantizedWeight)
    assert tensors["model.embed_tokens.weight"].bits == 8
    assert tensors["model.layers.0.self_attn.q_proj.weight"].bits == 4
    for name, value in tensors.items():  # norms and routers kept
        if "norm" in name or name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
            assert isinstance(value, torch.Tensor), name
    experts = [n for n in tensors if ".experts." in n]
    assert all(isinstance(tensors[n], GroupQuantizedWeight) for n in experts)
    # every tensor of the checkpoint is in the output, under its own name
    assert set(tensors) == {n for n, _ in iter_checkpoint(folder)}
    # the estimate printed first is what was written
    assert result["bytes_out"] == _run(folder, tmp_path / "dry", dry_run=True)["estimate"].bytes_out


def test_compressed_tensors_folder_verifies_through_transformers(tiny, tmp_path):
    result = _run(tiny("qwen3"), tmp_path / "ct", backend="hf-compressed-tensors")
    assert result["verification_failure"] is None and result["cosine"] > 0.95
    with open(tmp_path / "ct" / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "compressed-tensors"


def test_moe_nvfp4_compressed_tensors_runs_in_transformers(tiny, tmp_path):
    """Qwen3-MoE's compressed-tensors NVFP4 folder (generic target) runs in transformers as written: its
    experts carry g = 1 (transformers decompresses fused experts without their weight_global_scale), so
    transformers in a process without llmq gives the logits of the same model class on llmq's read-back
    of the folder (bfloat16 arithmetic: cosine >= 0.999; a dropped global scale gives far less), and
    compressed-tensors' own dequantizer agrees; no misread is warned of."""
    from transformers import AutoModelForCausalLM

    from llmq.consumer_run import run_consumer
    from llmq.export import consumer_warnings, read_export
    from llmq_hf.backend import try_compressed_tensors

    folder, out = tiny("qwen3_moe"), str(tmp_path / "ct")
    assert _run(folder, out, backend="hf-compressed-tensors", recipe="nvfp4")["verification_failure"] is None
    assert consumer_warnings(out) == []
    prompt = list(range(3, 19))
    got = run_consumer("transformers", out, prompt, new_tokens=4)
    assert got.ok, got.line()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    decoded = dict(read_export(out, torch.bfloat16))
    state = {}
    for name, value in model.state_dict().items():  # the per-expert read-back stacked as transformers fuses it
        prefix, _, proj = name.rpartition(".")
        experts = range(value.shape[0])
        if proj == "gate_up_proj":
            state[name] = torch.stack([torch.cat([decoded[f"{prefix}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
                                       for e in experts])
        elif proj == "down_proj" and prefix.endswith("experts"):
            state[name] = torch.stack([decoded[f"{prefix}.{e}.down_proj.weight"] for e in experts])
        else:
            state[name] = decoded.get(name, value)
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        ours = model(torch.tensor([prompt])).logits[0].float()
    cosine = torch.nn.functional.cosine_similarity(ours.double().flatten(), got.logits.double().flatten(), dim=0)
    assert cosine.item() >= 0.999, cosine.item()
    assert try_compressed_tensors(out)[1]["agrees"]


def test_unknown_architecture_is_checked_per_tensor(tiny, tmp_path):
    """A model_type transformers has no class for: quantized all the same, verified tensor by tensor."""
    import shutil

    folder = str(tmp_path / "custom")
    shutil.copytree(tiny("llama"), folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["model_type"] = "llmq_test_custom"
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    result = _run(folder, tmp_path / "out")
    assert result["verification_failure"] is None and "cosine" not in result
    assert 0 < max(result["tensor_errors"].values()) < 0.2


def test_cli_refuses_what_needs_a_model(tiny, tmp_path):
    from models.pipeline.cli import main_model_free

    folder = tiny("llama")
    for backend, words in (("mlx", ("--backend mlx", "model knowledge", "mlx-lm", "gguf for model_type llama")),):
        result = run_main(None, [f"--checkpoint={folder}", f"--backend={backend}", f"--out={tmp_path / backend}"],
                          tmp_path, entry=main_model_free)
        assert_one_line_exit_2(result, *words)
        assert not os.path.exists(tmp_path / backend)  # (gguf: generic_gguf_test.py)
    # not a checkpoint: one line naming what is supported
    (tmp_path / "notes.txt").write_text("x")
    result = run_main(None, [f"--checkpoint={tmp_path / 'notes.txt'}"], tmp_path, entry=main_model_free)
    assert_one_line_exit_2(result, "supported:", "any architecture", "gemma3")


def test_cli_gguf_of_unknown_architecture(tmp_path):
    import gguf
    import numpy as np

    from models.pipeline.cli import main_model_free

    path = str(tmp_path / "x.gguf")
    writer = gguf.GGUFWriter(path, "bert")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_main(None, [f"--checkpoint={path}"], tmp_path, entry=main_model_free)
    assert_one_line_exit_2(result, "'bert'", "supported:")


def test_cli_dry_run_and_suggestions(tiny, tmp_path):
    from models.pipeline.cli import main_model_free

    folder = tiny("mistral")
    code, out, err = run_main(None, [f"--checkpoint={folder}", "--dry_run", f"--out={tmp_path / 'o'}"], tmp_path,
                              entry=main_model_free)
    assert code == 0, err
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "bytes" in lines["bundle"] and "bits per weight" in lines["hf-compressed-tensors"]
    assert "not written" in lines["mlx"] and "bits per weight" in lines["gguf"]  # Mistral: llama.cpp's "llama"
    assert not os.path.exists(tmp_path / "o")
    assert_one_line_exit_2(run_main(None, [f"--checkpoint={folder}", "--recipe=imt4"], tmp_path,
                                    entry=main_model_free), "did you mean 'int4'")
    assert_one_line_exit_2(run_main(None, [f"--checkpoint={folder}", "--backend=bundel"], tmp_path,
                                    entry=main_model_free), "did you mean 'bundle'")
    code, out, _ = run_main(None, ["--help"], tmp_path, entry=main_model_free)
    assert code == 0
    headings = [line for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings[-6:] == ["input:", "output and backend:", "recipe:", "quality:", "verification:", "advanced:"]


def test_max_shard_size_units():
    from models.pipeline.cli import ByteSizeParser

    parse = ByteSizeParser().parse
    assert parse("5GB") == 5 * 10**9 and parse("500MiB") == 500 << 20 and parse("2 GiB") == 2 << 30
    assert parse("65536") == 65536 and parse(1 << 20) == 1 << 20
    for bad in ("5XB", "GB", "-1", "100"):
        with pytest.raises(ValueError):
            parse(bad)


def test_did_you_mean_in_the_library():
    from llmq.backend import get_backend
    from llmq.quant import QuantConfig, load_recipe

    with pytest.raises(ValueError, match="did you mean 'int4-mixed'"):
        load_recipe("int4-mixd")
    with pytest.raises(ValueError, match="did you mean 'hf-modelopt'"):
        get_backend("hf-modelop")
    with pytest.raises(ValueError, match="did you mean 'nvfp4'"):
        QuantConfig(format="nvfp")


def test_cli_names_llmqs_own_model_target(tmp_path):
    """A model_type llmq has model code for (gemma3_text) is still quantized model-free, verified through
    transformers, and the run names the per-model target."""
    folder = _checkpoint(tmp_path, "gemma3_text", fields=dict(COMMON, head_dim=16, sliding_window=64))
    # the binary in a fresh interpreter: a forked child that runs models after the parent's torch threads hang
    binary = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "quantize.py")
    proc = subprocess.run([sys.executable, binary, f"--checkpoint={folder}", f"--out={tmp_path / 'out'}"],
                          capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    code, out, err = proc.returncode, proc.stdout, proc.stderr
    assert code == 0, (code, err[-3000:])
    assert "//models/gemma3:quantize_and_save" in out and "through transformers' Gemma3ForCausalLM" in out
    assert out.index("estimate (--backend bundle)") < out.index("verify:")  # the size before the work
