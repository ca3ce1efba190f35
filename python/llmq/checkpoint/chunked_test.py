"""Tensors read as blocks of rows (iter_checkpoint(chunk_bytes=)) write the same bytes as whole
tensors: through quantize_stream into save_bundle for every quantizable format (per-tensor
scales included), and through the Hugging Face export; one block at a time; NaN/Inf errors and
warnings read as for the whole tensor."""

import os
import re
import warnings

import pytest
import torch
from safetensors.torch import save_file

from llmq.checkpoint import NonFiniteWeightError, iter_checkpoint, load_bundle, save_bundle
from llmq.checkpoint.testing_util import FORMAT_CONFIGS as CONFIGS
from llmq.quant import QuantConfig, QuantRecipe, QuantRule, get_format, quantize_stream
from llmq.quant.row_blocks import QuantizedRowBlocks, RowBlocks, TensorRowBlocks, quantize_row_blocks

CHUNK = 4096  # bytes: a 384 x 256 bf16 weight (192 KiB) becomes 48 blocks of 8 rows


def _checkpoint(folder, *, nan_at=None):
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(384, 256, generator=g) * 0.05).to(torch.bfloat16)
    w[5, 3] = 0.75  # an outlier, so the per-tensor amax sits in one block only
    if nan_at is not None:
        w[nan_at] = float("nan")
    tensors = {
        "model.embed_tokens.weight": torch.randn(300, 128, generator=g).to(torch.bfloat16),  # 300 % 16 rows
        "model.layers.0.mlp.down_proj.weight": w,
        "model.layers.0.mlp.up_proj.weight": torch.randn(130, 64, generator=g),  # float32, uneven blocks
        "model.layers.0.input_layernorm.weight": torch.ones(256, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": (torch.randn(16, 64, generator=g) * 0.1).to(torch.float16),  # small
        "lm_head.weight": torch.randn(3, 4, 1024, generator=g).to(torch.bfloat16),  # 3-D, 1 row = 8 KiB > CHUNK
    }
    path = os.path.join(folder, "model.safetensors")
    save_file(tensors, path)
    return path


def _files(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


def _bundle(src, out, recipe, chunk_bytes, seen=None, **kwargs):
    stream = quantize_stream(iter_checkpoint(src, chunk_bytes=chunk_bytes, **kwargs), recipe)

    def record(items):
        for name, value in items:
            if seen is not None:
                seen[name] = type(value)
            yield name, value

    save_bundle(record(stream), out, recipe=recipe, fsync=False)
    return _files(out)




@pytest.mark.parametrize("config", list(CONFIGS))
def test_bundle_bytes_equal_whole_tensor_path(tmp_path, config):
    src = _checkpoint(str(tmp_path))
    cfg = CONFIGS[config]
    both = get_format(cfg.format).shape_problem(cfg, (130, 64)) is None  # up_proj [130, 64]: no 128x128 tile
    recipe = QuantRecipe([QuantRule(r"model\.layers\.0\.mlp\.(down|up)_proj" if both else r".*down_proj", cfg)])
    whole = _bundle(src, str(tmp_path / "whole"), recipe, None)
    seen = {}
    chunked = _bundle(src, str(tmp_path / "chunked"), recipe, CHUNK, seen)
    assert list(chunked) == list(whole)
    for name in whole:
        assert chunked[name] == whole[name], name
    # The chunked path was taken: quantized weights and pass-through tensors alike.
    assert seen["model.layers.0.mlp.down_proj.weight"] is QuantizedRowBlocks
    assert seen["model.layers.0.mlp.up_proj.weight"] is QuantizedRowBlocks if both else issubclass(
        seen["model.layers.0.mlp.up_proj.weight"], RowBlocks)
    assert issubclass(seen["model.embed_tokens.weight"], RowBlocks)
    assert issubclass(seen["lm_head.weight"], RowBlocks)
    assert seen["model.layers.0.self_attn.q_proj.weight"] is torch.Tensor  # under CHUNK: whole


@pytest.mark.parametrize("config", [QuantConfig(format="int"), QuantConfig(format="nvfp4")], ids=["int4", "nvfp4"])
def test_bundle_bytes_equal_with_a_dtype_cast(tmp_path, config):
    """iter_checkpoint(dtype=) casts block by block: the same bytes as casting whole tensors."""
    src = _checkpoint(str(tmp_path))
    recipe = QuantRecipe([QuantRule(r".*_proj", config)])
    whole = _bundle(src, str(tmp_path / "whole"), recipe, None, dtype=torch.float16)
    seen = {}
    chunked = _bundle(src, str(tmp_path / "chunked"), recipe, CHUNK, seen, dtype=torch.float16)
    assert seen["model.layers.0.mlp.down_proj.weight"] is QuantizedRowBlocks
    assert chunked == whole


def test_per_tensor_scale_is_the_whole_tensors(tmp_path):
    """FP8 per tensor and NVFP4: the amax comes from one block only; every block uses it."""
    src = _checkpoint(str(tmp_path))
    for name, cfg in (("fp8_tensor", QuantConfig(format="fp8", granularity="tensor")), ("nvfp4", QuantConfig(format="nvfp4"))):
        recipe = QuantRecipe([QuantRule(r".*down_proj", cfg)])
        out = str(tmp_path / name)
        _bundle(src, out, recipe, CHUNK)
        w = load_bundle(out)["model.layers.0.mlp.down_proj.weight"]
        scale = w.scale if name == "fp8_tensor" else w.global_scale
        expect = 0.75 / (448.0 if name == "fp8_tensor" else 6.0 * 448.0)
        assert scale.shape == () and float(scale) == pytest.approx(expect, rel=1e-6)


def test_blocks_hold_at_most_chunk_bytes_and_rebuild_the_tensor(tmp_path):
    src = _checkpoint(str(tmp_path))
    whole = dict(iter_checkpoint(src))
    for name, value in iter_checkpoint(src, chunk_bytes=CHUNK, dtype=torch.float32):
        if not isinstance(value, RowBlocks):
            assert value.numel() * value.element_size() <= CHUNK * 2  # float32 of a <= CHUNK bf16 tensor
            continue
        rows = []
        for _r0, block in value.blocks():
            assert block.dtype == torch.float32
            assert block.numel() * whole[name].element_size() <= max(CHUNK, whole[name][0].numel() * 2)
            rows.append(block)
        assert torch.equal(torch.cat(rows), whole[name].float())
        assert torch.equal(value.whole(), whole[name].float())
        assert value.shape == whole[name].shape and value.nbytes == whole[name].numel() * 4


def test_nan_in_a_late_block_gives_the_whole_tensor_error(tmp_path):
    src = _checkpoint(str(tmp_path), nan_at=(380, 1))
    recipe = QuantRecipe([QuantRule(r".*down_proj", QuantConfig(format="nvfp4"))])
    with pytest.raises(NonFiniteWeightError) as whole:
        _bundle(src, str(tmp_path / "whole"), recipe, None)
    with pytest.raises(NonFiniteWeightError) as chunked:
        _bundle(src, str(tmp_path / "chunked"), recipe, CHUNK)
    assert str(chunked.value) == str(whole.value)
    assert "holds 1 NaN and 0 Inf" in str(chunked.value)
    assert not os.path.exists(tmp_path / "chunked")  # nothing published
    # A pass-through tensor (no quantization) reads the same.
    with pytest.raises(NonFiniteWeightError) as passed:
        _bundle(src, str(tmp_path / "plain"), QuantRecipe([]), CHUNK)
    assert str(passed.value) == str(whole.value)


def test_nan_warning_names_the_whole_tensors_counts(tmp_path):
    src = _checkpoint(str(tmp_path), nan_at=(200, 1))

    def messages(chunk_bytes):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _, value in iter_checkpoint(src, chunk_bytes=chunk_bytes, nonfinite="warn"):
                if isinstance(value, RowBlocks):
                    for _ in value.blocks():
                        pass
        return [str(w.message) for w in caught]

    assert messages(CHUNK) == messages(None) and len(messages(None)) == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_amax_pass_checks_like_the_reader(tmp_path, bad):
    """abs_max() reads the blocks once, the NaN/Inf check folded into the amax: a finite
    tensor gives the exact amax, a NaN/Inf the reader's own error or (warn) one warning."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(384, 256, generator=g).to(torch.bfloat16)
    path = os.path.join(str(tmp_path), "model.safetensors")
    save_file({"model.layers.0.mlp.down_proj.weight": w}, path)
    (_, rows), = iter_checkpoint(path, chunk_bytes=CHUNK)
    assert float(rows.abs_max()) == float(w.float().abs().max())
    w[300, 7] = bad
    save_file({"model.layers.0.mlp.down_proj.weight": w}, path)
    with pytest.raises(NonFiniteWeightError) as whole:
        list(iter_checkpoint(path))
    (_, rows), = iter_checkpoint(path, chunk_bytes=CHUNK)
    with pytest.raises(NonFiniteWeightError) as chunked:
        rows.abs_max()
    assert str(chunked.value) == str(whole.value)
    (_, rows), = iter_checkpoint(path, chunk_bytes=CHUNK, nonfinite="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows.abs_max()
    assert len(caught) == 1 and "down_proj" in str(caught[0].message)


def test_quantizer_errors_are_the_whole_tensors(tmp_path):
    """NaN allowed through by the reader: the block quantizer fails and the whole-tensor one
    raises its own message."""
    src = _checkpoint(str(tmp_path), nan_at=(300, 2))
    recipe = QuantRecipe([QuantRule(r".*down_proj", QuantConfig(format="int", bits=4, group_size=32))])
    errors = []
    for chunk_bytes in (None, CHUNK):
        with pytest.raises(ValueError) as e:
            _bundle(src, str(tmp_path / f"out{chunk_bytes}"), recipe, chunk_bytes, nonfinite="allow")
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "NaN/Inf" in errors[0]


def test_block128_needs_whole_tiles_and_odd_rows_fall_back(tmp_path):
    w = torch.randn(200, 128).to(torch.bfloat16)  # 200 rows: not a multiple of 128
    assert quantize_row_blocks(TensorRowBlocks(w, 3), QuantConfig(format="fp8", granularity="block128")) is None
    q = quantize_row_blocks(TensorRowBlocks(torch.randn(256, 128), 3), QuantConfig(format="fp8", granularity="block128"))
    assert q is not None and [r1 - r0 for r0, r1, _ in q.row_parts()] == [128, 128]


def test_chunk_bytes_argument_checks(tmp_path):
    src = _checkpoint(str(tmp_path))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
            list(iter_checkpoint(src, chunk_bytes=bad))
    with pytest.raises(ValueError, match="cannot be combined with convert"):
        list(iter_checkpoint(src, chunk_bytes=CHUNK, convert=lambda n, v: v))


def _hf_cases():
    """label -> (style, config dict): every exportable form (each registered format's example configs),
    each written in one of the styles its hook accepts for it, the styles taken in turn."""
    from llmq.export import make_spec

    cases, turn = {}, 0
    for label, config in CONFIGS.items():
        hook = get_format(config.format).hf_export
        if hook is None:
            continue
        styles = []
        for style in hook.styles:
            try:
                make_spec("m", config, style=style)
                styles.append(style)
            except ValueError:
                pass  # e.g. ModelOpt's per-tensor FP8 needs a static input scale
        cases[label] = (styles[turn % len(styles)], config.to_dict())
        turn += 1
    return cases


HF_CASES = _hf_cases()


@pytest.mark.parametrize("case", list(HF_CASES))
@pytest.mark.parametrize("max_shard_bytes", [100_000, 10 << 20])
def test_hf_export_bytes_equal_whole_tensor_path(tmp_path, case, max_shard_bytes):
    """Whole and chunked exports give the same files, with shard boundaries between and inside
    one module's tensors (100 kB shards) or none."""
    from llmq.export import write_hf_quantized_checkpoint

    style, fmt = HF_CASES[case]
    src = _checkpoint(str(tmp_path))
    quantized = r"model\.layers\.0\.mlp\.down_proj" if fmt.get("granularity") == "block128" else r".*_proj"
    outs = []
    for chunk_bytes in (None, CHUNK):
        out = str(tmp_path / f"hf{chunk_bytes}")
        stream = ((n, v) for n, v in iter_checkpoint(src, chunk_bytes=chunk_bytes) if n != "lm_head.weight")
        write_hf_quantized_checkpoint(out, stream, lambda module: fmt if re.fullmatch(quantized, module) else None,
                                      style=style, max_shard_bytes=max_shard_bytes)
        outs.append(_files(out))
    assert list(outs[0]) == list(outs[1])
    shards = sum(name.endswith(".safetensors") for name in outs[0])
    # (10 MiB: one shard, unless a tensor would break natural alignment, e.g. int5's odd-sized words)
    assert shards >= 2 if max_shard_bytes == 100_000 else shards >= 1, list(outs[0])
    for name in outs[0]:
        assert outs[1][name] == outs[0][name], name


def test_hf_export_writes_row_blocks_one_block_at_a_time(tmp_path, monkeypatch):
    """The chunked export never asks for the whole weight (no .whole()) in FP8 / NVFP4."""
    from llmq.export import write_hf_quantized_checkpoint

    src = _checkpoint(str(tmp_path))

    def refuse(self):
        raise AssertionError(f"whole() called for {self!r}")

    monkeypatch.setattr(RowBlocks, "whole", refuse)
    monkeypatch.setattr(type(next(v for _, v in iter_checkpoint(src, chunk_bytes=CHUNK) if isinstance(v, RowBlocks))),
                        "whole", refuse)
    for fmt in ({"format": "nvfp4"}, {"format": "fp8", "granularity": "channel"}):
        stream = ((n, v) for n, v in iter_checkpoint(src, chunk_bytes=CHUNK) if n != "lm_head.weight")
        write_hf_quantized_checkpoint(str(tmp_path / fmt["format"]), stream, lambda m, fmt=fmt: fmt if "down_proj" in m else None)



def _sibling_checkpoint(folder, names):
    g = torch.Generator().manual_seed(11)
    tensors = {n: (torch.randn(384, 256, generator=g) * (0.02 + 0.01 * i)).to(torch.bfloat16)
               for i, n in enumerate(names)}
    path = os.path.join(folder, "model.safetensors")
    save_file(tensors, path)
    return path


def test_siblings_sharing_an_amax_are_not_read_whole(tmp_path, monkeypatch):
    """gate/up (and q/k/v) share NVFP4's global scale: as row blocks they are read block by block
    (amax, then quantize) when their group completes, never whole; bytes as the whole-tensor path."""
    from llmq.export import write_hf_quantized_checkpoint

    names = [f"model.layers.0.mlp.{p}_proj.weight" for p in ("down", "gate", "up")]
    names += [f"model.layers.0.self_attn.{p}_proj.weight" for p in ("k", "o", "q", "v")]
    src = _sibling_checkpoint(str(tmp_path), names)
    fmt = {"format": "nvfp4"}
    outs = []
    for chunk_bytes in (None, CHUNK):
        out = str(tmp_path / f"hf{chunk_bytes}")
        with monkeypatch.context() as m:
            if chunk_bytes:
                m.setattr(RowBlocks, "whole", lambda self: pytest.fail(f"whole() called for {self!r}"))
                m.setattr(type(next(v for _, v in iter_checkpoint(src, chunk_bytes=CHUNK))), "whole",
                          lambda self: pytest.fail(f"whole() called for {self!r}"))
            write_hf_quantized_checkpoint(out, iter_checkpoint(src, chunk_bytes=chunk_bytes), lambda module: fmt)
        outs.append(_files(out))
    assert outs[1] == outs[0]


def _count_reads(monkeypatch):
    """{tensor name: bytes read from its file} for reads from here on."""
    from llmq.checkpoint import safetensors_io

    read = {}
    real = safetensors_io.pread_exact

    def counting(fd, buf, offset, *, path, tensor):
        read[tensor] = read.get(tensor, 0) + len(buf)
        return real(fd, buf, offset, path=path, tensor=tensor)

    monkeypatch.setattr(safetensors_io, "pread_exact", counting)
    return read


def test_amax_pass_keeps_its_last_blocks_for_the_next_pass(tmp_path, monkeypatch):
    """abs_max(keep_blocks=n) holds the last n blocks it read; the next blocks() yields them
    (equal to a fresh read) instead of reading them again, once: the pass after reads all."""
    src = _checkpoint(str(tmp_path))
    name = "model.layers.0.mlp.down_proj.weight"
    whole = dict(iter_checkpoint(src))[name]
    read = _count_reads(monkeypatch)
    rows = dict(iter_checkpoint(src, chunk_bytes=CHUNK))[name]
    block_bytes = rows.block_rows * whole.shape[1] * whole.element_size()
    assert float(rows.abs_max(keep_blocks=2)) == float(whole.float().abs().max())
    assert read[name] == whole.nbytes
    got = list(rows.blocks())
    assert read[name] == 2 * whole.nbytes - 2 * block_bytes  # the last two blocks were not read again
    assert torch.equal(torch.cat([b for _, b in got]), whole) and [r0 for r0, _ in got] == list(range(0, 384, 8))
    list(rows.blocks())
    assert read[name] == 3 * whole.nbytes - 2 * block_bytes  # kept blocks are handed out once
    rows.abs_max(keep_blocks=2)
    assert list(r0 for r0, _ in rows.blocks(16)) == list(range(0, 384, 16))  # other bounds: read, not kept
    assert read[name] == 5 * whole.nbytes - 2 * block_bytes

    rows = TensorRowBlocks(whole, 100)  # the base class: 4 blocks, the last of 84 rows
    reads = []
    monkeypatch.setattr(TensorRowBlocks, "_read", lambda self, r0, r1, check: reads.append(r0) or self.tensor[r0:r1].clone())
    rows.abs_max(keep_blocks=1)
    assert torch.equal(torch.cat([b for _, b in rows.blocks()]), whole) and reads == [0, 100, 200, 300, 0, 100, 200]

    import weakref  # kept blocks of other bounds are not held while the other pass runs

    made = []
    monkeypatch.setattr(TensorRowBlocks, "_read",
                        lambda self, r0, r1, check: made.append(self.tensor[r0:r1].clone()) or made[-1])
    rows.abs_max(keep_blocks=2)
    kept_refs = [weakref.ref(b) for b in made[-2:]]
    made.clear()
    other_pass = rows.blocks(8)
    next(other_pass)
    assert all(r() is None for r in kept_refs)


def test_nvfp4_export_reads_a_two_block_weight_once_where_it_is_quantized_next(tmp_path, monkeypatch):
    """A weight needing a tensor amax is quantized right after its amax pass from the blocks that
    pass kept (a sibling group: the first one written), so a weight of two blocks is read once;
    the other siblings are read twice. Bytes as the whole-tensor path."""
    from llmq.export import write_hf_quantized_checkpoint

    names = [f"model.layers.0.mlp.{p}_proj.weight" for p in ("down", "gate", "up")]
    names += [f"model.layers.0.self_attn.{p}_proj.weight" for p in ("k", "o", "q", "v")]
    src = _sibling_checkpoint(str(tmp_path), names)
    fmt = {"format": "nvfp4"}
    write_hf_quantized_checkpoint(str(tmp_path / "whole"), iter_checkpoint(src), lambda module: fmt)
    read = _count_reads(monkeypatch)
    size = 384 * 256 * 2
    write_hf_quantized_checkpoint(str(tmp_path / "rows"), iter_checkpoint(src, chunk_bytes=size // 2),
                                  lambda module: fmt)
    once = {n for n in names if n.split(".")[-2] in ("down_proj", "gate_proj", "k_proj", "o_proj")}
    assert read == {n: size if n in once else 2 * size for n in names}
    assert _files(str(tmp_path / "rows")) == _files(str(tmp_path / "whole"))


@pytest.mark.parametrize("last", ["model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.v_proj.weight"])
def test_an_incomplete_sibling_group_of_row_blocks_exports_after_the_stream_ends(tmp_path, last):
    """A sibling whose group never completes is flushed after the last tensor, when the reader's
    iterator has ended: its row blocks are still readable (the files close when they are freed)."""
    from llmq.export import write_hf_quantized_checkpoint

    src = _sibling_checkpoint(str(tmp_path), ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", last])
    fmt = {"format": "nvfp4"}
    outs = []
    for chunk_bytes in (None, CHUNK):
        out = str(tmp_path / f"hf{chunk_bytes}")
        write_hf_quantized_checkpoint(out, iter_checkpoint(src, chunk_bytes=chunk_bytes),
                                      lambda module: fmt if module.endswith("_proj") else None)
        outs.append(_files(out))
    assert outs[1] == outs[0]


def test_row_blocks_read_after_the_iterator_ended_then_files_close(tmp_path):
    src = _checkpoint(str(tmp_path))
    whole = dict(iter_checkpoint(src))
    before = len(os.listdir("/proc/self/fd"))
    held = {n: v for n, v in iter_checkpoint(src, chunk_bytes=CHUNK) if isinstance(v, RowBlocks)}
    assert held and len(os.listdir("/proc/self/fd")) > before  # still open: row blocks are held
    for name, rows in held.items():
        assert torch.equal(rows.whole(), whole[name])
    del rows, held
    assert len(os.listdir("/proc/self/fd")) == before


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
