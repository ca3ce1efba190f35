"""MLX's FP modes: llmq's mxfp4 / mxfp8 weights, and nvfp4 quantized with global scale 1 (granularity
"block": MLX's QuantizedLinear has no global scale), written by the MLX backend are, through MLX's own
`mx.dequantize(..., mode=...)`, llmq's values element by element in float32; a tiny Llama folder
with the modes loads with `mlx_lm.load` and its forward equals transformers' on llmq's dequantized
weights; an nvfp4 weight with another global scale is refused in one line."""

import json
import os

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="the MLX runtime (mlx, or mlx[cpu] on Linux) is not installed here")
mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed here")

from llmq.quant import QuantConfig, QuantRecipe, QuantRule  # noqa: E402
from llmq.quant.formats.mx import dequantize_mx, quantize_mx  # noqa: E402
from llmq.quant.formats.nvfp4 import quantize_nvfp4  # noqa: E402
from llmq_mlx import pack_mlx_fp, torch_to_mx, write_mlx_lm_folder  # noqa: E402
from llmq_mlx.backend import MlxBackend, mlx_storage  # noqa: E402
from mlx_testutil import hf_logits, logits_tolerance  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def hard_weight(shape, seed=0):
    """Normal values over 2**-20 .. 2**8 per block of 32, an all-zero block, exact zeros and
    signed zeros, the E2M1/E4M3 saturation edges and subnormal codes all occur."""
    g = torch.Generator().manual_seed(seed)
    n, k = shape
    w = torch.randn(n, k, generator=g)
    w = w * torch.exp2(torch.randint(-20, 9, (n, k // 32, 1), generator=g).float()).expand(-1, -1, 32).reshape(n, k)
    w[0, :32] = 0.0
    w[1, :32] = -0.0
    w[2, 5] = 0.0
    return w


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_dequantize_equals_llmq(fmt):
    w = hard_weight((64, 256))
    q = quantize_mx(w, fmt)
    m = pack_mlx_fp(q, name="w")
    assert m.mode == fmt and m.biases is None and m.scales.dtype == torch.uint8
    got = mx.dequantize(*(torch_to_mx(t) for t in (m.weight, m.scales)), group_size=m.group_size, bits=m.bits,
                        mode=fmt, dtype=mx.float32)
    got = torch.from_numpy(np.array(got))
    want = dequantize_mx(q, torch.float32)
    assert got.shape == want.shape
    diff = (got != want) & ~(torch.isnan(got) & torch.isnan(want))
    assert not diff.any(), f"{int(diff.sum())} elements differ, e.g. at {diff.nonzero()[0].tolist()}"
    # what the backend declares is what it writes
    config = QuantConfig(format=fmt)
    layout = mlx_storage(config, torch.bfloat16).layout(tuple(w.shape))
    assert layout == {"weight": (torch.uint32, tuple(m.weight.shape)), "scales": (torch.uint8, tuple(m.scales.shape))}


def test_nvfp4_block_scales_only_equal_llmq():
    """MLX's nvfp4 (e4m3 scale per 16, no global scale) holds llmq's nvfp4 of granularity "block" exactly,
    tiny and huge blocks included (block scales clamp to [2**-9, 448]: never zero, never NaN); on ordinary
    weights MLX's own mx.quantize writes the same bytes."""
    from llmq.quant import dequantize, quantize_weight

    block = QuantConfig(format="nvfp4", granularity="block")
    for w in (hard_weight((64, 256)), torch.randn(64, 256) * 0.02, torch.randn(4, 32, 64) * 0.01):
        q = quantize_weight(w, block)
        m = pack_mlx_fp(q, name="w")
        assert m.mode == "nvfp4" and (m.bits, m.group_size) == (4, 16) and m.scales.dtype == torch.uint8
        got = mx.dequantize(*(torch_to_mx(t) for t in (m.weight, m.scales)), group_size=16, bits=4, mode="nvfp4",
                            dtype=mx.float32)
        got, want = torch.from_numpy(np.array(got)), dequantize(q, torch.float32)
        diff = (got != want) & ~(torch.isnan(got) & torch.isnan(want))
        assert not diff.any(), f"{int(diff.sum())} elements differ, e.g. at {diff.nonzero()[0].tolist()}"
        assert torch.isfinite(want).all() and (q.block_scale.float() > 0).all()
        layout = mlx_storage(block, torch.bfloat16).layout(tuple(w.shape))
        assert layout == {"weight": (torch.uint32, tuple(m.weight.shape)), "scales": (torch.uint8, tuple(m.scales.shape))}
    w = torch.randn(64, 256) * 0.02  # MLX's own quantizer: the same codes and scale bytes
    m = pack_mlx_fp(quantize_weight(w, block), name="w")
    theirs = mx.quantize(torch_to_mx(w), mode="nvfp4")
    assert np.array_equal(np.array(theirs[0]), m.weight.numpy()) and np.array_equal(np.array(theirs[1]), m.scales.numpy())


def test_nvfp4_with_a_global_scale_refused_and_recipe_for_asks_for_none():
    q = quantize_nvfp4(hard_weight((8, 64)))  # granularity "tensor": g = amax / 2688
    with pytest.raises(ValueError, match="no per-tensor global scale") as e:
        pack_mlx_fp(q, name="layers.0.q_proj.weight")
    assert "\n" not in str(e.value) and "layers.0.q_proj.weight" in str(e.value)
    recipe = QuantRecipe([QuantRule(r".*_proj", QuantConfig(format="nvfp4"))])
    backend = MlxBackend()
    (rule,) = backend.recipe_for(recipe).rules
    assert rule.config == QuantConfig(format="nvfp4", granularity="block")
    assert backend._regrouped == [r".*_proj: nvfp4 g16 -> nvfp4 g16 block scales only"]
    assert {"mxfp4", "mxfp8", "nvfp4"} <= set(MlxBackend.accepts_formats)


def test_tiny_llama_mxfp4_mxfp8_loads_and_runs(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
               tie_word_embeddings=False)
    model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="eager")).float().eval()
    items, expected = [], {}
    state = model.state_dict()
    for name, t in state.items():
        module = name[: -len(".weight")]
        if t.dim() != 2 or module == "model.embed_tokens":
            items.append((name, t.clone()))
            continue
        fmt = "mxfp8" if ".mlp." in name else "mxfp4"
        q = quantize_mx(t, fmt)
        with torch.no_grad():
            state[name].copy_(dequantize_mx(q))  # the torch reference runs llmq's values
        items.append((name, q))
        expected[module] = fmt
    out = write_mlx_lm_folder(tmp_path / "llama-mxfp", iter(items), {"model_type": "llama", **cfg})
    section = json.loads((out / "config.json").read_text())["quantization"]
    for module, fmt in expected.items():
        params = section.get(module, {k: section[k] for k in ("group_size", "bits", "mode")})
        assert params == {"group_size": 32, "bits": 4 if fmt == "mxfp4" else 8, "mode": fmt}, module

    from mlx_lm.utils import load_model

    mlx_model, _ = load_model(out)
    layer0 = mlx_model.model.layers[0]
    assert (layer0.self_attn.q_proj.mode, layer0.mlp.up_proj.mode) == ("mxfp4", "mxfp8")
    ids = [1, 5, 9, 40, 2, 77, 3, 3, 60]
    got = np.array(mlx_model(mx.array([ids]))[0].astype(mx.float32))
    ref32, ref64 = hf_logits(model, ids)
    tol = logits_tolerance(ref64, [64, 128, 64, 128, 64])
    err = np.abs(got - ref64).max()
    print(f"max|mlx - ref64| {err:.3e}, max|torch fp32 - ref64| {np.abs(ref32 - ref64).max():.3e}, tol {tol:.3e}")
    assert np.isfinite(got).all() and err <= tol, f"max |mlx - ref| = {err:.3e} > {tol:.3e}"
