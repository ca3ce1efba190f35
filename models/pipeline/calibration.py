"""--calibration_text: per-layer statistics from running the unquantized model on a text.

The text is tokenized with the checkpoint's own tokenizer (an HF folder's tokenizer files, a
GGUF's tokenizer.ggml.* metadata, the embedded default's byte-level one), cut to --calibration_tokens
(only a prefix of the file is read and tokenized: ``read_tokens``; a FIFO or device is refused),
and run through the unquantized model in windows of WINDOW tokens. What is kept per linear layer
(llmq.quant.importance.Calibration): E[x^2] per input column (the importance that methods "hqq"
and "search" (llmq.quant.takes_importance) and --budget_bits_per_weight weight their errors by), up
to SAMPLE_ROWS input rows (the error report's layer output error), with `hessians` the mean of
x x^T per linear (GPTQ), and per MoE block the tokens routed to each expert (an expert no token
reaches has no statistics: it is quantized by its plain method, and the summary counts it).

Which inputs each layer sees (--calibration_inputs): "float" (the default) runs the unquantized
model, so layer i+1's statistics come from the float outputs of layers 0..i. "quantized" is the
sequential form of GPTQ-class methods: as soon as layer i's statistics are in, its tensors are
quantized as the run will write them (`layer_quantizer`: the recipe's rules through
llmq.quant.stream.quantize_stream, with layer i's own statistics, so a gptq rule rounds against
the H just measured) and the calibration text's hidden states are run again through the quantized
layer i; those outputs are layer i+1's inputs. So every layer's statistics describe the inputs it
meets in the quantized model, up to the layer itself: inside a layer the linears see the float
layer's values (o_proj the float q/k/v's attention), and the embedding's rows enter float. The
writing pass quantizes each layer again from the same tensors and the same statistics (the same
result: every method is deterministic); the quantized layers are not kept, so memory stays one
layer. With --budget_bits_per_weight the layers fed forward are rounded by --recipe's rules: the
budget chooses its formats after calibration, from these statistics.

The model runs layer by layer (models/pipeline/layerwise.py): one decoder layer in memory at a
time, the embedding by the rows of the text's tokens. With an output folder, each layer's
statistics and the hidden states leaving it are saved in ``<out>.calibration.partial/`` (a
llmq.checkpoint.workfolder.WorkFolder: locked, with a journal), so a run interrupted after layer k
resumes at layer k+1 with the same statistics; the folder is deleted once the output is published
(`discard_saved`). The statistics equal those of the whole model run at once
(`collect_calibration` on the built model): the same rows reach every linear in the same order.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from llmq.quant.importance import Calibration, CalibrationAccumulator, sample_stride, token_batches
from models.common.tokenizer import has_tokenizer, load_tokenizer
from models.pipeline import layerwise
from models.pipeline.arch import Architecture
from models.pipeline.progress import Progress
from models.pipeline.usage_error import UsageError

WINDOW = 512
SAMPLE_ROWS = 64
# Reading the text: a prefix of this many bytes (characters) a token to start with, doubled while it
# gives fewer than the tokens asked for plus TOKEN_MARGIN; never more than MAX_READ_BYTES in all.
PREFIX_BYTES_PER_TOKEN = 16
TOKEN_MARGIN = 64
MAX_READ_BYTES = 64 << 20


def tokenizer_source(source) -> str:
    """Where the source's tokenizer is read from, or UsageError naming the checkpoint."""
    if source.from_gguf:
        if has_tokenizer(source.path):
            return source.path
    elif source.tokenizer_files:
        return os.path.dirname(source.tokenizer_files[0])
    raise UsageError(f"--calibration_text: {source.path} has no tokenizer (tokenizer.json or tokenizer.model in an "
                     "HF folder, tokenizer.ggml.* in a GGUF) to turn the text into tokens")


