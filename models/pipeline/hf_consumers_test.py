"""Every HF backend x format output runs in transformers as written: the tiny default model of each llmq
architecture is written by --backend hf-compressed-tensors (int4, int8, fp8, nvfp4) and hf-modelopt
(fp8), then loaded by `AutoModelForCausalLM.from_pretrained(folder)` with transformers' defaults in a
`python -I` child process in which llmq cannot be imported (llmq.consumer_run), which runs a forward
and a greedy `generate`.

Its logits are compared with the same model class holding llmq's dequantization of the folder
(llmq.export.read_export, built here in the parent): the weights are the same, so only arithmetic
separates them (the consumer's dtype, bfloat16 for these configs): cosine >= 0.999. Where
consumer_warnings names a known misread (ModelOpt FP8 codes taken as weights), the consumer really does
disagree (cosine < 0.99), so the warning is true. compressed-tensors NVFP4 MoE experts carry global
scale 1 (transformers drops theirs), so the Qwen3.5-MoE nvfp4 folder has no warning and must agree.

compressed-tensors itself is the other consumer of the compressed-tensors folders: its model-free
dequantizer (`convert_checkpoint` + `CompressedTensorsDequantizer`, in a `python -I` child) decompresses
each folder, and every quantized module's weight equals llmq's read-back element by element: exactly
where it decodes in float32 (int4, int8, fp8: the same formula), within two roundings of its bfloat16
decode (2^-8 relative) for NVFP4.
"""

import json
import os

import pytest
import torch

from llmq.consumer_run import run_consumer
from llmq.export import consumer_warnings, read_export
from models.gemma3.architecture import ARCHITECTURE as GEMMA3
from models.gemma4.architecture import ARCHITECTURE as GEMMA4
from models.pipeline.default_model import write_default_checkpoint
from models.pipeline.quantize_and_save import run
from models.qwen.architecture import ARCHITECTURE as QWEN

transformers = pytest.importorskip("transformers")

SAME_WEIGHTS_MIN_COSINE = 0.999  # same weights, different arithmetic (bfloat16 matmuls)
MISREAD_MAX_COSINE = 0.99  # what the HF backend's consumer check calls a misread (llmq_hf CONSUMER_MIN_COSINE)
PROMPT = list(range(3, 19))
NEW_TOKENS = 4

CASES = [(arch, backend, recipe)
         for arch in (GEMMA3, GEMMA4, QWEN)
         for backend, recipe in (("hf-compressed-tensors", "int4"), ("hf-compressed-tensors", "int8"),
                                 ("hf-compressed-tensors", "fp8"), ("hf-compressed-tensors", "nvfp4"),
                                 ("hf-modelopt", "fp8"))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch.name: write_default_checkpoint(arch, str(tmp_path_factory.mktemp(arch.name) / "ckpt"), seed=0,
                                                dtype=torch.float32)
            for arch in (GEMMA3, GEMMA4, QWEN)}


def _restacked(model, decoded):
    """The model's state dict from read_export's per-module weights (fused experts stacked again)."""
    out = {}
    for name in model.state_dict():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            prefix, proj = name.rsplit(".", 1)
            n = model.state_dict()[name].shape[0]
            if proj == "gate_up_proj":
                out[name] = torch.stack([torch.cat([decoded[f"{prefix}.{e}.gate_proj.weight"],
                                                    decoded[f"{prefix}.{e}.up_proj.weight"]]) for e in range(n)])
            else:
                out[name] = torch.stack([decoded[f"{prefix}.{e}.down_proj.weight"] for e in range(n)])
        elif name in decoded:
            out[name] = decoded[name]
    return out


