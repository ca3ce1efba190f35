"""GGUF import: every supported block type becomes the canonical form exactly.

Reference: gguf-py's own writer produces the files and its own dequantizer
(gguf.quants.dequantize) the expected values. Block bytes are random (every bit
pattern of quants and sub-scales), with random finite float16 super-scales, so the
test does not depend on any quantizer. "Bit for bit" is checked on the float32 bit
patterns, with one documented exception: gguf-py's d*(q-8) gives -0.0 where the
additive form scale*q + bias gives +0.0, so exact zeros are compared by value.
"""

import os

import gguf
import numpy as np
import pytest
import torch

from llmq.checkpoint import UnsupportedCheckpointError, iter_checkpoint, read_gguf_metadata  # noqa: E402
from llmq.checkpoint.gguf_import import SUPPORTED_TYPES, GGUFFile  # noqa: E402
from llmq.quant.formats import GroupQuantizedWeight, dequantize_canonical  # noqa: E402

T = gguf.GGMLQuantizationType
# byte offsets of the float16 fields inside one block (all others are free bits)
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
EXPECTED_GROUP = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q2_K": 16, "Q3_K": 16, "Q4_K": 32,
                  "Q5_K": 32, "Q6_K": 16}
EXPECTED_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5,
                 "Q6_K": 6}


