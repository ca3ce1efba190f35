"""save_bundle / load_bundle: round trip, sharding, determinism, crash safety, resume, versions."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

from llmq.checkpoint import (
    BASE_BUNDLE_VERSION,
    BUNDLE_VERSION,
    BundleVersionError,
    BundleWriter,
    CheckpointError,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    ResumeMismatchError,
    iter_bundle,
    load_bundle,
    read_manifest,
    save_bundle,
)
from llmq.quant.formats import GroupQuantizedWeight, pack_bits

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_ROOT = os.path.dirname(os.path.dirname(HERE))


def gqw(seed, n=8, k=64, bits=4, gs=32, lead=()):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (*lead, n, k), generator=g)
    return GroupQuantizedWeight(qdata=pack_bits(q, bits), scale=torch.rand(*lead, n, k // gs, generator=g),
                                bias=-torch.rand(*lead, n, k // gs, generator=g), bits=bits, group_size=gs,
                                shape=(*lead, n, k))


def stream(n_layers=6):
    g = torch.Generator().manual_seed(1)
    yield "model.embed_tokens.weight", torch.randn(32, 64, generator=g).to(torch.bfloat16)
    for i in range(n_layers):
        yield f"model.layers.{i}.mlp.up_proj.weight", gqw(10 + i)
        yield f"model.layers.{i}.mlp.experts.gate_up", gqw(100 + i, bits=8, gs=16, lead=(3,))
        yield f"model.layers.{i}.norm.weight", torch.ones(64)
        yield f"model.layers.{i}.flag", torch.tensor([True, False])
    yield "lm_head.weight", gqw(99, bits=6, gs=16)


def assert_same(a, b):
    if isinstance(a, GroupQuantizedWeight):
        assert isinstance(b, GroupQuantizedWeight)
        assert (a.bits, a.group_size, a.shape, a.dtype) == (b.bits, b.group_size, b.shape, b.dtype)
        for f in ("qdata", "scale", "bias"):
            assert torch.equal(getattr(a, f), getattr(b, f))
    else:
        assert a.dtype == b.dtype and torch.equal(a, b)


def folder_digest(path):
    h = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            h[name] = hashlib.sha256(f.read()).hexdigest()
    return h


def rewrite_manifest(out, change):
    """Apply change(manifest dict) to a finished bundle's manifest; returns the new manifest."""
    mpath = os.path.join(out, "llmq_manifest.json")
    manifest = json.load(open(mpath))
    change(manifest)
    json.dump(manifest, open(mpath, "w"))
    return manifest


