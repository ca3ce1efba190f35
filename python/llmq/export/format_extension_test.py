"""Adding a format with a Hugging Face export hook is one Format subclass (with its HFExport) and one
register_format line: a family nothing else in llmq knows (signed int8, one float32 scale per row,
written as compressed-tensors "int-quantized") goes through recipe validation, quantize_stream, the
bundle, the HF writer, compressed-tensors' own decompressor and verify_export, no other file edited
(docs/formats.md, "Adding a format")."""

import dataclasses
import json

import pytest
import torch

from llmq.checkpoint import load_bundle, save_bundle
from llmq.export import verify_export, write_hf_quantized_checkpoint
from llmq.quant import QuantConfig, QuantRecipe, dequantize, quantize_stream
from llmq.quant.formats import Format, register_format, unregister_format
from llmq.quant.formats.hf_export import HFExport, ct_weights

# ---- the whole addition: a container, a Format with its HF hook, one registration line ---------------


@dataclasses.dataclass(frozen=True)
class Int8RowWeight:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, 1]
    dtype: torch.dtype = torch.bfloat16

    @property
    def shape(self):
        return tuple(self.q.shape)


class Int8RowHFExport(HFExport):
    styles, bits = ("compressed-tensors",), 8

    def roles(self, spec):
        return {"weight": "weight", "scale": "weight_scale"}

    def dtypes(self, spec):
        return {"weight": torch.int8, "scale": torch.float32}

    def shapes(self, spec, n, k):
        return {"weight": (n, k), "scale": (n, 1)}

    def compressed_tensors_scheme(self, spec):
        w = ct_weights(spec, type="int", strategy="channel", group_size=None, block_structure=None)
        act = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
        return {"format": "int-quantized", "weights": w, "input_activations": act, "output_activations": None}

    def from_compressed_tensors(self, scheme):
        return {"format": "int8_row"} if scheme.get("format") == "int-quantized" else None

    def quantize(self, weight, spec, state):
        return Int8RowFormat().quantize(weight, None)

    def to_tensors(self, q, spec, state, dtype):
        return {"weight": q.q, "scale": q.scale}

    def dequantize(self, t, spec):
        return t["weight"].float() * t["scale"]


class Int8RowFormat(Format):
    family, names, container, hf_export = "int8_row", ("int8_row",), Int8RowWeight, Int8RowHFExport()
    config_fields = ("bits", "group_size")

    def default_config(self, name):
        return {"bits": 8, "group_size": None}

    def validate_config(self, config):
        if config.bits != 8 or config.group_size is not None:
            raise ValueError("format 'int8_row' is 8-bit with one scale per row (group_size None)")

    def quantize(self, w, config, *, name="<tensor>"):
        scale = w.float().abs().amax(dim=-1, keepdim=True) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return Int8RowWeight(torch.round(w.float() / scale).clamp(-127, 127).to(torch.int8), scale, w.dtype)

    def dequantize(self, value, dtype=torch.float32):
        return (value.q.float() * value.scale).to(dtype)

    def stored(self, value):
        return {"q": value.q, "scale": value.scale}

    def rebuild(self, name, params, shape, dtype, stored):
        return Int8RowWeight(stored["q"], stored["scale"], dtype)

    def layout(self, name, params, shape):
        return {"q": (torch.int8, tuple(shape)), "scale": (torch.float32, tuple(shape[:-1]) + (1,))}


@pytest.fixture()
def int8_row():
    fmt = register_format(Int8RowFormat())
    yield fmt
    unregister_format(fmt)


# ------------------------------------------------------------------------------------------------------


def test_a_new_format_goes_from_recipe_to_bundle_to_hf_folder(int8_row, tmp_path):
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = {"format": "int8_row", "bits": 8, "group_size": None}
    recipe = QuantRecipe([{"pattern": r".*proj", "config": config}])
    with pytest.raises(ValueError, match="one scale per row"):
        QuantConfig(format="int8_row", bits=8, group_size=32)
    g = torch.Generator().manual_seed(0)
    items = [("m.a_proj.weight", torch.randn(16, 64, generator=g).to(torch.bfloat16)),
             ("m.b_proj.weight", torch.randn(32, 64, generator=g).to(torch.bfloat16)), ("m.norm.weight", torch.ones(64))]
    quantized = dict(quantize_stream(iter(items), recipe))
    assert isinstance(quantized["m.a_proj.weight"], Int8RowWeight)
    back = load_bundle(save_bundle(iter(quantized.items()), tmp_path / "bundle", fsync=False))
    assert torch.equal(back["m.a_proj.weight"].q, quantized["m.a_proj.weight"].q)

    out = tmp_path / "hf"
    write_hf_quantized_checkpoint(str(out), iter(items), recipe, style="compressed-tensors")
    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = next(iter(qc.config_groups.values()))
    assert scheme.format == "int-quantized"
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    for name in ("m.a_proj", "m.b_proj"):
        local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        theirs = BaseCompressor.get_value_from_registry("int-quantized").decompress(local, scheme)["weight"]
        assert torch.equal(theirs.float(), dequantize(quantized[f"{name}.weight"], torch.float32)), name
    report = verify_export(str(out), {n[: -len(".weight")]: v for n, v in quantized.items() if n.endswith("proj.weight")})
    assert report.ok, report.problems
    assert report.modules == {"m.a_proj": "int8_row", "m.b_proj": "int8_row"}
    assert report.max_error == {"m.a_proj": 0.0, "m.b_proj": 0.0}
    with pytest.raises(ValueError, match="int8_row is not exported in the modelopt style"):
        write_hf_quantized_checkpoint(str(tmp_path / "mo"), iter(items), recipe, style="modelopt")
