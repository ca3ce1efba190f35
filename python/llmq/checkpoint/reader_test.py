"""iter_checkpoint / load_checkpoint on safetensors files and HF folders, and every refusal.

Files are written by the reference writer (safetensors.torch.save_file) and then
corrupted by hand, so the reader is checked against the format, not against itself.
"""

import json
import os
import struct
import time

import pytest
import torch
from safetensors.torch import save_file

from llmq.checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingTensorsError,
    NonFiniteWeightError,
    TensorMismatchError,
    UnsupportedCheckpointError,
    checkpoint_names,
    checkpoint_shapes,
    iter_checkpoint,
    load_checkpoint,
)


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 12, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(8, dtype=torch.float32),
        "model.rope.inv_freq": torch.arange(4, dtype=torch.int64),
    }


def write_hf_folder(folder, sd, n_shards=2):
    os.makedirs(folder, exist_ok=True)
    names = sorted(sd)
    weight_map = {}
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: sd[n] for n in names[i::n_shards]}
        save_file(part, os.path.join(folder, shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return folder


def raw_safetensors(header: dict, data: bytes = b"", header_len=None) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) if header_len is None else header_len) + h + data


def test_single_file_round_trip(tmp_path):
    sd = tensors()
    save_file(sd, tmp_path / "m.safetensors")
    got = dict(iter_checkpoint(tmp_path / "m.safetensors"))
    assert got.keys() == sd.keys()
    for k in sd:
        assert got[k].dtype == sd[k].dtype and torch.equal(got[k], sd[k])


def test_hf_folder_with_index_yields_every_tensor_once(tmp_path):
    sd = tensors()
    folder = write_hf_folder(tmp_path / "hf", sd, n_shards=3)
    got = list(iter_checkpoint(folder))
    assert sorted(n for n, _ in got) == sorted(sd)
    for n, t in got:
        assert torch.equal(t, sd[n])


def test_hf_folder_single_model_safetensors(tmp_path):
    sd = tensors()
    os.makedirs(tmp_path / "hf")
    save_file(sd, tmp_path / "hf" / "model.safetensors")
    assert dict(iter_checkpoint(tmp_path / "hf")).keys() == sd.keys()


def test_yielded_tensors_own_their_memory(tmp_path):
    sd = tensors()
    save_file(sd, tmp_path / "m.safetensors")
    it = iter_checkpoint(tmp_path / "m.safetensors")
    name, t = next(it)
    t.add_(1)  # writable, not a view on a read-only map
    assert not torch.equal(dict(iter_checkpoint(tmp_path / "m.safetensors"))[name], t)


def test_key_map_renames_and_drops_without_reading(tmp_path, monkeypatch):
    sd = tensors()
    save_file(sd, tmp_path / "m.safetensors")
    reads = []
    from llmq.checkpoint.safetensors_io import SafetensorsFile
    orig = SafetensorsFile.read
    monkeypatch.setattr(SafetensorsFile, "read", lambda self, n, **kw: reads.append(n) or orig(self, n, **kw))

    def key_map(n):
        if n.endswith("inv_freq"):
            return None
        return n.removeprefix("model.")

    got = dict(iter_checkpoint(tmp_path / "m.safetensors", key_map=key_map))
    assert "embed_tokens.weight" in got and not any("inv_freq" in n for n in got)
    assert "model.rope.inv_freq" not in reads
    got2 = dict(iter_checkpoint(tmp_path / "m.safetensors", key_map={"model.norm.weight": "norm", "model.rope.inv_freq": None}))
    assert "norm" in got2 and "model.rope.inv_freq" not in got2 and "model.embed_tokens.weight" in got2


