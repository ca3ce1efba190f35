"""verify_export / read_export / consumer_warnings: folders read back as their consumer reads them
(config-driven), compared with what llmq quantized, with compressed-tensors' own decompressor as
the independent reference, and a corrupted scale named."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmq.export import (
    ExportState,
    consumer_warnings,
    make_spec,
    read_export,
    verify_export,
    write_hf_quantized_checkpoint,
)
from llmq.quant.presets import FP8_PER_CHANNEL as FP8_CHANNEL, INT4, MXFP4, MXFP8, NVFP4
from llmq.quant.recipe import QuantConfig

FP8_BLOCK = QuantConfig(format="fp8", granularity="block128")
INT8_ASYM = QuantConfig(format="int", bits=8, group_size=64, symmetric=False)
KEEP = ("lm_head", "embed_tokens", "mlp.gate")
SIBLINGS = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]


def _checkpoint(moe=True):
    """A Qwen3-MoE-shaped state dict (layer 0 MoE with 4 fused experts, layer 1 dense)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (256, 128), "lm_head.weight": (256, 128)}
    for layer in (0, 1):
        p = f"model.layers.{layer}"
        shapes.update({f"{p}.self_attn.q_proj.weight": (128, 128), f"{p}.self_attn.k_proj.weight": (64, 128),
                       f"{p}.self_attn.v_proj.weight": (64, 128), f"{p}.self_attn.o_proj.weight": (128, 128),
                       f"{p}.input_layernorm.weight": (128,)})
    if moe:
        shapes.update({"model.layers.0.mlp.gate.weight": (4, 128), "model.layers.0.mlp.experts.gate_up_proj": (4, 128, 128),
                       "model.layers.0.mlp.experts.down_proj": (4, 128, 64)})
    else:
        shapes.update({"model.layers.0.mlp.gate_proj.weight": (256, 128), "model.layers.0.mlp.up_proj.weight": (256, 128),
                       "model.layers.0.mlp.down_proj.weight": (128, 256)})
    shapes.update({"model.layers.1.mlp.gate_proj.weight": (256, 128), "model.layers.1.mlp.up_proj.weight": (256, 128),
                   "model.layers.1.mlp.down_proj.weight": (128, 256)})
    return {n: (torch.randn(s, generator=g) * (0.5 + torch.rand(s[:-1] + (1,), generator=g))).to(torch.bfloat16) for n, s in shapes.items()}


def _modules(sd):
    """module -> 2-D float weight, fused experts split as the writer documents."""
    out = {}
    for name, t in sd.items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                out[f"{name[:-13]}.{e}.gate_proj"], out[f"{name[:-13]}.{e}.up_proj"] = t[e].chunk(2)
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[:-10]}.{e}.down_proj"] = t[e]
        elif t.dim() == 2:
            out[name[: -len(".weight")]] = t
    return out


def mixed(fqn):
    if fqn.endswith(KEEP):
        return None
    if ".self_attn." in fqn:
        return (FP8_BLOCK if fqn.endswith("o_proj") else NVFP4) if ".layers.0." in fqn else FP8_CHANNEL
    if ".experts." in fqn:
        return MXFP8 if fqn.endswith("down_proj") else (NVFP4 if ".experts.0." in fqn else MXFP4)
    return INT8_ASYM if fqn.endswith("down_proj") else INT4


def _quantized(sd, recipe, style):
    """module -> the llmq container the writer stores, computed here with ModelOpt's sibling rule
    (siblings with a tensor-level scale share max(amax)) -- what verify_export compares against."""
    mods = _modules(sd)
    out = {}
    for m, w in mods.items():
        config = recipe(m)
        if config is None:
            continue
        spec = make_spec(m, config, style=style)
        amax = None
        if spec.hook.needs_tensor_amax(spec):
            parent, _, leaf = m.rpartition(".")
            group = next((s for s in SIBLINGS if leaf in s), (leaf,))
            amax = max(mods[f"{parent}.{s}"].float().abs().max() for s in group if recipe(f"{parent}.{s}") == config)
        out[m] = spec.hook.quantize(w, spec, ExportState(weight_amax=amax))
    return out


def _write(tmp_path, name, recipe, style, moe=True):
    sd = _checkpoint(moe)
    folder = str(tmp_path / name)
    write_hf_quantized_checkpoint(folder, iter(sd.items()), recipe, style=style, config={"architectures": ["Qwen3MoeForCausalLM"]},
                                  max_shard_bytes=150_000)
    return folder, sd


