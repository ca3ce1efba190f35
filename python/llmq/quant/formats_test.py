"""The format registry: lookups, registration rules, config validation through it, import-only families."""

import dataclasses

import pytest
import torch

from llmq.quant import QuantConfig, QuantRecipe, dequantize, quantize_weight
from llmq.quant.formats import Format, format_names, format_of, get_format, register_format
from llmq.quant.formats.gguf_blocks import BLOCK_TYPES


def test_names_and_families():
    names = format_names()
    assert names and set(format_names(quantizable=True)) | set(format_names(quantizable=False)) == set(names)
    for name in names:
        fmt = get_format(name)
        assert name in fmt.names and fmt.can_quantize == (name in format_names(quantizable=True))
    assert set(format_names(quantizable=False)) >= set(BLOCK_TYPES)
    assert get_format("mxfp4") is get_format("mxfp8")
    assert get_format("Q4_K").family == "gguf"
    with pytest.raises(ValueError, match=r"format 'int3' unknown; expected one of \('int', 'fp8'"):
        get_format("int3")


def test_config_validation_goes_through_the_format():
    with pytest.raises(ValueError, match="QuantConfig.format='fp6' unknown"):
        QuantConfig(format="fp6")
    with pytest.raises(ValueError, match="'Q4_K' is import-only"):
        QuantConfig(format="Q4_K", bits=4, group_size=32)
    with pytest.raises(ValueError, match="format 'nvfp4' uses group_size=16, got 32"):
        QuantConfig(format="nvfp4", bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"FP8 group_size=64 unsupported; use 0 \(per tensor\)"):
        QuantConfig.from_dict({"format": "fp8", "bits": 8, "group_size": 64})
    with pytest.raises(ValueError, match="QuantConfig.granularity='row' unsupported for fp8"):
        QuantConfig(format="fp8", granularity="row")
    with pytest.raises(ValueError, match="bits=9 unsupported for format 'int'"):
        QuantConfig(format="int", bits=9)


def test_duplicate_names_are_refused():
    class Other(Format):
        family, names, container = "other", ("nvfp4",), object

        def validate_config(self, config): pass
        def quantize(self, w, config, *, name="<tensor>"): pass
        def dequantize(self, value, dtype=torch.float32): pass
        def stored(self, value): return {}
        def rebuild(self, name, params, shape, dtype, stored): pass
        def layout(self, name, params, shape): return {}

    with pytest.raises(ValueError, match="'nvfp4' is already registered by family 'nvfp4'"):
        register_format(Other())
    assert get_format("nvfp4").family == "nvfp4"


def test_quantize_and_dequantize_dispatch_by_container():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    for name in format_names(quantizable=True):
        if get_format(name).family == "gguf-quant":
            continue  # canonical "int" values, no container of their own (gguf_quant_test.py)
        q = quantize_weight(w, QuantConfig(format=name))
        fmt = format_of(q)
        assert fmt is get_format(name) and fmt.name_of(q) == name
        assert torch.equal(dequantize(q), fmt.dequantize(q, torch.float32))
    with pytest.raises(ValueError, match="expects a quantized weight"):
        dequantize(w)


def test_recipe_check_formats_names_rule_and_format():
    recipe = QuantRecipe([{"pattern": ".*norm", "config": None},
                          {"pattern": ".*proj", "config": {"format": "fp8", "bits": 8, "group_size": 0}}])
    assert recipe.formats() == ("fp8",)
    recipe.check_formats(("int", "fp8"), "the bundle")
    with pytest.raises(ValueError, match=r"^recipe rule '\.\*proj': format 'fp8' cannot be written by w; it takes int$"):
        recipe.check_formats(("int",), "w")


def test_gguf_layout_is_the_raw_block_bytes():
    fmt = get_format("Q6_K")
    assert fmt.layout("Q6_K", {}, (4, 512)) == {"blocks": (torch.uint8, (4 * 2 * 210,))}
    with pytest.raises(ValueError, match="multiple of 256"):
        fmt.layout("Q6_K", {}, (4, 100))


def test_a_config_is_complete_from_its_format_alone():
    """{"format": name} takes every field from the format's defaults, for every quantizable format,
    and round-trips through to_dict / from_dict with only the fields the format uses."""
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    for name in format_names(quantizable=True):
        fmt = get_format(name)
        recipe = QuantRecipe.from_dict({"rules": [{"pattern": ".*", "config": {"format": name}}]})
        config = recipe.get_config("m")
        assert config == QuantConfig(format=name)
        for field, value in fmt.default_config(name).items():
            assert getattr(config, field) == value, (name, field)
        d = config.to_dict()
        assert set(d) == {"format", "method", *fmt.config_fields}
        assert QuantConfig.from_dict(d) == config
        if fmt.family != "gguf-quant":  # canonical "int" values, K-quants need K % 256 (gguf_quant_test.py)
            assert format_of(quantize_weight(w, config)) is fmt
        assert config.describe()


def test_a_field_the_format_does_not_use_is_refused_by_name():
    for name in format_names(quantizable=True):
        unused = [f for f in ("bits", "group_size", "symmetric", "scale_dtype", "granularity")
                  if f not in get_format(name).config_fields]
        some = {"bits": 8, "group_size": 32, "symmetric": True, "scale_dtype": "float32", "granularity": "tensor"}
        for field in unused:
            with pytest.raises(ValueError, match=rf"QuantConfig field\(s\) \['{field}'\] do not apply to format '{name}'"):
                QuantConfig(format=name, **{field: some[field]})
            assert getattr(QuantConfig(format=name), field) is None  # unused fields stay unset
            assert QuantConfig(format=name, **{field: None}) == QuantConfig(format=name)  # None: unset
        config = QuantConfig(format=name)
        assert dataclasses.replace(config, method=config.method) == config


def test_fp8_granularity_is_its_own_field_and_old_recipe_files_still_read():
    assert QuantConfig(format="fp8").granularity == "channel"
    assert QuantConfig(format="fp8").describe() == "fp8 per channel"
    # what recipe files and bundle manifests held before the field existed
    old = {"format": "fp8", "bits": 8, "group_size": 0, "symmetric": True, "method": "minmax", "scale_dtype": "float32"}
    assert QuantConfig.from_dict(old) == QuantConfig(format="fp8", granularity="tensor")
    assert QuantConfig.from_dict({**old, "group_size": 128}).granularity == "block128"
    assert QuantConfig.from_dict({**old, "group_size": None}).granularity == "channel"
    old_nvfp4 = {"format": "nvfp4", "bits": 4, "group_size": 16, "symmetric": True, "method": "minmax", "scale_dtype": "float32"}
    assert QuantConfig.from_dict(old_nvfp4) == QuantConfig(format="nvfp4")
    with pytest.raises(ValueError, match=r"\['symmetric'\] do not apply to format 'nvfp4'"):
        QuantConfig.from_dict({**old_nvfp4, "symmetric": False})
