"""The per-tensor error report: its figures against independent numpy formulas, the files it
writes (CSV/Markdown parse back, the PNG decodes to the documented picture), streaming use."""

import csv
import math

import numpy as np
import pytest
import torch

from llmq.quant import QuantConfig, dequantize, quantize_weight
from llmq.quant.report import ErrorReport, tensor_error
from llmq.quant.storage import Storage, group_tensors


def tensors():
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(16, 128, generator=g) * 0.02
    w2 = (torch.randn(8, 64, generator=g) * 0.05).to(torch.bfloat16)
    w3 = torch.randn(4, 64, generator=g)
    return [
        ("a.q_proj.weight", w1, QuantConfig(bits=4, group_size=32, symmetric=False, method="hqq")),
        ("a.down_proj.weight", w2, QuantConfig(bits=8, group_size=None)),
        ("a.up_proj.weight", w3, QuantConfig(format="mxfp4", bits=4, group_size=32)),
    ]


def test_figures_match_independent_formulas():
    for name, w, cfg in tensors():
        q = quantize_weight(w, cfg, name=name)
        row = tensor_error(name, w, q, cfg)
        a = w.float().numpy().astype(np.float64)
        b = dequantize(q, torch.float32).numpy().astype(np.float64)
        sqnr = 20.0 * np.log10(np.linalg.norm(a) / np.linalg.norm(a - b))  # amplitude form
        assert abs(row.sqnr_db - sqnr) < 1e-9 * abs(sqnr)
        assert abs(row.rel_error - np.linalg.norm(a - b) / np.linalg.norm(a)) < 1e-12
        assert row.max_abs_error == float(np.abs(a - b).max())
        assert row.format == cfg.describe() and row.numel == w.numel()
    # effective bits, from the storage rule: int4 g32 stores float32 scale + bias per 32 weights
    name, w, cfg = tensors()[0]
    assert tensor_error(name, w, quantize_weight(w, cfg)).bits_per_weight == 4 + 2 * 32 / 32
    name, w, cfg = tensors()[1]  # int8 per row of 64: 8 + 64/64
    assert tensor_error(name, w, quantize_weight(w, cfg)).bits_per_weight == 8 + 64 / 64


def test_exact_and_mismatched_inputs():
    w = torch.randn(4, 32)
    assert math.isinf(tensor_error("w", w, w.clone()).sqnr_db) and tensor_error("w", w, w.clone()).rel_error == 0.0
    with pytest.raises(ValueError, match="m.w: quantized shape \\[4, 64\\] does not match the original \\[4, 32\\]"):
        tensor_error("m.w", w, quantize_weight(torch.randn(4, 64), QuantConfig()))


def test_streamed_report_writes_csv_markdown_png(tmp_path):
    seen = []

    def stream():  # one tensor alive at a time
        for name, w, cfg in tensors():
            seen.append(name)
            yield name, w, quantize_weight(w, cfg, name=name)

    report = ErrorReport().extend(stream())
    paths = report.write(str(tmp_path / "out"))
    rows = list(csv.DictReader(open(paths["csv"])))
    assert [r["name"] for r in rows] == seen + ["TOTAL"]
    for r, row in zip(rows, report.rows):
        assert abs(float(r["sqnr_db"]) - row.sqnr_db) < 1e-3 and r["shape"] == "x".join(map(str, row.shape))
    total = report.total()
    want_bits = sum(r.written_bits for r in report.rows) / sum(r.numel for r in report.rows)
    assert abs(float(rows[-1]["bits_per_weight"]) - want_bits) < 1e-4
    want_sqnr = 10 * math.log10(sum(r.signal for r in report.rows) / sum(r.noise for r in report.rows))
    assert abs(total.sqnr_db - want_sqnr) < 1e-12 and "3 tensors" in report.summary()
    md = open(paths["md"]).read().splitlines()
    assert md[0].startswith("| name | format |") and len([line for line in md if line.startswith("| a.")]) == 3
    from PIL import Image  # matplotlib's own dependency

    with Image.open(paths["png"]) as img:
        assert img.format == "PNG" and img.size[0] >= 600 and len(img.convert("L").getcolors(maxcolors=1 << 16) or []) > 2
    # the bars are the SQNRs; the axis top is the largest one rounded up to 10 dB
    top = 10 * math.ceil(max(r.sqnr_db for r in report.rows) / 10)
    assert [(n, f) for n, _, f in report.sqnr_bars()] == [(r.name, r.format) for r in report.rows]
    assert [h for _, h, _ in report.sqnr_bars()] == pytest.approx([r.sqnr_db for r in report.rows])
    assert top >= max(h for _, h, _ in report.sqnr_bars())


def test_output_error_and_written_bits_against_numpy():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 64, generator=g) * 0.03
    x = torch.randn(10, 64, generator=g) * torch.linspace(0.1, 3.0, 64)  # uneven input channels
    cfg = QuantConfig(bits=4, group_size=32, symmetric=True)
    q = quantize_weight(w, cfg)
    row = tensor_error("l.weight", w, q, cfg, inputs=x)
    a, b, xs = (t.numpy().astype(np.float64) for t in (w, dequantize(q, torch.float32), x))
    want = np.linalg.norm(xs @ (a - b).T) / np.linalg.norm(xs @ a.T)
    assert abs(row.output_rel_error - want) < 1e-12 * want
    # the default storage is the bundle's: 4-bit codes + float32 scale and bias per 32 weights
    assert row.bits_per_weight == 4 + 64 / 32
    assert tensor_error("l.weight", w, q).output_rel_error is None  # no calibration rows: no figure
    with pytest.raises(ValueError, match="l.weight: calibration inputs have shape"):
        tensor_error("l.weight", w, q, cfg, inputs=x[:, :32])
    # a backend writing a float16 scale and bias per group (MLX's way): 4 + 32/32 bits per weight
    report = ErrorReport(lambda config: Storage(torch.float16, group_tensors(config.bits, config.group_size)))
    report.add("l.weight", w, q, cfg, inputs=x)
    report.add("m.weight", w, q, cfg)
    total = report.total()
    assert abs(total.output_rel_error - want) < 1e-12 * want  # only the measured tensor counts
    assert report.rows[0].bits_per_weight == 5.0
    assert "layer output rel. error" in report.summary() and "5.000 bits/weight as written" in report.summary()
