"""Mutation tests: thousands of corrupted files into the readers; only CheckpointError comes out.

Each example mutates a small valid file (bit flips, overwritten 64-bit fields,
truncation, insertions; positions biased towards the headers, where the parsing
happens), reads it completely, and asserts that the reader either succeeds or raises
CheckpointError -- never IndexError, struct.error, MemoryError, a numpy error, or a
hang (each example runs under a 5 s alarm). Where the reader accepts a mutated
safetensors file, the reference implementation (safetensors.safe_open) must accept it
too and return the same tensors; for structured headers the reverse holds as well.
GGUF files are also built field by field, and their counts and lengths (array element
counts, string and key lengths, tensor and metadata counts, dims, offsets) overwritten
with hostile values; where the reader accepts such a file, gguf-py's GGUFReader must
read the same metadata and tensor table. Mutated safetensors files are also read as row
blocks (iter_checkpoint(chunk_bytes=)), which must fail or succeed exactly as the whole
read does and give the same bytes. (The GGUF hyper-parameter and tokenizer fields, read by
the model packages, are fuzzed in models/pipeline/gguf_fuzz_test.py.) Deterministic
(derandomize) and bounded: about 4,600 examples, under a minute.
"""

import json
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import save_file

from llmq.checkpoint import CheckpointError, iter_checkpoint, load_bundle, save_bundle
from llmq.checkpoint.testing_util import time_limit
from llmq.quant.formats import GroupQuantizedWeight, pack_bits

_FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                 suppress_health_check=list(HealthCheck))


def fuzz(n: int):
    return settings(_FUZZ, max_examples=n)


def mutations(hot_bytes: int):
    pos = st.one_of(st.integers(0, hot_bytes - 1), st.integers(0, 1 << 20))
    return st.lists(st.one_of(
        st.tuples(st.just("xor"), pos, st.integers(1, 255)),
        st.tuples(st.just("u64"), pos, st.one_of(st.integers(0, 2 ** 64 - 1), st.integers(0, 4096))),
        st.tuples(st.just("truncate"), pos, st.just(0)),
        st.tuples(st.just("insert"), pos, st.binary(min_size=1, max_size=12)),
        st.tuples(st.just("delete"), pos, st.integers(1, 16)),
    ), min_size=1, max_size=3)


def mutate(data: bytes, ops) -> bytes:
    buf = bytearray(data)
    for op, p, arg in ops:
        p = p % (len(buf) + 1)
        if op == "xor" and p < len(buf):
            buf[p] ^= arg
        elif op == "u64":
            buf[p:p + 8] = struct.pack("<Q", arg)
        elif op == "truncate":
            del buf[p:]
        elif op == "insert":
            buf[p:p] = arg
        elif op == "delete":
            del buf[p:p + arg]
    return bytes(buf)


def read_all(path, **kw):
    """Consume the reader fully; return the tensors or the CheckpointError."""
    with time_limit(5.0):
        try:
            return dict(iter_checkpoint(path, **kw))
        except CheckpointError as e:
            return e


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fuzz"))


def seed_safetensors(workdir) -> bytes:
    path = os.path.join(workdir, "seed.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({"a": torch.randn(3, 4, generator=g), "b": torch.arange(6, dtype=torch.int16),
               "c": torch.randn(2, 2, generator=g).to(torch.bfloat16), "e": torch.zeros(0, 3)},
              path, metadata={"format": "pt"})
    return open(path, "rb").read()


def check_against_reference(path, ours):
    if isinstance(ours, CheckpointError):
        return
    from safetensors import safe_open

    with safe_open(path, "pt") as f:  # the reference must accept what we accept ...
        assert sorted(f.keys()) == sorted(ours)
        for k in f.keys():  # ... and agree on every tensor
            ref = f.get_tensor(k)
            assert ref.dtype == ours[k].dtype and ref.shape == ours[k].shape
            assert torch.equal(ref.view(torch.uint8), ours[k].view(torch.uint8)) if ref.numel() else True


def write_mutated(workdir, name: str, seed: bytes, ops) -> str:
    """The seed file's bytes with the mutations applied, written as workdir/name."""
    path = os.path.join(workdir, name)
    with open(path, "wb") as f:
        f.write(mutate(seed, ops))
    return path


@fuzz(1000)
@given(ops=mutations(hot_bytes=200))
def test_mutated_safetensors(workdir, ops):
    path = write_mutated(workdir, "m.safetensors", seed_safetensors.cache, ops)
    ours = read_all(path, nonfinite="allow")
    check_against_reference(path, ours)


