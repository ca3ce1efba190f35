"""Unit tests for the per-weight export API: specs, states, tensors and configs."""

import pytest
import torch

from llmq.export import (
    ExportState,
    WeightExportSpec,
    build_compressed_tensors_config,
    build_hf_quantization_config,
    build_modelopt_hf_quant_config,
    compute_export_state,
    dequantize_exported_tensors,
    export_quantized_weight_tensors,
    make_spec,
    merge_export_states,
    select_export_state,
)
from llmq.quant import get_format
from llmq.quant.formats.mx import quantize_mx

CASES = [
    ("nvfp4", None, False),
    ("nvfp4", None, True),
    ("mxfp4", None, False),
    ("mxfp8", None, False),
    ("fp8", "tensor", True),
    ("fp8", "channel", False),
    ("fp8", "block128", False),
]


def _w(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * (0.1 + torch.rand(shape[:-1] + (1,), generator=g))).to(torch.bfloat16)


@pytest.mark.parametrize("style", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("fmt, gran, static", CASES)
def test_tensors_have_the_spec_names_dtypes_shapes_and_values(style, fmt, gran, static):
    spec = WeightExportSpec("m.lin", fmt, style=style, granularity=gran, static_input_scale=static)
    w = _w((256, 128))
    state = compute_export_state(w, spec, input_amax=2.0 if static else None)
    out = export_quantized_weight_tensors(w, spec, state)
    names, dtypes, shapes = spec.tensor_names(), spec.tensor_dtypes(), spec.tensor_shapes(256, 128)
    assert set(out) == set(names.values())
    for role, name in names.items():
        assert out[name].dtype == dtypes[role], (role, out[name].dtype)
        assert tuple(out[name].shape) == shapes[role], (role, tuple(out[name].shape))
    ref = get_format(fmt).dequantize(get_format(fmt).quantize(w, make_spec("m.lin", {"format": fmt, "granularity": gran}, style="compressed-tensors")))
    got = dequantize_exported_tensors(out, spec)
    if fmt == "nvfp4" and style == "compressed-tensors":
        assert bool(((got - ref).abs() <= ref.abs() * 2.0**-23).all())  # 1/g is stored: one rounding apart
    else:
        assert torch.equal(got, ref)
    if static:
        amax_scale = 2.0 / (448.0 if fmt == "fp8" else 2688.0)
        value = out[names["input_scale"]].item()
        expect = torch.tensor(amax_scale, dtype=torch.float32)
        assert value == (1.0 / expect).item() if (fmt == "nvfp4" and style == "compressed-tensors") else value == expect.item()


def test_expected_names_per_style():
    mo = WeightExportSpec("a.q", "nvfp4", style="modelopt", static_input_scale=True).tensor_names()
    assert mo == {"weight": "a.q.weight", "scale": "a.q.weight_scale", "global_scale": "a.q.weight_scale_2", "input_scale": "a.q.input_scale"}
    ct = WeightExportSpec("a.q", "nvfp4", style="compressed-tensors", static_input_scale=True).tensor_names()
    assert ct == {"weight": "a.q.weight_packed", "scale": "a.q.weight_scale",
                  "global_scale": "a.q.weight_global_scale", "input_scale": "a.q.input_global_scale"}
    i = WeightExportSpec("a.q", "int", style="compressed-tensors", bits=4, group_size=32, symmetric=False).tensor_names()
    assert i == {"weight": "a.q.weight_packed", "scale": "a.q.weight_scale", "zero_point": "a.q.weight_zero_point", "shape": "a.q.weight_shape"}


def test_states_merge_for_siblings_and_select_for_experts():
    spec = WeightExportSpec("l.q_proj", "nvfp4")
    q, k = _w((64, 32), 1), _w((32, 32), 2) * 5
    sq, sk = compute_export_state(q, spec), compute_export_state(k, spec)
    merged = merge_export_states([sq, sk])
    assert merged.weight_amax.item() == max(q.float().abs().max(), k.float().abs().max()).item()
    a = export_quantized_weight_tensors(q, spec, merged)
    b = export_quantized_weight_tensors(k, WeightExportSpec("l.k_proj", "nvfp4"), merged)
    assert a["l.q_proj.weight_scale_2"].item() == b["l.k_proj.weight_scale_2"].item() == (merged.weight_amax / 2688).item()
    stacked = _w((3, 16, 32), 3)
    st = compute_export_state(stacked, spec)
    assert st.weight_amax.shape == (3,)
    one = select_export_state(st, 2)
    assert one.weight_amax.item() == stacked[2].float().abs().max().item()
    full = export_quantized_weight_tensors(stacked, spec, st)
    single = export_quantized_weight_tensors(stacked[2], spec, one)
    for name in single:
        assert torch.equal(full[name][2].float(), single[name].float()), name
    with pytest.raises(ValueError, match="only some siblings"):
        merge_export_states([sq, ExportState()])
    with pytest.raises(IndexError):
        select_export_state(st, 3)


def test_int_pack_quantized_matches_compressed_tensors_unpacker():
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from llmq.quant.quantize import quantize_weight
    from llmq.quant.recipe import QuantConfig

    for bits, sym, n, k, gs in [(4, True, 24, 64, 32), (8, False, 40, 128, 64), (4, False, 16, 96, 32), (2, True, 16, 64, 16)]:
        w = _w((n, k), bits)
        q = quantize_weight(w, QuantConfig(format="int", bits=bits, group_size=gs, symmetric=sym))
        spec = WeightExportSpec("m.x", "int", style="compressed-tensors", bits=bits, group_size=gs, symmetric=sym)
        out = export_quantized_weight_tensors(q, spec)
        signed = unpack_from_int32(out["m.x.weight_packed"], bits, torch.Size([n, k]))
        from llmq.quant.formats import dequantize_canonical, unpack_bits

        assert torch.equal(signed.to(torch.int16) + (1 << (bits - 1)), unpack_bits(q.qdata, bits, k).to(torch.int16))
        if not sym:
            zp = unpack_from_int32(out["m.x.weight_zero_point"], bits, torch.Size([n, k // gs]), packed_dim=0)
            assert torch.equal(-(zp.double() + (1 << (bits - 1))) * q.scale.double(), q.bias.double())
        assert torch.equal(dequantize_exported_tensors(out, spec), dequantize_canonical(q))


def test_int_bias_without_integer_zero_is_rejected():
    from llmq.quant.formats import GroupQuantizedWeight, pack_bits

    q = torch.randint(0, 16, (4, 32), dtype=torch.uint8)
    scale = torch.full((4, 1), 0.5)
    gq = GroupQuantizedWeight(pack_bits(q, 4), scale, torch.full((4, 1), -0.3), 4, 32, (4, 32))
    with pytest.raises(ValueError, match="m.hqq.weight: bias/scale is not an integer zero point"):
        export_quantized_weight_tensors(gq, WeightExportSpec("m.hqq", "int", style="compressed-tensors", bits=4, group_size=32, symmetric=False))
    with pytest.raises(ValueError, match="not symmetric"):
        export_quantized_weight_tensors(gq, WeightExportSpec("m.hqq", "int", style="compressed-tensors", bits=4, group_size=32))


def test_spec_errors():
    with pytest.raises(ValueError, match="compressed-tensors style"):
        WeightExportSpec("m", "int", style="modelopt")
    with pytest.raises(ValueError, match="nvfp4 uses blocks of 16"):
        WeightExportSpec("m", "nvfp4", group_size=32)
    with pytest.raises(ValueError, match="style 'vllm' unknown"):
        WeightExportSpec("m", "nvfp4", style="vllm")
    with pytest.raises(ValueError, match="needs an activation amax"):
        compute_export_state(torch.ones(4, 16), WeightExportSpec("m", "nvfp4", static_input_scale=True))
    with pytest.raises(ValueError, match="spec says nvfp4, got a MXWeight"):
        export_quantized_weight_tensors(quantize_mx(torch.ones(2, 32), "mxfp4"), WeightExportSpec("m", "nvfp4"))


def test_modelopt_configs_single_and_mixed():
    specs = {f"l.{i}.q": WeightExportSpec(f"l.{i}.q", "nvfp4") for i in range(2)}
    hf = build_modelopt_hf_quant_config(specs, exclude_modules=["lm_head"])
    assert hf["quantization"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    assert hf["producer"]["name"] == "llmq"
    specs["l.1.o"] = WeightExportSpec("l.1.o", "fp8", granularity="block128")
    hf = build_modelopt_hf_quant_config(specs, exclude_modules=["lm_head"])
    assert hf["quantization"]["quant_algo"] == "MIXED_PRECISION"
    assert hf["quantization"]["quantized_layers"]["l.1.o"] == {"quant_algo": "FP8_PB_WO", "group_size": 128}
    cj = build_hf_quantization_config(specs, exclude_modules=["lm_head"])
    assert cj["quant_method"] == "modelopt" and cj["ignore"] == ["lm_head"] and len(cj["config_groups"]) == 2


def test_compressed_tensors_config_parses_and_targets_generalise():
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    specs = {}
    for layer in range(3):
        for e in range(4):
            m = f"model.layers.{layer}.mlp.experts.{e}.down_proj"
            specs[m] = WeightExportSpec(m, "mxfp4", style="compressed-tensors")
        m = f"model.layers.{layer}.self_attn.o_proj"
        specs[m] = WeightExportSpec(m, "fp8" if layer == 0 else "nvfp4", style="compressed-tensors", granularity="channel" if layer == 0 else None)
    cfg = build_compressed_tensors_config(specs, exclude_modules=["lm_head", "model.layers.0.mlp.gate"])
    qc = QuantizationConfig.model_validate(cfg)
    assert qc.format == "mixed-precision"
    for m, spec in specs.items():
        hits = [g for g in qc.config_groups.values() if any(match_name(m, t) for t in g.targets)]
        assert len(hits) == 1 and hits[0].format == spec.compressed_tensors_scheme()["format"], m
    assert not any(match_name("lm_head", t) for g in qc.config_groups.values() for t in g.targets)
    mx = [g for g in cfg["config_groups"].values() if g["format"] == "mxfp4-pack-quantized"][0]
    assert mx["targets"] == [r"re:^model\.layers\.\d+\.mlp\.experts\.\d+\.down_proj$"]
