"""iter_checkpoint / load_checkpoint: stream a checkpoint one tensor at a time.

Only the tensor being yielded is materialised (plus, by default, the next one, read on
a background thread while the caller works on this one): each is read with positioned
reads into fresh memory (safetensors, GGUF) and dropped by the caller before
the next, so a 60 GB checkpoint streams through a few hundred MB of RAM.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
import weakref
from collections import deque
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch

from llmq.checkpoint.errors import (
    MissingTensorsError,
    NonFiniteWeightError,
    TensorMismatchError,
)
from llmq.checkpoint.tensor_sources import Source, open_source
from llmq.quant import _native
from llmq.quant.formats import GroupQuantizedWeight
from llmq.quant.row_blocks import RowBlocks

Value = Union[torch.Tensor, GroupQuantizedWeight, RowBlocks]
KeyMap = Union[Mapping[str, Optional[str]], Callable[[str], Optional[str]], None]
Convert = Optional[Callable[[str, Value], Optional[Value]]]

NONFINITE_POLICIES = ("error", "warn", "allow")
DEFAULT_READ_AHEAD_MIN_BYTES = 64 << 20  # iter_checkpoint read_ahead_bytes=None: max(this, 5% of the input)
# Only real-valued high-precision floats are cast by dtype=; float8 weights carry
# separate scales, and casting them alone would silently change their meaning.
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _mapper(key_map: KeyMap) -> Callable[[str], Optional[str]]:
    if key_map is None:
        return lambda n: n
    if callable(key_map):
        return key_map
    if isinstance(key_map, Mapping):
        return lambda n: key_map.get(n, n)
    raise TypeError(f"key_map must be a mapping, a callable or None, got {type(key_map).__name__}")


def count_nonfinite(t: torch.Tensor) -> Tuple[int, int]:
    """(NaN count, Inf count) of a floating tensor; (0, 0) for anything else."""
    if not t.is_floating_point() or t.dtype not in _CASTABLE or t.numel() == 0:
        return 0, 0
    counts = _native.count_nonfinite(t)  # from the bits, one thread (no OpenMP team spinning)
    if counts is not None:
        return counts
    # One fused min/max pass (NaN propagates, +-Inf lands in min or max): ~10x faster
    # than torch.isfinite(t).all() on bf16 here, so the check can stay on by default.
    lo, hi = torch.aminmax(t)
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return 0, 0
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def find_nonfinite(name: str, value: Value, policy: str) -> List[Tuple[str, str]]:
    """(part name, message) for each part holding NaN/Inf; [] under policy "allow".

    Thread-safe (it only reads), so the read-ahead thread can run it; raising or warning
    is left to report_nonfinite in the consumer's thread.
    """
    if policy == "allow":
        return []
    parts = ((name, value),) if isinstance(value, torch.Tensor) else (
        (f"{name}.scale", value.scale), (f"{name}.bias", value.bias))
    found = []
    for part_name, t in parts:
        n_nan, n_inf = count_nonfinite(t)
        if n_nan or n_inf:
            found.append((part_name, _nonfinite_message(n_nan, n_inf)))
    return found


def _nonfinite_message(n_nan: int, n_inf: int) -> str:
    return f"holds {n_nan} NaN and {n_inf} Inf values; pass nonfinite='allow' or 'warn' to accept them"


def report_nonfinite(found: List[Tuple[str, str]], policy: str, *, path: str) -> None:
    for part_name, msg in found:
        if policy == "error":
            raise NonFiniteWeightError(msg, path=path, tensor=part_name)
        warnings.warn(f"{path}: tensor {part_name!r} {msg}", RuntimeWarning, stacklevel=4)


def check_finite(name: str, value: Value, policy: str, *, path: str) -> None:
    report_nonfinite(find_nonfinite(name, value, policy), policy, path=path)


def _cast(value: Value, dtype: Optional[torch.dtype]) -> Value:
    if dtype is None or isinstance(value, RowBlocks):  # row blocks are cast block by block
        return value
    if isinstance(value, GroupQuantizedWeight):
        return dataclasses.replace(value, dtype=dtype)
    if value.dtype in _CASTABLE and value.dtype != dtype:
        return value.to(dtype)
    return value


class _CheckpointRows(RowBlocks):
    """One tensor of a checkpoint yielded as blocks of rows (``iter_checkpoint(chunk_bytes=)``).

    Each block is read into fresh memory when asked for, NaN/Inf-checked and cast as the whole
    tensor would be, so the bytes are the whole tensor's. The NaN/Inf error names the whole
    tensor's counts: at the first block holding one, the rest is counted before raising, and
    nothing of that block is yielded; under "warn" the warning comes after the last block.
    Readable while referenced: when the iterator that yielded it ends, its files stay open
    until the last such object is freed (a writer may hold one to the end of the stream)."""

    def __init__(self, source: Source, name: str, out: str, stored_dtype: torch.dtype,
                 read_rows: Callable[[int, int], torch.Tensor], dtype: Optional[torch.dtype], nonfinite: str,
                 chunk_bytes: int):
        shape = source.shape(name)
        row_bytes = source.nbytes(name) // shape[0]
        self._cast_to = dtype if dtype is not None and stored_dtype in _CASTABLE else None
        super().__init__(shape, self._cast_to or stored_dtype, chunk_bytes // max(1, row_bytes))
        self._source, self._name, self._out = source, name, out
        self._read_rows, self._nonfinite = read_rows, nonfinite

    def _report(self, n_nan: int, n_inf: int, policy: str) -> None:
        report_nonfinite([(self._out, _nonfinite_message(n_nan, n_inf))], policy, path=self._source.path)

    def blocks(self, multiple: int = 1, *, check: bool = True):
        policy = self._nonfinite if check else "allow"
        bounds = list(self.bounds(multiple))
        kept = self.take_kept(bounds)  # abs_max found them finite and cast them already
        n_nan = n_inf = 0
        for i, (r0, r1) in enumerate(bounds):
            block = kept.pop((r0, r1), None)
            if block is not None:
                yield r0, block
                del block
                continue
            block = self._read_rows(r0, r1)
            if policy != "allow":
                a, b = count_nonfinite(block)
                n_nan, n_inf = n_nan + a, n_inf + b
                if (a or b) and policy == "error":
                    for r2, r3 in bounds[i + 1:]:
                        a, b = count_nonfinite(self._read_rows(r2, r3))
                        n_nan, n_inf = n_nan + a, n_inf + b
                    self._report(n_nan, n_inf, policy)
            yield r0, block if self._cast_to is None else _cast(block, self._cast_to)
            del block
        if n_nan or n_inf:
            self._report(n_nan, n_inf, policy)

    def whole(self) -> torch.Tensor:
        value = self._source.read(self._name)
        report_nonfinite(find_nonfinite(self._out, value, self._nonfinite), self._nonfinite, path=self._source.path)
        return _cast(value, self._cast_to)


@dataclasses.dataclass
class _Plan:
    source: Source
    renames: List[Tuple[str, str]]  # (name in file, output name), in read order
    aliases: Dict[str, List[str]]  # output name -> tied output names to yield it under as well


def _plan(path: str, key_map: KeyMap, tied: Optional[Mapping[str, str]]) -> _Plan:
    source = open_source(path)
    try:
        rename = _mapper(key_map)
        renames: List[Tuple[str, str]] = []
        origin: Dict[str, str] = {}
        for name in source.names():
            out = rename(name)
            if out is None:
                continue
            if not isinstance(out, str):
                raise TypeError(f"key_map returned {type(out).__name__} for {name!r}; expected str or None")
            if out in origin:
                raise TensorMismatchError(f"key_map sends both {origin[out]!r} and {name!r} to {out!r}",
                                          path=path, tensor=out)
            origin[out] = name
            renames.append((name, out))
        aliases: Dict[str, List[str]] = {}
        for target, src in (tied or {}).items():
            if target in origin:
                continue  # the checkpoint has its own copy: it wins
            if src not in origin:
                raise MissingTensorsError(
                    f"declared tied to {src!r}, but the checkpoint has neither (after key_map)",
                    path=path, tensor=target)
            aliases.setdefault(src, []).append(target)
        return _Plan(source, renames, aliases)
    except BaseException:
        source.close()
        raise


def checkpoint_names(path: str | os.PathLike, *, key_map: KeyMap = None,
                     tied: Optional[Mapping[str, str]] = None) -> List[str]:
    """The names iter_checkpoint would yield, in order, without reading any tensor data."""
    plan = _plan(os.fspath(path), key_map, tied)
    plan.source.close()
    out = []
    for _, name in plan.renames:
        out.append(name)
        out.extend(plan.aliases.get(name, ()))
    return out


def _from_headers(path: os.PathLike, key_map: KeyMap, field: Callable[[Source, str], Any]) -> Optional[Dict[str, Any]]:
    """{name after key_map: field(source, name)} in read order, or None when a field needs a read."""
    plan = _plan(os.fspath(path), key_map, None)
    try:
        values = {out: field(plan.source, name) for name, out in plan.renames}
    finally:
        plan.source.close()
    return None if any(v is None for v in values.values()) else values


def checkpoint_shapes(path: os.PathLike, *, key_map: KeyMap = None) -> Optional[Dict[str, Tuple[int, ...]]]:
    """{name: stored shape} in read order, from the headers alone (names after key_map), or None
    for a format whose shapes need reading the tensors (torch pickles, bundles)."""
    return _from_headers(path, key_map, lambda source, name: source.shape(name))


def checkpoint_stored_types(path: os.PathLike, *, key_map: KeyMap = None) -> Optional[Dict[str, str]]:
    """{name: stored type} in read order, by the file format's type name (safetensors "BF16", "I32";
    GGUF "F32", "Q4_K"), from the headers alone (names after key_map), or None for a format whose
    types need reading the tensors."""
    return _from_headers(path, key_map, lambda source, name: source.stored_type(name))


class _ReadAhead:
    """Reads (and NaN-checks) up to ``depth`` tensors ahead of the consumer on one thread.

    Reading (``preadv``) and the NaN/Inf check release the GIL, so they overlap whatever
    the consumer does with the previous tensor (quantizing, writing). A slot is taken
    before each read and given back when the consumer takes the tensor, so at most
    ``depth`` tensors exist beyond the one the consumer holds. A tensor whose stored bytes
    plus those of the tensor before it exceed ``pair_bytes`` is not read ahead: the thread
    waits until the consumer asks for it (so two large tensors, e.g. an embedding next to
    lm_head, are not in memory at once). A read error is delivered in order, when the
    consumer reaches that tensor.
    """

    _END = object()

    def __init__(self, renames: List[Tuple[str, str]], read: Callable[[str, str], Any], depth: int,
                 sizes: Optional[List[Optional[int]]] = None, pair_bytes: Optional[int] = None):
        self._renames, self._read = renames, read
        self._sizes = [s or 0 for s in sizes] if sizes else [0] * len(renames)
        self._pair_bytes = pair_bytes
        self._asked = 0  # items the consumer has asked for
        self._slots = threading.Semaphore(depth)
        self._ready: deque = deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="llmq-read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for i, (name, out) in enumerate(self._renames):
                self._slots.acquire()
                if self._stop:
                    return
                if (i and self._pair_bytes is not None
                        and self._sizes[i - 1] + self._sizes[i] > self._pair_bytes):
                    with self._cv:
                        while self._asked <= i and not self._stop:
                            self._cv.wait()
                    if self._stop:
                        return
                try:
                    item = (name, out, self._read(name, out), None)
                except BaseException as e:  # handed to the consumer at this position
                    item = (name, out, None, e)
                with self._cv:
                    self._ready.append(item)
                    self._cv.notify()
                failed = item[3] is not None
                del item  # the consumer owns it now: not held while the next one is read
                if failed:
                    return
        finally:
            with self._cv:
                self._ready.append(self._END)
                self._cv.notify()

    def __iter__(self):
        while True:
            with self._cv:
                self._asked += 1
                self._cv.notify_all()
                while not self._ready:
                    self._cv.wait()
                item = self._ready.popleft()
            if item is self._END:
                return
            self._slots.release()
            name, out, value, error = item
            if error is not None:
                raise error
            del item
            yield name, out, value
            del value  # not held while the next one is asked for and read

    def stop(self) -> None:
        self._stop = True
        self._slots.release()  # wake the thread if it waits for a slot
        with self._cv:
            self._cv.notify_all()  # or for the consumer to ask
        self._thread.join()


def iter_checkpoint(path: str | os.PathLike, *, key_map: KeyMap = None, convert: Convert = None,
                    dtype: Optional[torch.dtype] = None, tied: Optional[Mapping[str, str]] = None,
                    nonfinite: str = "error", read_ahead: int = 1,
                    read_ahead_bytes: Optional[int] = None,
                    chunk_bytes: Optional[int] = None) -> Iterator[Tuple[str, Value]]:
    """Yield ``(fqn, tensor)`` one at a time from a safetensors file, an HF folder or a GGUF file.

    key_map: a mapping (names not in it pass through; a None value drops the tensor)
        or a callable name -> new name | None. Dropped tensors are never read.
    convert: called as convert(fqn, value) after the dtype cast; may return a new
        value (e.g. a quantized weight) or None to drop it.
    dtype: cast high-precision float tensors (f16/bf16/f32/f64) to this dtype; for
        GGUF-quantized weights it is recorded as their dequantization dtype.
    tied: {target: source} in output names, e.g. {"lm_head.weight":
        "model.embed_tokens.weight"}: when the checkpoint lacks target, source is
        yielded again under that name (the same tensor object, no copy).
    nonfinite: "error" (default) refuses NaN/Inf in float weights and quantization
        scales, "warn" warns, "allow" skips the check.
    read_ahead: how many tensors to read (and check) on a background thread ahead of
        the one being yielded; 0 reads in the caller's thread. Each costs one tensor of
        memory; 1 (default) lets reading overlap the caller's work on this tensor.
    read_ahead_bytes: a tensor is read ahead only while its stored bytes plus those of
        the tensor before it (the one the caller holds) are at most this; a larger pair
        is read in turn, when the caller asks. None (default): 5% of the checkpoint's
        bytes, at least 64 MiB, so read-ahead memory stays a small fraction of the input.
    chunk_bytes: None (default) yields every tensor whole. An int: a safetensors tensor of more
        than this many bytes is yielded as a RowBlocks (llmq.quant.row_blocks) instead, which
        reads it when asked, a block of whole rows (at most chunk_bytes, at least one row) at a
        time, each checked and cast as above; quantize_stream, save_bundle and the Hugging
        Face export write it block by block with the same bytes. It is never read ahead.
        Not with convert= (which expects whole tensors).

    Every problem with the input raises a CheckpointError naming the file and tensor.
    """
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    if not isinstance(read_ahead, int) or isinstance(read_ahead, bool) or read_ahead < 0:
        raise ValueError(f"read_ahead must be an int >= 0, got {read_ahead!r}")
    if chunk_bytes is not None:
        if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int or None, got {chunk_bytes!r}")
        if convert is not None:
            raise ValueError("chunk_bytes cannot be combined with convert= (convert takes whole tensors)")
    path = os.fspath(path)
    plan = _plan(path, key_map, tied)

    def row_reader(name: str):
        if chunk_bytes is None or (plan.source.nbytes(name) or 0) <= chunk_bytes:
            return None
        return plan.source.row_reader(name)

    live_rows = weakref.WeakSet()  # the _CheckpointRows yielded and still referenced

    def read(name: str, out: str) -> Tuple[Value, List[Tuple[str, str]]]:
        rows = row_reader(name)
        if rows is not None:  # read (and checked) block by block when the consumer asks
            value = _CheckpointRows(plan.source, name, out, *rows, dtype, nonfinite, chunk_bytes)
            live_rows.add(value)
            return value, []
        value = plan.source.read(name, dtype=dtype)
        return value, find_nonfinite(out, value, nonfinite)

    if read_ahead:
        # What each item holds while the consumer has it: row blocks hold one block at a time.
        sizes = [min(plan.source.nbytes(name) or 0, chunk_bytes) if row_reader(name) else plan.source.nbytes(name)
                 for name, _ in plan.renames]
        if read_ahead_bytes is None:
            read_ahead_bytes = max(DEFAULT_READ_AHEAD_MIN_BYTES, sum(s or 0 for s in sizes) // 20)
        ahead = _ReadAhead(plan.renames, read, read_ahead, sizes, read_ahead_bytes)
    else:
        ahead = None
    items = iter(ahead) if ahead else ((name, out, read(name, out)) for name, out in plan.renames)
    try:
        for _name, out, (value, nonfinite_parts) in items:
            report_nonfinite(nonfinite_parts, nonfinite, path=plan.source.path)
            value = _cast(value, dtype)
            if convert is not None:
                value = convert(out, value)
                if value is None:
                    continue
            yield out, value
            for alias in plan.aliases.get(out, ()):
                yield alias, value
            del value
    finally:
        if ahead is not None:
            ahead.stop()
        if not live_rows:  # else the files close when the last row blocks (holding the source) are freed
            plan.source.close()


@dataclasses.dataclass
class LoadResult:
    loaded: List[str]
    missing: List[str]
    unexpected: List[str]


def _model_slots(model: torch.nn.Module):
    """name -> (module, attribute, is_param, original object), with tied parameters grouped by identity."""
    persistent = set(model.state_dict(keep_vars=True).keys())
    slots = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in mod._parameters.items():
            if p is not None:
                slots[prefix + attr] = (mod, attr, True, p)
        for attr, b in mod._buffers.items():
            if b is not None and prefix + attr in persistent:
                slots[prefix + attr] = (mod, attr, False, b)
    return slots


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, *, key_map: KeyMap = None,
                    convert: Convert = None, dtype: Optional[torch.dtype] = None,
                    tied: Optional[Mapping[str, str]] = None, strict: bool = True,
                    nonfinite: str = "error") -> LoadResult:
    """Fill a (meta-device or ordinary) model from a checkpoint, one tensor at a time.

    Each tensor replaces the model's parameter/buffer object (``assign`` semantics,
    so meta tensors need no copy). Shapes must match exactly; dtypes must match
    after ``dtype`` is applied (pass dtype= to cast). Parameters the model ties
    together (the same object under two names) are filled once for all names.
    With strict=True a missing or unexpected tensor raises MissingTensorsError that
    names them all; otherwise they are returned in the LoadResult.
    """
    path = os.fspath(path)
    slots = _model_slots(model)
    filled: Dict[int, torch.Tensor] = {}  # id(original object) -> new object
    loaded: List[str] = []
    unexpected: List[str] = []
    for fqn, value in iter_checkpoint(path, key_map=key_map, convert=convert, dtype=dtype, tied=tied,
                                      nonfinite=nonfinite):
        slot = slots.get(fqn)
        if slot is None:
            unexpected.append(fqn)
            continue
        mod, attr, is_param, orig = slot
        if not isinstance(value, torch.Tensor):
            raise TensorMismatchError(
                f"the checkpoint holds a {type(value).__name__} but the model expects a plain tensor "
                f"{orig.dtype} {list(orig.shape)}; pass convert= to turn it into one", path=path, tensor=fqn)
        if tuple(value.shape) != tuple(orig.shape):
            raise TensorMismatchError(f"shape {list(value.shape)} but the model expects {list(orig.shape)}",
                                      path=path, tensor=fqn)
        if value.dtype != orig.dtype:
            raise TensorMismatchError(f"dtype {value.dtype} but the model expects {orig.dtype} (pass dtype= to cast)",
                                      path=path, tensor=fqn)
        new = filled.get(id(orig))
        if new is None:
            new = torch.nn.Parameter(value, requires_grad=orig.requires_grad) if is_param else value
            filled[id(orig)] = new
        if is_param:
            mod._parameters[attr] = new
        else:
            mod._buffers[attr] = new
        loaded.append(fqn)
    # A tied alias counts as loaded when any of its names was filled.
    for name, (mod, attr, is_param, orig) in slots.items():
        new = filled.get(id(orig))
        if new is not None and name not in loaded:
            (mod._parameters if is_param else mod._buffers)[attr] = new
    missing = [n for n, (_, _, _, orig) in slots.items() if id(orig) not in filled]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {missing[:20]}{' ...' if len(missing) > 20 else ''}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected: {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}")
        raise MissingTensorsError("; ".join(parts) + " (use key_map= to rename/drop, tied= for shared weights, "
                                  "or strict=False)", path=path)
    return LoadResult(loaded, missing, unexpected)
