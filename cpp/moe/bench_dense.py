"""Benchmark of torch.ops.llmq.quantized_linear (dense y = x W^T on the MoE kernel's tiles).

    bazel run //cpp/moe:bench_dense -- [--shapes 2048,4096] [--tokens 1,512] [--format int4g128] [--rounds 5]

Per (N = K, tokens) it times, side by side in interleaved rounds (a burst of load from other
tenants of this shared machine slows all three alike, so the ratios stay meaningful):
  (op)    QuantizedLinear.forward with the compiled kernel (llmq.ops.install_dense_kernel()),
  (deq)   the same module under llmq.quant.modules.reference_linears(): dequantize every weight,
          then F.linear in float32 (what every quantized linear did before the kernel),
  (fp32)  torch.matmul(x, W^T) on the float32 weight (the float model's cost).
Weights are random, quantized with llmq's int recipe (asymmetric min-max); x float32. Prints the
median (min) ms per call and "x" = the baseline's median / the op's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmq.ops import dense_op
from llmq.quant import QuantizedLinear, modules
from llmq.quant.quantize import quantize_weight
from llmq.quant.recipe import QuantConfig

FORMATS = {"int4g128": (4, 128), "int4g32": (4, 32), "int8g128": (8, 128)}


def _time(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def bench_case(n: int, tokens: int, bits: int, group_size: int, rounds: int):
    g = torch.Generator().manual_seed(n + tokens)
    w = torch.randn(n, n, generator=g) * 0.02
    qw = quantize_weight(w, QuantConfig(format="int", bits=bits, group_size=group_size, symmetric=False), name="w")
    lin = QuantizedLinear.from_quantized(qw)
    x = torch.randn(tokens, n, generator=g)
    wt = w.T.contiguous()

    def op():
        return lin(x)

    def deq():
        with modules.reference_linears():
            return lin(x)

    def fp32():
        return torch.matmul(x, wt)

    methods = {"op": op, "deq": deq, "fp32": fp32}
    times = {name: [] for name in methods}
    with torch.no_grad():
        for fn in methods.values():  # warm-up (packs the weight once)
            fn()
        # calls per round: about 0.2 s of the slowest method
        per = {name: max(1, int(200 / max(_time(fn, 1), 1e-3))) for name, fn in methods.items()}
        for _ in range(rounds):
            for name, fn in methods.items():
                times[name].append(_time(fn, per[name]))
                time.sleep(0.05)
    return {name: (statistics.median(v), min(v)) for name, v in times.items()}


def _cell(r, name: str) -> str:
    med, mn = r[name]
    return f"{med:.3f} ({mn:.3f})" + ("" if name == "op" else f", {med / r['op'][0]:.2f}x")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2048,4096", help="N = K of the square weight")
    ap.add_argument("--tokens", default="1,512")
    ap.add_argument("--format", default="int4g128", choices=sorted(FORMATS))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if not dense_op.install_dense_kernel():
        raise SystemExit("the compiled kernel (//cpp/moe:_moe_kernel.so) is not loaded; build it or set LLMQ_MOE_KERNEL")
    bits, gs = FORMATS[args.format]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.format}, median (min) ms per call")
    print("| N x K | tokens | (op) kernel | (deq) dequantize + F.linear | (fp32) torch.matmul |")
    print("|---|---|---|---|---|")
    for n in (int(s) for s in args.shapes.split(",")):
        for t in (int(s) for s in args.tokens.split(",")):
            r = bench_case(n, t, bits, gs, args.rounds)
            cells = [_cell(r, name) for name in ("op", "deq", "fp32")]
            print(f"| {n} x {n} | {t} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
