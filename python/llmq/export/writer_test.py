"""Folder-level tests of the HF writers on a tiny Qwen3-MoE built from transformers' config
classes: compressed-tensors itself parses our config, matches our modules and decompresses
our tensors; ModelOpt folders are checked against ModelOpt's documented formulas."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from llmq.checkpoint import CheckpointError, ResumeMismatchError
from llmq.export import write_hf_quantized_checkpoint
from llmq.quant import dequantize, quantize_weight
from llmq.quant.formats.nvfp4 import quantize_nvfp4
from llmq.quant.presets import FP8_PER_CHANNEL as FP8_CHANNEL, INT4, MXFP4, MXFP8, NVFP4
from llmq.quant.recipe import QuantConfig

FP8_BLOCK = QuantConfig(format="fp8", granularity="block128")
INT8_ASYM = QuantConfig(format="int", bits=8, group_size=64, symmetric=False)
UNQUANTIZED = ("lm_head", "embed_tokens", "mlp.gate")


@pytest.fixture(scope="module")
def tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
        mlp_only_layers=[1],
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # Make magnitudes differ between siblings and experts so shared scales are observable.
    g = torch.Generator().manual_seed(1)
    for k in sd:
        if sd[k].dim() >= 2:
            sd[k] = (torch.randn(sd[k].shape, generator=g) * (0.5 + torch.rand(sd[k].shape[:-1] + (1,), generator=g))).to(torch.bfloat16)
    return cfg, sd


def mixed_recipe(fqn):
    if fqn.endswith(UNQUANTIZED):
        return None
    if ".self_attn." in fqn:
        if ".layers.0." in fqn:
            return FP8_BLOCK if fqn.endswith("o_proj") else NVFP4
        return FP8_CHANNEL
    if ".experts." in fqn:
        return MXFP8 if fqn.endswith("down_proj") else (NVFP4 if ".experts.0." in fqn or ".experts.1." in fqn else MXFP4)
    return INT8_ASYM if fqn.endswith("down_proj") else INT4


def _read_folder(folder):
    tensors = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, f)))
    return tensors


def _source_weights(sd):
    """module fqn -> 2-D float weight, with fused experts split the way the writer documents."""
    out = {}
    for name, t in sd.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj"] = t[e, :half]
                out[f"{prefix}.{e}.up_proj"] = t[e, half:]
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj"] = t[e]
        elif name.endswith(".weight") and t.dim() == 2:
            out[name[: -len(".weight")]] = t
    return out


def _canonical(module, w, sources, config, style="modelopt"):
    """Our own canonical dequantization of the weight, with ModelOpt's sibling rule for the
    NVFP4 global scale (max over q/k/v or over gate/up), computed here independently; compressed-tensors
    MoE experts carry no global scale (g = 1: transformers drops theirs)."""
    if config.format == "nvfp4" and style == "compressed-tensors" and ".experts." in module:
        return dequantize(quantize_nvfp4(w, global_scale=torch.tensor(1.0)), torch.float32)
    if config.format == "nvfp4":
        parent, _, leaf = module.rpartition(".")
        group = (("q_proj", "k_proj", "v_proj") if leaf in ("q_proj", "k_proj", "v_proj")
                 else ("gate_proj", "up_proj") if leaf in ("gate_proj", "up_proj") else (leaf,))
        amax = max(sources[f"{parent}.{s}"].float().abs().max() for s in group)
        return dequantize(quantize_nvfp4(w, global_scale=amax / 2688.0), torch.float32)
    return dequantize(quantize_weight(w, config), torch.float32)


def test_compressed_tensors_decompresses_our_folder_exactly(tiny_moe, tmp_path):
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    cfg, sd = tiny_moe
    out = tmp_path / "ct"
    summary = write_hf_quantized_checkpoint(str(out), iter(sd.items()), mixed_recipe, style="compressed-tensors", config=cfg.to_dict())
    sources = _source_weights(sd)
    quantized = sorted(m for m in sources if mixed_recipe(m) is not None)
    assert summary.quantized_modules == len(quantized) == 2 * 4 + 4 * 3 + 3  # attention, experts, dense MLP
    assert summary.excluded_modules == ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"]

    config = json.loads((out / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    assert qc.format == "mixed-precision" and qc.quant_method == "compressed-tensors"
    assert sorted(qc.ignore) == summary.excluded_modules
    tensors = _read_folder(out)
    # Nothing left in high precision except the excluded modules and the 1-D norms.
    for name, t in tensors.items():
        if t.dtype == torch.bfloat16:
            assert t.dim() == 1 or name.rsplit(".", 1)[0] in summary.excluded_modules, name

    for module in quantized:
        groups = [g for g in qc.config_groups.values() if any(match_name(module, t) for t in g.targets)]
        assert len(groups) == 1, (module, groups)
        scheme = groups[0]
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        local = {n[len(module) + 1 :]: t for n, t in tensors.items() if n.rsplit(".", 1)[0] == module}
        got = compressor.decompress(local, scheme)["weight"]
        config_ = mixed_recipe(module)
        ours = _canonical(module, sources[module], sources, config_, "compressed-tensors")
        if config_.format == "nvfp4":
            # compressed-tensors divides by weight_global_scale = 1/g: within one float32
            # rounding of our value * (s * g); compare exactly against that formula.
            from llmq.export import dequantize_exported_tensors, make_spec

            spec = make_spec(module, config_, style="compressed-tensors")
            theirs_formula = dequantize_exported_tensors({f"{module}.{k}": v for k, v in local.items()}, spec)
            assert torch.equal(got, theirs_formula.to(got.dtype)), module
            assert bool(((theirs_formula - ours).abs() <= ours.abs() * 2.0**-23).all()), module
        else:
            assert torch.equal(got, ours.to(got.dtype)), module


@pytest.mark.parametrize("config", [INT4, INT8_ASYM, NVFP4, MXFP4, FP8_CHANNEL, MXFP8], ids=lambda c: c.describe())
def test_transformers_loads_our_compressed_tensors_folder(config, tmp_path):
    """transformers' own compressed-tensors integration (from_pretrained, decompressing on
    load) gives exactly our weights. It applies one scheme to every dense module, so this uses
    one format per folder; mixed folders are covered by the compressed-tensors test above."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from llmq.export import dequantize_exported_tensors, make_spec

    cfg = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, vocab_size=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    sd = Qwen3ForCausalLM(cfg).to(torch.bfloat16).state_dict()
    def recipe(fqn):
        return None if fqn.endswith(UNQUANTIZED) else config
    hf_config = {**cfg.to_dict(), "architectures": ["Qwen3ForCausalLM"]}
    write_hf_quantized_checkpoint(str(tmp_path / "m"), iter(sd.items()), recipe, style="compressed-tensors", config=hf_config)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), quantization_config=CompressedTensorsConfig(run_compressed=False), dtype=torch.bfloat16)
    loaded = model.state_dict()
    files = _read_folder(tmp_path / "m")
    sources = _source_weights(sd)
    for module, w in sources.items():
        if recipe(module) is None:
            assert torch.equal(loaded[f"{module}.weight"], w)
            continue
        if config.format == "nvfp4":  # its formula divides by 1/g (see the test above)
            ours = dequantize_exported_tensors(files, make_spec(module, config, style="compressed-tensors"))
        else:
            ours = _canonical(module, w, sources, config)
        assert torch.equal(loaded[f"{module}.weight"], ours.to(torch.bfloat16)), module