def test_round_trip_and_layout(tmp_path):
    out = save_bundle(stream(), tmp_path / "b", recipe={"default": "int4"}, max_shard_bytes=4096, fsync=False)
    got = load_bundle(out)
    want = dict(stream())
    assert list(got) == list(want)  # stream order
    for k in want:
        assert_same(want[k], got[k])
    manifest = read_manifest(out)
    # dense and integer weights only: written as version 2, byte for byte what version-2 writers wrote
    assert manifest["format_version"] == BASE_BUNDLE_VERSION and manifest["recipe"] == {"default": "int4"}
    assert len(manifest["shards"]) > 2
    assert set(manifest["library_versions"]) >= {"llmq", "torch"}
    assert not os.path.exists(str(out) + ".partial")
    # shards are ordinary safetensors files (the reference reader agrees), no shard much over the limit
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    for shard in manifest["shards"]:
        path = os.path.join(out, shard["file"])
        assert os.path.getsize(path) == shard["bytes"]
        with safe_open(path, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                assert index["weight_map"][key] == shard["file"]
                t = f.get_tensor(key)
                assert t.data_ptr() % t.element_size() == 0
    entry = manifest["tensors"]["model.layers.0.mlp.up_proj.weight"]
    assert entry["entries"] == {"qdata": "model.layers.0.mlp.up_proj.weight.qdata",
                                "scale": "model.layers.0.mlp.up_proj.weight.scale",
                                "bias": "model.layers.0.mlp.up_proj.weight.bias"}


def test_byte_identical_for_same_input(tmp_path):
    a = save_bundle(stream(), tmp_path / "a", recipe={"r": 1}, metadata={"x": "1", "a": "2"},
                    max_shard_bytes=5000, fsync=False)
    b = save_bundle(stream(), tmp_path / "b", recipe={"r": 1}, metadata={"a": "2", "x": "1"},
                    max_shard_bytes=5000, fsync=False)
    assert folder_digest(a) == folder_digest(b)


def test_existing_output_is_not_clobbered(tmp_path):
    save_bundle(stream(1), tmp_path / "b", fsync=False)
    with pytest.raises(CheckpointError, match="already exists"):
        save_bundle(stream(1), tmp_path / "b", fsync=False)
    save_bundle(stream(2), tmp_path / "b", overwrite=True, fsync=False)
    assert "model.layers.1.flag" in load_bundle(tmp_path / "b")


def failing(after):
    for i, item in enumerate(stream()):
        if i == after:
            raise KeyboardInterrupt("killed")
        yield item


@pytest.mark.parametrize("after", [0, 3, 11, 20])
def test_interrupted_run_leaves_nothing_complete_and_resumes_identically(tmp_path, after):
    ref = save_bundle(stream(), tmp_path / "ref", max_shard_bytes=3000, fsync=False)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        save_bundle(failing(after), out, max_shard_bytes=3000, fsync=False)
    assert not out.exists()
    with pytest.raises(CheckpointNotFoundError, match="partial"):
        load_bundle(out)
    probe = BundleWriter(out, max_shard_bytes=3000, fsync=False)  # what a producer could skip
    done = probe.completed()
    probe.abort()
    assert done == [n for n, _ in stream()][:len(done)]
    computed = []

    def lazy():
        for name, value in stream():
            yield name, (lambda v=value, n=name: computed.append(n) or v)

    save_bundle(lazy(), out, max_shard_bytes=3000, fsync=False)
    assert folder_digest(out) == folder_digest(ref)
    if after >= 11:  # at least one shard was finished before the kill: its tensors were not recomputed
        assert len(computed) < len(dict(stream()))


def test_resume_refuses_a_different_stream_or_recipe(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        save_bundle(failing(15), out, max_shard_bytes=3000, recipe="a", fsync=False)
    with pytest.raises(ResumeMismatchError, match="recipe"):
        save_bundle(stream(), out, max_shard_bytes=3000, recipe="b", fsync=False)
    renamed = ((n.replace("layers.0", "layers.9"), v) for n, v in stream())
    with pytest.raises(ResumeMismatchError, match="differs"):
        save_bundle(renamed, out, max_shard_bytes=3000, recipe="a", fsync=False)
    save_bundle(stream(), out, max_shard_bytes=3000, recipe="b", resume=False, fsync=False)
    assert read_manifest(out)["recipe"] == "b"


def test_killed_process_leaves_no_complete_folder(tmp_path):
    """A real SIGKILL in the middle of writing, then a resume: byte-identical to a clean run."""
    ref = save_bundle(stream(30), tmp_path / "ref", max_shard_bytes=3000, fsync=False)
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {PYTHON_ROOT!r}); sys.path.insert(0, {HERE!r})
        from bundle_test import stream
        from llmq.checkpoint import save_bundle
        def killing():
            for i, item in enumerate(stream(30)):
                if i == 70:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield item
        save_bundle(killing(), {str(tmp_path / 'out')!r}, max_shard_bytes=3000, fsync=False)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not (tmp_path / "out").exists() and (tmp_path / "out.partial").is_dir()
    save_bundle(stream(30), tmp_path / "out", max_shard_bytes=3000, fsync=False)
    assert folder_digest(tmp_path / "out") == folder_digest(ref)


def test_checksum_and_size_are_verified(tmp_path):
    out = save_bundle(stream(), tmp_path / "b", max_shard_bytes=3000, fsync=False)
    shard = os.path.join(out, read_manifest(out)["shards"][1]["file"])
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(ChecksumError, match="blake3 checksum"):
        load_bundle(out)
    load_bundle(out, verify=False)  # opt-out reads the (corrupt) bytes
    open(shard, "ab").write(b"x")
    with pytest.raises(ChecksumError, match="bytes"):
        load_bundle(out, verify=False)


@pytest.mark.parametrize("version,match", [(BUNDLE_VERSION + 1, "newer"), (0, "unknown"), ("1", "integer"),
                                           (None, "integer")])
def test_newer_or_unknown_versions_are_refused(tmp_path, version, match):
    out = save_bundle(stream(1), tmp_path / "b", fsync=False)
    rewrite_manifest(out, lambda m: m.update(format_version=version))
    with pytest.raises(BundleVersionError, match=match):
        load_bundle(out)


def as_format_1(out):
    """Rewrite a bundle's manifest as format 1 wrote it: the same layout, SHA-256 per shard."""
    def to_v1(manifest):
        manifest["format_version"] = 1
        for shard in manifest["shards"]:
            with open(os.path.join(out, shard["file"]), "rb") as f:
                shard["sha256"] = hashlib.sha256(f.read()).hexdigest()
            shard.pop("blake3")

    return rewrite_manifest(out, to_v1)


def test_format_1_bundles_are_read_and_verified_with_sha256(tmp_path):
    out = save_bundle(stream(), tmp_path / "b", max_shard_bytes=3000, fsync=False)
    manifest = as_format_1(out)
    got = load_bundle(out, verify=True)
    for k, want in stream():
        assert_same(want, got[k])
    shard = os.path.join(out, manifest["shards"][1]["file"])
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(ChecksumError, match="sha256 checksum"):
        load_bundle(out)


def test_a_manifest_without_its_versions_checksum_is_refused(tmp_path):
    out = save_bundle(stream(1), tmp_path / "b", fsync=False)
    rewrite_manifest(out, lambda m: m.update(format_version=1))  # format 1 needs "sha256", not "blake3"
    with pytest.raises(CorruptCheckpointError, match="bad shard record"):
        load_bundle(out)


def test_manifest_cannot_point_outside_the_bundle(tmp_path):
    out = save_bundle(stream(1), tmp_path / "b", fsync=False)
    rewrite_manifest(out, lambda m: m["shards"][0].update(file="../evil.safetensors"))
    with pytest.raises(CheckpointError, match="plain file name"):
        load_bundle(out)


def test_iter_bundle_subset_and_bad_values(tmp_path):
    out = save_bundle(stream(2), tmp_path / "b", fsync=False)
    got = dict(iter_bundle(out, names=["lm_head.weight"]))
    assert list(got) == ["lm_head.weight"]
    with pytest.raises(CheckpointNotFoundError, match="nope"):
        list(iter_bundle(out, names=["nope"]))
    with pytest.raises(TypeError, match="expected torch.Tensor"):
        save_bundle([("x", [1, 2])], tmp_path / "c", fsync=False)
    with pytest.raises(CheckpointError, match="already used"):
        save_bundle([("x", gqw(0)), ("x.qdata", torch.zeros(1))], tmp_path / "d", fsync=False)


def test_empty_stream_and_fsync_path(tmp_path):
    out = save_bundle(iter(()), tmp_path / "empty")
    assert load_bundle(out) == {}
    out = save_bundle(stream(1), tmp_path / "synced", max_shard_bytes=2000)  # fsync=True default
    assert len(load_bundle(out)) == 6


def torchao_friendly(seed, n=16, k=64, bits=4, gs=32):
    """A weight whose bias is -zero*scale for an integer zero (what torchao can hold)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (n, k), generator=g)
    scale = torch.randint(1, 64, (n, k // gs), generator=g) / 256.0  # short mantissas: zero*scale is exact
    zero = torch.randint(0, 2 ** bits, (n, k // gs), generator=g).float()
    return GroupQuantizedWeight(qdata=pack_bits(q, bits), scale=scale, bias=-zero * scale, bits=bits,
                                group_size=gs, shape=(n, k))


def test_torchao_output_option(tmp_path):
    from safetensors.torch import load_file, save_file
    from torchao.prototype.safetensors.safetensors_support import (
        flatten_tensor_state_dict,
        unflatten_tensor_state_dict,
    )

    from llmq.checkpoint import UnsupportedCheckpointError
    from llmq.quant.formats import dequantize_canonical

    w = torchao_friendly(3)
    out = save_bundle([("layer.weight", w), ("layer.bias", torch.ones(16))], tmp_path / "b", fsync=False)
    got = load_bundle(out, output="torchao")
    assert torch.equal(got["layer.bias"], torch.ones(16))
    assert type(got["layer.weight"]).__name__ == "IntxUnpackedToInt8Tensor"
    want = dequantize_canonical(w, torch.bfloat16)
    assert torch.equal(got["layer.weight"].dequantize(), want)
    # ... and it serialises the torchao way (what transformers' TorchAoConfig loads)
    data, meta = flatten_tensor_state_dict(got)
    save_file(data, tmp_path / "torchao.safetensors", metadata=meta)
    back = unflatten_tensor_state_dict(load_file(tmp_path / "torchao.safetensors"), meta)[0]
    assert torch.equal(back["layer.weight"].dequantize(), want)
    # a GGUF-K-style bias torchao cannot hold is refused by name
    out = save_bundle([("k.weight", gqw(1))], tmp_path / "k", fsync=False)
    with pytest.raises(UnsupportedCheckpointError, match="k.weight"):
        load_bundle(out, output="torchao")


def test_misaligned_data_opens_a_new_shard_and_header_gap_is_valid(tmp_path):
    items = [("odd", torch.ones(3, dtype=torch.bfloat16)), ("f32", torch.ones(4)), ("u8", torch.ones(5, dtype=torch.uint8)),
             ("i64", torch.ones(2, dtype=torch.int64))]
    out = save_bundle(items, tmp_path / "b", fsync=False)  # default 2 GiB shards: a 1 MiB header gap
    manifest = read_manifest(out)
    assert [manifest["tensors"][n]["shard"] for n, _ in items] == [
        "model-00001.safetensors", "model-00002.safetensors", "model-00002.safetensors", "model-00003.safetensors"]
    for shard in manifest["shards"]:
        path = os.path.join(out, shard["file"])
        with open(path, "rb") as f:
            assert int.from_bytes(f.read(8), "little") + 8 == 1 << 20  # data starts right after the gap
        with safe_open(path, "pt") as f:  # the reference reader accepts the space-padded header
            for key in f.keys():
                t = f.get_tensor(key)
                assert t.data_ptr() % t.element_size() == 0
    got = load_bundle(out)
    assert all(torch.equal(got[n], t) for n, t in items)


def test_many_small_tensors_close_shards_before_the_header_overflows(tmp_path):
    items = [(f"t{i:04d}", torch.full((2,), float(i))) for i in range(300)]
    out = save_bundle(items, tmp_path / "b", max_shard_bytes=1 << 20, fsync=False)  # 4 KiB header gap
    assert len(read_manifest(out)["shards"]) >= 4  # ~70 entries fit in 4 KiB
    got = load_bundle(out)
    assert all(torch.equal(got[n], t) for n, t in items)


def test_iter_checkpoint_reads_a_bundle_in_canonical_form(tmp_path):
    from llmq.checkpoint import iter_checkpoint
    from llmq.checkpoint.bundle import MANIFEST
    from llmq.checkpoint.tensor_sources import BUNDLE_MANIFEST

    assert BUNDLE_MANIFEST == MANIFEST
    out = save_bundle(stream(2), tmp_path / "b", max_shard_bytes=3000, fsync=False)
    got = list(iter_checkpoint(out, key_map=lambda n: None if n.endswith("flag") else n))
    want = {n: v for n, v in stream(2) if not n.endswith("flag")}
    assert [n for n, _ in got] == list(want)
    for n, v in got:
        assert_same(want[n], v)


# -- the background writer ---------------------------------------------------------------------------

def counting(items, seen):
    for item in items:
        seen.append(item[0])
        yield item


@pytest.mark.parametrize("fsync", [False, True])
def test_a_failed_background_write_surfaces_naming_the_file_and_leaves_no_bundle(tmp_path, monkeypatch, fsync):
    import errno

    from llmq.checkpoint import bundle

    real_pwrite = os.pwrite
    victim = "model.layers.2.odd"
    items = list(stream())
    items.insert(11, (victim, torch.arange(123, dtype=torch.uint8)))  # the only entry of 123 bytes

    def pwrite(fd, data, offset):
        if len(data) == 123:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(bundle.os, "pwrite", pwrite)
    seen = []
    with pytest.raises(CheckpointError, match=r"model-\d+\.safetensors\.tmp: No space left on device$") as info:
        save_bundle(counting(items, seen), tmp_path / "out", max_shard_bytes=3000, fsync=fsync,
                    write_queue_bytes=0)
    assert info.value.tensor == victim and info.value.path.endswith(".tmp")
    assert len(seen) < len(items)  # the producer was stopped, not drained to the end
    assert not (tmp_path / "out").exists()
    partial = tmp_path / "out.partial"
    assert not (partial / "llmq_manifest.json").exists()
    assert not [n for n in os.listdir(partial) if n.endswith(".tmp")]  # the failed shard was removed
    monkeypatch.setattr(bundle.os, "pwrite", real_pwrite)
    ref = save_bundle(items, tmp_path / "ref", max_shard_bytes=3000, fsync=False)
    save_bundle(items, tmp_path / "out", max_shard_bytes=3000, fsync=False)  # resumes
    assert folder_digest(tmp_path / "out") == folder_digest(ref)


def test_a_failed_hash_surfaces_at_close_naming_the_shard(tmp_path, monkeypatch):
    from llmq.checkpoint import bundle

    def broken(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(bundle, "file_digest", broken)
    with pytest.raises(CheckpointError, match=r"model-00001\.safetensors\.tmp: hashing and renaming failed"):
        save_bundle(stream(1), tmp_path / "out", fsync=False)  # one shard: fails inside close()
    assert not (tmp_path / "out").exists()
    assert os.listdir(tmp_path / "out.partial") == ["journal.json"]


def test_writer_queue_holds_at_most_its_byte_limit():
    from llmq.checkpoint.ordered_worker import OrderedWorker

    worker = OrderedWorker("test", limit_bytes=100)
    pending_seen = []
    for nbytes in (30, 30, 30, 30, 90, 250, 10):  # 250 is over the limit: admitted alone
        worker.submit(lambda: pending_seen.append(worker._pending), nbytes)
    worker.join()
    assert len(pending_seen) == 7
    assert max(pending_seen[:5] + pending_seen[6:]) <= 100 and pending_seen[5] == 250


def test_a_job_over_the_limit_has_run_when_submit_returns():
    import threading
    import time

    from llmq.checkpoint.ordered_worker import OrderedWorker

    worker = OrderedWorker("test", limit_bytes=100)
    done, gate = [], threading.Event()
    worker.submit(lambda: gate.wait(5) and done.append("small"), 50)  # queued, held by the gate
    threading.Timer(0.2, gate.set).start()
    t0 = time.perf_counter()
    worker.submit(lambda: (time.sleep(0.1), done.append("big")), 150)
    assert done == ["small", "big"] and time.perf_counter() - t0 >= 0.25  # waited for both
    worker.submit(lambda: (time.sleep(0.2), done.append("queued")), 50)
    assert done == ["small", "big"]  # within the limit: queued, submit returned at once
    worker.join()
    assert done == ["small", "big", "queued"]


def test_writer_cannot_be_used_after_close_and_queue_size_is_checked(tmp_path):
    w = BundleWriter(tmp_path / "b", fsync=False)
    w.add("x", torch.ones(3))
    w.close()
    with pytest.raises(CheckpointError, match="already closed"):
        w.add("y", torch.ones(3))
    with pytest.raises(ValueError, match="write_queue_bytes"):
        BundleWriter(tmp_path / "c", write_queue_bytes=-1)


def test_flushing_while_writing_gives_the_same_bytes(tmp_path, monkeypatch):
    from llmq.checkpoint import bundle

    ref = save_bundle(stream(), tmp_path / "ref", max_shard_bytes=3000, fsync=False)
    monkeypatch.setattr(bundle, "_FLUSH_EVERY", 1)  # an fdatasync queued after every write
    out = save_bundle(stream(), tmp_path / "out", max_shard_bytes=3000, fsync=True, write_queue_bytes=0)
    assert folder_digest(out) == folder_digest(ref)
