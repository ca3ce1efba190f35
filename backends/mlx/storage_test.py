"""MlxBackend.storage: the bits it declares are the bytes write_mlx_lm_folder writes, for weights
quantized with the folder's 16-bit scale dtype and for imported ones whose scales need a wider dtype
(a GGUF Q8_0's float16 scales in a bfloat16 folder, a K-quant's products in float32)."""

import json
import os
import struct

import pytest
import torch

from llmq.quant import GroupQuantizedWeight, QuantConfig, quantize_weight
from llmq_mlx import write_mlx_lm_folder
from llmq_mlx.backend import mlx_scale_dtype, mlx_storage


def _headers(folder):
    out = {}
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            with open(os.path.join(folder, f), "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                for name, meta in json.loads(fh.read(n)).items():
                    if name != "__metadata__":
                        out[name] = (meta["dtype"], meta["data_offsets"][1] - meta["data_offsets"][0])
    return out


def _with_scale(q: GroupQuantizedWeight, scale: float) -> GroupQuantizedWeight:
    s = torch.full_like(q.scale, scale)
    return GroupQuantizedWeight(qdata=q.qdata, scale=s, bias=-8 * s, bits=q.bits, group_size=q.group_size,
                                shape=q.shape)


def test_mlx_scale_dtype_follows_the_models_dtype():
    assert mlx_scale_dtype({"torch_dtype": "bfloat16"}) == torch.bfloat16
    assert mlx_scale_dtype({"torch_dtype": "float16"}) == torch.float16
    assert mlx_scale_dtype({"text_config": {"dtype": "float32"}}) == torch.float16  # 16 bits all the same
    assert mlx_scale_dtype({}) == mlx_scale_dtype(None) == torch.bfloat16


@pytest.mark.parametrize("group", [32, 64, None])
def test_declared_bits_are_the_written_bytes(tmp_path, group):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    config = QuantConfig(bits=4, group_size=group, scale_dtype=torch.bfloat16)
    storage = mlx_storage(config, torch.bfloat16)
    q = quantize_weight(w, config)
    weights = {  # module -> (value, the dtype its scales must be written in)
        "a": (q, "BF16"),
        "b": (_with_scale(q, 1 + 2 ** -9), "F16"),  # float16 holds it, bfloat16 does not
        "c": (_with_scale(q, 1 + 2 ** -20), "F32"),  # only float32 holds it
    }
    folder = write_mlx_lm_folder(tmp_path / "out", [(f"{m}.weight", v) for m, (v, _) in weights.items()],
                                 {"model_type": "llama"}, scale_dtype=torch.bfloat16)
    headers = _headers(folder)
    for module, (value, dtype) in weights.items():
        assert headers[f"{module}.scales"][0] == headers[f"{module}.biases"][0] == dtype, module
        written = 8 * sum(headers[f"{module}.{part}"][1] for part in ("weight", "scales", "biases"))
        assert storage.bits(tuple(w.shape), value) == written, module
    # int4 with a 16-bit scale and bias per MLX group (a whole row is written as groups of 128)
    assert storage.bits(tuple(w.shape), q) == w.numel() * (4 + 32 / (group or 128))


def test_unrepresentable_import_keeps_its_size_class():
    """A GGUF Q6_K-like weight (6-bit groups of 16, which MLX cannot hold) is re-quantized at 6 bits in MLX
    groups of 32 from its exact values - never 4-bit, never float - and the storage counts exactly that."""
    from llmq.backend import WriteJob
    from llmq.quant import dequantize
    from llmq_mlx.backend import _representable

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    q6 = quantize_weight(w, QuantConfig(bits=6, group_size=16, symmetric=False))
    job = WriteJob(out="unused", recipe=None, recipe_name="int4", architecture="test", hf_config={"torch_dtype": "bfloat16"})
    (name, got), = list(_representable(iter([("model.layers.0.mlp.down_proj.weight", q6)]), job))
    assert (got.bits, got.group_size) == (6, 32)
    exact = dequantize(q6, torch.float32)
    step = (exact.amax(1) - exact.amin(1)).max() / 63
    assert float((dequantize(got, torch.float32) - exact).abs().max()) <= float(step)  # within one 6-bit step
    storage = mlx_storage(QuantConfig(bits=6, group_size=16, symmetric=False), mlx_scale_dtype(job.hf_config))
    assert storage.bits((64, 128)) == 64 * 128 * 6 + 64 * (128 // 32) * 2 * 16