def read_tokens(path: str, tokenizer, limit: int):
    """The first `limit` token ids of the text file at `path`, reading only a prefix of it.

    The prefix starts at PREFIX_BYTES_PER_TOKEN bytes a token and doubles until it gives `limit`
    tokens plus a margin (so the cut falls well inside the text and the first `limit` ids are
    those of the whole text), the file ends, or MAX_READ_BYTES were read. A FIFO, a device
    (/dev/zero) or a folder is refused before anything is read."""
    import torch

    from llmq.input_files import InputFileError, iter_text

    what = "--calibration_text"
    want = limit + TOKEN_MARGIN
    budget = max(limit * PREFIX_BYTES_PER_TOKEN, 1 << 16)
    pieces, read, ids = [], 0, []
    try:
        for piece in iter_text(path, what):
            pieces.append(piece)
            read += len(piece)
            if read >= budget or read >= MAX_READ_BYTES:
                ids = tokenizer.encode("".join(pieces))
                if len(ids) >= want or read >= MAX_READ_BYTES:
                    break
                budget *= 2
        else:
            ids = tokenizer.encode("".join(pieces))
    except InputFileError as e:
        raise UsageError(str(e)) from None
    if len(ids) < 2:
        raise UsageError(f"{what} {path}: {len(ids)} tokens; expected a text of at least a few hundred tokens")
    return torch.tensor(ids[:limit], dtype=torch.long)


# quantize(i, tensors, statistics) -> layer i's tensors as the run writes them (model names; quantized
# weights where the recipe quantizes), given its tensors as read and its calibration statistics.
LayerQuantizer = Callable[[int, Dict[str, Any], Calibration], Dict[str, Any]]
INPUTS = ("float", "quantized")  # --calibration_inputs


def layer_quantizer(recipe, num_layers: int, *, as_float: Optional[Callable] = None) -> LayerQuantizer:
    """The LayerQuantizer of a run's recipe: its tensors through quantize_stream (the writing pass's
    own function, so the layer fed forward is the layer written) with the layer's statistics;
    as_float(items) maps the input's quantized values to float first (--requantize_gguf)."""
    from llmq.quant.row_blocks import RowBlocks
    from llmq.quant.stream import quantize_stream
    from models.pipeline.arch import quantizable_module

    bound = recipe.bind(num_layers)

    def quantize(index: int, tensors: Dict[str, Any], statistics: Calibration) -> Dict[str, Any]:
        items = ((n, v.whole() if isinstance(v, RowBlocks) else v) for n, v in tensors.items())
        if as_float is not None:
            items = as_float(items)
        return dict(quantize_stream(items, bound, module_of=quantizable_module, calibration=statistics))

    return quantize


def calibrate(arch: Architecture, config, source, text_path: str, tokens: int, *, out: Optional[str] = None,
              hessians: bool = False, progress: bool = True, quantize: Optional[LayerQuantizer] = None,
              quantized_by: str = "") -> Calibration:
    """Run the model on the first `tokens` tokens of the text; see the module docstring. quantize: the
    sequential form (each layer's outputs from its quantized tensors), `quantized_by` saying how (the
    recipe: part of what a saved run must match to be resumed)."""
    try:
        tokenizer = load_tokenizer(tokenizer_source(source))
    except ValueError as e:
        raise UsageError(f"--calibration_text: {e}") from None
    ids = read_tokens(text_path, tokenizer, tokens)
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and int(ids.max()) >= vocab:
        raise UsageError(f"--calibration_text {text_path}: the tokenizer gives id {int(ids.max())}, outside the "
                         f"model's vocabulary of {vocab}")
    model = layerwise.from_input(arch, config, source)
    fingerprint = _fingerprint(source, text_path, ids, hessians, quantized_by if quantize is not None else "")
    saved = SavedCalibration.open(out, fingerprint) if out else None
    try:
        return calibrate_layerwise(model, ids, hessians=hessians, saved=saved, progress=progress, quantize=quantize)
    finally:
        if saved is not None:
            saved.release()