def random_blocks(type_name: str, shape, rng: np.random.Generator) -> np.ndarray:
    """Random raw bytes in gguf-py's byte shape [..., N, K/block*type_size] with finite f16 scales."""
    block, type_size = gguf.GGML_QUANT_SIZES[T[type_name]]
    *lead, k = shape
    n_blocks = int(np.prod(lead)) * (k // block)
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in HALF_FIELDS[type_name]:
        # magnitudes from f16 subnormals to ~1e3, both signs
        mag = np.exp2(rng.uniform(-24, 10, size=n_blocks)) * rng.choice([-1.0, 1.0], size=n_blocks)
        raw[:, off:off + 2] = mag.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return raw.reshape(*lead, k // block * type_size)


def assert_bitwise_equal(ours: torch.Tensor, ref: np.ndarray):
    ref_t = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    assert ours.dtype == torch.float32 and ours.shape == ref_t.shape
    assert torch.equal(ours, ref_t)  # values (so -0.0 == +0.0)
    nonzero = ref_t != 0
    assert torch.equal(ours.view(torch.int32)[nonzero], ref_t.view(torch.int32)[nonzero])


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_string("general.name", "tiny")
    raws = {}
    for type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        raw = random_blocks(type_name, (8, 512), rng)
        raws[f"{type_name}.weight"] = (type_name, raw, (8, 512))
        w.add_tensor(f"{type_name}.weight", raw, raw_dtype=T[type_name])
    # a stacked MoE tensor [E=3, N=4, K=256]: GGUF ne = [256, 4, 3]
    moe = random_blocks("Q4_K", (3, 4, 256), rng)
    raws["moe.ffn_up_exps.weight"] = ("Q4_K", moe, (3, 4, 256))
    w.add_tensor("moe.ffn_up_exps.weight", moe, raw_dtype=T.Q4_K)
    moe6 = random_blocks("Q6_K", (2, 3, 256), rng)
    raws["moe.ffn_down_exps.weight"] = ("Q6_K", moe6, (2, 3, 256))
    w.add_tensor("moe.ffn_down_exps.weight", moe6, raw_dtype=T.Q6_K)
    f32 = rng.standard_normal((5, 7)).astype(np.float32)
    f16 = rng.standard_normal((6,)).astype(np.float16)
    bf16 = (rng.standard_normal((4, 8)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    w.add_tensor("norm.weight", f16)
    w.add_tensor("f32.weight", f32)
    w.add_tensor("bf16.weight", bf16.view(np.uint8).reshape(4, 16), raw_dtype=T.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, raws, {"f32.weight": f32, "norm.weight": f16, "bf16.weight": bf16}


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_block_types_match_gguf_dequantizer_bit_for_bit(gguf_file, type_name):
    path, raws, _ = gguf_file
    name = f"{type_name}.weight"
    got = dict(iter_checkpoint(path))[name]
    _, raw, shape = raws[name]
    assert isinstance(got, GroupQuantizedWeight)
    assert got.shape == shape and got.bits == EXPECTED_BITS[type_name]
    assert got.group_size == EXPECTED_GROUP[type_name]
    ref = gguf.quants.dequantize(raw, T[type_name])
    assert_bitwise_equal(dequantize_canonical(got), ref)


@pytest.mark.parametrize("name", ["moe.ffn_up_exps.weight", "moe.ffn_down_exps.weight"])
def test_moe_tensor_keeps_expert_dimension(gguf_file, name):
    path, raws, _ = gguf_file
    type_name, raw, shape = raws[name]
    got = dict(iter_checkpoint(path))[name]
    assert got.shape == shape and got.qdata.shape[:2] == shape[:2]
    ref = gguf.quants.dequantize(raw, T[type_name])
    assert_bitwise_equal(dequantize_canonical(got), ref)
    # expert e of the stack is exactly the GGUF rows of expert e
    e1 = dequantize_canonical(got)[1]
    assert_bitwise_equal(e1, gguf.quants.dequantize(raw[1], T[type_name]))


def test_plain_types_come_back_as_tensors(gguf_file):
    path, _, plain = gguf_file
    got = dict(iter_checkpoint(path))
    assert got["f32.weight"].dtype == torch.float32
    assert torch.equal(got["f32.weight"], torch.from_numpy(plain["f32.weight"]))
    assert got["norm.weight"].dtype == torch.float16
    assert torch.equal(got["norm.weight"], torch.from_numpy(plain["norm.weight"]))
    assert got["bf16.weight"].dtype == torch.bfloat16 and got["bf16.weight"].shape == (4, 8)
    ref = gguf.quants.dequantize(plain["bf16.weight"].view(np.uint8), T.BF16).reshape(4, 8)
    assert torch.equal(got["bf16.weight"].float(), torch.from_numpy(ref))


def test_metadata_and_dtype_option(gguf_file):
    path, _, _ = gguf_file
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2
    got = dict(iter_checkpoint(path, dtype=torch.bfloat16))
    assert got["Q4_0.weight"].dtype == torch.bfloat16  # recorded dequantization dtype
    assert got["f32.weight"].dtype == torch.bfloat16  # plain floats are cast


def test_unsupported_type_is_refused_by_name(tmp_path):
    path = tmp_path / "iq2.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((2, 66), dtype=np.uint8), raw_dtype=T.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedCheckpointError, match=r"blk\.0\.attn_q\.weight.*IQ2_XXS"):
        list(iter_checkpoint(path))


def test_supported_list_is_what_the_issue_names():
    assert set(SUPPORTED_TYPES) >= {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


def test_reads_in_file_order_without_dequantizing(gguf_file, monkeypatch):
    path, _, _ = gguf_file
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a, **k: pytest.fail("must not dequantize"))
    with GGUFFile(path) as f:
        offsets = [t.start for t in f.tensors]
        names = [n for n, _ in f]
    assert len(names) == len(offsets)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_swar_pack_equals_canonical_pack_bits(bits):
    from llmq.quant.formats import pack_bits
    from llmq.quant.formats.gguf_blocks import swar_pack

    q = torch.randint(0, 2 ** bits, (3, 5, 64), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    assert torch.equal(torch.from_numpy(swar_pack(q.numpy(), bits)), pack_bits(q, bits))


def test_unknown_type_id_is_refused_clearly(tmp_path):
    path = tmp_path / "unknown.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    # tensor info: name (u64 length + bytes), n_dims u32, dims u64 x n, type u32, offset u64
    at = data.index(b"blk.0.ffn_up.weight") + len("blk.0.ffn_up.weight") + 4 + 2 * 8
    assert data[at:at + 4] == bytes([0, 0, 0, 0])  # F32
    data[at:at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(UnsupportedCheckpointError, match=r"unknown\.gguf.*GGML type.*Q4_K"):
        list(iter_checkpoint(path))
    data[at:at + 4] = (0).to_bytes(4, "little")
    path.write_bytes(bytes(data[:-16]))  # truncated data
    from llmq.checkpoint import CorruptCheckpointError
    with pytest.raises(CorruptCheckpointError, match="unknown.gguf"):
        list(iter_checkpoint(path))


# ---- dequantize_canonical works in row blocks: bounded scratch memory, identical values ----------------


@pytest.mark.parametrize("block_elements", [1, 700, 2048 + 256])
def test_blockwise_dequantization_matches_gguf_py_across_block_edges(gguf_file, monkeypatch, block_elements):
    """Blocks of one row, of one row with a remainder, and of several rows with a partial last block."""
    from llmq.quant.formats import int_affine as formats

    monkeypatch.setattr(formats, "DEQUANT_BLOCK_ELEMENTS", block_elements)
    path, raws, _ = gguf_file
    got = dict(iter_checkpoint(path))
    for name, (type_name, raw, _shape) in raws.items():
        assert_bitwise_equal(dequantize_canonical(got[name]), gguf.quants.dequantize(raw, T[type_name]))
    bf16 = dequantize_canonical(got["Q5_K.weight"], torch.bfloat16)  # float32 first, then one more rounding
    assert torch.equal(bf16, torch.from_numpy(gguf.quants.dequantize(raws["Q5_K.weight"][1], T.Q5_K)).bfloat16())


def test_blockwise_dequantization_touches_at_most_a_block_at_a_time(gguf_file, monkeypatch):
    from llmq.quant.formats import int_affine as formats

    seen = []
    unpack = formats.unpack_bits
    monkeypatch.setattr(formats, "unpack_bits", lambda q, bits, k: seen.append(q.shape[:-1].numel() * k) or
                        unpack(q, bits, k))
    monkeypatch.setattr(formats, "DEQUANT_BLOCK_ELEMENTS", 1024)
    path, raws, _ = gguf_file
    w = dict(iter_checkpoint(path))["moe.ffn_up_exps.weight"]  # [3, 4, 256]: 12 rows of 256
    dequantize_canonical(w)
    assert seen == [1024, 1024, 1024]


def test_dequantization_peak_memory_is_the_output_plus_one_block(tmp_path):
    """A 4096 x 4096 4-bit weight in a fresh process: peak RSS grows by the 64 MiB float32 output plus
    about one block of float64 scratch (~25 MiB); whole-tensor float64 intermediates grew it by ~400 MiB."""
    import subprocess
    import sys

    script = (
        "import os, resource, torch\n"
        "from llmq.quant.formats import GroupQuantizedWeight, dequantize_canonical\n"
        "n = k = 4096\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w = GroupQuantizedWeight(qdata=torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),\n"
        "    scale=torch.rand(n, k // 32, generator=g), bias=torch.rand(n, k // 32, generator=g), bits=4,\n"
        "    group_size=32, shape=(n, k))\n"
        "now = int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
        "out = dequantize_canonical(w)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - now)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    growth = int(subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True,
                                text=True).stdout)
    output = 4096 * 4096 * 4
    assert growth < output + (64 << 20), f"peak RSS grew by {growth / 2 ** 20:.0f} MiB"


# ---- quantized tensors are read in chunks; truncated block data names the tensor ----------------------

@pytest.mark.parametrize("native", ["on", "off"])
def test_chunked_read_equals_whole_tensor_decode(gguf_file, monkeypatch, native):
    import llmq.checkpoint.gguf_import as gi
    from llmq.quant import _native
    from llmq.quant.formats.gguf_blocks import decode

    path, raws, _ = gguf_file
    if native == "off":
        monkeypatch.setattr(_native, "gguf_decode_available", lambda: False)
    monkeypatch.setattr(gi, "CHUNK_BYTES", 1000)  # a few blocks per chunk, cutting rows
    with GGUFFile(path) as f:
        for info in f.tensors:
            if info.type_name not in ("Q5_0", "Q4_K", "Q6_K"):
                continue
            got = f.read(info)
            _, raw, shape = raws[info.name]
            ref = decode(info.type_name, torch.from_numpy(raw), shape, native=False)
            assert torch.equal(got.qdata, ref.qdata)
            assert torch.equal(got.scale.view(torch.int32), ref.scale.view(torch.int32))
            assert torch.equal(got.bias.view(torch.int32), ref.bias.view(torch.int32))


def test_truncated_block_data_is_one_error_line_naming_the_tensor(tmp_path):
    from llmq.checkpoint import CorruptCheckpointError

    path = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", random_blocks("Q6_K", (4, 512), np.random.default_rng(1)),
                 raw_dtype=T.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CorruptCheckpointError) as e:
        list(iter_checkpoint(path))
    msg = str(e.value)
    assert "blk.0.attn_q.weight" in msg and "cut.gguf" in msg and "truncated" in msg and "\n" not in msg


def test_outputs_held_by_the_caller_keep_their_bytes_and_dropped_ones_are_reused(tmp_path):
    """Imported tensors of 4 MiB and more come from reused buffers (ReadBuffers): one the caller
    still holds is never written again; dropped ones are."""
    rng = np.random.default_rng(5)
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    raws = {}
    for i in range(4):  # Q8_0 [2048, 2048]: 4 MiB of codes each; f32 [1024, 1024]: 4 MiB read raw
        raws[f"blk.{i}.q.weight"] = random_blocks("Q8_0", (2048, 2048), rng)
        w.add_tensor(f"blk.{i}.q.weight", raws[f"blk.{i}.q.weight"], raw_dtype=T.Q8_0)
        raws[f"blk.{i}.f.weight"] = rng.standard_normal((1024, 1024)).astype(np.float32)
        w.add_tensor(f"blk.{i}.f.weight", raws[f"blk.{i}.f.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    def expected(name):
        if name.endswith(".f.weight"):
            return torch.from_numpy(raws[name])
        return torch.from_numpy(gguf.quants.dequantize(raws[name], T.Q8_0))

    held = list(iter_checkpoint(str(path)))
    for name, value in held:
        got = dequantize_canonical(value).float() if isinstance(value, GroupQuantizedWeight) else value
        assert torch.equal(got, expected(name)), name
    del held, value, got
    pointers = set()
    for name, value in iter_checkpoint(str(path)):
        got = dequantize_canonical(value).float() if isinstance(value, GroupQuantizedWeight) else value
        assert torch.equal(got, expected(name)), name
        pointers.add((value.qdata if isinstance(value, GroupQuantizedWeight) else value).data_ptr())
    assert len(pointers) <= 4  # 8 tensors of 4 MiB from a few buffers
