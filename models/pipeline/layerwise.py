"""Run a decoder-only model one decoder layer at a time, from its tensors, in bounded memory.

Every model here is a ``models.common.causal_lm.CausalLM``: ``embed(ids)`` -> each layer as
``layer(hidden, cos, sin, position, state)`` with ``rope_for(positions, dtype)(layer)`` (Gemma: the
sliding or global table by the layer's kind; Qwen: one table, its linear-attention layers ignore
it) -> ``model.norm`` -> ``logits(hidden)`` (the head, Gemma's soft-capping included). So the
executor needs nothing from an architecture but its model built on the meta device (the skeleton:
module tree, rope tables, embedding scale and head function, no memory) and the tensors by group:

* ``"embed"``: ``model.embed_tokens.weight``, used by rows: only the rows of the tokens run are
  gathered (row blocks read one at a time where the tensor arrives as ``RowBlocks``);
* decoder layer ``i``: ``model.layers.{i}.*``, filled into the skeleton's layer (quantized weights as
  QuantizedLinear / QuantizedExperts, models/pipeline/quantized_model.fill_module), run on the
  hidden states of every window, then sent back to the meta device (freed);
* ``"final"``: ``model.norm.weight`` and ``lm_head.weight`` (tied: the embedding again), the head
  computed block of vocabulary rows by block.

Peak memory: one layer's tensors + the hidden states of the windows run ([tokens, hidden] each)
+ one block of head or embedding rows; flat in the number of layers. `LayerTensors` gives the
groups: from an HF folder each group is read on its own (other tensors are never read: the key
map drops them), from any other stream in one pass, tensors of a later group held until it is
reached (a GGUF is stored in layer order, so that holds about one layer).

`run_layers` is the loop a pass uses: ``observe(i, layer)`` may hook the layer's modules before it
runs (calibration: each linear's inputs), and ``replace(i, layer)`` (the sequential form of
error-compensating methods) may return a layer with new (e.g. quantized) weights, which then
recomputes the outputs fed to the next layer.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from llmq.quant import GroupQuantizedWeight, dequantize
from llmq.quant.modules import dequantize_graph
from llmq.quant.row_blocks import RowBlocks
from models.common.loading import decoder_layer_index
from models.pipeline.quantized_model import fill_module

Group = Union[str, int]  # "embed", a decoder layer index, or "final"
EMBED, FINAL = "embed", "final"
EMBED_WEIGHT, HEAD_WEIGHT = "model.embed_tokens.weight", "lm_head.weight"
HEAD_BLOCK_BYTES = 16 << 20  # the head's weight is applied (dequantized) this many bytes of rows at a time


def group_of(name: str) -> Group:
    """The group a model-layout tensor name belongs to."""
    layer = decoder_layer_index(name)
    if layer is not None:
        return layer
    return EMBED if name.startswith("model.embed_tokens.") else FINAL


class LayerTensors:
    """A model's tensors group by group (see the module docstring).

    ``open_stream(only)`` gives a model-layout stream (name, value); with ``selective`` it honours
    ``only`` (a predicate on names) by never reading the others, and every group is read on its
    own stream; else one stream is read once, in order, and tensors of groups not asked for yet
    are held until they are."""

    def __init__(self, open_stream: Callable[[Optional[Callable[[str], bool]]], Iterator[Tuple[str, Any]]], *,
                 selective: bool, expected: Dict[Group, Sequence[str]], keep_last: bool = False):
        self._open = open_stream
        self.selective = selective
        self.keep_last = keep_last  # the last group read is given again without reading (two users of one group)
        self._expected = {g: set(names) for g, names in expected.items()}
        self._held: Dict[Group, Dict[str, Any]] = {}
        self._stream: Optional[Iterator[Tuple[str, Any]]] = None
        self._ended = False
        self._served: set = set()
        self._last: Optional[Tuple[Group, Dict[str, Any]]] = None

    def group(self, group: Group) -> Dict[str, Any]:
        """The tensors of `group`, by model name (read now; with keep_last, kept until another group is asked)."""
        if self._last is not None and self._last[0] == group:
            return self._last[1]
        self._last = None
        tensors = self._read(group)
        if self.keep_last:
            self._last = (group, tensors)
        return tensors

    def _read(self, group: Group) -> Dict[str, Any]:
        if self.selective:
            return dict(self._open(lambda name: group_of(name) == group))
        if group in self._served:  # a second pass over the model: the stream starts again
            self._stream, self._ended, self._held, self._served = None, False, {}, set()
        self._served.add(group)
        want = self._expected.get(group, set())
        have = self._held.setdefault(group, {})
        while not self._ended and not want <= set(have):
            if self._stream is None:
                self._stream = iter(self._open(None))
            try:
                name, value = next(self._stream)
            except StopIteration:
                self._ended = True
                break
            self._held.setdefault(group_of(name), {})[name] = value
        return self._held.pop(group)


def expected_groups(skeleton: nn.Module) -> Dict[Group, List[str]]:
    """The tensor names of each group the skeleton (a meta model) is filled from (a tied head: none)."""
    out: Dict[Group, List[str]] = {}
    for name in skeleton.state_dict():
        out.setdefault(group_of(name), []).append(name)
    if bool(getattr(skeleton.config, "tie_word_embeddings", False)):
        out[FINAL] = [n for n in out.get(FINAL, []) if n != HEAD_WEIGHT]
    return out


# -- rows of a weight that may be a tensor, row blocks or a quantized weight --------------------------------------

class RoundedRows:
    """A 2-D weight rounded to nearest in `config`'s format block of rows by block (exact for the formats
    whose scales are per row or per group in a row; a per-tensor scale is then per block)."""

    def __init__(self, value: Any, config, name: str):
        self.value, self.config, self.name = value, config, name
        self.shape = tuple(value.shape)

    def blocks(self, block_bytes: int = HEAD_BLOCK_BYTES) -> Iterator[Tuple[int, torch.Tensor]]:
        from llmq.quant import quantize_weight

        for r0, block in _row_blocks(self.value, block_bytes):
            try:
                rounded = quantize_weight(block, self.config, name=self.name)
            except ValueError:  # a block the format cannot take alone (e.g. 128-row tiles): the whole weight
                whole = self.value.whole() if isinstance(self.value, RowBlocks) else self.value
                yield 0, dequantize(quantize_weight(whole, self.config, name=self.name)).to(whole.dtype)
                return
            yield r0, dequantize(rounded).to(block.dtype)


def _row_blocks(value: Any, block_bytes: int) -> Iterator[Tuple[int, torch.Tensor]]:
    """(first row, float rows) blocks of a 2-D weight; a quantized weight is dequantized block by block."""
    if isinstance(value, RowBlocks):
        yield from value.blocks()
        return
    if isinstance(value, RoundedRows):
        yield from value.blocks(block_bytes)
        return
    if isinstance(value, GroupQuantizedWeight):
        n, k = value.shape
        step = max(1, block_bytes // max(4 * k, 1))
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            yield r0, dequantize_graph(value.qdata[r0:r1], value.scale[r0:r1], value.bias[r0:r1], value.bits,
                                       value.group_size, k).to(value.dtype)
        return
    if not isinstance(value, torch.Tensor):
        value = dequantize(value)  # another format: its exact values, whole
    yield 0, value


def gather_rows(value: Any, rows: torch.Tensor, block_bytes: int = HEAD_BLOCK_BYTES) -> torch.Tensor:
    """value[rows] for a 2-D weight read by row blocks (sorted unique `rows`)."""
    if isinstance(value, torch.Tensor):
        return value[rows]
    out: Optional[torch.Tensor] = None
    for r0, block in _row_blocks(value, block_bytes):
        inside = (rows >= r0) & (rows < r0 + block.shape[0])
        if out is None:
            out = torch.empty(rows.numel(), block.shape[1], dtype=block.dtype)
        if inside.any():
            out[inside] = block[rows[inside] - r0]
    assert out is not None
    return out


class _GatheredRows(nn.Module):
    """Stands in for the embedding: the looked-up rows of the ids run, gathered once."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor):
        super().__init__()
        self.ids, self.rows = ids, rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rows[torch.searchsorted(self.ids, input_ids)]


