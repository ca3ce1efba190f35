"""Tensors too large to hold whole, carried through a stream as blocks of whole rows.

A reader (``iter_checkpoint(..., chunk_bytes=N)``) yields a tensor of more than N bytes as a
`RowBlocks`: its shape and dtype, and `blocks()` reading it block of rows by block of rows
(along the first dimension), never more than one block at a time. ``quantize_stream`` turns one
it quantizes into a `QuantizedRowBlocks`, which quantizes each block as it is read; the writers
(``save_bundle``, the Hugging Face export) place an item from its shape alone and write its bytes
block by block after the header entry. The bytes written are those of the whole-tensor path:

* every format quantizes along the last dimension in groups or blocks inside one row, so a
  block of whole rows quantizes to exactly its rows of the whole result (FP8 128x128 tiles:
  blocks of a multiple of 128 rows);
* a per-tensor scale (FP8 per tensor, NVFP4's global scale) comes from the amax of the whole
  tensor, computed in a first pass over the blocks (exact: a max of maxima), then given to
  each block's quantization, as ``quantize_fp8(scale=)`` / ``quantize_nvfp4(global_scale=)``
  would compute it from the whole tensor.

`Format.row_quantizer` says whether and how a format does this; ``None`` (and any block that
fails to quantize) sends the weight through the whole-tensor quantizer instead, which then
produces the same bytes or raises its usual error.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

import llmq.quant._native_fp as _native_fp
from llmq.quant.formats import Format, get_format
from llmq.quant.formats.base import RowQuantizer

Parts = Dict[str, torch.Tensor]

# Blocks a per-tensor scale's amax pass keeps for the quantizing pass that follows it
# (RowBlocks.abs_max(keep_blocks=)): a tensor of up to this many blocks is read once.
SECOND_PASS_KEPT_BLOCKS = 2


class RowBlocks:
    """A dense tensor read block of rows by block of rows (rows: the first dimension).

    Subclasses implement `_read(r0, r1, check)`; `block_rows` is the most rows one block holds.
    It looks enough like a tensor for a writer to place it (shape, dtype, dim, numel,
    element_size); `whole()` reads all of it (for consumers that need the full tensor)."""

    def __init__(self, shape: Tuple[int, ...], dtype: torch.dtype, block_rows: int):
        if len(shape) < 1 or shape[0] < 1:
            raise ValueError(f"RowBlocks needs at least one row, got shape {list(shape)}")
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.block_rows = max(1, int(block_rows))
        self._kept: Dict[Tuple[int, int], torch.Tensor] = {}  # see abs_max(keep_blocks=)

    # -- what a writer asks -------------------------------------------------------------------------
    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()

    @property
    def rows(self) -> int:
        return self.shape[0]

    def parts_layout(self) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
        """(role, dtype, shape) of what it stores: one dense part, "data"."""
        return [("data", self.dtype, tuple(self.shape))]

    def row_parts(self) -> Iterator[Tuple[int, int, Parts]]:
        """(first row, end row, {role: the block's tensor}) for each block, in order."""
        for r0, block in self.blocks():
            yield r0, r0 + block.shape[0], {"data": block}

    # -- reading ------------------------------------------------------------------------------------
    def bounds(self, multiple: int = 1) -> Iterator[Tuple[int, int]]:
        step = max(multiple, self.block_rows // multiple * multiple)
        for r0 in range(0, self.rows, step):
            yield r0, min(self.rows, r0 + step)

    def blocks(self, multiple: int = 1, *, check: bool = True) -> Iterator[Tuple[int, torch.Tensor]]:
        """(first row, block) for blocks of at most `block_rows` rows (a multiple of `multiple`
        except the last). check=False skips the reader's NaN/Inf check (a second pass). Blocks
        the last `abs_max(keep_blocks=)` kept are yielded from memory, not read again."""
        bounds = list(self.bounds(multiple))
        kept = self.take_kept(bounds)
        for r0, r1 in bounds:
            block = kept.pop((r0, r1), None)
            yield r0, block if block is not None else self._read(r0, r1, check)
            del block

    def abs_max(self, keep_blocks: int = 0) -> torch.Tensor:
        """float32 max |w| over the whole tensor (0-dim), one block at a time: exact, a max of the
        blocks' maxima. The NaN/Inf check is folded into the compiled amax, which is finite
        exactly when every element is: the blocks are read unchecked, and only a tensor with a
        NaN/Inf (or no compiled kernel) is read again checked, as `blocks()` checks it.

        keep_blocks: the last this many blocks read stay in memory for the next `blocks()` call
        (with the same `multiple`, 1), which yields them instead of reading them again: for a
        caller that quantizes this tensor right after its amax (a per-tensor scale's second
        pass), at the cost of that many blocks held in between. They are known finite, as a
        checked read would find. The next `blocks()` call releases them."""
        amax: Optional[torch.Tensor] = None
        kept: List[Tuple[int, torch.Tensor]] = []
        self._kept = {}
        for r0, block in self.blocks(check=False):
            m = _native_fp.abs_max(block, False)
            if m is None:
                del kept, block
                return self._checked_abs_max()
            amax = m if amax is None else torch.maximum(amax, m)
            if keep_blocks > 0:
                kept.append((r0, block))
                del kept[:-keep_blocks]
            del block
        self._kept = {(r0, r0 + b.shape[0]): b for r0, b in kept}
        return amax if amax is not None else torch.zeros((), dtype=torch.float32)  # no rows: 0

    def take_kept(self, bounds: List[Tuple[int, int]]) -> Dict[Tuple[int, int], torch.Tensor]:
        """The blocks abs_max(keep_blocks=) kept whose (first row, end row) are among `bounds`,
        handed over once: every kept block is released from here (for a subclass's blocks())."""
        kept, self._kept = self._kept, {}
        return {b: kept[b] for b in bounds if b in kept}

    def _checked_abs_max(self) -> torch.Tensor:
        amax = None
        for _, block in self.blocks():
            m = _block_abs_max(block)
            amax = m if amax is None else torch.maximum(amax, m)
            del block
        return amax if amax is not None else torch.zeros((), dtype=torch.float32)

    def whole(self) -> torch.Tensor:
        """All rows in one tensor (validated as the reader validates a whole tensor)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        for r0, block in self.blocks():
            out[r0:r0 + block.shape[0]] = block
        return out

    def _read(self, r0: int, r1: int, check: bool) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={list(self.shape)}, dtype={self.dtype}, block_rows={self.block_rows})"


class TensorRowBlocks(RowBlocks):
    """A tensor already in memory, seen as row blocks (tests; a caller that wants the row-block
    write path for its own tensor)."""

    def __init__(self, tensor: torch.Tensor, block_rows: int):
        super().__init__(tuple(tensor.shape), tensor.dtype, block_rows)
        self.tensor = tensor

    def _read(self, r0: int, r1: int, check: bool) -> torch.Tensor:
        return self.tensor[r0:r1].contiguous()

    def whole(self) -> torch.Tensor:
        return self.tensor


def _block_abs_max(block: torch.Tensor) -> torch.Tensor:
    """float32 max |block| (0-dim), exact."""
    amax = _native_fp.abs_max(block, False)
    return amax if amax is not None else block.abs().amax().float()


class QuantizedRowBlocks:
    """A 2-D weight quantized block by block as a writer reads it: the stored parts of each
    block of rows, equal byte for byte to the rows of ``fmt.quantize`` on the whole weight.

    Record fields (what a writer needs before any data): fmt, name (the format name), params,
    shape, dtype, parts_layout(). `row_parts()` reads, quantizes and yields block by block.
    A block that fails to quantize sends the whole weight through `whole_quantize` (which
    raises the whole-tensor path's own error, or gives the bytes that are then used)."""

    def __init__(self, source: RowBlocks, fmt: Format, plan: RowQuantizer, probe: Any,
                 whole_quantize: Callable[[torch.Tensor], Any]):
        self.source, self.fmt, self.plan = source, fmt, plan
        self.name = fmt.name_of(probe)
        self.params = fmt.params(probe)
        self.shape = tuple(source.shape)
        self.dtype = source.dtype
        layout = fmt.layout(self.name, self.params, self.shape)
        self._layout = [(role, layout[role][0], tuple(layout[role][1])) for role in fmt.stored(probe)]
        self._whole_quantize = whole_quantize

    def parts_layout(self) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
        """(role, dtype, shape) of every stored tensor, in the format's storage order."""
        return list(self._layout)

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dt.itemsize for _, dt, shape in self._layout)

    def row_parts(self) -> Iterator[Tuple[int, int, Parts]]:
        multiple = self.plan.row_multiple
        amax = self.source.abs_max(SECOND_PASS_KEPT_BLOCKS) if self.plan.needs_amax else None
        for r0, block in self.source.blocks(multiple, check=amax is None):
            try:
                q = self.plan.quantize(block, amax)
            except (ValueError, RuntimeError):
                q = None
            if q is None:  # the whole-tensor quantizer raises its own error (or, unexpectedly, succeeds)
                q = self._whole_quantize(self.source.whole())
                yield 0, self.source.rows, self.fmt.stored(q)
                return
            yield r0, r0 + block.shape[0], self.fmt.stored(q)
            del block, q

    def __repr__(self) -> str:
        return f"QuantizedRowBlocks({self.name}, shape={list(self.shape)}, dtype={self.dtype})"


def quantize_row_blocks(source: RowBlocks, config: Any, *, name: str = "<tensor>") -> Optional[QuantizedRowBlocks]:
    """`source` quantized by `config` block by block, or None when its format cannot do that for
    this weight (then quantize ``source.whole()`` instead)."""
    if len(source.shape) != 2 or source.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    fmt = get_format(config.format)
    plan = fmt.row_quantizer(config, tuple(source.shape), name=name)
    if plan is None:
        return None
    try:  # the container of a block of zeros gives the record's name and params
        probe = plan.quantize(torch.zeros(plan.row_multiple, source.shape[1], dtype=source.dtype),
                              torch.ones((), dtype=torch.float32) if plan.needs_amax else None)
    except (ValueError, RuntimeError):
        return None  # e.g. a K the format refuses: the whole-tensor path raises its error
    return QuantizedRowBlocks(source, fmt, plan, probe, lambda w: fmt.quantize(w, config, name=name))


def is_row_blocks(value: Any) -> bool:
    """Whether `value` is a tensor or quantized weight a writer receives block by block."""
    return isinstance(value, (RowBlocks, QuantizedRowBlocks))
