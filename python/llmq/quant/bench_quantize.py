"""Throughput of llmq.quant.quantize_weight: torch reference path vs the compiled kernel.

Not a test: prints GB/s of input (bytes of the bf16 weight read per second), best and median
of --repeats runs, for each shape x config x path x thread count. The machine may be shared,
so the best is the figure to compare; the median shows the noise.

    LLMQ_QUANT_KERNEL=/tmp/quant/_quant_kernel.so PYTHONPATH=python \\
        .venv/bin/python python/llmq/quant/bench_quantize.py [--repeats 5] [--threads 1,2] [--quick]

A second table compares methods "search" and "hqq" (asymmetric, one thread only) with
"minmax": the whole quantize_weight call, wall-clock MB/s and MB per process-CPU-second (all
threads; times the number of cores it is the rate a quiet machine would give), and the squared
error. --search_shape sets its weight (default 1024x1024). A third times the "hqq" kernel
alone at an LLM weight scale.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from llmq.quant import QuantConfig, _native
from llmq.quant.formats.int_affine import quantize_weight_torch
from llmq.quant.quantize import quantize_weight

SHAPES = {"4096x4096": (4096, 4096), "experts64x1024x2048": (64, 1024, 2048)}
CONFIGS = {
    "int4 g32 sym": QuantConfig(bits=4, group_size=32, symmetric=True),
    "int4 g32 asym": QuantConfig(bits=4, group_size=32, symmetric=False),
    "int8 per-channel": QuantConfig(bits=8, group_size=None, symmetric=True),
}


def _time(fn, repeats: int):
    fn()  # warm: page in the input, allocator, thread start-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (torch and kernel)")
    ap.add_argument("--quick", action="store_true", help="only the 4096x4096 shape")
    ap.add_argument("--search_shape", default="1024x1024", help="ROWSxCOLS of the search/hqq table's weight")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    available = _native.native_kernel_available()
    print(f"kernel: {'available, isa ' + str(_native.best_isa()) if available else 'NOT available: ' + str(_native.native_kernel_error())}")
    print(f"{'shape':<22}{'config':<18}{'path':<8}{'threads':>8}{'best GB/s':>11}{'median GB/s':>13}")
    for shape_name, shape in SHAPES.items():
        if args.quick and shape_name != "4096x4096":
            continue
        w = (torch.randn(*shape) * 0.02).to(torch.bfloat16)
        nbytes = w.numel() * w.element_size()
        for cfg_name, cfg in CONFIGS.items():
            for t in threads:
                paths = [("torch", lambda w=w, cfg=cfg: quantize_weight_torch(w, cfg))]
                if _native.native_kernel_available():
                    paths.append(("kernel", lambda w=w, cfg=cfg: quantize_weight(w, cfg)))
                for path, fn in paths:
                    torch.set_num_threads(t)
                    _native.set_num_threads(t)
                    best, med = _time(fn, args.repeats)
                    print(f"{shape_name:<22}{cfg_name:<18}{path:<8}{t:>8}{nbytes / best / 1e9:>11.2f}{nbytes / med / 1e9:>13.2f}", flush=True)
    rows, cols = (int(v) for v in args.search_shape.lower().split("x"))
    search_table(args.repeats, threads, (rows, cols))
    hqq_kernel_table(args.repeats, threads)


SEARCH_CONFIGS = {"int4 g32 sym": (4, True), "int3 g32 sym": (3, True), "int4 g32 asym": (4, False), "int3 g32 asym": (3, False)}


def _time_cpu(fn, repeats: int):
    """(best wall seconds, best process-CPU seconds, all threads) over `repeats` runs after a warm one."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return min(walls), min(cpus)


def search_table(repeats: int, threads, shape) -> None:
    """Methods "search" and "hqq" beside "minmax" on a bf16 N(0,1) weight of `shape`, g32, the
    whole quantize_weight call (kernel when loaded): wall-clock MB/s, MB per CPU-second (bytes
    / process CPU seconds, all threads) and that times 2 (the rate of 2 quiet cores), and the
    squared error of the dequantized weight. "hqq" (its torch path around the hqq kernel) at
    one thread only."""
    from llmq.quant import dequantize

    print(f"\nmethod search: {'compiled kernel (codes and packing included)' if _native.search_quantize_available() else 'torch reference'}, "
          f"method hqq: {'compiled kernel' if _native.hqq_available() else 'torch reference'}; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} on {os.cpu_count()} CPUs")
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    nbytes = w.numel() * w.element_size()
    label = f"{shape[0]}x{shape[1]}"
    print(f"{label:<12}{'config':<16}{'threads':>8}  {'method':<8}{'wall MB/s':>10}{'CPU MB/s':>10}{'x2 cores':>10}"
          f"{'sq. error':>12}{'vs minmax':>11}")
    for cfg_name, (bits, sym) in SEARCH_CONFIGS.items():
        errors = {}
        for t in threads:
            torch.set_num_threads(t)
            _native.set_num_threads(t)
            for method in ("minmax", "search") + (("hqq",) if not sym and t == 1 else ()):
                cfg = QuantConfig(bits=bits, group_size=32, symmetric=sym, method=method)
                wall, cpu = _time_cpu(lambda cfg=cfg: quantize_weight(w, cfg), max(1, min(repeats, 3)))
                if method not in errors:
                    errors[method] = float((dequantize(quantize_weight(w, cfg), torch.float32).double()
                                            - w.double()).square().sum())
                err = errors[method]
                print(f"{'':<12}{cfg_name:<16}{t:>8}  {method:<8}{nbytes / wall / 1e6:>10.1f}{nbytes / cpu / 1e6:>10.1f}"
                      f"{2 * nbytes / cpu / 1e6:>10.1f}{err:>12.1f}{err / errors['minmax']:>11.3f}", flush=True)


def hqq_kernel_table(repeats: int, threads) -> None:
    """The "hqq" kernel alone (scale and zero choice, no packing) at an LLM weight scale,
    2048x4096 N(0, 0.02^2) float32, g32, int4: MB/s of bf16-equivalent input."""
    if not _native.hqq_available():
        return
    w = torch.randn(2048, 4096, generator=torch.Generator().manual_seed(0)) * 0.02
    print(f"\n{'hqq kernel 2048x4096':<22}{'config':<18}{'threads':>8}{'best MB/s':>11}{'median MB/s':>13}")
    for t in threads:
        best, med = _time(lambda t=t: _native.hqq_qparams(w, 32, 4, threads=t), repeats)
        print(f"{'N(0, 0.02^2)':<22}{'int4 g32 asym':<18}{t:>8}{w.numel() * 2 / best / 1e6:>11.1f}{w.numel() * 2 / med / 1e6:>13.1f}", flush=True)


if __name__ == "__main__":
    main()