def test_checkpoint_shapes_from_headers_without_reading(tmp_path, monkeypatch):
    sd = tensors()
    folder = write_hf_folder(str(tmp_path / "hf"), sd)
    from llmq.checkpoint.safetensors_io import SafetensorsFile
    monkeypatch.setattr(SafetensorsFile, "read", lambda self, n: pytest.fail(f"read {n}"))
    shapes = checkpoint_shapes(folder, key_map=lambda n: None if n.endswith("inv_freq") else n.removeprefix("model."))
    assert shapes == {n.removeprefix("model."): tuple(t.shape) for n, t in sd.items() if not n.endswith("inv_freq")}
    assert list(shapes) == [n.removeprefix("model.") for n in checkpoint_names(folder) if not n.endswith("inv_freq")]


def test_key_map_collision_is_an_error(tmp_path):
    save_file(tensors(), tmp_path / "m.safetensors")
    with pytest.raises(TensorMismatchError, match="sends both"):
        list(iter_checkpoint(tmp_path / "m.safetensors", key_map=lambda n: "same"))


def test_tied_weights_declared(tmp_path):
    sd = tensors()
    save_file(sd, tmp_path / "m.safetensors")
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    got = list(iter_checkpoint(tmp_path / "m.safetensors", tied=tied))
    d = dict(got)
    assert d["lm_head.weight"] is d["model.embed_tokens.weight"]
    assert checkpoint_names(tmp_path / "m.safetensors", tied=tied) == [n for n, _ in got]
    with pytest.raises(MissingTensorsError, match="lm_head.weight"):
        list(iter_checkpoint(tmp_path / "m.safetensors", tied={"lm_head.weight": "nope"}))


def test_dtype_casts_only_high_precision_floats(tmp_path):
    sd = tensors()
    sd["fp8"] = torch.zeros(4, dtype=torch.float8_e4m3fn)
    save_file(sd, tmp_path / "m.safetensors")
    got = dict(iter_checkpoint(tmp_path / "m.safetensors", dtype=torch.float32))
    assert got["model.embed_tokens.weight"].dtype == torch.float32
    assert got["model.rope.inv_freq"].dtype == torch.int64
    assert got["fp8"].dtype == torch.float8_e4m3fn