def _llmq_logits(checkpoint, folder, dtype):
    """The consumer's model class on llmq's dequantization of `folder`, in the consumer's dtype."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    decoded = dict(read_export(folder, dtype))
    state = _restacked(model, decoded)
    missing = [k for k in model.state_dict() if k not in state and not k.endswith("lm_head.weight")]
    assert not missing, missing[:5]
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


def _cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.parametrize("arch,backend,recipe", CASES, ids=[f"{a.name}-{b}-{r}" for a, b, r in CASES])
def test_transformers_runs_the_folder_as_written(arch, backend, recipe, checkpoints, tmp_path):
    folder = run(arch, checkpoint=checkpoints[arch.name], recipe=recipe, backend=backend, out=str(tmp_path / "out"),
                 resume=True, max_shard_size=1 << 20, verify=False, seed=0, progress=False)["bundle"]
    got = run_consumer("transformers", folder, PROMPT, new_tokens=NEW_TOKENS)
    assert got.ok, got.line()
    assert got.version == transformers.__version__
    assert len(got.tokens) == NEW_TOKENS and got.logits.shape == (len(PROMPT), arch.tiny_hf_config()["vocab_size"])
    dtype = getattr(torch, got.details["dtype"])
    if recipe == "nvfp4":  # compressed-tensors unpacks FP4 to bfloat16: the folder says so for the default load
        assert json.load(open(os.path.join(folder, "config.json")))["dtype"] == "bfloat16" and dtype == torch.bfloat16
    else:  # the checkpoint's own float32
        assert dtype == torch.float32
    cosine = _cosine(got.logits, _llmq_logits(checkpoints[arch.name], folder, dtype))
    if consumer_warnings(folder):  # a known misread: the warning is true
        assert cosine < MISREAD_MAX_COSINE, (cosine, consumer_warnings(folder))
    else:
        assert cosine >= SAME_WEIGHTS_MIN_COSINE, cosine


CT_CASES = [(arch, recipe) for arch in (GEMMA3, GEMMA4, QWEN) for recipe in ("int4", "int8", "fp8", "nvfp4")]


@pytest.mark.parametrize("arch,recipe", CT_CASES, ids=[f"{a.name}-{r}" for a, r in CT_CASES])
def test_compressed_tensors_decompresses_the_folder_as_written(arch, recipe, checkpoints, tmp_path):
    import compressed_tensors

    from llmq_hf.backend import compare_decompressed

    folder = run(arch, checkpoint=checkpoints[arch.name], recipe=recipe, backend="hf-compressed-tensors",
                 out=str(tmp_path / "out"), resume=True, max_shard_size=1 << 20, verify=False, seed=0,
                 progress=False)["bundle"]
    got = run_consumer("compressed-tensors", folder)
    assert got.ok and got.version == compressed_tensors.__version__, got.line()
    quantized = read_export_modules(folder)
    assert quantized and all(f"{m}.weight" in got.weights for m in quantized), sorted(got.weights)[:5]
    compared = compare_decompressed(folder, got.weights)
    assert compared["agrees"] and compared["modules"] == len(quantized), compared["problems"][:3]
    if recipe == "nvfp4":  # bfloat16 decode: two roundings at most, and it does round
        assert 0 < compared["worst"][1] <= 2.0 ** -8, compared["worst"]
    else:
        assert compared["worst"][1] == 0.0, compared["worst"]
    # one element moved by more than the bound is named
    name = f"{sorted(quantized)[0]}.weight"
    moved = dict(got.weights)
    moved[name] = moved[name].clone()
    moved[name].view(-1)[7] += 2.0 ** -6 * moved[name].abs().max()
    bad = compare_decompressed(folder, moved)
    assert not bad["agrees"] and bad["problems"][0].startswith(f"{name}: element 7 decompressed to"), bad["problems"]


def read_export_modules(folder):
    from llmq.export import verify_export

    return set(verify_export(folder).modules)


def test_the_summary_names_the_consumer_tried_gemma3(tmp_path, checkpoints):
    """--verify runs transformers on the folder (a process without llmq) and its summary line says so."""
    result = run(GEMMA3, checkpoint=checkpoints[GEMMA3.name], recipe="nvfp4", backend="hf-compressed-tensors",
                 out=str(tmp_path / "out"), resume=True, max_shard_size=1 << 20, verify=True, seed=0, progress=False)
    consumer = result["consumer"]
    assert result["verification_failure"] is None
    assert consumer["consumer"] == "transformers" and consumer["version"] == transformers.__version__
    assert consumer["ok"] and consumer["agrees"] and consumer["cosine"] >= SAME_WEIGHTS_MIN_COSINE
    assert len(consumer["tokens"]) == 8
    import compressed_tensors

    ct = result["compressed_tensors"]  # compressed-tensors' own dequantizer, tried too
    assert ct["consumer"] == "compressed-tensors" and ct["version"] == compressed_tensors.__version__
    assert ct["ok"] and ct["agrees"] and ct["modules"] > 0


def _gguf_with_tokenizer(path):
    """The tiny Gemma 4 as a GGUF file whose metadata holds a SentencePiece (llama) tokenizer with byte
    fallback: <pad> <eos> <bos> <unk>, the 256 byte tokens, fillers."""
    import gguf

    from models.pipeline.gguf_input_test import _write_gguf

    n = GEMMA4.config_from_hf(GEMMA4.tiny_hf_config()).vocab_size
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(n - len(tokens))]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * (n - 260)
    array, f32, i32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.INT32
    _write_gguf(GEMMA4, path, tokens=[t.encode() for t in tokens], extra_kv={
        "tokenizer.ggml.model": ("llama", gguf.GGUFValueType.STRING, None),
        "tokenizer.ggml.scores": ([0.0] * n, array, f32),
        "tokenizer.ggml.token_type": (types, array, i32),
        "tokenizer.ggml.bos_token_id": (2, gguf.GGUFValueType.UINT32, None),
        "tokenizer.ggml.unknown_token_id": (3, gguf.GGUFValueType.UINT32, None),
        "tokenizer.ggml.padding_token_id": (0, gguf.GGUFValueType.UINT32, None),
    })
    return str(path)


def test_gguf_input_outputs_carry_config_and_tokenizer_gemma4(tmp_path):
    """A bundle and an HF folder written from a GGUF file carry config.json (the HF config rebuilt from the
    metadata) and the tokenizer (tokenizer.json from tokenizer.ggml.*); transformers loads the HF folder,
    its tokenizer included, and generates text."""
    gguf_path = _gguf_with_tokenizer(tmp_path / "model.gguf")
    for backend in ("bundle", "hf-compressed-tensors"):
        folder = run(GEMMA4, checkpoint=gguf_path, recipe="int4", backend=backend, out=str(tmp_path / backend),
                     resume=True, max_shard_size=1 << 20, verify=False, seed=0, progress=False)["bundle"]
        files = set(os.listdir(folder))
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= files, (backend, sorted(files))
        config = json.load(open(os.path.join(folder, "config.json")))
        assert config["model_type"] == GEMMA4.tiny_hf_config()["model_type"], config.get("model_type")
    got = run_consumer("transformers", str(tmp_path / "hf-compressed-tensors"), PROMPT, new_tokens=NEW_TOKENS,
                       prompt_text="The capital of France is")
    assert got.ok, got.line()
    assert isinstance(got.text, str) and len(got.tokens) == NEW_TOKENS