_DTYPES = ["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "Q4", "", 7, None]


@st.composite
def headers(draw):
    n = draw(st.integers(0, 3))
    header, data_len = {}, 0
    for i in range(n):
        shape = draw(st.lists(st.one_of(st.integers(0, 5), st.integers(-3, 2 ** 63)), max_size=3))
        lo = draw(st.integers(-2, 64))
        hi = draw(st.one_of(st.integers(-2, 80), st.integers(0, 2 ** 64)))
        header[f"t{i}"] = {"dtype": draw(st.sampled_from(_DTYPES)), "shape": shape, "data_offsets": [lo, hi]}
        if draw(st.booleans()):
            header[f"t{i}"][draw(st.sampled_from(["extra", "dtype", "shape"]))] = draw(
                st.one_of(st.none(), st.integers(), st.text(max_size=3)))
    strings = st.one_of(st.text(max_size=3), st.sampled_from(["\ud800", "a\udfff", "\udc80b", "\U0001f600"]))
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(
            st.dictionaries(strings, st.one_of(strings, st.integers(), st.none()), max_size=2),
            st.sampled_from([[], "", 0, False, None, {}, [["a", "b"]]])))
    if draw(st.integers(0, 4)) == 0 and header:  # a tensor name that is not valid Unicode
        name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__") or ["__metadata__"]))
        header[name + draw(st.sampled_from(["\ud800", "\udfff"]))] = header.pop(name)
    data_len = draw(st.integers(0, 96))
    return header, data_len


