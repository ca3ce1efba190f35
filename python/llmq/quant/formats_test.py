"""The format registry: lookups, registration rules, config validation through it, import-only families."""

import pytest
import torch

from llmq.quant import QuantConfig, QuantRecipe, dequantize, quantize_weight
from llmq.quant.formats import Format, format_names, format_of, get_format, register_format
from llmq.quant.formats.gguf_blocks import BLOCK_TYPES


def test_names_and_families():
    assert format_names(quantizable=True) == ("int", "fp8", "mxfp4", "mxfp8", "nvfp4")
    assert set(format_names(quantizable=False)) == set(BLOCK_TYPES)
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
    with pytest.raises(ValueError, match="unsupported for fp8"):
        QuantConfig(format="fp8", bits=8, group_size=64)
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
        fixed = {"int": (4, 32), "fp8": (8, None), "mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}[name]
        q = quantize_weight(w, QuantConfig(format=name, bits=fixed[0], group_size=fixed[1]))
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
