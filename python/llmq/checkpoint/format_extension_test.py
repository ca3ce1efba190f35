"""Adding a format is one Format subclass and one register_format line: proved with a new family
(FP8 e5m2, one float32 scale per row) that nothing else in llmq knows about, taken through recipe
validation, quantize_weight, dequantize and the bundle (docs/formats.md, "Adding a format")."""

import dataclasses

import pytest
import torch

from llmq.checkpoint import load_bundle, read_manifest, save_bundle
from llmq.quant import QuantConfig, QuantRecipe, dequantize, quantize_stream, quantize_weight
from llmq.quant.formats import Format, register_format

# ---- the whole addition: a container, a Format, one registration line -------------------------------


@dataclasses.dataclass(frozen=True)
class E5M2Weight:
    data: torch.Tensor  # float8_e5m2 [..., N, K]
    scale: torch.Tensor  # float32 [..., N, 1]
    dtype: torch.dtype = torch.bfloat16

    @property
    def shape(self):
        return tuple(self.data.shape)


class E5M2Format(Format):
    family, names, container = "e5m2", ("fp8_e5m2",), E5M2Weight
    config_fields = ("bits", "group_size")

    def default_config(self, name):
        return {"bits": 8, "group_size": None}

    def validate_config(self, config):
        if config.bits != 8 or config.group_size is not None:
            raise ValueError("format 'fp8_e5m2' is 8-bit with one scale per row (group_size None)")

    def quantize(self, w, config, *, name="<tensor>"):
        scale = w.float().abs().amax(dim=-1, keepdim=True) / 57344.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return E5M2Weight((w.float() / scale).to(torch.float8_e5m2), scale, w.dtype)

    def dequantize(self, value, dtype=torch.float32):
        return (value.data.float() * value.scale).to(dtype)

    def stored(self, value):
        return {"data": value.data, "scale": value.scale}

    def rebuild(self, name, params, shape, dtype, stored):
        return E5M2Weight(stored["data"], stored["scale"], dtype)

    def layout(self, name, params, shape):
        return {"data": (torch.float8_e5m2, tuple(shape)), "scale": (torch.float32, tuple(shape[:-1]) + (1,))}


register_format(E5M2Format())

# ------------------------------------------------------------------------------------------------------


def test_a_new_format_goes_from_recipe_to_bundle_and_back(tmp_path):
    recipe = QuantRecipe([{"pattern": ".*proj", "config": {"format": "fp8_e5m2", "bits": 8, "group_size": None}}])
    g = torch.Generator().manual_seed(0)
    items = [("a.proj.weight", torch.randn(16, 64, generator=g).to(torch.bfloat16)), ("a.norm.weight", torch.ones(64))]
    quantized = dict(quantize_stream(iter(items), recipe))
    assert isinstance(quantized["a.proj.weight"], E5M2Weight)
    out = save_bundle(iter(quantized.items()), tmp_path / "b", fsync=False)
    back = load_bundle(out)
    assert torch.equal(dequantize(back["a.proj.weight"]), dequantize(quantized["a.proj.weight"]))
    rec = read_manifest(out)["tensors"]["a.proj.weight"]
    assert rec["format"] == "fp8_e5m2" and set(rec["entries"]) == {"data", "scale"}
    err = (dequantize(back["a.proj.weight"], torch.float32) - items[0][1].float()).abs().max()
    assert err < 0.25 * items[0][1].float().abs().max()  # e5m2 keeps 2 mantissa bits
    with pytest.raises(ValueError, match="one scale per row"):
        QuantConfig(format="fp8_e5m2", bits=8, group_size=32)
    assert isinstance(quantize_weight(items[0][1], QuantConfig(format="fp8_e5m2", bits=8, group_size=None)), E5M2Weight)