@fuzz(500)
@given(spec=headers())
def test_structured_safetensors_headers(workdir, spec):
    header, data_len = spec
    raw = json.dumps(header).encode()
    path = os.path.join(workdir, "h.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes(range(data_len % 256)) + b"\0" * max(0, data_len - 256))
    ours = read_all(path, nonfinite="allow")
    check_against_reference(path, ours)
    if isinstance(ours, CheckpointError):  # ... and we refuse only what the reference refuses
        from safetensors import safe_open

        with pytest.raises(Exception):  # noqa: B017 - safetensors refuses with several exception types
            with safe_open(path, "pt") as f:
                [f.get_tensor(k) for k in f.keys()]


def seed_gguf(workdir):
    import gguf

    path = os.path.join(workdir, "seed.gguf")
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    q4 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
    w.add_tensor("blk.0.q4", q4, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    q6 = rng.integers(0, 256, size=(1, 210), dtype=np.uint8)
    q6[:, 208:210] = np.array([[0x00, 0x3C]], dtype=np.uint8)  # d = 1.0
    w.add_tensor("blk.0.q6", q6, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.add_tensor("norm", rng.standard_normal(8).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open(path, "rb").read()


@fuzz(700)
@given(ops=mutations(hot_bytes=400))
def test_mutated_gguf(workdir, ops):
    path = write_mutated(workdir, "m.gguf", seed_gguf.cache, ops)
    got = read_all(path, nonfinite="error")
    if not isinstance(got, CheckpointError):
        for v in got.values():
            assert isinstance(v, (torch.Tensor, GroupQuantizedWeight))


class GGUFBuilder:
    """Writes a GGUF file field by field (independently of the reader under test) and records
    where every count and length lives, so the fuzzer can overwrite exactly those."""

    def __init__(self):
        self.buf = bytearray()
        self.fields = []  # (offset, struct format, label)

    def put(self, fmt: str, value, label=None):
        if label is not None:
            self.fields.append((len(self.buf), fmt, label))
        self.buf += struct.pack(fmt, value)

    def string(self, s: str, label: str):
        raw = s.encode()
        self.put("<Q", len(raw), f"{label} length")
        self.buf += raw

    def value(self, vtype: int, v, label: str):
        if vtype == 8:
            self.string(v, label)
        elif vtype == 9:
            etype, items = v
            self.put("<I", etype, f"{label} element type")
            self.put("<Q", len(items), f"{label} count")
            for i, item in enumerate(items):
                self.value(etype, item, f"{label}[{i}]")
        else:
            self.buf += struct.pack("<" + {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                                           11: "q", 12: "d"}[vtype], v)

    def build(self, kvs, tensors, alignment=32) -> bytes:
        self.buf += b"GGUF"
        self.put("<I", 3, "version")
        self.put("<Q", len(tensors), "tensor count")
        self.put("<Q", len(kvs), "kv count")
        for key, vtype, v in kvs:
            self.string(key, f"key {key}")
            self.put("<I", vtype, f"{key} type")
            self.value(vtype, v, key)
        offset, blobs = 0, []
        for name, ggml_type, dims, data in tensors:
            self.string(name, f"tensor {name} name")
            self.put("<I", len(dims), f"{name} n_dims")
            for d, n in enumerate(dims):
                self.put("<Q", n, f"{name} dim {d}")
            self.put("<I", ggml_type, f"{name} type")
            self.put("<Q", offset, f"{name} offset")
            blobs.append((offset, data))
            offset += len(data) + (-len(data) % alignment)
        self.buf += b"\0" * (-len(self.buf) % alignment)
        start = len(self.buf)
        for off, data in blobs:
            self.buf += b"\0" * (start + off - len(self.buf)) + data
        return bytes(self.buf)


def seed_gguf_fields():
    """A small GGUF holding every metadata value type and array kind, plus F32 / Q8_0 tensors."""
    rng = np.random.default_rng(1)
    q8 = rng.integers(0, 256, size=(2, 34), dtype=np.uint8)
    q8[:, 0:2] = np.array([0x00, 0x3C], dtype=np.uint8)  # d = 1.0
    kvs = [("general.architecture", 8, "llama"), ("general.alignment", 4, 32), ("llama.block_count", 4, 2),
           ("llama.u8", 0, 7), ("llama.i8", 1, -7), ("llama.u16", 2, 700), ("llama.i16", 3, -700),
           ("llama.i32", 5, -70000), ("llama.f32", 6, 0.5), ("llama.flag", 7, True), ("llama.u64", 10, 2 ** 40),
           ("llama.i64", 11, -(2 ** 40)), ("llama.f64", 12, 0.25),
           ("llama.pattern", 9, (7, [True, False, True])), ("llama.heads", 9, (5, [4, 8, 4, 8])),
           ("llama.scales", 9, (6, [0.5, 1.5])), ("llama.ids", 9, (10, [1, 2])),
           ("tokenizer.ggml.tokens", 9, (8, ["a", "bb", "", "dddd", "e"]))]
    tensors = [("norm.weight", 0, [8], np.arange(8, dtype=np.float32).tobytes()),
               ("blk.0.q8", 8, [32, 2], q8.tobytes()), ("tail", 0, [2, 2], np.ones(4, np.float32).tobytes())]
    builder = GGUFBuilder()
    return builder.build(kvs, tensors), builder.fields


_HOSTILE = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 31, 33, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 35,
                                      10 ** 9, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]),
                     st.integers(0, 2 ** 64 - 1), st.integers(0, 4096))


def gguf_reference_view(path):
    """gguf-py's reading of a file: metadata values and (name, type, dims, data offset) per tensor."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset)) for t in reader.tensors]
    return meta, tensors


def test_gguf_builder_seed_reads_the_same_in_gguf_py(workdir):
    from llmq.checkpoint import read_gguf_metadata

    path = os.path.join(workdir, "seed_fields.gguf")
    with open(path, "wb") as f:
        f.write(seed_gguf_fields.cache[0])
    meta = {k: list(v) for k, v in read_gguf_metadata(path).items() if not isinstance(v, (str, int, float))}
    ref_meta, _ = gguf_reference_view(path)
    assert meta == {k: v for k, v in ref_meta.items() if isinstance(v, list)}
    assert meta["tokenizer.ggml.tokens"] == ["a", "bb", "", "dddd", "e"]
    assert set(dict(iter_checkpoint(path))) == {"norm.weight", "blk.0.q8", "tail"}


@fuzz(1500)
@given(edits=st.lists(st.tuples(st.integers(0, 10 ** 6), _HOSTILE), min_size=1, max_size=2),
       delta=st.booleans(), cut=st.one_of(st.none(), st.integers(1, 160)))
def test_gguf_hostile_counts_and_lengths(workdir, edits, delta, cut):
    from llmq.checkpoint import gguf_header, read_gguf_metadata

    data, fields = seed_gguf_fields.cache
    buf = bytearray(data)
    for index, value in edits:
        offset, fmt, _ = fields[index % len(fields)]
        width = struct.calcsize(fmt)
        if delta:  # near the true value: off by a little, the classic miscount
            value = struct.unpack_from(fmt, buf, offset)[0] + (value % 33) - 16
        struct.pack_into(fmt, buf, offset, value % (1 << (8 * width)))
    if cut is not None:
        del buf[len(buf) - cut:]
    path = os.path.join(workdir, "f.gguf")
    with open(path, "wb") as f:
        f.write(bytes(buf))
    got = read_all(path, nonfinite="allow")
    with time_limit(5.0):
        try:
            meta = read_gguf_metadata(path)
            meta = {k: v.tolist() if isinstance(v, gguf_header.GGUFArray) else v for k, v in meta.items()}
        except CheckpointError:
            meta = None
    if isinstance(got, CheckpointError) or meta is None:
        return
    # Accepted: gguf-py reads the same (its reader is safe on a file whose counts all fit).
    with time_limit(5.0):
        ref_meta, ref_tensors = gguf_reference_view(path)
    assert meta == ref_meta
    header = gguf_header.parse_header(path)
    assert [(t.name, t.ggml_type, t.dims, t.start) for t in header.tensors] == ref_tensors


def read_all_rows(path, chunk_bytes: int, multiple: int):
    """Consume the reader with tensors over `chunk_bytes` as row blocks (iter_checkpoint(chunk_bytes=)),
    every block read; return {name: whole tensor rebuilt from its blocks} or the CheckpointError."""
    from llmq.quant.row_blocks import RowBlocks

    with time_limit(5.0):
        try:
            out = {}
            for name, value in iter_checkpoint(path, chunk_bytes=chunk_bytes, nonfinite="error"):
                if isinstance(value, RowBlocks):
                    rows = [block for _, block in value.blocks(multiple)]
                    assert sum(b.shape[0] for b in rows) == value.shape[0]
                    value = torch.cat(rows)
                out[name] = value
            return out
        except CheckpointError as e:
            return e


@fuzz(600)
@given(ops=mutations(hot_bytes=200), chunk_bytes=st.integers(1, 64), multiple=st.integers(1, 3))
def test_mutated_safetensors_row_blocks(workdir, ops, chunk_bytes, multiple):
    """Row-block reads of mutated files: only CheckpointError, and what is accepted equals the
    whole-tensor read (NaN/Inf refused in either)."""
    path = write_mutated(workdir, "rows.safetensors", seed_safetensors.cache, ops)
    rows = read_all_rows(path, chunk_bytes, multiple)
    whole = read_all(path, nonfinite="error")
    if isinstance(rows, CheckpointError) or isinstance(whole, CheckpointError):
        assert type(rows) is type(whole), (rows, whole)
        return
    assert rows.keys() == whole.keys()
    for name in whole:
        assert rows[name].dtype == whole[name].dtype and rows[name].shape == whole[name].shape
        assert torch.equal(rows[name].view(torch.uint8), whole[name].view(torch.uint8)) if whole[name].numel() else True


def seed_bundle(workdir):
    out = os.path.join(workdir, "seed_bundle")
    q = pack_bits(torch.arange(64).reshape(2, 32) % 16, 4)
    w = GroupQuantizedWeight(qdata=q, scale=torch.ones(2, 1), bias=torch.zeros(2, 1), bits=4, group_size=32,
                             shape=(2, 32))
    save_bundle([("w", w), ("d", torch.ones(3, dtype=torch.bfloat16))], out, max_shard_bytes=64, fsync=False)
    files = {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))}
    return files


@fuzz(300)
@given(target=st.sampled_from(["llmq_manifest.json", "model-00001.safetensors", "model-00002.safetensors"]),
       ops=mutations(hot_bytes=300), verify=st.booleans())
def test_mutated_bundles(workdir, target, ops, verify):
    folder = os.path.join(workdir, "bundle")
    os.makedirs(folder, exist_ok=True)
    for name, data in seed_bundle.cache.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(mutate(data, ops) if name == target else data)
    with time_limit(5.0):
        try:
            load_bundle(folder, verify=verify)
        except CheckpointError:
            pass


@st.composite
def weight_maps(draw):
    names = ["model-00001.safetensors", "../outside.safetensors", "/abs.safetensors", "missing.safetensors",
             "", ".", "sub/../model-00001.safetensors", "model-00001.safetensors\x00x",
             "model-00001\ud800.safetensors", "\udc80", "model-00001.safetensors\udfff"]
    wm = draw(st.dictionaries(st.sampled_from(["a", "b", "ghost", "a\ud800", "\udfff"]),
                              st.one_of(st.sampled_from(names), st.integers(), st.none()), max_size=3))
    return draw(st.sampled_from([{"weight_map": wm}, wm, [wm], {"weight_map": [1]}, "x"]))


@fuzz(300)
@given(index=weight_maps())
def test_mutated_index_json(workdir, index):
    folder = os.path.join(workdir, "hf")
    os.makedirs(folder, exist_ok=True)
    save_file({"a": torch.zeros(2), "b": torch.ones(1)}, os.path.join(folder, "model-00001.safetensors"))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    got = read_all(folder)
    if not isinstance(got, CheckpointError):
        assert set(got) <= {"a", "b"}


@pytest.fixture(scope="module", autouse=True)
def seeds(workdir):
    seed_safetensors.cache = seed_safetensors(workdir)
    seed_gguf.cache = seed_gguf(workdir)
    seed_gguf_fields.cache = seed_gguf_fields()
    from llmq.checkpoint import gguf_header

    gguf_header.EAGER_ARRAY_LIMIT, old_limit = 3, gguf_header.EAGER_ARRAY_LIMIT  # exercise the lazy arrays too
    seed_bundle.cache = seed_bundle(workdir)
    yield
    gguf_header.EAGER_ARRAY_LIMIT = old_limit
