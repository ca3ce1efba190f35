"""Every format the library can quantize goes through a bundle and back bit for bit.

quantize -> save_bundle -> load_bundle -> dequantize equals the in-memory dequantize exactly,
the manifest names the format and the tensors its Format says it stores, a bundle with a
floating-point record is version 3 (integer-only bundles stay version 2), and a reader sees
the stored parts checked against the format's container.
"""

import json
import os

import pytest
import torch
from safetensors import safe_open

from llmq.checkpoint import (
    BASE_BUNDLE_VERSION,
    BUNDLE_VERSION,
    BundleVersionError,
    CorruptCheckpointError,
    TensorMismatchError,
    UnsupportedCheckpointError,
    load_bundle,
    read_manifest,
    save_bundle,
)
from llmq.checkpoint.testing_util import FORMAT_CONFIGS as CONFIGS
from llmq.quant import QuantConfig, dequantize, quantize_weight
from llmq.quant.formats import format_names, format_of, get_format


def weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.mlp.down_proj.weight": torch.randn(128, 256, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.experts.gate_up_proj": (torch.randn(3, 256, 128, generator=g) * 0.02).to(torch.bfloat16),
        "model.norm.weight": torch.rand(128, generator=g).to(torch.float32),
    }


def quantized_stream(config, seed=0):
    for name, w in weights(seed).items():
        yield name, (quantize_weight(w, config, name=name) if w.dim() >= 2 else w)


def test_every_quantizable_format_is_covered():
    covered = {c.format for c in CONFIGS.values()}
    # gguf-quant (q4_0 .. q6_k) values are canonical "int" weights, stored as "int": covered by "int" here, and
    # written to bundles in models/pipeline:gguf_backend_test
    assert covered == {n for n in format_names(quantizable=True) if get_format(n).family != "gguf-quant"}


@pytest.mark.parametrize("label", sorted(CONFIGS))
def test_round_trip_is_bit_exact(tmp_path, label):
    config = CONFIGS[label]
    want = dict(quantized_stream(config))
    out = save_bundle(quantized_stream(config), tmp_path / label, max_shard_bytes=1 << 16, fsync=False)
    got = load_bundle(out, verify=True)
    assert list(got) == list(want)
    manifest = read_manifest(out)
    for name, value in want.items():
        fmt = format_of(value)
        if fmt is None:
            assert torch.equal(got[name], value)
            continue
        back = got[name]
        assert type(back) is type(value) and format_of(back) is fmt
        for role, t in fmt.stored(value).items():  # every stored tensor identical, dtype included
            assert fmt.stored(back)[role].dtype == t.dtype
            assert torch.equal(fmt.stored(back)[role].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
        a, b = dequantize(value, torch.float32), dequantize(back, torch.float32)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # bit for bit, signed zeros included
        assert back.dtype == value.dtype == torch.bfloat16
        rec = manifest["tensors"][name]
        name_of = fmt.name_of(value)
        layout = fmt.layout(name_of, fmt.params(value), tuple(rec["shape"]))
        assert set(rec["entries"]) == set(layout) == set(fmt.stored(value))
        with safe_open(os.path.join(out, rec["shard"]), "pt") as f:
            for role, entry in rec["entries"].items():
                t = f.get_tensor(entry)
                assert (t.dtype, tuple(t.shape)) == layout[role], (role, entry)
    version = manifest["format_version"]
    assert version == (BASE_BUNDLE_VERSION if config.format == "int" else BUNDLE_VERSION)
    kinds = {r["kind"] for r in manifest["tensors"].values()}
    assert kinds == ({"dense", "group_quantized"} if config.format == "int" else {"dense", "quantized"})


def test_fp_record_names_format_and_params(tmp_path):
    out = save_bundle(quantized_stream(QuantConfig(format="fp8", granularity="block128")), tmp_path / "b", fsync=False)
    rec = read_manifest(out)["tensors"]["model.layers.0.mlp.down_proj.weight"]
    assert rec["format"] == "fp8" and rec["params"] == {"granularity": "block128"}
    assert rec["entries"] == {"data": "model.layers.0.mlp.down_proj.weight.data",
                              "scale": "model.layers.0.mlp.down_proj.weight.scale"}


def test_mixed_formats_in_one_bundle(tmp_path):
    items = []
    for i, label in enumerate(sorted(CONFIGS)):
        w = weights(i)["model.layers.0.mlp.down_proj.weight"]
        items.append((f"m.{i}.weight", quantize_weight(w, CONFIGS[label])))
    out = save_bundle(iter(items), tmp_path / "b", max_shard_bytes=1 << 15, fsync=False)
    got = load_bundle(out)
    for name, value in items:
        assert torch.equal(dequantize(got[name], torch.float32), dequantize(value, torch.float32))


def edit_manifest(out, change):
    path = os.path.join(out, "llmq_manifest.json")
    manifest = json.load(open(path))
    change(manifest)
    json.dump(manifest, open(path, "w"))


def test_fp_record_in_a_version_2_manifest_is_refused(tmp_path):
    out = save_bundle(quantized_stream(QuantConfig(format="nvfp4")), tmp_path / "b", fsync=False)
    edit_manifest(out, lambda m: m.update(format_version=2))
    with pytest.raises(CorruptCheckpointError, match="bad tensor record"):
        load_bundle(out)


def test_unknown_format_and_newer_version_are_refused(tmp_path):
    out = save_bundle(quantized_stream(QuantConfig(format="mxfp4")), tmp_path / "b", fsync=False)
    for bad in ("mxfp3", "Q4_K"):  # unknown, and import-only (never stored)
        edit_manifest(out, lambda m, bad=bad: m["tensors"]["model.layers.0.mlp.down_proj.weight"].update(format=bad))
        with pytest.raises(CorruptCheckpointError, match="bad tensor record"):
            load_bundle(out)
    out2 = save_bundle(quantized_stream(QuantConfig(format="mxfp4")), tmp_path / "c", fsync=False)
    edit_manifest(out2, lambda m: m.update(format_version=BUNDLE_VERSION + 1))
    with pytest.raises(BundleVersionError, match="newer"):
        load_bundle(out2)


def test_parts_that_disagree_with_the_format_are_refused(tmp_path):
    out = save_bundle(quantized_stream(QuantConfig(format="fp8", granularity="channel")), tmp_path / "b", fsync=False)
    edit_manifest(out, lambda m: m["tensors"]["model.layers.0.mlp.down_proj.weight"]["params"].update(
        granularity="tensor"))  # the stored scale is per channel
    with pytest.raises(TensorMismatchError, match="stored parts disagree"):
        load_bundle(out)


def test_fp_weights_have_no_torchao_form(tmp_path):
    out = save_bundle(quantized_stream(QuantConfig(format="nvfp4")), tmp_path / "b", fsync=False)
    with pytest.raises(UnsupportedCheckpointError, match="no torchao conversion"):
        load_bundle(out, output="torchao")


def test_registry_lookup_and_layout_agree_with_containers():
    for label, config in CONFIGS.items():
        fmt = get_format(config.format)
        w = weights(1)["model.layers.0.mlp.experts.gate_up_proj"]
        value = fmt.quantize(w, config, name=label)
        assert isinstance(value, fmt.container)
        layout = fmt.layout(fmt.name_of(value), fmt.params(value), tuple(w.shape))
        assert {r: (t.dtype, tuple(t.shape)) for r, t in fmt.stored(value).items()} == layout
        assert fmt.nbytes(value) == sum(t.numel() * t.element_size() for t in fmt.stored(value).values())
    with pytest.raises(ValueError, match="format 'int3' unknown"):
        get_format("int3")
