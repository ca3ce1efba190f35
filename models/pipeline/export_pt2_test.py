"""torch.export of the quantized tiny models: export, save, load, same logits as eager.

Three references per step (prefill, then greedy decode steps), all in float32 (the default --float32):
- the eager prefill/decode steps (same module code as the graph); the loaded .pt2 programs run the
  same aten ops on the same inputs, except that Qwen's experts run densely in the graph (so BLAS may
  block their reductions differently): agreement within export_pt2.TOLERANCE_EPS (16) float32 eps
  times max|logit| (see its comment for the derivation; measured 0 for Gemma 4, 3.4 eps for Qwen).
  A real bug moves logits far more: the first one this test caught (the decode position advanced
  in place, so the graph saw position + 1) moved them by 6% of max|logit|;
- the model's own `forward(..., cache=model.new_cache())` path, which grows its caches in Python
  (independent of the static cache and its position masks): same tolerance;
- the exported program's state: every quantized weight is a uint8 tensor, with no dense float copy.

Qwen runs a 4-expert top-2 variant of the tiny config (same layer kinds) through --bundle +
--checkpoint: under export every expert runs on every token, and 16 experts made the graphs 4x
larger and the test too slow; the 16-expert default is exercised by `bazel run //models/qwen:export_pt2`.
"""

import json
import os

import pytest
import torch

from llmq.quant import QuantConfig, QuantizedLinear
from models.gemma3 import export_pt2 as gemma3_export
from models.gemma4 import export_pt2 as gemma_export
from models.pipeline import export_pt2, quantize_and_save
from models.pipeline.default_model import write_default_checkpoint
from models.qwen import export_pt2 as qwen_export

MAX_SEQ_LEN = 24
DECODE_STEPS = 3


def _tolerance(diffs):
    assert diffs["dtype"] == torch.float32
    return export_pt2.TOLERANCE_EPS * torch.finfo(torch.float32).eps * diffs["logit_scale"]


def _check_run(result):
    diffs = result["diffs"]
    tol = _tolerance(diffs)
    assert len(diffs["exported"]) == 1 + DECODE_STEPS
    assert result["ok"] and result["tolerance"] == pytest.approx(tol)
    for name in ("exported", "model_cache", "exported_vs_model_cache"):
        assert max(diffs[name]) <= tol, (name, diffs[name], tol)
    # The cache tensors are O(1) (normalised keys, values, DeltaNet state): same tolerance, absolute scale 1.
    assert diffs["cache_max_diff"] <= export_pt2.TOLERANCE_EPS * torch.finfo(torch.float32).eps * max(
        1.0, diffs["cache_scale"]), diffs["cache_max_diff"]
    assert result["quantized_checked"] > 0
    for totals in (result["bytes_prefill"], result["bytes_decode"]):
        assert totals["uint8"] > 0
    assert os.path.isfile(result["paths"]["prefill"]) and os.path.isfile(result["paths"]["decode"])
    with open(os.path.join(result["out"], "cache_layout.json")) as f:
        layout = json.load(f)
    assert [e["name"] for e in layout["cache"]] == [e.name for e in result["layout"].entries]


@pytest.fixture(scope="module", params=["gemma4", "gemma3"])
def gemma(request, tmp_path_factory):
    # Gemma 3 runs Gemma 4's modules under its own config (and exports with the same cache layout)
    export = gemma3_export if request.param == "gemma3" else gemma_export
    out = tmp_path_factory.mktemp(request.param)
    return export_pt2.run(export.ARCHITECTURE, export.cache_layout, dynamic_prompt=True, recipe="int4",
                          out=str(out / "export"), max_seq_len=MAX_SEQ_LEN, decode_steps=DECODE_STEPS, quiet=True)


@pytest.fixture(scope="module")
def qwen_bundle(tmp_path_factory):
    """(checkpoint, bundle) of the 4-expert tiny Qwen quantized with int4."""
    root = tmp_path_factory.mktemp("qwen")
    arch = qwen_export.ARCHITECTURE
    hf_config = dict(arch.tiny_hf_config(), num_experts=4, num_experts_per_tok=2)
    checkpoint = write_default_checkpoint(arch, str(root / "checkpoint"), seed=1, hf_config=hf_config)
    bundle = quantize_and_save.run(arch, checkpoint=checkpoint, recipe="int4", backend="bundle",
                                   out=str(root / "bundle"), resume=False, max_shard_size=1 << 30, verify=False, seed=1,
                                   progress=False)["bundle"]
    return checkpoint, bundle


def _export_qwen(qwen_bundle, out, **kwargs):
    checkpoint, bundle = qwen_bundle
    return export_pt2.run(qwen_export.ARCHITECTURE, qwen_export.cache_layout, dynamic_prompt=False, bundle=bundle,
                          checkpoint=checkpoint, recipe="int4", out=out, max_seq_len=MAX_SEQ_LEN,
                          decode_steps=DECODE_STEPS, seed=1, quiet=True, **kwargs)


@pytest.fixture(scope="module")
def qwen(qwen_bundle, tmp_path_factory):
    return _export_qwen(qwen_bundle, str(tmp_path_factory.mktemp("qwen_export")))


def test_gemma_exported_steps_match_eager(gemma):
    _check_run(gemma)
    kinds = {e.name.rsplit(".", 1)[1] for e in gemma["layout"].entries}
    assert kinds == {"keys", "values"}


def test_gemma_prefill_prompt_length_is_dynamic(gemma):
    """A prompt longer than the sliding window (8) and of another length than the traced one."""
    prefill, _ = gemma["programs"]
    prompt = torch.randint(0, gemma["model"].config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = gemma["model"](prompt)
        got, cache = prefill(prompt)
    assert got.shape == expected.shape
    assert got.dtype == torch.float32
    tol = export_pt2.TOLERANCE_EPS * torch.finfo(torch.float32).eps * expected.abs().max().item()
    assert (got.double() - expected.double()).abs().max().item() <= tol
    assert cache[0].shape[2] == MAX_SEQ_LEN and cache[0][:, :, 13:].abs().max().item() == 0


def test_qwen_exported_steps_match_eager(qwen):
    _check_run(qwen)
    names = [e.name for e in qwen["layout"].entries]
    assert names[:2] == ["layers.0.conv", "layers.0.recurrent"] and names[-2:] == ["layers.3.keys", "layers.3.values"]
    assert qwen["diffs"]["dtype"] == torch.float32
    assert all(e.dtype == torch.float32 for e in qwen["layout"].entries)


def test_quantized_weights_are_uint8_in_the_saved_program(qwen, gemma):
    for result in (qwen, gemma):
        program = result["loaded"]["decode"]  # as torch.export.load returned it
        qdata = {n: t for n, t in program.state_dict.items() if n.endswith(("weight_qdata", ".qdata"))}
        assert len(qdata) == result["quantized_checked"]
        assert all(t.dtype == torch.uint8 for t in qdata.values())
    # Qwen's stacked experts are among them, as [E, N, K/2] uint8.
    experts = qwen["loaded"]["decode"].state_dict["model.model.layers.0.mlp.experts.gate_up.qdata"]
    assert experts.dtype == torch.uint8 and experts.shape[0] == 4


def _require_moe_kernel():
    """This case needs the compiled MoE kernel: without it the test fails (saying how to get it),
    never skips. Under Bazel it is a data dependency of this test."""
    from llmq.ops.kernel_loader import moe_kernel_available

    if not moe_kernel_available():
        pytest.fail("the compiled MoE kernel (//cpp/moe:_moe_kernel.so) is not loaded; build it (bazel test "
                    "does) or set LLMQ_MOE_KERNEL to it")


def test_qwen_with_the_moe_op_in_the_graph(qwen_bundle, tmp_path):
    _require_moe_kernel()
    result = _export_qwen(qwen_bundle, str(tmp_path / "export"), use_moe_quantized_op=True)
    _check_run(result)
    assert len(result["moe_op_blocks"]) == 4
    assert result["ops_in_graph"] == ["llmq.quantized_moe_ffn.default"]


class _LinearWithDenseCopy(torch.nn.Module):
    """A quantized linear that also keeps its dequantized weight around: what the check must reject."""

    def __init__(self):
        super().__init__()
        dense = torch.nn.Linear(64, 8, bias=False)
        self.linear = QuantizedLinear.from_linear(dense, QuantConfig(bits=4, group_size=32), name="linear")
        self.register_buffer("dense_copy", export_pt2._dequantized_linear(self.linear).clone())

    def forward(self, x):
        return self.linear(x) + x @ self.dense_copy.t()


def test_storage_check_rejects_a_dense_copy():
    module = _LinearWithDenseCopy()
    program = torch.export.export(module, (torch.randn(2, 64),), strict=False)
    with pytest.raises(ValueError, match="dense float copy of quantized linear.weight_qdata"):
        export_pt2.check_quantized_storage(program, module, prefix="")


def test_cache_capacity_is_checked_before_any_work():
    with pytest.raises(quantize_and_save.UsageError, match="exceeds --max_seq_len 8"):
        export_pt2.run(gemma_export.ARCHITECTURE, gemma_export.cache_layout, dynamic_prompt=True, max_seq_len=8,
                       prompt_len=6, decode_steps=4)


def test_an_existing_out_is_refused_before_any_work_unless_overwrite(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "prefill.pt2").write_bytes(b"an earlier export")
    with pytest.raises(quantize_and_save.UsageError, match=f"^--out {out} already exists; pass --overwrite"):
        export_pt2.run(gemma_export.ARCHITECTURE, gemma_export.cache_layout, dynamic_prompt=True, out=str(out))
    assert (out / "prefill.pt2").read_bytes() == b"an earlier export"


def test_the_export_binary_refuses_an_existing_out_with_one_line(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "export"
    out.mkdir()
    (out / "prefill.pt2").write_bytes(b"an earlier export")
    proc = subprocess.run([sys.executable, "-m", "models.gemma4.export_pt2", f"--out={out}"], capture_output=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 2, proc.stderr.decode()[-2000:]
    assert proc.stderr.decode().splitlines() == [f"error: --out {out} already exists; pass --overwrite to replace "
                                                 "its files"]
    assert (out / "prefill.pt2").read_bytes() == b"an earlier export"
