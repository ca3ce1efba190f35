"""--backend=mlx end to end: the embedded default of each model, quantized with its int4 and mixed
recipes, is written as an mlx-lm folder, loaded offline with `mlx_lm.load`, and its logits equal
our quantized model's logits (same quantized tensors) within fp32 rounding. Also: config.json's
"quantization" names every quantized module's (bits, group) and `false` for every kept one, in
mlx-lm's module paths; and the name/layout maps themselves (exact expert split, conv1d axis, +1 norms).
"""

import json
import os

import pytest
import torch

from llmq.quant import GroupQuantizedWeight, QuantConfig, quantize_stream, quantize_weight
from llmq.quant.formats import dequantize_canonical
from models.gemma4.architecture import ARCHITECTURE as GEMMA4
from models.pipeline.agreement import verification_prompt
from models.pipeline.arch import quantizable_module
from models.pipeline.default_model import write_default_checkpoint, write_tiny_tokenizer
from models.pipeline.quantize_and_save import _read_hf_config, model_tensors, run
from models.pipeline.quantized_model import build_quantized_model
from models.qwen.architecture import ARCHITECTURE as QWEN

mx = pytest.importorskip("mlx.core", reason="the MLX runtime (mlx, or mlx[cpu] on Linux) is not installed here")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed here")

from mlx.utils import tree_flatten  # noqa: E402

from llmq_mlx import (  # noqa: E402
    backend as mlx_backend,
    mlx_group_size_for,
)
from llmq_mlx.mlx_lm_models import gemma4 as gemma4_mlx, naming_for, qwen3_5_moe as qwen_mlx  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FP32_UNIT_ROUNDOFF = 2.0 ** -24
PROMPT_LEN = 16


# ---------------------------------------------------------------- the maps alone (no mlx needed)

def test_expert_split_is_exact_row_slicing():
    torch.manual_seed(0)
    w = torch.randn(3, 2 * 48, 64)
    qw = quantize_weight(w, QuantConfig(bits=4, group_size=32, symmetric=False))
    (gate_name, gate), (up_name, up) = qwen_mlx.mlx_tensors("model.layers.2.mlp.experts.gate_up_proj", qw)
    assert gate_name == "language_model.model.layers.2.mlp.switch_mlp.gate_proj.weight"
    assert up_name == "language_model.model.layers.2.mlp.switch_mlp.up_proj.weight"
    full = dequantize_canonical(qw)
    assert gate.shape == (3, 48, 64) and up.shape == (3, 48, 64)
    assert torch.equal(dequantize_canonical(gate), full[:, :48]) and torch.equal(dequantize_canonical(up), full[:, 48:])
    ((down_name, down),) = qwen_mlx.mlx_tensors("model.layers.2.mlp.experts.down_proj", qw)
    assert down_name.endswith("layers.2.mlp.switch_mlp.down_proj.weight") and down is qw
    ((g_name, _), (u_name, _)) = gemma4_mlx.mlx_tensors("model.layers.0.experts.gate_up_proj", qw)
    assert (g_name, u_name) == ("model.layers.0.experts.switch_glu.gate_proj.weight",
                                "model.layers.0.experts.switch_glu.up_proj.weight")


def test_qwen_conv1d_and_norms_are_written_already_sanitized():
    conv = torch.randn(256, 1, 4)
    ((name, value),) = qwen_mlx.mlx_tensors("model.layers.0.linear_attn.conv1d.weight", conv)
    assert name == "language_model.model.layers.0.linear_attn.conv1d.weight"
    assert value.shape == (256, 4, 1) and torch.equal(value[:, :, 0], conv[:, 0, :])
    offset = torch.randn(32)
    for norm in ("model.norm.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.0.post_attention_layernorm.weight", "model.layers.3.self_attn.q_norm.weight",
                 "model.layers.3.self_attn.k_norm.weight"):
        ((_, value),) = qwen_mlx.mlx_tensors(norm, offset)
        assert torch.equal(value, offset + 1.0), norm
    ((_, value),) = qwen_mlx.mlx_tensors("model.layers.0.linear_attn.norm.weight", offset)  # plain-scale norm
    assert torch.equal(value, offset)
    with pytest.raises(ValueError, match="conv1d.weight: expected a depthwise conv weight"):
        qwen_mlx.mlx_tensors("model.layers.0.linear_attn.conv1d.weight", torch.randn(256, 4, 1))


