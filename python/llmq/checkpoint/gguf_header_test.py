"""GGUF header parsing: corrupted counts fail at once, metadata agrees with gguf-py, large arrays stay
lazy, and an unchanged file is parsed once per process.

Files are written by gguf-py's GGUFWriter; gguf-py's GGUFReader is the reference for the values.
Every read of a corrupted file runs under a 5 s alarm, so a parser that loops on a bad count fails
the test instead of hanging it.
"""

import os
import struct
import time

import gguf
import numpy as np
import pytest

from llmq.checkpoint import (
    CorruptCheckpointError,
    UnsupportedCheckpointError,
    gguf_header,
    iter_checkpoint,
    read_gguf_metadata,
)
from llmq.checkpoint.gguf_import import GGUFFile
from llmq.checkpoint.testing_util import time_limit

TOKENS = [f"tok{i}" for i in range(5000)]  # above EAGER_ARRAY_LIMIT: stays on disk until used


def write_gguf(path, tokens=("a", "bb", "ccc")):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.5)
    w.add_bool("llama.flag", True)
    w.add_int64("llama.big", -(2 ** 40))
    w.add_float64("llama.f64", 0.1)
    w.add_uint8("llama.u8", 200)
    w.add_int16("llama.i16", -3)
    w.add_string("general.name", "tiny ✓")
    w.add_array("llama.pattern", [True, False, True])
    w.add_array("llama.heads", [4, 8, 4])
    w.add_array("llama.scales", [0.5, 1.5])
    w.add_array("tokenizer.ggml.tokens", list(tokens))
    w.add_tensor("norm.weight", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def field_offset(data: bytes, key: str) -> int:
    """Offset just after a metadata key's name (where its u32 value type starts)."""
    return data.index(key.encode()) + len(key)


def corrupt(path, at: int, fmt: str, value) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))


def refused(path) -> CorruptCheckpointError:
    with time_limit(5.0):
        with pytest.raises(CorruptCheckpointError) as info:
            list(iter_checkpoint(path))
    return info.value


@pytest.mark.parametrize("key", ["llama.pattern", "llama.heads", "tokenizer.ggml.tokens"])
@pytest.mark.parametrize("count", [2 ** 35, 2 ** 64 - 1, 10 ** 6])
def test_huge_array_count_fails_at_once_naming_the_field(tmp_path, key, count):
    path = write_gguf(tmp_path / "m.gguf")
    corrupt(path, field_offset(path.read_bytes(), key) + 4 + 4, "<Q", count)  # after type u32, element type u32
    start = time.perf_counter()
    err = refused(path)
    assert time.perf_counter() - start < 1.0
    msg = str(err)
    assert msg.startswith(str(path)) and repr(key) in msg and str(count) in msg and "bytes" in msg
    assert "IndexError" not in msg