class _BlockHead(nn.Module):
    """Stands in for the head: x @ W^T one block of W's rows (vocabulary entries) at a time."""

    def __init__(self, weight: Any, block_bytes: int):
        super().__init__()
        self.weight_source, self.block_bytes = weight, block_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(x, block.to(x.dtype)) for _, block in
                          _row_blocks(self.weight_source, self.block_bytes)], dim=-1)


class LayerwiseModel:
    """One model run layer by layer (see the module docstring): `skeleton` is the architecture's model
    on the meta device, `tensors` its LayerTensors."""

    def __init__(self, skeleton: nn.Module, tensors: LayerTensors, block_bytes: int = HEAD_BLOCK_BYTES):
        self.skeleton = skeleton
        self.tensors = tensors
        self.block_bytes = block_bytes
        self.num_layers = len(skeleton.model.layers)
        self.tied = bool(getattr(skeleton.config, "tie_word_embeddings", False))

    @torch.no_grad()
    def embed(self, batches: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Hidden states entering layer 0 for each batch of token ids [B, S]: only their rows are read."""
        ids = torch.unique(torch.cat([b.reshape(-1) for b in batches]))
        weight = self.tensors.group(EMBED)[EMBED_WEIGHT]
        rows = gather_rows(weight, ids, self.block_bytes)
        del weight
        original = self.skeleton.model.embed_tokens
        self.skeleton.model.embed_tokens = _GatheredRows(ids, rows)
        try:
            return [self.skeleton.embed(b) for b in batches]
        finally:
            self.skeleton.model.embed_tokens = original

    @contextlib.contextmanager
    def layer(self, index: int):
        """Decoder layer `index`, filled from its tensors; sent back to the meta device afterwards."""
        module = self.build_layer(index, self.tensors.group(index))
        try:
            yield module
        finally:
            module.to("meta")  # its tensors freed (the caller may still hold the module object)

    def build_layer(self, index: int, tensors: Dict[str, Any]) -> nn.Module:
        """Decoder layer `index` (a copy of the skeleton's) filled from its tensors (model names)."""
        prefix = f"model.layers.{index}."
        tensors = {name[len(prefix):]: value.whole() if isinstance(value, RowBlocks) else value
                   for name, value in tensors.items()}
        return fill_module(_meta_copy(self.skeleton.model.layers[index]), tensors, f"layer {index}")

    @torch.no_grad()
    def run_layer(self, layer: nn.Module, hidden: Sequence[torch.Tensor], position: int = 0,
                  states: Optional[Sequence[Any]] = None) -> List[torch.Tensor]:
        """The layer's outputs for each window's hidden states [B, S, D], the first at `position`;
        states: the layer's decode state for each window (``layer.new_state()``), or None (no cache)."""
        out = []
        for w, h in enumerate(hidden):
            positions = torch.arange(h.shape[1]) + position
            cos, sin = self.skeleton.rope_for(positions, h.dtype)(layer)
            out.append(layer(h, cos, sin, position, None if states is None else states[w]))
        return out

    @torch.no_grad()
    def final_norm(self, hidden: Sequence[torch.Tensor], final: Optional[Dict[str, Any]] = None) -> List[torch.Tensor]:
        """model.norm of each window's last hidden states (the head's inputs)."""
        final = self.tensors.group(FINAL) if final is None else final
        norm = fill_module(_meta_copy(self.skeleton.model.norm),
                           {k[len("model.norm."):]: v for k, v in final.items() if k.startswith("model.norm.")},
                           "model.norm")
        return [norm(h) for h in hidden]

    @torch.no_grad()
    def logits(self, hidden: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Logits [B, S, V] of each window's last hidden states: final norm, then the head by row blocks."""
        final = self.tensors.group(FINAL)
        normed = self.final_norm(hidden, final)
        weight = final.get(HEAD_WEIGHT)
        if weight is None:
            if not self.tied:
                raise ValueError(f"no {HEAD_WEIGHT} among the model's tensors, and the config does not tie it to "
                                 "the embedding")
            weight = self.tensors.group(EMBED)[EMBED_WEIGHT]
        original = self.skeleton.lm_head
        self.skeleton.lm_head = _BlockHead(weight, self.block_bytes)
        try:
            return [self.skeleton.logits(h) for h in normed]
        finally:
            self.skeleton.lm_head = original


def _meta_copy(module: nn.Module) -> nn.Module:
    """A fresh copy of a meta module (the skeleton's own stays untouched)."""
    import copy

    return copy.deepcopy(module)


@torch.no_grad()
def run_layers(model: LayerwiseModel, hidden: List[torch.Tensor], *, start: int = 0,
               observe: Optional[Callable[[int, nn.Module], List[Any]]] = None,
               replace: Optional[Callable[[int, nn.Module], Optional[nn.Module]]] = None,
               after: Optional[Callable[[int, List[torch.Tensor]], None]] = None) -> List[torch.Tensor]:
    """Run layers start..L-1 on `hidden` (the states entering layer `start`), one layer in memory.

    observe(i, layer) -> hook handles, removed once the layer ran; replace(i, layer) -> a layer with new
    weights (or None: keep it), whose outputs then go on to layer i+1 (the sequential form);
    after(i, outputs) sees each layer's outputs (progress, saving a resumable state)."""
    for i in range(start, model.num_layers):
        with model.layer(i) as layer:
            handles = observe(i, layer) if observe is not None else []
            try:
                out = model.run_layer(layer, hidden)
            finally:
                for h in handles:
                    h.remove()
            if replace is not None:
                new = replace(i, layer)
                if new is not None:
                    out = model.run_layer(new, hidden)
                    del new
        hidden = out
        if after is not None:
            after(i, hidden)
    return hidden


def from_input(arch, config, model_input, chunk_bytes: Optional[int] = HEAD_BLOCK_BYTES) -> LayerwiseModel:
    """The unquantized model of a run's input (models/pipeline/inputs.ModelInput), layer by layer:
    an HF folder group by group (tensors over chunk_bytes as row blocks), a GGUF in one pass."""
    skeleton = arch.build_model(config, device="meta")

    def open_stream(only):
        return model_input.stream(None, chunk_bytes if model_input.reads_selectively else None, only=only)

    tensors = LayerTensors(open_stream, selective=model_input.reads_selectively, expected=expected_groups(skeleton))
    return LayerwiseModel(skeleton, tensors)