def test_modelopt_folder_matches_documented_formulas(tiny_moe, tmp_path):
    cfg, sd = tiny_moe
    act_amax = {f"model.layers.0.self_attn.{p}": 3.5 for p in ("q_proj", "k_proj", "v_proj")}

    def recipe(fqn):
        return None if fqn.endswith(UNQUANTIZED) else NVFP4

    out = tmp_path / "mo"
    write_hf_quantized_checkpoint(str(out), iter(sd.items()), recipe, style="modelopt", config=cfg.to_dict(), input_amax=act_amax, kv_cache_quant_algo="FP8")
    hf = json.loads((out / "hf_quant_config.json").read_text())
    q = hf["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION" and q["kv_cache_quant_algo"] == "FP8"
    assert q["exclude_modules"] == ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"]
    assert q["quantized_layers"]["model.layers.0.self_attn.q_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert q["quantized_layers"]["model.layers.0.mlp.experts.3.down_proj"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MIXED_PRECISION"
    assert qc["quantized_layers"] == q["quantized_layers"]

    tensors = _read_folder(out)
    sources = _source_weights(sd)
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    for module, w in sources.items():
        if recipe(module) is None:
            assert tensors[f"{module}.weight"].dtype == torch.bfloat16
            continue
        n, k = w.shape
        packed, s, s2 = tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"], tensors[f"{module}.weight_scale_2"]
        assert (packed.dtype, tuple(packed.shape)) == (torch.uint8, (n, k // 2))
        assert (s.dtype, tuple(s.shape)) == (torch.float8_e4m3fn, (n, k // 16))
        assert (s2.dtype, tuple(s2.shape)) == (torch.float32, ())
        # ModelOpt / vLLM: low nibble first, value * (float(weight_scale) * weight_scale_2).
        codes = torch.stack([packed & 15, packed >> 4], -1).reshape(n, k).long()
        deq = (e2m1[codes].reshape(n, k // 16, 16) * (s.float() * s2).unsqueeze(-1)).reshape(n, k)
        assert torch.equal(deq, _canonical(module, w, sources, NVFP4)), module
        # The shared global scale is max(sibling amax) / (6 * 448).
        parent, _, leaf = module.rpartition(".")
        sib = (("q_proj", "k_proj", "v_proj") if leaf in ("q_proj", "k_proj", "v_proj")
               else ("gate_proj", "up_proj") if leaf in ("gate_proj", "up_proj") else (leaf,))
        amax = max(sources[f"{parent}.{x}"].float().abs().max() for x in sib)
        assert s2.item() == (amax / 2688.0).item(), module
        if module in act_amax:
            assert tensors[f"{module}.input_scale"].item() == torch.tensor(3.5 / 2688.0, dtype=torch.float32).item()
        else:
            assert f"{module}.input_scale" not in tensors


def test_single_format_modelopt_config_and_exclusions(tiny_moe, tmp_path):
    cfg, sd = tiny_moe
    def recipe(fqn):
        return None if fqn.endswith(UNQUANTIZED) else FP8_CHANNEL
    write_hf_quantized_checkpoint(str(tmp_path / "fp8"), iter(sd.items()), recipe, style="modelopt", config=cfg.to_dict())
    q = json.loads((tmp_path / "fp8" / "hf_quant_config.json").read_text())["quantization"]
    assert q == {
        "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"],
    }
    tensors = _read_folder(tmp_path / "fp8")
    w = tensors["model.layers.1.mlp.down_proj.weight"]
    assert w.dtype == torch.float8_e4m3fn and tensors["model.layers.1.mlp.down_proj.weight_scale"].shape == (128,)


def test_embeddings_head_and_router_stay_unquantized_unless_asked(tiny_moe, tmp_path):
    cfg, sd = tiny_moe
    def everything(fqn):
        return MXFP8
    s = write_hf_quantized_checkpoint(str(tmp_path / "a"), iter(sd.items()), everything, style="compressed-tensors")
    assert s.excluded_modules == ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"]
    s = write_hf_quantized_checkpoint(str(tmp_path / "b"), iter(sd.items()), everything, style="compressed-tensors", keep_unquantized=[r".*embed_tokens"])
    assert s.excluded_modules == ["model.embed_tokens"]
    tensors = _read_folder(tmp_path / "b")
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float8_e4m3fn
    assert tensors["lm_head.weight_scale"].dtype == torch.uint8


def test_streaming_is_atomic_sharded_and_deterministic(tiny_moe, tmp_path):
    cfg, sd = tiny_moe
    out = tmp_path / "a"

    def failing():
        for i, item in enumerate(sd.items()):
            if i == 10:
                raise RuntimeError("reader died")
            yield item

    with pytest.raises(RuntimeError, match="reader died"):
        write_hf_quantized_checkpoint(str(out), failing(), mixed_recipe, style="compressed-tensors", max_shard_bytes=20000)
    assert os.listdir(tmp_path) == []  # no folder, no temporary left behind

    s1 = write_hf_quantized_checkpoint(str(out), iter(sd.items()), mixed_recipe, style="compressed-tensors", max_shard_bytes=100_000)
    assert len(s1.shards) > 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for name, shard in index["weight_map"].items():
        with safe_open(str(out / shard), "pt") as f:
            assert name in f.keys()
    assert index["metadata"]["total_size"] == s1.output_bytes
    with pytest.raises(CheckpointError, match="output already exists"):
        write_hf_quantized_checkpoint(str(out), iter(sd.items()), mixed_recipe, style="compressed-tensors")
    s2 = write_hf_quantized_checkpoint(str(tmp_path / "b"), iter(sd.items()), mixed_recipe, style="compressed-tensors", max_shard_bytes=100_000)
    for shard in s1.shards:
        assert (out / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()
    assert s2.shards == s1.shards


def test_interrupted_export_resumes_to_identical_bytes(tiny_moe, tmp_path):
    cfg, sd = tiny_moe
    whole = write_hf_quantized_checkpoint(str(tmp_path / "whole"), iter(sd.items()), mixed_recipe, style="compressed-tensors", max_shard_bytes=60_000)

    def dies_after(n):
        for i, item in enumerate(sd.items()):
            if i == n:
                raise KeyboardInterrupt
            yield item

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        write_hf_quantized_checkpoint(str(out), dies_after(14), mixed_recipe, style="compressed-tensors", max_shard_bytes=60_000, resume=True)
    partial = tmp_path / "resumed.partial"
    assert not out.exists() and (partial / "journal.json").exists()
    with pytest.raises(ResumeMismatchError, match="another style or shard size"):
        write_hf_quantized_checkpoint(str(out), iter(sd.items()), mixed_recipe, style="compressed-tensors", max_shard_bytes=70_000, resume=True)
    again = write_hf_quantized_checkpoint(str(out), iter(sd.items()), mixed_recipe, style="compressed-tensors", max_shard_bytes=60_000, resume=True)
    assert again.resumed_tensors > 0 and not partial.exists() and sorted(os.listdir(tmp_path)) == ["resumed", "whole"]
    assert again.shards == whole.shards
    for f in whole.shards + ["model.safetensors.index.json", "config.json"]:
        assert (out / f).read_bytes() == (tmp_path / "whole" / f).read_bytes(), f


def test_fused_experts_are_never_silently_left_unquantized(tiny_moe, tmp_path):
    cfg, sd = tiny_moe
    def recipe(fqn):
        return None if (fqn.endswith(UNQUANTIZED) or ".experts." in fqn) else NVFP4
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj: the recipe gives no quantization"):
        write_hf_quantized_checkpoint(str(tmp_path / "x"), iter(sd.items()), recipe)
    assert not (tmp_path / "x").exists()


def test_bad_configs_name_the_tensor(tiny_moe, tmp_path):
    cfg, sd = tiny_moe
    bad = dict(sd)
    bad["model.layers.1.mlp.down_proj.weight"] = torch.randn(128, 250).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight: NVFP4 needs the input dimension K=250 to be a multiple of 16"):
        write_hf_quantized_checkpoint(str(tmp_path / "x"), iter(bad.items()), lambda f: None if f.endswith(UNQUANTIZED) else NVFP4)
    # k_proj is [64, 128]: 128x128 blocks need both dimensions to be multiples of 128.
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight: FP8 block128 needs.*got shape \[64, 128\]"):
        write_hf_quantized_checkpoint(str(tmp_path / "x"), iter(bad.items()), lambda f: None if f.endswith(UNQUANTIZED) else FP8_BLOCK)
    with pytest.raises(ValueError, match=r"ModelOpt's per-tensor FP8 .* needs a static input scale"):
        write_hf_quantized_checkpoint(str(tmp_path / "x"), iter(sd.items()),
                                      lambda f: None if f.endswith(UNQUANTIZED) else {"format": "fp8", "granularity": "tensor"})
    assert os.listdir(tmp_path) == []


def test_a_full_disk_is_one_line_naming_the_file_and_the_export_resumes(tiny_moe, tmp_path, monkeypatch):
    import errno
    import stat

    from llmq.checkpoint import OutputWriteError

    cfg, sd = tiny_moe
    whole = write_hf_quantized_checkpoint(str(tmp_path / "whole"), iter(sd.items()), mixed_recipe,
                                          style="compressed-tensors", max_shard_bytes=60_000)
    assert stat.S_IMODE(os.stat(tmp_path / "whole" / whole.shards[0]).st_mode) == 0o666 & ~_umask()
    real_write = os.write

    def enospc(fd, data):  # the journal, written before anything else
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", enospc)
    out = tmp_path / "out"
    with pytest.raises(OutputWriteError) as info:
        write_hf_quantized_checkpoint(str(out), iter(sd.items()), mixed_recipe, style="compressed-tensors",
                                      max_shard_bytes=60_000, resume=True)
    assert str(info.value) == f"{tmp_path / 'out.partial' / 'journal.json'}: No space left on device"
    assert not out.exists()
    monkeypatch.setattr(os, "write", real_write)
    write_hf_quantized_checkpoint(str(out), iter(sd.items()), mixed_recipe, style="compressed-tensors",
                                  max_shard_bytes=60_000, resume=True)
    for f in whole.shards + ["model.safetensors.index.json", "config.json"]:
        assert (out / f).read_bytes() == (tmp_path / "whole" / f).read_bytes(), f


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask
