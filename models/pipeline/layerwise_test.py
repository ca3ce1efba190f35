"""The layer-wise executor against the whole model, for each architecture's tiny model:

* the logits it computes (embedding by rows, one layer at a time, head by row blocks) equal the
  whole model's (models.common.loading.load_model);
* calibration layer by layer (models/pipeline/calibration.calibrate_layerwise) gives the statistics
  of today's whole-model collect_calibration: importance, sampled rows and X^T X per linear;
* interrupted after layer k, a rerun resumes from the work folder at layer k+1 with the same result;
* the sequential option: a replaced layer's outputs are what the next layer sees;
* sequential calibration (--calibration_inputs=quantized): layer 0's statistics are the float run's,
  every later layer's differ, and layer j's X^T X is what the whole model with layers 0..j-1
  quantized (as they were fed forward) and the rest float gives to collect_calibration.
"""

from __future__ import annotations

import os

import pytest
import torch

import models.architectures  # noqa: F401  (registers every architecture)
from llmq.quant import QuantRecipe
from llmq.quant.importance import collect_calibration, token_batches
from llmq.quant.recipe import layer_index
from models.common.loading import load_model
from models.pipeline import calibration as calib, inputs, layerwise
from models.pipeline.arch import registered_architectures
from models.pipeline.default_model import write_default_checkpoint
from models.pipeline.quantized_model import build_quantized_model

ARCHS = {a.name: a for a in registered_architectures()}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    arch = ARCHS[request.param]
    folder = write_default_checkpoint(arch, str(tmp_path_factory.mktemp(arch.name) / "ckpt"), seed=3)
    source = inputs.open_input(arch, folder, "hf")
    return arch, source


def _ids(config, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (n,), generator=g)


def test_logits_equal_whole_model(tiny):
    arch, source = tiny
    ids = _ids(source.config, 40).reshape(2, 20)
    whole = load_model(arch, source.path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = whole(ids)
    # small row blocks: the embedding and the head are read and applied in several blocks
    model = layerwise.from_input(arch, source.config, source, chunk_bytes=4096)
    model.block_bytes = 4096
    hidden = layerwise.run_layers(model, model.embed([ids]))
    got = model.logits(hidden)[0]
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=0)


def _assert_same(a, b):
    for field in ("importance", "inputs", "hessians"):
        x, y = getattr(a, field), getattr(b, field)
        assert sorted(x) == sorted(y), field
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=1e-6, atol=1e-7, msg=f"{field} {k}")
    assert a.tokens == b.tokens


def test_calibration_equals_whole_model(tiny):
    arch, source = tiny
    ids = _ids(source.config, 2 * calib.WINDOW + 37)
    whole = load_model(arch, source.path, dtype=torch.bfloat16).eval()
    expected = collect_calibration(whole, token_batches(ids, calib.WINDOW), sample_rows=calib.SAMPLE_ROWS,
                                   hessians=True)
    model = layerwise.from_input(arch, source.config, source)
    got = calib.calibrate_layerwise(model, ids, hessians=True, progress=False)
    _assert_same(got, expected)
    assert "lm_head" in got.importance
    assert all(h.shape == (v.shape[0], v.shape[0]) for h, v in zip(got.hessians.values(), got.importance.values()))
    if getattr(source.config, "num_experts", 0):
        reached, total = calib.unreached_experts(got)
        assert total == source.config.num_experts * source.config.num_hidden_layers
        counts = torch.stack(list(got.expert_tokens.values()))
        # every token goes to top_k experts in each layer
        assert int(counts.sum()) == ids.numel() * source.config.num_experts_per_tok * source.config.num_hidden_layers


def test_resume_after_interruption(tiny, tmp_path):
    arch, source = tiny
    ids = _ids(source.config, calib.WINDOW + 11, seed=1)
    fingerprint = calib._fingerprint(source, source.path, ids, True)
    out = str(tmp_path / "out")
    full = calib.calibrate_layerwise(layerwise.from_input(arch, source.config, source), ids, hessians=True,
                                     progress=False)
    saved = calib.SavedCalibration.open(out, fingerprint)
    calib.calibrate_layerwise(layerwise.from_input(arch, source.config, source), ids, hessians=True, saved=saved,
                              progress=False, stop_after=1)
    saved.release()
    assert os.path.isfile(os.path.join(out + ".calibration.partial", "layer-00001.safetensors"))
    # the rerun reads layers 0 and 1 from the folder: their tensors are never read again
    model = layerwise.from_input(arch, source.config, source)
    read = []
    open_stream = model.tensors._open
    model.tensors._open = lambda only: ((n, v) for n, v in open_stream(only) if not read.append(n))
    saved = calib.SavedCalibration.open(out, fingerprint)
    resumed = calib.calibrate_layerwise(model, ids, hessians=True, saved=saved, progress=False)
    saved.release()
    assert not [n for n in read if n.startswith(("model.layers.0.", "model.layers.1.", "model.embed_tokens"))]
    _assert_same(resumed, full)
    # another text (other tokens): the saved statistics are not used
    saved = calib.SavedCalibration.open(out, dict(fingerprint, tokens="other"))
    assert saved.resume()[0] == 0
    saved.release()
    calib.discard_saved(out)
    assert not os.path.exists(out + ".calibration.partial")