@torch.no_grad()
def calibrate_layerwise(model: "layerwise.LayerwiseModel", ids: torch.Tensor, *, hessians: bool = False,
                        saved: Optional["SavedCalibration"] = None, progress: bool = True,
                        stop_after: Optional[int] = None, quantize: Optional[LayerQuantizer] = None) -> Calibration:
    """The statistics of `ids` (1-D token ids, run in windows of WINDOW) layer by layer; `saved`
    resumes from and records to a work folder; stop_after=k stops after layer k (tests of resuming);
    quantize: the sequential form (module docstring), None: the float model throughout."""
    batches = list(token_batches(ids, WINDOW))
    stride = sample_stride(int(ids.numel()), SAMPLE_ROWS)
    pieces: List[Calibration] = []
    start, hidden = 0, None
    if saved is not None:
        start, hidden, pieces = saved.resume()
        if start:
            print(f"calibration: resuming after layer {start - 1} ({saved.folder.path})", flush=True)
    if hidden is None:
        hidden = model.embed(batches)
    bar = Progress("calibration", model.num_layers + 1, "layers", enabled=progress, done=start)
    accumulators: Dict[int, CalibrationAccumulator] = {}
    experts: Dict[int, Dict[str, torch.Tensor]] = {}
    finished: Dict[int, Calibration] = {}
    if quantize is not None:
        model.tensors.keep_last = True  # the layer's tensors, read to run it, are quantized next: not read twice

    def observe(i: int, layer: nn.Module):
        acc = accumulators[i] = CalibrationAccumulator(SAMPLE_ROWS, stride, hessians)
        counts = experts[i] = {}
        prefix = f"model.layers.{i}."
        handles = []
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear):
                handles.append(module.register_forward_pre_hook(acc.hook(prefix + name)))
            elif _is_routed_experts(module):
                handles.append(module.register_forward_pre_hook(_count_routed(counts, prefix + name, module)))
        return handles

    def finish(i: int) -> Calibration:
        piece = accumulators.pop(i).calibration(int(ids.numel()))
        piece.expert_tokens.update(experts.pop(i))
        return piece

    def replace(i: int, layer: nn.Module) -> Optional[nn.Module]:
        assert quantize is not None
        piece = finished[i] = finish(i)
        return model.build_layer(i, quantize(i, model.tensors.group(i), piece))

    def after(i: int, out: List[torch.Tensor]) -> None:
        piece = finished.pop(i) if i in finished else finish(i)
        pieces.append(piece)
        if saved is not None:
            saved.record(i, piece, out)
        bar.advance()
        if stop_after is not None and i == stop_after:
            raise _Stopped

    try:
        hidden = layerwise.run_layers(model, hidden, start=start, observe=observe, after=after,
                                      replace=None if quantize is None else replace)
    except _Stopped:
        return merge(pieces, int(ids.numel()))
    # The head's input: the final norm of the last hidden states ("lm_head" is a linear like the others).
    acc = CalibrationAccumulator(SAMPLE_ROWS, stride, hessians)
    for h in model.final_norm(hidden):
        acc.observe("lm_head", h)
    pieces.append(acc.calibration(int(ids.numel())))
    bar.advance()
    return merge(pieces, int(ids.numel()))


class _Stopped(Exception):
    pass


def _is_routed_experts(module: nn.Module) -> bool:
    """A stacked routed-experts module (forward(x, weights, index), fused gate_up_proj and down_proj)."""
    return hasattr(module, "num_experts") and (hasattr(module, "gate_up_proj") or hasattr(module, "gate_up"))


def _count_routed(counts: Dict[str, torch.Tensor], name: str, module: nn.Module):
    def record(_module: nn.Module, args) -> None:
        index = args[2]
        add = torch.bincount(index.reshape(-1), minlength=module.num_experts)
        counts[name] = add if name not in counts else counts[name] + add

    return record


def merge(pieces: List[Calibration], tokens: int) -> Calibration:
    """One Calibration from per-layer ones (their modules are disjoint)."""
    out = Calibration({}, {}, tokens)
    for p in pieces:
        out.importance.update(p.importance)
        out.inputs.update(p.inputs)
        out.hessians.update(p.hessians)
        out.expert_tokens.update(p.expert_tokens)
    return out


def unreached_experts(calibration: Calibration) -> Tuple[int, int]:
    """(experts no calibration token reached, experts in all), over every MoE block."""
    counts = list(calibration.expert_tokens.values())
    return sum(int((c == 0).sum()) for c in counts), sum(int(c.numel()) for c in counts)