def test_string_and_key_lengths_past_the_end_are_named(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    at = data.index(b"general.name") - 8  # the key's u64 length
    corrupt(path, at, "<Q", 2 ** 62)
    msg = str(refused(path))
    assert "metadata entry" in msg and "key" in msg and str(2 ** 62) in msg
    path = write_gguf(tmp_path / "m.gguf")
    corrupt(path, field_offset(path.read_bytes(), "general.name") + 4, "<Q", 10 ** 9)  # the string value's length
    msg = str(refused(path))
    assert "'general.name'" in msg and str(10 ** 9) in msg
    path = write_gguf(tmp_path / "m.gguf")
    at = path.read_bytes().index(b"ccc") - 8  # one element of the token array
    corrupt(path, at, "<Q", 2 ** 40)
    msg = str(refused(path))
    assert "'tokenizer.ggml.tokens'" in msg and "element 2" in msg


def test_counts_in_the_fixed_header_are_checked(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    for offset, what in ((8, "tensors"), (16, "metadata entries")):
        path = write_gguf(tmp_path / "m.gguf")
        corrupt(path, offset, "<Q", 2 ** 50)
        assert what in str(refused(path))
    path = write_gguf(tmp_path / "m.gguf")
    at = path.read_bytes().index(b"norm.weight") + len("norm.weight")
    corrupt(path, at, "<I", 7)  # n_dims
    msg = str(refused(path))
    assert "'norm.weight'" in msg and "7 dims" in msg


def test_bad_magic_version_endianness_and_alignment(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    corrupt(path, 0, "<4s", b"GGUX")
    assert "magic" in str(refused(path))
    path = write_gguf(tmp_path / "m.gguf")
    corrupt(path, 4, "<I", 1)
    with pytest.raises(UnsupportedCheckpointError, match="GGUF version 1"):
        list(iter_checkpoint(path))
    path = write_gguf(tmp_path / "m.gguf")
    corrupt(path, 4, ">I", 3)
    with pytest.raises(UnsupportedCheckpointError, match="big-endian"):
        list(iter_checkpoint(path))
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_uint32("general.alignment", 48)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(CorruptCheckpointError, match="general.alignment must be a power of two, got 48"):
        list(iter_checkpoint(tmp_path / "a.gguf"))


def test_metadata_equals_gguf_py(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tokens=TOKENS)
    ours = read_gguf_metadata(path)
    ref = gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours) == list(expected)
    for key, value in expected.items():
        got = ours[key]
        got = got.tolist() if isinstance(got, gguf_header.GGUFArray) else got
        assert got == value and type(got) is type(value), key
    assert isinstance(ours["llama.block_count"], int) and isinstance(ours["llama.pattern"], list)
    assert ours["llama.rope.freq_base"] == float(np.float32(10000.5))


def test_large_arrays_are_read_only_when_used(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tokens=TOKENS)
    with GGUFFile(path) as f:
        tokens = f.metadata["tokenizer.ggml.tokens"]
        assert isinstance(tokens, gguf_header.GGUFArray) and not tokens.loaded
        assert len(tokens) == len(TOKENS) and not tokens.loaded
        list(f)  # reading every tensor does not touch the metadata arrays
        assert not tokens.loaded
        assert tokens[4321] == "tok4321" and tokens.loaded
        assert list(tokens) == TOKENS and tokens == TOKENS
    # a file rewritten under a lazy array is refused, not misread
    lazy = gguf_header.parse_header(str(path)).metadata["tokenizer.ggml.tokens"]
    write_gguf(path, tokens=[t.upper() for t in TOKENS])
    with pytest.raises(CorruptCheckpointError, match="changed after its header was read"):
        lazy.tolist()


def test_parsed_once_per_unchanged_file(tmp_path, monkeypatch):
    calls = []
    real = gguf_header.parse_header
    monkeypatch.setattr(gguf_header, "parse_header", lambda p: calls.append(p) or real(p))
    gguf_header.clear_cache()
    path = write_gguf(tmp_path / "m.gguf", tokens=TOKENS)
    GGUFFile(path).close()
    GGUFFile(path).close()
    assert len(calls) == 2  # just written: its times are too fresh to trust (racy), so not cached
    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))
    for _ in range(4):
        GGUFFile(path).close()
        read_gguf_metadata(path)
    list(iter_checkpoint(path))
    assert len(calls) == 3
    write_gguf(path, tokens=TOKENS[:10])  # changed: parsed again
    os.utime(path, (hour_ago - 10, hour_ago - 10))
    assert read_gguf_metadata(path)["tokenizer.ggml.tokens"] == TOKENS[:10]
    assert len(calls) == 4


def _raw_gguf(path, kvs: bytes, kv_count: int, tensor_count: int = 0) -> str:
    """A GGUF of metadata only: the header then `kvs`, the key/value records as bytes."""
    def s(x):
        return struct.pack("<Q", len(x.encode())) + x.encode()
    head = b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count + 1) + s("general.architecture") + \
        struct.pack("<I", 8) + s("llama")
    with open(path, "wb") as f:
        f.write(head + kvs + b"\0" * (tensor_count * 32))
    return str(path)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_metadata_entry_and_tensor_counts_are_bounded(tmp_path):
    """A metadata-heavy header (1.4 M small entries in 32 MB) parsed for 24 s in 190 MB: more
    entries than a real GGUF has by far are refused in one line, before any is parsed."""
    n = gguf_header.MAX_METADATA_ENTRIES + 1
    kvs = b"".join(_key(f"k{i}") + struct.pack("<II", 4, i) for i in range(n))
    path = _raw_gguf(tmp_path / "keys.gguf", kvs, n)
    with pytest.raises(UnsupportedCheckpointError, match="metadata entries; at most"):
        gguf_header.parse_header(path)
    path = _raw_gguf(tmp_path / "tensors.gguf", b"", 0, tensor_count=gguf_header.MAX_TENSORS + 1)
    with pytest.raises(UnsupportedCheckpointError, match="tensors; at most"):
        gguf_header.parse_header(path)


def test_decoded_array_elements_are_bounded_in_all(tmp_path):
    """Arrays of up to EAGER_ARRAY_LIMIT elements are decoded at parse, but only up to
    EAGER_TOTAL_LIMIT elements in all: the rest stay on disk (memory was 10x the file's size)."""
    per = gguf_header.EAGER_ARRAY_LIMIT
    n = gguf_header.EAGER_TOTAL_LIMIT // per + 2
    kvs = b"".join(_key(f"a{i}") + struct.pack("<IIQ", 9, 4, per) + struct.pack(f"<{per}I", *range(per))
                   for i in range(n))
    header = gguf_header.parse_header(_raw_gguf(tmp_path / "arrays.gguf", kvs, n))
    arrays = [header.metadata[f"a{i}"] for i in range(n)]
    decoded = sum(len(a) for a in arrays if isinstance(a, list))
    assert decoded <= gguf_header.EAGER_TOTAL_LIMIT
    assert isinstance(arrays[-1], gguf_header.GGUFArray) and not arrays[-1].loaded
    assert arrays[-1].tolist() == list(range(per))  # still readable, on first use