def test_configs_say_what_mlx_lm_would_otherwise_default_wrongly():
    qwen = qwen_mlx.mlx_config(QWEN.tiny_hf_config(), QWEN.config_from_hf(QWEN.tiny_hf_config()))
    assert qwen["model_type"] == "qwen3_5_moe" and qwen["text_config"]["full_attention_interval"] == 4
    assert "quantization" not in qwen
    irregular = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    with pytest.raises(ValueError, match="full attention every 2th layer"):
        qwen_mlx.mlx_config(dict(QWEN.tiny_hf_config(), layer_types=irregular),
                            QWEN.config_from_hf(dict(QWEN.tiny_hf_config(), layer_types=irregular)))
    gemma = gemma4_mlx.mlx_config(GEMMA4.tiny_hf_config(), GEMMA4.config_from_hf(GEMMA4.tiny_hf_config()))
    assert gemma["model_type"] == "gemma4_text"
    assert (gemma["num_kv_shared_layers"], gemma["hidden_size_per_layer_input"]) == (0, 0)  # mlx-lm: 20, 256
    assert (gemma["global_head_dim"], gemma["num_global_key_value_heads"], gemma["attention_k_eq_v"]) == (64, 1, True)


# ---------------------------------------------------------------- through mlx_lm.load

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The embedded default checkpoint of each model (as quantize_and_save writes it) + a tiny tokenizer."""
    made = {}
    for arch in (QWEN, GEMMA4):
        folder = write_default_checkpoint(arch, str(tmp_path_factory.mktemp(arch.name) / "ckpt"), seed=0)
        hf_config = _read_hf_config(folder)
        config = arch.config_from_hf(hf_config)
        made[arch.name] = (folder, hf_config, config, write_tiny_tokenizer(folder, config.vocab_size))
    return made


def _reduction_lengths(arch, config):
    """Lengths of the dependent fp32 reductions from the embedding to one logit (see _tolerance)."""
    d = config.hidden_size
    lengths = []
    for i in range(config.num_hidden_layers):
        if arch is QWEN:
            linear = config.layer_types[i] == "linear_attention"
            key_dim = config.linear_key_head_dim if linear else config.head_dim
            out_width = (config.linear_value_head_dim * config.linear_num_value_heads if linear
                         else config.head_dim * config.num_attention_heads)
            ffn = [d, d, max(config.moe_intermediate_size, config.shared_expert_intermediate_size),
                   config.num_experts_per_tok + 1]  # router, gate/up, down, combine
            conv = [config.linear_conv_kernel_dim] if linear else []
            lengths += [d, d] + conv + [key_dim, key_dim, PROMPT_LEN, out_width] + ffn  # 2 norms, proj, q/k norm...
        else:
            g = config.layer_geometry[i]
            lengths += [d] * 4 + [d, g.head_dim, g.head_dim, PROMPT_LEN, g.head_dim * config.num_attention_heads,
                                  d, config.intermediate_size]
    return lengths + [d, d]  # final norm, lm_head


def _tolerance(arch, config, ref64):
    """Both sides evaluate the same function of identical weights in fp32 (MLX's dequantize adds one
    rounding per weight). A length-n reduction carries at most gamma_n ~ n*u relative error of its
    |terms|, and each elementwise step (norm scale, activation, gating, residual add) about 2 more
    roundings; summed along the chain of dependent reductions this gives a forward-error scale
    relative to the logits' magnitude (as in backends/mlx's writer test). It is a model, not a proof
    through softmax/exp; the test checks torch's own fp32 run against it too. A layout, naming or
    +1-norm mistake moves logits by O(max|logit|), orders of magnitude above it."""
    lengths = _reduction_lengths(arch, config)
    n = sum(lengths) + 2 * len(lengths)
    return 2 * n * FP32_UNIT_ROUNDOFF * float(ref64.abs().max())


def _quantize_and_write(arch, checkpoint, recipe, out):
    """The pipeline's stream, quantized once, written as an mlx-lm folder with kept tensors in fp32,
    and the same tensors (fp32) returned for our model."""
    folder, hf_config, config, tokenizer = checkpoint
    stream = quantize_stream(model_tensors(arch, folder, config), arch.presets[recipe],
                             num_layers=arch.num_layers(config), module_of=quantizable_module)
    tensors = {}

    def keep(items):
        for name, value in items:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value = value.float()  # bf16 -> fp32 is exact; both sides then run in fp32
            tensors[name] = value
            yield name, value

    path = mlx_backend.write_mlx_folder(str(out), keep(stream), hf_config, config, tokenizer=tokenizer,
                                        float_dtype=torch.float32, max_shard_bytes=1 << 20)
    return path, tensors


def _check_quantization_section(naming, q, tensors, mlx_params):
    """Every quantized module's effective (bits, group) and every kept matrix's `false`, in mlx-lm paths."""
    default = {k: q[k] for k in ("group_size", "bits", "mode")}
    quantized = kept = 0
    for name, value in tensors.items():
        for mlx_name, mlx_value in naming.mlx_tensors(name, value):
            path = mlx_name[: -len(".weight")] if mlx_name.endswith(".weight") else mlx_name
            if isinstance(mlx_value, GroupQuantizedWeight):
                group = mlx_group_size_for(mlx_value.group_size, mlx_value.shape[-1], name=path)
                want = {"group_size": group, "bits": mlx_value.bits, "mode": "affine"}
                assert q.get(path, default) == want, path
                assert f"{path}.scales" in mlx_params and f"{path}.biases" in mlx_params, path
                quantized += 1
            elif mlx_name.endswith(".weight") and mlx_value.dim() >= 2:
                assert q.get(path) is False, path
                assert f"{path}.scales" not in mlx_params, path
                kept += 1
    return quantized, kept


@pytest.mark.parametrize("arch,recipe", [(QWEN, "int4"), (QWEN, "mixed"), (GEMMA4, "int4"), (GEMMA4, "mixed")],
                         ids=["qwen-int4", "qwen-mixed", "gemma4-int4", "gemma4-mixed"])
def test_mlx_lm_loads_the_folder_and_matches_our_quantized_model(arch, recipe, checkpoints, tmp_path):
    checkpoint = checkpoints[arch.name]
    config = checkpoint[2]
    folder, tensors = _quantize_and_write(arch, checkpoint, recipe, tmp_path / "mlx")

    cfg = json.loads((folder / "config.json").read_text())
    q = cfg["quantization"]
    assert (q["bits"], q["group_size"], q["mode"]) == ((4, 32, "affine") if recipe == "int4" else (8, 32, "affine"))
    overrides = {k: v for k, v in q.items() if isinstance(v, dict)}
    if recipe == "int4":
        assert not overrides  # one format everywhere: no per-layer entries
    else:
        assert overrides and all(v["bits"] == 4 for v in overrides.values())

    model, tokenizer = mlx_backend.load_mlx_model(folder)  # mlx_lm.load: the folder has a tokenizer
    text = "quantized é\n"
    assert tokenizer is not None and tokenizer.encode(text) == list(text.encode())  # byte-level, both loaders
    assert tokenizer.decode(list(text.encode())) == text and tokenizer.eos_token_id == 256
    mlx_params = dict(tree_flatten(model.parameters()))
    quantized, kept = _check_quantization_section(naming_for(checkpoint[1]), q, tensors, mlx_params)
    assert quantized > 0 and kept > 0
    if arch is QWEN:
        switch = model.language_model.model.layers[1].mlp.switch_mlp
        assert type(switch.gate_proj).__name__ == "QuantizedSwitchLinear"
        assert switch.gate_proj.bits == 4
        norm = mlx_params["language_model.model.norm.weight"]
        assert abs(float(mx.mean(norm)) - 1.0) < 0.5  # +1 applied once (offsets are ~0, gains ~1)

    ours = build_quantized_model(arch.build_model(config, device="meta"), tensors)
    prompt = verification_prompt(config.vocab_size, seed=0, prompt_len=PROMPT_LEN)
    got = mlx_backend.mlx_logits(model, prompt).double()
    with torch.no_grad():
        ref32 = ours(prompt)[0].double()
        ref64 = ours.double()(prompt)[0].double()
    tol = _tolerance(arch, config, ref64)
    err32, err = (ref32 - ref64).abs().max().item(), (got - ref64).abs().max().item()
    print(f"{arch.name} {recipe}: max|mlx - ours64| {err:.3e}, max|ours32 - ours64| {err32:.3e}, tol {tol:.3e}, "
          f"max|logit| {ref64.abs().max().item():.3f}")
    assert err32 <= tol  # the bound holds for our own fp32 evaluation
    assert err <= tol, f"mlx-lm logits differ from ours by {err:.3e} > {tol:.3e}"


@pytest.mark.parametrize("arch,recipe", [(QWEN, "int4"), (QWEN, "int8"), (GEMMA4, "int8")],
                         ids=["qwen-int4", "qwen-int8", "gemma4-int8"])
def test_quantize_and_save_backend_mlx(arch, recipe, tmp_path):
    """Every recipe through the CLI path; int8 per-channel rows are quantized in MLX groups (recipe_for)."""
    result = run(arch, checkpoint=None, recipe=recipe, backend="mlx", out=str(tmp_path / "out"), resume=True,
                 max_shard_size=1 << 20, verify=True, seed=0, progress=False)
    files = set(os.listdir(result["bundle"]))
    assert {"config.json", "tokenizer.json"} <= files and any(f.startswith("model") for f in files)
    # The folder keeps the checkpoint's bf16 tensors; run() compares in float32, where the folder and
    # our quantized model are the same function up to fp32 rounding (bounded tightly in the test above;
    # here the wiring: a wrong model or prompt would be off by the quantization error, cosine ~0.99).
    assert result["mlx"]["float32"]
    assert result["mlx"]["mlx_vs_quantized"]["cosine"] > 1 - 1e-6
    assert abs(result["mlx"]["mlx_vs_reference"]["cosine"] - result["cosine"]) < 1e-2


def test_quantize_and_save_backend_mlx_mxfp4_mxfp8(tmp_path):
    """llmq's mxfp4/mxfp8 through the CLI path (Qwen3.5-MoE: dense and stacked experts) land in MLX's modes
    of those names, mlx-lm's forward equals our quantized model's, and mlx-lm runs the folder as its user does."""
    rules = [{"pattern": "(.*\\.)?(embed_tokens|lm_head)", "config": None},
             {"pattern": ".*\\.mlp\\.(gate|shared_expert_gate)", "config": None},
             {"pattern": ".*(norm|conv1d).*", "config": None},
             {"pattern": ".*\\.mlp\\..*", "config": {"format": "mxfp8"}},
             {"pattern": ".*", "config": {"format": "mxfp4"}}]
    recipe = tmp_path / "mx.json"
    recipe.write_text(json.dumps({"rules": rules}))
    result = run(QWEN, checkpoint=None, recipe=str(recipe), backend="mlx", out=str(tmp_path / "out"), resume=True,
                 max_shard_size=1 << 20, verify=True, seed=0, progress=False)
    with open(os.path.join(result["bundle"], "config.json")) as f:
        q = json.load(f)["quantization"]
    modes = {p.get("mode", q["mode"]) if isinstance(p, dict) else q["mode"]
             for k, p in q.items() if k not in ("group_size", "bits", "mode") and p is not False}
    assert modes | {q["mode"]} == {"mxfp4", "mxfp8"}, q
    assert result["mlx"]["mlx_vs_quantized"]["cosine"] > 1 - 1e-6
    assert result["consumer"]["ok"], result["consumer"]
