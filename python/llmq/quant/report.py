"""Per-tensor quantization error report: format, bits per weight, relative error, SQNR.

Streaming: `ErrorReport.add(name, original, quantized)` reduces one tensor to a handful of
numbers at once (float64 sums over its elements) and keeps only those, so a pipeline can call
it tensor by tensor while it writes a bundle, never holding the model. `write(folder)` then
writes three files into `folder`:

* `<stem>.csv`: one row per tensor (name, format, shape, numel, bits_per_weight,
  rel_error, sqnr_db, max_abs_error, output_rel_error) and a final `TOTAL` row;
* `<stem>.md`: the same as a Markdown table;
* `<stem>.png`: a bar chart drawn with matplotlib: one bar per tensor in table order, height
  = SQNR in dB (an exact SQNR, +inf, drawn at the top of the axis), colour by format, with a
  legend; `sqnr_bars()` returns what it draws.

Definitions (per tensor, W the original upcast to float64, W' = dequantize(quantized) in
float64, E = W - W'):

* bits_per_weight = the bits the run's backend writes for the quantized weight (codes, scales,
  biases or zero points and per-tensor extras as it stores them: its declared
  llmq.quant.storage.Storage, given to the report as `storage`) / numel; default the llmq
  bundle's: int4 g32 with float32 scale and bias is 4 + 64/32 = 6.0, in an MLX folder (16-bit
  scale and bias) 5.0; the budget counts the same bits;
* rel_error = ||E||_2 / ||W||_2;
* sqnr_db = 10 log10(sum W^2 / sum E^2) (inf when E = 0, -inf when W = 0 and E != 0);
* output_rel_error (only with calibration inputs X [R, K], the layer's input rows from a
  calibration text; 2-D weights): ||X E^T||_F / ||X W^T||_F, the relative error of the
  layer's output on those tokens; empty otherwise;
* TOTAL: numel-weighted bits, and the error ratios of the summed sums over all tensors
  (output_rel_error over the tensors that have one).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from llmq.quant.formats import GroupQuantizedWeight, format_of, nbytes_of
from llmq.quant.storage import CANONICAL, Storage


@dataclasses.dataclass(frozen=True)
class TensorError:
    """The error figures of one quantized tensor (or the TOTAL of many)."""

    name: str
    format: str
    shape: Tuple[int, ...]
    numel: int
    written_bits: int  # what the backend writes for it (module docstring)
    signal: float  # sum W^2
    noise: float  # sum (W - W')^2
    max_abs_error: float
    output_signal: Optional[float] = None  # sum (X W^T)^2 over calibration rows
    output_noise: Optional[float] = None  # sum (X E^T)^2

    @property
    def output_rel_error(self) -> Optional[float]:
        if self.output_signal is None:
            return None
        if self.output_signal > 0:
            return math.sqrt(self.output_noise / self.output_signal)
        return 0.0 if self.output_noise == 0 else math.inf

    @property
    def bits_per_weight(self) -> float:
        return self.written_bits / self.numel if self.numel else 0.0

    @property
    def rel_error(self) -> float:
        return math.sqrt(self.noise / self.signal) if self.signal > 0 else (0.0 if self.noise == 0 else math.inf)

    @property
    def sqnr_db(self) -> float:
        if self.noise == 0:
            return math.inf
        if self.signal == 0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)


COLUMNS = ("name", "format", "shape", "numel", "bits_per_weight", "rel_error", "sqnr_db", "max_abs_error",
           "output_rel_error")


def describe(quantized, config=None) -> str:
    """A short format label: the config's own (e.g. 'int4 g32 asym hqq') when given, else
    'int<b> g<group>' for integer weights and the registry name for the others."""
    if config is not None and hasattr(config, "describe"):
        return config.describe()
    if isinstance(quantized, GroupQuantizedWeight):
        return f"int{quantized.bits} g{quantized.group_size}"
    fmt = format_of(quantized)
    return fmt.name_of(quantized) if fmt is not None else str(quantized.dtype).replace("torch.", "")


def tensor_error(name: str, original: torch.Tensor, quantized, config=None,
                 inputs: Optional[torch.Tensor] = None, storage: Optional[Storage] = None) -> TensorError:
    """The figures of one tensor (see the module docstring); `quantized` is any registered
    quantized container (or a plain tensor: a kept weight, error 0 against itself); `inputs`
    [R, K] calibration input rows of the layer (2-D weights only) add output_rel_error; `storage`:
    how the backend writes it (default: the bundle's canonical containers)."""
    from llmq.quant.quantize import dequantize

    if not isinstance(original, torch.Tensor):
        raise ValueError(f"{name}: expected the original weight as a torch.Tensor, got {type(original).__name__}")
    recon = dequantize(quantized, torch.float32) if format_of(quantized) is not None else quantized
    if tuple(recon.shape) != tuple(original.shape):
        raise ValueError(f"{name}: quantized shape {list(recon.shape)} does not match the original {list(original.shape)}")
    w = original.detach().reshape(-1)
    r = recon.detach().reshape(-1)
    signal = noise = max_err = 0.0
    step = 1 << 22  # float64 temporaries of a few chunks, not of the whole tensor
    for i in range(0, w.numel(), step):
        wc = w[i : i + step].to(torch.float64)
        e = wc - r[i : i + step].to(torch.float64)
        signal += float(wc.square().sum())
        noise += float(e.square().sum())
        max_err = max(max_err, float(e.abs().max()))
    out_signal = out_noise = None
    if inputs is not None and original.dim() == 2:
        if inputs.dim() != 2 or inputs.shape[1] != original.shape[1]:
            raise ValueError(f"{name}: calibration inputs have shape {list(inputs.shape)}, expected [rows, "
                             f"{original.shape[1]}]")
        x = inputs.to(torch.float64)
        y = x @ original.detach().to(torch.float64).T
        out_signal = float(y.square().sum())
        out_noise = float((y - x @ recon.detach().to(torch.float64).T).square().sum())
    if format_of(quantized) is not None:
        written = (storage or CANONICAL).bits(tuple(original.shape), quantized)
    else:
        written = nbytes_of(quantized) * 8
    return TensorError(name, describe(quantized, config), tuple(original.shape), w.numel(), written,
                       signal, noise, max_err, out_signal, out_noise)


class ErrorReport:
    """Accumulates TensorError rows; write() emits CSV, Markdown and PNG (module docstring).
    storage: config -> Storage, how the run's backend writes each weight (default: the bundle's)."""

    def __init__(self, storage: Optional[Callable[[Any], Storage]] = None):
        self.rows: List[TensorError] = []
        self.storage = storage

    def add(self, name: str, original: torch.Tensor, quantized, config=None,
            inputs: Optional[torch.Tensor] = None) -> TensorError:
        storage = self.storage(config) if self.storage is not None and config is not None else None
        row = tensor_error(name, original, quantized, config, inputs, storage)
        self.rows.append(row)
        return row

    def extend(self, pairs: Iterable[Tuple[str, torch.Tensor, object]]) -> "ErrorReport":
        """Add (name, original, quantized) triples one at a time (a generator stays lazy)."""
        for name, original, quantized in pairs:
            self.add(name, original, quantized)
        return self

    def total(self) -> TensorError:
        rows = self.rows
        measured = [r for r in rows if r.output_signal is not None]
        return TensorError("TOTAL", "", (), sum(r.numel for r in rows), sum(r.written_bits for r in rows),
                           sum(r.signal for r in rows), sum(r.noise for r in rows),
                           max((r.max_abs_error for r in rows), default=0.0),
                           sum(r.output_signal for r in measured) if measured else None,
                           sum(r.output_noise for r in measured) if measured else None)

    def summary(self) -> str:
        """One line for a run's final table."""
        t = self.total()
        line = (f"{len(self.rows)} tensors: {t.bits_per_weight:.3f} bits/weight as written, rel. error "
                f"{t.rel_error:.4g}, SQNR {t.sqnr_db:.2f} dB")
        if t.output_rel_error is not None:
            line += f", layer output rel. error {t.output_rel_error:.4g} (calibration text)"
        return line

    @staticmethod
    def _cells(r: TensorError) -> List[str]:
        return [r.name, r.format, "x".join(map(str, r.shape)), str(r.numel), f"{r.bits_per_weight:.4f}",
                f"{r.rel_error:.6g}", f"{r.sqnr_db:.3f}", f"{r.max_abs_error:.6g}",
                "" if r.output_rel_error is None else f"{r.output_rel_error:.6g}"]

    def write_csv(self, path: str) -> None:
        with open(path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(COLUMNS)
            for r in self.rows + [self.total()]:
                out.writerow(self._cells(r))

    def write_markdown(self, path: str, png_name: Optional[str] = None) -> None:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for r in self.rows + [self.total()]:
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in self._cells(r)) + " |")
        if png_name:
            lines += ["", f"![SQNR per tensor]({png_name})", "",
                      "Bars: SQNR (dB) per tensor in table order, coloured by format (legend in the picture)."]
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")

    def sqnr_bars(self) -> List[Tuple[str, float, str]]:
        """(tensor, bar height in dB, format) per row, as write_png draws them: +inf (exact) at the
        axis top (the largest finite SQNR rounded up to 10 dB, at least 10), NaN/-inf at 0."""
        finite = [r.sqnr_db for r in self.rows if math.isfinite(r.sqnr_db)]
        top = 10.0 * math.ceil(max([10.0] + finite) / 10.0)
        return [(r.name, top if r.sqnr_db == math.inf else max(0.0, r.sqnr_db) if math.isfinite(r.sqnr_db) else 0.0,
                 r.format) for r in self.rows]

    def write_png(self, path: str) -> None:
        """The SQNR bar chart (module docstring)."""
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        from matplotlib import pyplot as plt

        bars = self.sqnr_bars()
        formats = list(dict.fromkeys(f for _, _, f in bars))
        colours = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(formats)}
        fig, ax = plt.subplots(figsize=(max(6.0, 0.12 * len(bars)), 3.5), dpi=100)
        try:
            ax.bar(range(len(bars)), [h for _, h, _ in bars], color=[colours[f] for _, _, f in bars], width=0.8)
            for f in formats:
                ax.bar([], [], color=colours[f], label=f)
            ax.set_xlabel("tensor (table order)")
            ax.set_ylabel("SQNR (dB)")
            ax.set_title(f"quantization error per tensor ({len(bars)} tensors)")
            ax.grid(axis="y", alpha=0.4)
            ax.legend(loc="lower right", fontsize="small")
            fig.tight_layout()
            fig.savefig(path, format="png")
        finally:
            plt.close(fig)

    def write(self, folder: str, stem: str = "quant_error") -> Dict[str, str]:
        """Write <stem>.csv, <stem>.md and <stem>.png into folder (created if missing); returns
        {"csv": path, "md": path, "png": path}."""
        os.makedirs(folder, exist_ok=True)
        paths = {ext: os.path.join(folder, name) for ext, name in zip(("csv", "md", "png"), self.file_names(stem))}
        for path, write in ((paths["csv"], self.write_csv), (paths["png"], self.write_png),
                            (paths["md"], lambda p: self.write_markdown(p, png_name=os.path.basename(paths["png"])))):
            try:
                write(path)
            except OSError as e:  # a full disk while flushing names no file: this one is it
                if e.filename is None:
                    e.filename = path
                raise
        return paths

    @staticmethod
    def file_names(stem: str = "quant_error") -> List[str]:
        """The names `write` gives its files."""
        return [f"{stem}.{ext}" for ext in ("csv", "md", "png")]
