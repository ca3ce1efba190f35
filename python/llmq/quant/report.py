"""Per-tensor quantization error report: format, bits per weight, relative error, SQNR.

Streaming: `ErrorReport.add(name, original, quantized)` reduces one tensor to a handful of
numbers at once (float64 sums over its elements) and keeps only those, so a pipeline can call
it tensor by tensor while it writes a bundle, never holding the model. `write(folder)` then
writes three files into `folder`:

* `<stem>.csv`: one row per tensor (name, format, shape, numel, bits_per_weight,
  rel_error, sqnr_db, max_abs_error) and a final `TOTAL` row;
* `<stem>.md`: the same as a Markdown table;
* `<stem>.png`: a bar chart drawn without any plotting library (stdlib zlib only): one bar
  per tensor in table order, height = SQNR in dB (0 at the bottom, the largest finite SQNR at
  the top), horizontal grid lines every 10 dB, bar colour by format (legend in the .md).

Definitions (per tensor, W the original upcast to float64, W' = dequantize(quantized) in
float64, E = W - W'):

* bits_per_weight = 8 * (bytes the quantized weight stores, scales and zero points included)
  / numel: e.g. int4 g32 with float32 scale and bias is 4 + 64/32 = 6.0;
* rel_error = ||E||_2 / ||W||_2;
* sqnr_db = 10 log10(sum W^2 / sum E^2) (inf when E = 0, -inf when W = 0 and E != 0);
* TOTAL: numel-weighted bits, and the error ratios of the summed sums over all tensors.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import struct
import zlib
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from llmq.quant.formats import GroupQuantizedWeight, format_of, nbytes_of


@dataclasses.dataclass(frozen=True)
class TensorError:
    """The error figures of one quantized tensor (or the TOTAL of many)."""

    name: str
    format: str
    shape: Tuple[int, ...]
    numel: int
    stored_bytes: int
    signal: float  # sum W^2
    noise: float  # sum (W - W')^2
    max_abs_error: float

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.stored_bytes / self.numel if self.numel else 0.0

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


COLUMNS = ("name", "format", "shape", "numel", "bits_per_weight", "rel_error", "sqnr_db", "max_abs_error")


def describe(quantized, config=None) -> str:
    """A short format label: the config's own (e.g. 'int4 g32 asym hqq') when given, else
    'int<b> g<group>' for integer weights and the registry name for the others."""
    if config is not None and hasattr(config, "describe"):
        return config.describe()
    if isinstance(quantized, GroupQuantizedWeight):
        return f"int{quantized.bits} g{quantized.group_size}"
    fmt = format_of(quantized)
    return fmt.name_of(quantized) if fmt is not None else str(quantized.dtype).replace("torch.", "")


def tensor_error(name: str, original: torch.Tensor, quantized, config=None) -> TensorError:
    """The figures of one tensor (see the module docstring); `quantized` is any registered
    quantized container (or a plain tensor: a kept weight, error 0 against itself)."""
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
    return TensorError(name, describe(quantized, config), tuple(original.shape), w.numel(), nbytes_of(quantized),
                       signal, noise, max_err)


class ErrorReport:
    """Accumulates TensorError rows; write() emits CSV, Markdown and PNG (module docstring)."""

    def __init__(self):
        self.rows: List[TensorError] = []

    def add(self, name: str, original: torch.Tensor, quantized, config=None) -> TensorError:
        row = tensor_error(name, original, quantized, config)
        self.rows.append(row)
        return row

    def extend(self, pairs: Iterable[Tuple[str, torch.Tensor, object]]) -> "ErrorReport":
        """Add (name, original, quantized) triples one at a time (a generator stays lazy)."""
        for name, original, quantized in pairs:
            self.add(name, original, quantized)
        return self

    def total(self) -> TensorError:
        rows = self.rows
        return TensorError("TOTAL", "", (), sum(r.numel for r in rows), sum(r.stored_bytes for r in rows),
                           sum(r.signal for r in rows), sum(r.noise for r in rows),
                           max((r.max_abs_error for r in rows), default=0.0))

    def summary(self) -> str:
        """One line for a run's final table."""
        t = self.total()
        return (f"{len(self.rows)} tensors: {t.bits_per_weight:.3f} bits/weight, rel. error {t.rel_error:.4g}, "
                f"SQNR {t.sqnr_db:.2f} dB")

    @staticmethod
    def _cells(r: TensorError) -> List[str]:
        return [r.name, r.format, "x".join(map(str, r.shape)), str(r.numel), f"{r.bits_per_weight:.4f}",
                f"{r.rel_error:.6g}", f"{r.sqnr_db:.3f}", f"{r.max_abs_error:.6g}"]

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
            legend = ", ".join(f"{fmt}: rgb{col}" for fmt, col in self._colours().items())
            lines += ["", f"![SQNR per tensor]({png_name})", "",
                      f"Bars: SQNR (dB) per tensor in table order; grid every 10 dB; colours: {legend}."]
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")

    _PALETTE = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75))

    def _colours(self) -> Dict[str, Tuple[int, int, int]]:
        out: Dict[str, Tuple[int, int, int]] = {}
        for r in self.rows:
            if r.format not in out:
                out[r.format] = self._PALETTE[len(out) % len(self._PALETTE)]
        return out

    def write_png(self, path: str, height: int = 200, bar: int = 6) -> None:
        """The SQNR bar chart (module docstring), an 8-bit RGB PNG."""
        finite = [r.sqnr_db for r in self.rows if math.isfinite(r.sqnr_db)]
        top = max([10.0] + [v for v in finite if v > 0])
        top = 10.0 * math.ceil(top / 10.0)
        colours = self._colours()
        width = max(1, len(self.rows)) * bar + 2
        img = [[(255, 255, 255)] * width for _ in range(height)]
        for db in range(0, int(top) + 1, 10):  # grid
            y = height - 1 - round(db / top * (height - 1))
            img[y] = [(200, 200, 200)] * width
        for i, r in enumerate(self.rows):
            v = r.sqnr_db
            v = top if v == math.inf else max(0.0, v if math.isfinite(v) else 0.0)
            h = round(v / top * (height - 1))
            for y in range(height - h, height):
                for x in range(1 + i * bar, 1 + i * bar + bar - 1):
                    img[y][x] = colours[r.format]
        raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in img)

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                    + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))

    def write(self, folder: str, stem: str = "quant_error") -> Dict[str, str]:
        """Write <stem>.csv, <stem>.md and <stem>.png into folder (created if missing); returns
        {"csv": path, "md": path, "png": path}."""
        os.makedirs(folder, exist_ok=True)
        paths = {ext: os.path.join(folder, f"{stem}.{ext}") for ext in ("csv", "md", "png")}
        self.write_csv(paths["csv"])
        self.write_png(paths["png"])
        self.write_markdown(paths["md"], png_name=os.path.basename(paths["png"]))
        return paths