def _corrupt(folder, name, change):
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    shard = os.path.join(folder, index["weight_map"][name])
    tensors = load_file(shard)
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, shard, metadata={"format": "pt"})


@pytest.mark.parametrize("style", ["compressed-tensors", "modelopt"])
def test_a_written_folder_reads_back_exactly_as_quantized(style, tmp_path):
    recipe = mixed if style == "compressed-tensors" else (lambda m: None if mixed(m) is None or mixed(m).format == "int" else mixed(m))
    folder, sd = _write(tmp_path, "f", recipe, style)
    quantized = _quantized(sd, recipe, style)
    report = verify_export(folder, quantized)
    assert report.ok, report.problems
    assert report.style == style and set(report.modules) == set(quantized)
    assert {report.modules[m] for m in quantized} == {mixed(m).format for m in quantized}
    for m, err in report.max_error.items():
        if style == "compressed-tensors" and report.modules[m] == "nvfp4":  # divides by the stored 1/g
            assert err <= 2.0 ** -20, m
        else:
            assert err == 0.0, m
    # Against the float weights: every module within its format's error bound.
    assert verify_export(folder, _modules(sd)).ok
    from llmq.export import iter_module_weights

    split = dict(iter_module_weights(sd.items()))
    assert split.keys() == _modules(sd).keys() and all(torch.equal(split[m], w) for m, w in _modules(sd).items())
    # read_export: the decoded weights, and everything else as stored.
    got = dict(read_export(folder))
    from llmq.quant.formats import format_of

    for m, q in quantized.items():
        expect = format_of(q).dequantize(q, torch.float32)
        assert torch.allclose(got[f"{m}.weight"], expect, rtol=2.0 ** -20, atol=0), m
    assert torch.equal(got["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    assert not any(n.endswith(("weight_scale", "weight_packed", "weight_scale_2")) for n in got)


def test_a_corrupted_scale_is_named(tmp_path):
    folder, sd = _write(tmp_path, "ct", mixed, "compressed-tensors")
    quantized = _quantized(sd, mixed, "compressed-tensors")
    target = "model.layers.1.mlp.down_proj.weight_scale"  # int8 asymmetric, float32 scales
    _corrupt(folder, target, lambda t: t.index_put_((torch.tensor([3]), torch.tensor([1])), t[3, 1] * 2))
    report = verify_export(folder, quantized)
    assert [p for p in report.problems if p.startswith(target + ":")], report.problems
    assert all("model.layers.1.mlp.down_proj" in p for p in report.problems), report.problems
    # Without the containers, against the float weights: the module and its scale are named.
    _corrupt(folder, target, lambda t: t * 8)
    report = verify_export(folder, _modules(sd))
    assert len(report.problems) == 1 and target in report.problems[0] and "relative RMS error" in report.problems[0]
    # Without any reference: a non-finite scale is still found.
    e4m3 = "model.layers.0.self_attn.q_proj.weight_scale"
    _corrupt(folder, e4m3, lambda t: t.view(torch.uint8).index_fill_(0, torch.tensor([5]), 0x7F).view(torch.float8_e4m3fn))
    problems = verify_export(folder).problems
    assert f"{e4m3}: holds non-finite values" in problems, problems


def test_layout_errors_are_one_line_naming_the_tensor(tmp_path):
    folder, sd = _write(tmp_path, "mo", lambda m: None if m.endswith(KEEP) else FP8_CHANNEL, "modelopt")
    name = "model.layers.1.mlp.up_proj.weight_scale"
    _corrupt(folder, name, lambda t: t.to(torch.bfloat16))
    _corrupt(folder, "model.layers.1.mlp.gate_proj.weight_scale", lambda t: t[:-1])
    problems = verify_export(folder).problems
    assert problems == [
        "model.layers.1.mlp.gate_proj.weight_scale: shape [255], expected [256] for a [256, 128] weight",
        f"{name}: dtype BF16, the modelopt reader expects torch.float32",
    ] or (len(problems) == 2 and name in problems[1]), problems
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg["quantization_config"]["quant_algo"] = "FP8_PB_WO"
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    assert any(p.startswith("hf_quant_config.json: quant_algo") for p in verify_export(folder).problems)


def test_compressed_tensors_decompressor_agrees_with_the_read_back(tmp_path):
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    folder, sd = _write(tmp_path, "ct", mixed, "compressed-tensors")
    qc = QuantizationConfig.model_validate(json.load(open(os.path.join(folder, "config.json")))["quantization_config"])
    tensors = {}
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, f)))
    theirs = {}
    for m in _quantized(sd, mixed, "compressed-tensors"):
        scheme = next(g for g in qc.config_groups.values() if any(match_name(m, t) for t in g.targets))
        local = {n[len(m) + 1:]: t for n, t in tensors.items() if n.rsplit(".", 1)[0] == m}
        theirs[m] = BaseCompressor.get_value_from_registry(scheme.format).decompress(local, scheme)["weight"]
    report = verify_export(folder, theirs)
    assert report.ok, report.problems
    for m, err in report.max_error.items():
        if theirs[m].dtype == torch.float32:
            assert err == 0.0, m
        else:  # compressed-tensors 0.20 decodes NVFP4 and MX to bfloat16: one bf16 rounding of our value
            assert theirs[m].dtype == torch.bfloat16 and report.modules[m] in ("nvfp4", "mxfp4", "mxfp8"), m
            assert err <= 2.0 ** -8 * float(theirs[m].float().abs().max()), m