def test_sequential_replace_feeds_next_layer(tiny):
    arch, source = tiny
    ids = _ids(source.config, 24).reshape(1, 24)
    model = layerwise.from_input(arch, source.config, source)
    seen = {}

    def observe(i, layer):
        return [layer.register_forward_pre_hook(lambda m, args, i=i: seen.setdefault(i, []).append(args[0].clone()))]

    def zero_layer(i, layer):
        if i != 0:
            return None
        for p in layer.parameters():
            p.data.zero_()
        return layer

    hidden = model.embed([ids])
    layerwise.run_layers(model, hidden, observe=observe, replace=zero_layer)
    # layer 1 saw what a zeroed layer 0 gives, not what layer 0's real weights give
    with model.layer(0) as layer0:
        real = model.run_layer(layer0, hidden)[0]
    assert not torch.equal(seen[1][0], real)
    with model.layer(0) as layer0:
        zero_layer(0, layer0)
        assert torch.equal(seen[1][0], model.run_layer(layer0, hidden)[0])


# int4 asymmetric gptq on every projection (a fused expert stack, which no nn.Linear computes with, falls
# back to the rule's search fit: llmq.quant.stream.quantize_stream).
GPTQ = QuantRecipe([{"pattern": r".*_proj", "config": {"bits": 4, "group_size": 16, "symmetric": False,
                                                       "method": "gptq", "options": {"block_size": 8}}}])


def test_sequential_calibration_feeds_each_layer_the_quantized_ones_before_it(tiny):
    arch, source = tiny
    config = source.config
    layers = arch.num_layers(config)
    ids = _ids(config, calib.WINDOW + 29, seed=2)
    fed = {}
    quantizer = calib.layer_quantizer(GPTQ, layers)

    def quantize(i, tensors, statistics):
        fed[i] = quantizer(i, tensors, statistics)
        return fed[i]

    plain = calib.calibrate_layerwise(layerwise.from_input(arch, config, source), ids, hessians=True, progress=False)
    seq = calib.calibrate_layerwise(layerwise.from_input(arch, config, source), ids, hessians=True, progress=False,
                                    quantize=quantize)
    assert sorted(fed) == list(range(layers))
    assert sorted(seq.hessians) == sorted(plain.hessians)
    assert any(not isinstance(v, torch.Tensor) for v in fed[0].values())  # the layer fed forward is quantized
    differ = 0
    for name, h in plain.hessians.items():
        i = layer_index(name)
        if i == 0:  # the embedding's rows enter layer 0 float either way
            torch.testing.assert_close(seq.hessians[name], h, rtol=0, atol=0, msg=name)
        elif i is not None:
            differ += not torch.allclose(seq.hessians[name], h, rtol=1e-3, atol=1e-6)
    assert differ == sum(1 for n in plain.hessians if layer_index(n) not in (0, None))  # every later linear moved
    assert not torch.allclose(seq.hessians["lm_head"], plain.hessians["lm_head"], rtol=1e-3, atol=1e-6)

    # Independently: the whole model, layers 0..j-1 as quantized and fed forward, the rest float.
    tensors = dict(source.stream(None, None))
    for j in sorted({1, layers - 1}):
        mixed = dict(tensors)
        for i in range(j):
            mixed.update(fed[i])
        whole = build_quantized_model(arch.build_model(config, device="meta"), mixed)
        expected = collect_calibration(whole, token_batches(ids, calib.WINDOW), sample_rows=calib.SAMPLE_ROWS,
                                       hessians=True)
        names = [n for n in seq.hessians if layer_index(n) == j]
        assert names
        for n in names:
            torch.testing.assert_close(seq.hessians[n], expected.hessians[n], rtol=1e-5, atol=1e-7, msg=n)
            torch.testing.assert_close(seq.importance[n], expected.importance[n], rtol=1e-5, atol=1e-7, msg=n)