def _fingerprint(source, text_path: str, ids: torch.Tensor, hessians: bool, quantized_by: str = "") -> Dict:
    return {"checkpoint": os.path.abspath(source.path), "checkpoint_bytes": int(source.size_bytes),
            "text": os.path.abspath(text_path), "tokens": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
            "window": WINDOW, "sample_rows": SAMPLE_ROWS, "hessians": bool(hessians),
            "inputs": hashlib.sha256(quantized_by.encode()).hexdigest() if quantized_by else "float"}


CALIBRATION_SUFFIX = ".calibration"


class SavedCalibration:
    """Per-layer statistics of a calibration run in ``<out>.calibration.partial/``: ``layer-<i>.safetensors``
    (importance.<module>, inputs.<module>, hessians.<module>, experts.<module>) and ``hidden.safetensors``
    (the states leaving the last layer done), the journal recording the layers done and what was run
    (checkpoint, text, token ids, settings): a journal of another run starts over."""

    def __init__(self, folder, fingerprint: Dict):
        self.folder, self.fingerprint = folder, fingerprint

    @classmethod
    def open(cls, out: str, fingerprint: Dict) -> "SavedCalibration":
        from llmq.checkpoint.workfolder import WorkFolder

        folder = WorkFolder(out.rstrip(os.sep) + CALIBRATION_SUFFIX, writer="calibration", overwrite=False,
                            fsync=False)
        saved = cls(folder, fingerprint)
        journal = folder.journal or {}
        if journal.get("fingerprint") != fingerprint:
            folder.clear()
            folder.write_journal({"fingerprint": fingerprint, "layers_done": 0})
        return saved

    def resume(self) -> Tuple[int, Optional[List[torch.Tensor]], List[Calibration]]:
        """(layers done, hidden states leaving the last of them or None, their statistics)."""
        from safetensors.torch import load_file

        done = int((self.folder.journal or {}).get("layers_done", 0))
        if (self.folder.journal or {}).get("fingerprint") != self.fingerprint or not done:
            return 0, None, []
        pieces = [_piece(load_file(os.path.join(self.folder.path, f"layer-{i:05d}.safetensors"))) for i in range(done)]
        hidden_file = load_file(os.path.join(self.folder.path, "hidden.safetensors"))
        hidden = [hidden_file[f"window.{w}"] for w in range(len(hidden_file))]
        return done, hidden, pieces

    def record(self, layer: int, piece: Calibration, hidden: List[torch.Tensor]) -> None:
        from safetensors.torch import save

        from llmq.checkpoint.fileio import write_file_atomic

        tensors = {}
        for field in ("importance", "inputs", "hessians"):
            tensors.update({f"{field}.{k}": v.contiguous() for k, v in getattr(piece, field).items()})
        tensors.update({f"experts.{k}": v.contiguous() for k, v in piece.expert_tokens.items()})
        path = os.path.join(self.folder.path, f"layer-{layer:05d}.safetensors")
        write_file_atomic(path, save(tensors), fsync=False)
        write_file_atomic(os.path.join(self.folder.path, "hidden.safetensors"),
                          save({f"window.{w}": h.contiguous() for w, h in enumerate(hidden)}), fsync=False)
        self.folder.write_journal({"fingerprint": self.fingerprint, "layers_done": layer + 1})
        self.folder.journal = {"fingerprint": self.fingerprint, "layers_done": layer + 1}

    def release(self) -> None:
        self.folder.release()


def _piece(tensors: Dict[str, torch.Tensor]) -> Calibration:
    parts: Dict[str, Dict[str, torch.Tensor]] = {"importance": {}, "inputs": {}, "hessians": {}, "experts": {}}
    for key, value in tensors.items():
        field, _, module = key.partition(".")
        parts[field][module] = value
    return Calibration(parts["importance"], parts["inputs"], 0, parts["hessians"], parts["experts"])


def discard_saved(out: str) -> None:
    """Delete the saved statistics of a run into `out` (its output is published: nothing to resume)."""
    import shutil

    from llmq.checkpoint.workfolder import PARTIAL_SUFFIX

    path = out.rstrip(os.sep) + CALIBRATION_SUFFIX + PARTIAL_SUFFIX
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "journal.json")):
        shutil.rmtree(path, ignore_errors=True)