def test_convert_hook_sees_final_names(tmp_path):
    save_file(tensors(), tmp_path / "m.safetensors")
    seen = []
    got = dict(iter_checkpoint(tmp_path / "m.safetensors", key_map=lambda n: n.upper(),
                               convert=lambda n, t: seen.append(n) or (None if "NORM" in n else t * 0)))
    assert all(n.isupper() for n in seen) and "MODEL.NORM.WEIGHT" not in got
    assert all(float(t.abs().sum()) == 0 for t in got.values())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_policy(tmp_path, bad):
    sd = tensors()
    sd["model.layers.0.mlp.up_proj.weight"][3, 4] = bad
    save_file(sd, tmp_path / "m.safetensors")
    with pytest.raises(NonFiniteWeightError, match=r"up_proj.*(1 NaN and 0 Inf|0 NaN and 1 Inf)"):
        list(iter_checkpoint(tmp_path / "m.safetensors"))
    with pytest.warns(RuntimeWarning, match="up_proj"):
        list(iter_checkpoint(tmp_path / "m.safetensors", nonfinite="warn"))
    assert len(list(iter_checkpoint(tmp_path / "m.safetensors", nonfinite="allow"))) == len(sd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_nonfinite_counts_match_torch(dtype, monkeypatch):
    """The compiled bit-pattern count (f32/bf16/f16) and the torch fallback (float64, or no
    kernel) both equal torch.isnan / torch.isinf, with NaN and Inf of both signs."""
    from llmq.checkpoint.reader import count_nonfinite
    from llmq.quant import _native

    g = torch.Generator().manual_seed(3)
    t = torch.randn(300, 257, generator=g).to(dtype)
    flat = t.view(-1)
    flat[torch.randint(0, flat.numel(), (40,), generator=g)] = float("nan")
    flat[torch.randint(0, flat.numel(), (30,), generator=g)] = float("inf")
    flat[torch.randint(0, flat.numel(), (20,), generator=g)] = -float("inf")
    flat[5] = -float("nan")
    want = (int(torch.isnan(t).sum()), int(torch.isinf(t).sum()))
    assert count_nonfinite(t) == want
    if dtype != torch.float64 and os.environ.get("TEST_SRCDIR"):  # under Bazel the kernel is a data dep
        assert _native.count_nonfinite(t) == want
    monkeypatch.setattr(_native, "count_nonfinite", lambda t: None)  # the torch path
    assert count_nonfinite(t) == want
    assert count_nonfinite(torch.randn(8, 8).to(dtype)) == (0, 0)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(16, 8, dtype=torch.bfloat16)
        self.up_proj = torch.nn.Linear(8, 12, bias=False, dtype=torch.bfloat16)
        self.down_proj = torch.nn.Linear(12, 8, bias=False, dtype=torch.bfloat16)
        self.norm = torch.nn.Parameter(torch.ones(8))
        self.lm_head = torch.nn.Linear(8, 16, bias=False, dtype=torch.bfloat16)
        self.lm_head.weight = self.embed_tokens.weight  # tied
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def tiny_key_map(n):
    return {"model.embed_tokens.weight": "embed_tokens.weight",
            "model.layers.0.mlp.up_proj.weight": "up_proj.weight",
            "model.layers.0.mlp.down_proj.weight": "down_proj.weight",
            "model.norm.weight": "norm"}.get(n)


def test_load_checkpoint_fills_meta_model_and_ties(tmp_path):
    sd = tensors()
    folder = write_hf_folder(tmp_path / "hf", sd)
    with torch.device("meta"):
        model = Tiny()
    result = load_checkpoint(folder, model, key_map=tiny_key_map)
    assert not result.missing and not result.unexpected
    assert torch.equal(model.up_proj.weight, sd["model.layers.0.mlp.up_proj.weight"])
    assert model.lm_head.weight is model.embed_tokens.weight and not model.lm_head.weight.is_meta
    assert isinstance(model.norm, torch.nn.Parameter)
    x = torch.tensor([[1, 2]])
    assert model.lm_head(model.embed_tokens(x)).shape == (1, 2, 16)


def test_load_checkpoint_names_missing_and_unexpected(tmp_path):
    sd = tensors()
    save_file(sd, tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = Tiny()
    with pytest.raises(MissingTensorsError) as e:
        load_checkpoint(tmp_path / "m.safetensors", model, key_map=lambda n: None if "down" in n else tiny_key_map(n) or n)
    msg = str(e.value)
    assert "down_proj.weight" in msg and "model.rope.inv_freq" in msg and "m.safetensors" in msg
    assert "scratch" not in msg  # non-persistent buffers are not expected from a checkpoint


def test_load_checkpoint_checks_shape_and_dtype(tmp_path):
    sd = tensors()
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(12, 9, dtype=torch.bfloat16)
    save_file(sd, tmp_path / "bad_shape.safetensors")
    with torch.device("meta"):
        model = Tiny()
    with pytest.raises(TensorMismatchError, match=r"up_proj.weight.*\[12, 9\].*\[12, 8\]"):
        load_checkpoint(tmp_path / "bad_shape.safetensors", model, key_map=tiny_key_map)
    sd = tensors()
    sd["model.norm.weight"] = sd["model.norm.weight"].half()
    save_file(sd, tmp_path / "bad_dtype.safetensors")
    with torch.device("meta"):
        model = Tiny()
    with pytest.raises(TensorMismatchError, match=r"norm.*float16.*float32"):
        load_checkpoint(tmp_path / "bad_dtype.safetensors", model, key_map=tiny_key_map)


# --- hostile and broken input ------------------------------------------------------------------------

def corrupt_cases(tmp_path):
    good = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    return {
        "empty": b"",
        "short": b"\x01\x02",
        "huge_header_len": raw_safetensors(good, b"\0" * 8, header_len=1 << 60),
        "header_past_eof": raw_safetensors(good, b"\0" * 8, header_len=10_000),
        "not_json": struct.pack("<Q", 4) + b"nope",
        "not_object": raw_safetensors([1, 2]),
        "bad_dtype": raw_safetensors({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
        "negative_shape": raw_safetensors({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
        "offsets_past_eof": raw_safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
        "size_mismatch": raw_safetensors({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        "huge_tensor": raw_safetensors({"a": {"dtype": "F32", "shape": [1 << 40, 1 << 20],
                                              "data_offsets": [0, 1 << 62]}}, b"\0" * 8),
        "overlap": raw_safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
        "hole": raw_safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
        "trailing": raw_safetensors(good, b"\0" * 12),
        "duplicate_key": struct.pack("<Q", 2 * len(json.dumps(good)) - 1)
        + (json.dumps(good)[:-1] + "," + json.dumps(good)[1:]).encode() + b"\0" * 8,
        "bool_offsets": raw_safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [False, 8]}}, b"\0" * 8),
    }


@pytest.mark.parametrize("case", list(corrupt_cases(None)))
def test_corrupt_safetensors_raise_checkpoint_error_naming_file(tmp_path, case):
    data = corrupt_cases(tmp_path)[case]
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as e:
        list(iter_checkpoint(path))
    assert str(path) in str(e.value)


def test_huge_tensor_refused_before_allocating(tmp_path, monkeypatch):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(corrupt_cases(tmp_path)["huge_tensor"])
    import llmq.checkpoint.safetensors_io as sio
    monkeypatch.setattr(sio, "alloc_bytes", lambda n: pytest.fail(f"allocated {n} bytes"))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(CorruptCheckpointError, match="tensor 'a'"):
        list(iter_checkpoint(path))


def test_index_pointing_outside_folder_or_missing(tmp_path):
    sd = tensors()
    folder = write_hf_folder(tmp_path / "hf", sd)
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    save_file({"x": torch.zeros(1)}, tmp_path / "outside.safetensors")
    for rel, err in (("../outside.safetensors", CorruptCheckpointError),
                     ("/etc/passwd", CorruptCheckpointError),
                     ("missing.safetensors", CheckpointNotFoundError)):
        data["weight_map"]["model.norm.weight"] = rel
        index.write_text(json.dumps(data))
        with pytest.raises(err) as e:
            list(iter_checkpoint(folder))
        assert "model.norm.weight" in str(e.value) and "index.json" in str(e.value)
    # a symlink that escapes is refused too
    os.symlink(tmp_path / "outside.safetensors", folder / "link.safetensors")
    data["weight_map"]["model.norm.weight"] = "link.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CorruptCheckpointError, match="outside"):
        list(iter_checkpoint(folder))


def test_index_naming_tensor_the_shard_lacks(tmp_path):
    folder = write_hf_folder(tmp_path / "hf", tensors())
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = data["weight_map"]["model.norm.weight"]
    index.write_text(json.dumps(data))
    with pytest.raises(TensorMismatchError, match="ghost.weight"):
        list(iter_checkpoint(folder))


def test_truncated_shard_fails_before_any_tensor_is_yielded(tmp_path):
    folder = write_hf_folder(tmp_path / "hf", tensors(), n_shards=2)
    last = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))[-1]
    data = (folder / last).read_bytes()
    (folder / last).write_bytes(data[:-3])
    it = iter_checkpoint(folder)
    with pytest.raises(CorruptCheckpointError, match=last):
        next(it)


def test_missing_path_and_unknown_kinds(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        list(iter_checkpoint(tmp_path / "nope"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="model.safetensors"):
        list(iter_checkpoint(tmp_path / "empty_dir"))
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(UnsupportedCheckpointError):
        list(iter_checkpoint(tmp_path / "x.txt"))


def _hostile_pickle_stream(sentinel):
    """A protocol-0 pickle stream of {"w": os.system("touch <sentinel>")}, written out opcode by
    opcode (GLOBAL os.system, a one-string tuple, REDUCE), so the test never needs the pickle
    module: an unpickler that honoured it would create the sentinel file."""
    return (b"(dp0\nVw\np1\ncos\nsystem\np2\n(V" + f"touch {sentinel}".encode()
            + b"\np3\ntp4\nRp5\ns.")


def test_pickles_never_unpickle_arbitrary_objects(tmp_path):
    import zipfile

    stream = _hostile_pickle_stream(tmp_path / "pwned")
    legacy = tmp_path / "legacy.bin"
    legacy.write_bytes(stream)
    with pytest.raises(UnsupportedCheckpointError, match="legacy"):
        list(iter_checkpoint(legacy))
    zipped = tmp_path / "evil.pt"  # torch's zip layout: <name>/data.pkl, version, byteorder
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("evil/data.pkl", stream)
        z.writestr("evil/byteorder", "little")
        z.writestr("evil/version", "3\n")
    with pytest.raises(UnsupportedCheckpointError, match="weights_only"):
        list(iter_checkpoint(zipped))
    assert not (tmp_path / "pwned").exists()
    good = tmp_path / "pytorch_model.bin"
    torch.save(tensors(), good)
    got = dict(iter_checkpoint(good))
    assert torch.equal(got["model.norm.weight"], tensors()["model.norm.weight"])


def test_every_safetensors_dtype_reads_and_rebundles(tmp_path):
    from llmq.checkpoint import load_bundle, save_bundle

    sd = {"u16": torch.arange(5).to(torch.uint16), "u32": torch.arange(5).to(torch.uint32),
          "u64": torch.arange(5).to(torch.uint64), "e8m0": torch.ones(4).to(torch.float8_e8m0fnu),
          "e5m2": torch.ones(4).to(torch.float8_e5m2), "e4m3": torch.ones(4).to(torch.float8_e4m3fn),
          "bool": torch.tensor([True, False]), "scalar": torch.tensor(3.0), "f64": torch.ones(2, dtype=torch.float64),
          "i8": torch.tensor([-1, 2], dtype=torch.int8), "f16": torch.ones(3, dtype=torch.float16)}
    save_file(sd, tmp_path / "all.safetensors")

    def same(a, b):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))

    got = dict(iter_checkpoint(tmp_path / "all.safetensors"))
    assert all(same(got[k], sd[k]) for k in sd)
    back = load_bundle(save_bundle(got.items(), tmp_path / "b", fsync=False))
    assert all(same(back[k], sd[k]) for k in sd)


# -- read-ahead ----------------------------------------------------------------------------------------

def _read_ahead_threads():
    import threading

    return sum(t.name == "llmq-read-ahead" for t in threading.enumerate())


@pytest.mark.parametrize("read_ahead", [0, 1, 3])
def test_read_ahead_yields_the_same_stream(tmp_path, read_ahead):
    sd = tensors()
    folder = write_hf_folder(tmp_path / "hf", sd, n_shards=3)
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    serial = [(n, t.clone()) for n, t in iter_checkpoint(folder, read_ahead=0, tied=tied)]
    got = list(iter_checkpoint(folder, read_ahead=read_ahead, tied=tied))
    assert [n for n, _ in got] == [n for n, _ in serial] and len(got) == len(sd) + 1
    for (n, a), (m, b) in zip(got, serial):
        assert n == m and torch.equal(a, b)


def test_read_ahead_delivers_errors_in_order_and_stops_its_thread(tmp_path):
    sd = tensors()
    sd["model.layers.0.mlp.up_proj.weight"][3, 1] = float("nan")
    save_file(sd, tmp_path / "m.safetensors")
    before = _read_ahead_threads()
    seen = []
    with pytest.raises(NonFiniteWeightError, match=r"m\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj"):
        for name, _ in iter_checkpoint(tmp_path / "m.safetensors", read_ahead=2):
            seen.append(name)
    order = [n for n in safe_open_keys(tmp_path / "m.safetensors")]
    assert seen == order[:order.index("model.layers.0.mlp.up_proj.weight")]  # everything before it, in order
    with pytest.warns(RuntimeWarning, match="up_proj"):  # warnings come from the consumer's thread
        assert len(list(iter_checkpoint(tmp_path / "m.safetensors", nonfinite="warn"))) == len(sd)
    it = iter_checkpoint(tmp_path / "m.safetensors", nonfinite="allow")
    next(it)
    it.close()  # a consumer that stops early: the thread is joined
    assert _read_ahead_threads() == before


@pytest.mark.parametrize("threads", [1, 3])
def test_large_tensors_read_in_parallel_ranges_exactly(tmp_path, threads, monkeypatch):
    """A 20 MiB tensor is read as one byte range per torch thread; the bytes equal safe_open's, and a
    file that shrinks after opening fails in a later range with the one-line truncation error."""
    from safetensors import safe_open

    from llmq.checkpoint import safetensors_io
    from llmq.checkpoint.safetensors_io import SafetensorsFile

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine: the reads split
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert safetensors_io._idle_cpus() == 8
    g = torch.Generator().manual_seed(3)
    sd = {"big": torch.randint(-2 ** 31, 2 ** 31 - 1, (5 << 20,), dtype=torch.int32, generator=g),
          "small": torch.arange(7, dtype=torch.int16)}
    path = tmp_path / "m.safetensors"
    save_file(sd, path)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with safe_open(path, "pt") as ref:
            for name, t in iter_checkpoint(path, nonfinite="allow"):
                assert torch.equal(t, ref.get_tensor(name)), name
        with SafetensorsFile(path) as f:
            os.truncate(path, f.entries["big"].end - (3 << 20))  # the last range ends early
            with pytest.raises(CorruptCheckpointError, match=r"m\.safetensors: tensor 'big'.*file ended after"):
                f.read("big")
    finally:
        torch.set_num_threads(before)


def safe_open_keys(path):
    from llmq.checkpoint.safetensors_io import read_header

    return sorted(read_header(path).entries, key=lambda n: read_header(path).entries[n].start)


def test_read_ahead_holds_at_most_its_depth(tmp_path, monkeypatch):
    from llmq.checkpoint import safetensors_io

    save_file(tensors(), tmp_path / "m.safetensors")
    calls = []
    real_read = safetensors_io.SafetensorsFile.read

    def counting_read(self, name, *args, **kwargs):
        calls.append(name)
        return real_read(self, name, *args, **kwargs)

    monkeypatch.setattr(safetensors_io.SafetensorsFile, "read", counting_read)
    it = iter_checkpoint(tmp_path / "m.safetensors", read_ahead=1)
    next(it)  # holding tensor 0: at most tensor 1 may have been read ahead
    assert 1 <= len(calls) <= 2
    rest = list(it)
    assert len(rest) == 4 and len(calls) == 5
    with pytest.raises(ValueError, match="read_ahead"):
        next(iter_checkpoint(tmp_path / "m.safetensors", read_ahead=-1))


def test_a_large_pair_is_not_read_ahead(tmp_path, monkeypatch):
    from llmq.checkpoint import safetensors_io

    # file order: a (4 KiB), b (64 KiB), c (64 KiB), d (4 KiB)
    ts = {"a": torch.ones(1024), "b": torch.ones(16384), "c": torch.ones(16384), "d": torch.ones(1024)}
    save_file(ts, tmp_path / "m.safetensors")
    events = []
    real_read = safetensors_io.SafetensorsFile.read
    monkeypatch.setattr(safetensors_io.SafetensorsFile, "read",
                        lambda self, name, **kw: events.append(f"read {name}") or real_read(self, name, **kw))
    for name, _ in iter_checkpoint(tmp_path / "m.safetensors", read_ahead=1, read_ahead_bytes=80 << 10):
        time.sleep(0.05)  # time for the read-ahead thread to run ahead where it may
        events.append(f"got {name}")
    # b after a (68 KiB) and d after c are read ahead; c after b (128 KiB) waits for b to be done
    assert events.index("read b") < events.index("got a")
    assert events.index("got b") < events.index("read c")
    assert events.index("read d") < events.index("got c")
    default = list(iter_checkpoint(tmp_path / "m.safetensors"))  # default budget: 64 MiB, all read ahead
    assert [n for n, _ in default] == ["a", "b", "c", "d"]


# ---- strictness: the reference reader (safetensors.safe_open) decides what is a valid header ----------

_ENTRY = '"t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}'
HEADER_CASES = {  # raw JSON text: lone surrogates can only be written as escapes
    "metadata list": '{"__metadata__": [], %s}' % _ENTRY,
    "metadata string": '{"__metadata__": "", %s}' % _ENTRY,
    "metadata false": '{"__metadata__": false, %s}' % _ENTRY,
    "metadata zero": '{"__metadata__": 0, %s}' % _ENTRY,
    "metadata int value": '{"__metadata__": {"a": 1}, %s}' % _ENTRY,
    "metadata nested": '{"__metadata__": {"a": {}}, %s}' % _ENTRY,
    "metadata null": '{"__metadata__": null, %s}' % _ENTRY,
    "metadata empty": '{"__metadata__": {}, %s}' % _ENTRY,
    "metadata ok": '{"__metadata__": {"format": "pt"}, %s}' % _ENTRY,
    "lone high surrogate name": '{"\\ud800": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}',
    "lone low surrogate name": '{"x\\udc80": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}',
    "surrogate pair name": '{"\\ud83d\\ude00": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}',
    "lone surrogate metadata key": '{"__metadata__": {"\\ud800": "x"}, %s}' % _ENTRY,
    "lone surrogate metadata value": '{"__metadata__": {"x": "a\\udfff"}, %s}' % _ENTRY,
    "lone surrogate dtype": '{"t": {"dtype": "U8\\ud800", "shape": [2], "data_offsets": [0, 2]}}',
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_header_accepted_exactly_when_safe_open_accepts_it(tmp_path, case):
    from safetensors import safe_open

    raw = HEADER_CASES[case].encode("ascii")
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"ab")
    try:
        with safe_open(str(path), "pt") as f:
            reference = {k: f.get_tensor(k) for k in f.keys()}
    except Exception:
        reference = None
    if reference is None:
        with pytest.raises(CorruptCheckpointError, match=r"m\.safetensors"):
            list(iter_checkpoint(path))
    else:
        ours = dict(iter_checkpoint(path))
        assert ours.keys() == reference.keys()
        assert all(torch.equal(ours[k], reference[k]) for k in ours)


@pytest.mark.parametrize("bad", [{"model.norm.weight": "model\ud800.safetensors"},
                                 {"model.norm\udfff.weight": "SHARD"}])
def test_index_with_lone_surrogates_is_a_checkpoint_error(tmp_path, bad):
    folder = write_hf_folder(tmp_path / "hf", tensors())
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = data["weight_map"]["model.norm.weight"]
    data["weight_map"].update({k: shard if v == "SHARD" else v for k, v in bad.items()})
    index.write_text(json.dumps(data))  # ensure_ascii: the surrogate is written as a \\u escape
    with pytest.raises(CorruptCheckpointError, match="lone UTF-16 surrogate"):
        list(iter_checkpoint(folder))
    with pytest.raises(CorruptCheckpointError, match="lone UTF-16 surrogate"):
        checkpoint_names(folder)


def write_hub_cache(root, sd):
    """The layout huggingface_hub's snapshot_download writes: snapshots/<rev>/ holds relative
    symlinks into ../../blobs/<hash>."""
    plain = write_hf_folder(root / "plain", sd)
    model = root / "hub" / "models--org--tiny"
    snapshot = model / "snapshots" / "0123abcd"
    (model / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text("0123abcd")
    for i, name in enumerate(sorted(os.listdir(plain))):
        blob = model / "blobs" / f"{i:040x}"
        os.rename(plain / name, blob)
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snapshot / name)
    return model, snapshot


def test_hub_cache_snapshot_symlinks_into_blobs_are_followed(tmp_path):
    sd = tensors()
    model, snapshot = write_hub_cache(tmp_path, sd)
    got = dict(iter_checkpoint(snapshot))
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    # a link inside the snapshot pointing out of this model's cache folder is still refused
    save_file({"x": torch.zeros(1)}, tmp_path / "hub" / "elsewhere.safetensors")
    index = snapshot / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = data["weight_map"]["model.norm.weight"]
    os.unlink(snapshot / shard)
    os.symlink(os.path.join("..", "..", "..", "elsewhere.safetensors"), snapshot / shard)
    with pytest.raises(CorruptCheckpointError, match="outside the hub cache folder .*models--org--tiny"):
        list(iter_checkpoint(snapshot))
    # ... and so is a link into another model's blobs
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    os.rename(tmp_path / "hub" / "elsewhere.safetensors", other / "b")
    os.unlink(snapshot / shard)
    os.symlink(os.path.join("..", "..", "..", "models--org--other", "blobs", "b"), snapshot / shard)
    with pytest.raises(CorruptCheckpointError, match="outside"):
        list(iter_checkpoint(snapshot))


def test_a_folder_merely_named_like_a_snapshot_gets_no_wider_root(tmp_path):
    """Without the hub cache's blobs/ folder next to snapshots/, the checkpoint folder is the root."""
    folder = write_hf_folder(tmp_path / "models--a--b" / "snapshots" / "rev", tensors())
    save_file({"x": torch.zeros(1)}, tmp_path / "models--a--b" / "x.safetensors")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.norm.weight"] = "link.safetensors"
    os.symlink(os.path.join("..", "..", "x.safetensors"), folder / "link.safetensors")
    index.write_text(json.dumps(data))
    with pytest.raises(CorruptCheckpointError, match="outside the checkpoint folder"):
        list(iter_checkpoint(folder))


# ---- read buffers reused once unreferenced ------------------------------------------------------

MIB = 1 << 20


def test_a_read_buffer_is_reused_only_when_nothing_references_it():
    from llmq.checkpoint.safetensors_io import ReadBuffers

    bufs = ReadBuffers(max_bytes=16 * MIB)
    a = bufs.take(4 * MIB)
    b = bufs.take(4 * MIB)
    assert a.data_ptr() != b.data_ptr()  # a is still held
    ptr = a.data_ptr()
    view = a.view(torch.int16)[100:]
    array = b.numpy()
    del a, b
    c = bufs.take(4 * MIB)  # a's view and b's array keep both alive: a third buffer
    assert c.data_ptr() != ptr and len(c) == 4 * MIB
    del view
    assert bufs.take(4 * MIB).data_ptr() == ptr  # a's buffer is free again
    del array, c
    # Full (12 of 16 MiB kept): a read that needs more room forgets a free one first.
    big = bufs.take(8 * MIB)
    assert len(big) == 8 * MIB
    small = bufs.take(1024)  # under 4 MiB: never from the pool
    assert len(small) == 1024


def test_blocks_and_tensors_held_by_the_caller_keep_their_bytes(tmp_path):
    """The reader reuses a buffer only after the caller drops every reference to it: holding
    every block and tensor gives the file's bytes, and dropping them lets the reader reuse."""
    g = torch.Generator().manual_seed(3)
    expect = {f"model.layers.{i}.mlp.{p}.weight": torch.randn(rows, 1024, generator=g).to(torch.bfloat16)
              for i in range(3) for p, rows in (("gate_proj", 4096), ("down_proj", 2048))}
    path = str(tmp_path / "model.safetensors")
    save_file(expect, path)
    held = []
    for name, value in iter_checkpoint(path, chunk_bytes=4 * MIB):
        if hasattr(value, "blocks"):
            held.append((name, [(r0, blk) for r0, blk in value.blocks()]))
        else:
            held.append((name, [(0, value)]))
    for name, blocks in held:
        assert torch.equal(torch.cat([blk for _, blk in blocks]), expect[name]), name
    del held
    pointers, n = set(), 0
    for name, value in iter_checkpoint(path, chunk_bytes=4 * MIB):
        for r0, blk in (value.blocks() if hasattr(value, "blocks") else [(0, value)]):
            assert torch.equal(blk, expect[name][r0:r0 + blk.shape[0]]), name
            pointers.add(blk.data_ptr())
            n += 1
    assert n == 9 and len(pointers) <= 3  # 9 reads of 4 MiB (2 blocks, 1 whole tensor a layer), <= 3 buffers