def test_known_consumer_misreads_are_one_line_each(tmp_path):
    fp8 = lambda m: None if m.endswith(KEEP) else FP8_CHANNEL  # noqa: E731
    nv = lambda m: None if m.endswith(KEEP) else NVFP4  # noqa: E731
    mo_fp8, _ = _write(tmp_path, "mo_fp8", fp8, "modelopt")
    (warning,) = consumer_warnings(mo_fp8)
    assert "transformers" in warning and "raw FP8 codes" in warning and "vLLM" in warning
    assert verify_export(mo_fp8).warnings == [warning]
    mo_mx, _ = _write(tmp_path, "mo_mx", lambda m: None if m.endswith(KEEP) else (MXFP8 if "down" in m else MXFP4), "modelopt")
    assert len(consumer_warnings(mo_mx)) == 1 and "raw MXFP8 codes" in consumer_warnings(mo_mx)[0]
    # compressed-tensors NVFP4 experts carry g = 1 (transformers decompresses experts without their
    # weight_global_scale): no misread to warn of; dense modules keep their amax global scale
    ct_nv_moe, _ = _write(tmp_path, "ct_nv_moe", nv, "compressed-tensors")
    assert consumer_warnings(ct_nv_moe) == []
    tensors = {}
    for f in os.listdir(ct_nv_moe):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(ct_nv_moe, f)))
    globals_ = {n: t for n, t in tensors.items() if n.endswith(".weight_global_scale")}
    experts = [n for n in globals_ if ".experts." in n]
    assert experts and all(torch.equal(globals_[n], torch.ones_like(globals_[n])) for n in experts)
    assert any(not torch.equal(t, torch.ones_like(t)) for n, t in globals_.items() if ".experts." not in n)
    assert consumer_warnings(_write(tmp_path, "ct_nv_dense", nv, "compressed-tensors", moe=False)[0]) == []
    assert consumer_warnings(_write(tmp_path, "ct_fp8", fp8, "compressed-tensors", moe=False)[0]) == []


@pytest.mark.parametrize("style", ["compressed-tensors", "modelopt"])
def test_every_config_entry_parses_back_to_its_spec(style):
    """Each exportable format's hook inverts its own config entry (what read-back relies on)."""
    from llmq.export import WeightExportSpec
    from llmq.export.spec import export_format_names, export_hook, export_hooks

    cases = [("nvfp4", {}), ("nvfp4", {"static_input_scale": True}), ("mxfp4", {}), ("mxfp8", {}),
             ("fp8", {"granularity": "tensor", "static_input_scale": True}), ("fp8", {"granularity": "channel"}),
             ("fp8", {"granularity": "block128"}), ("int", {"bits": 4, "group_size": 32}),
             ("int", {"bits": 8, "group_size": None, "symmetric": False})]
    assert {f for f, _ in cases} == set(export_format_names())
    if style == "compressed-tensors":
        cases.append(("fp8", {"granularity": "tensor"}))
    for fmt, kw in cases:
        if style == "modelopt" and "modelopt" not in export_hook(fmt).styles:
            continue
        spec = WeightExportSpec("m.x", fmt, style=style, **kw)
        if style == "compressed-tensors":
            parsed = [f for h in export_hooks() if (f := h.from_compressed_tensors(spec.compressed_tensors_scheme()))]
        else:
            parsed = [f for h in export_hooks() if (f := h.from_modelopt(spec.modelopt_layer_config()))]
        assert len(parsed) == 1, (fmt, kw, parsed)
        assert WeightExportSpec("m.x", style=style, **parsed[0]) == spec, (fmt, kw)
