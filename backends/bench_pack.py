"""Packing throughput of the terminal backends on one Qwen3.5-MoE layer's experts.

Input: the canonical 4-bit form (llmq.quant.formats) of a layer's routed experts,
gate and up [E, 512, 2048] and down [E, 2048, 512] (E = 256), group 64 by default.
Throughput is reported in GB/s of canonical input (qdata + scale + bias bytes).

    PYTHONPATH=python:backends/mlx:backends/cuda .venv/bin/python backends/bench_pack.py
    (under Bazel: bazel run //backends:bench_pack -- --experts 256)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from llmq.quant.formats import GroupQuantizedWeight, pack_bits


def canonical_experts(e: int, n: int, k: int, group: int, seed: int) -> GroupQuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (e, n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(e, n, k // group, generator=g) * 0.01 + 1e-3
    return GroupQuantizedWeight(pack_bits(q, 4), scale, -8 * scale, bits=4, group_size=group, shape=(e, n, k))


def timed(fn, repeat: int):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: shared machines)")
    args = p.parse_args(argv)
    if args.experts <= 0 or args.repeat <= 0 or args.hidden % 128 or args.inter % 128:
        print("bench_pack: --experts/--repeat must be positive, --hidden/--inter multiples of 128", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)

    try:
        import llmq_cuda
        import llmq_mlx
    except ImportError as exc:  # pragma: no cover - run from the wrong place
        print(f"bench_pack: cannot import the backends ({exc}); see the module docstring", file=sys.stderr)
        return 2

    e, d, f = args.experts, args.hidden, args.inter
    weights = {
        "gate": canonical_experts(e, f, d, args.group, 0),
        "up": canonical_experts(e, f, d, args.group, 1),
        "down": canonical_experts(e, d, f, args.group, 2),
    }
    in_bytes = sum(w.nbytes for w in weights.values())

    def mlx_view():
        return [llmq_mlx.pack_mlx_affine(w) for w in weights.values()]

    def mlx_materialized():  # what a writer pays: the words and metadata in fresh buffers
        return [(m.weight.clone(), m.scales.clone(), m.biases.clone()) for m in mlx_view()]

    def mlx_arrays():
        import mlx.core as mx

        arrays = [m.to_mx() for m in mlx_view()]
        mx.eval(*[a for t in arrays for a in t])
        return arrays

    def cuda_tinygemm():
        return [llmq_cuda.pack_tinygemm_int4(w, inner_k_tiles=8) for w in weights.values()]

    cases = [
        ("mlx affine (zero-copy view)", mlx_view),
        ("mlx affine (materialized copy)", mlx_materialized),
        ("mlx affine -> mx.array", mlx_arrays),
        ("cuda tinygemm int4 (T=8, bf16 s/z)", cuda_tinygemm),
    ]
    print(
        f"Qwen3.5-MoE layer experts: E={e}, gate/up [{f}, {d}], down [{d}, {f}], int4 g{args.group}; "
        f"canonical input {in_bytes / 1e6:.1f} MB; torch threads {args.threads}"
    )
    print(f"{'target':40s} {'best ms':>10s} {'median ms':>10s} {'GB/s (best)':>12s}")
    for name, fn in cases:
        try:
            fn()  # warm up (and fail early, visibly)
        except Exception as exc:  # noqa: BLE001 - a benchmark row reports its failure
            print(f"{name:40s} unavailable: {exc}")
            continue
        best, med = timed(fn, args.repeat)
        print(f"{name:40s} {best * 1e3:10.2f} {med * 1e3:10.2f} {in_bytes / best / 1e9:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
