"""Packing throughput of the terminal backends on one Qwen3.5-MoE layer's experts.

Input: the canonical 4-bit form (llmq.quant.formats) of a layer's routed experts,
gate and up [E, 512, 2048] and down [E, 2048, 512] (E = 256), group 64 by default.
Throughput is reported in GB/s of canonical input (qdata + scale + bias bytes), and as a
ratio to the I/O-only rate of the same run: the same canonical bytes, saved as a safetensors
file, read back through llmq's reader (`iter_checkpoint`, page cache warm) into fresh memory,
i.e. what any path pays just to have the input in memory. Cases run interleaved, round by
round, best of --repeat.

    PYTHONPATH=python:backends/mlx:backends/cuda .venv/bin/python backends/bench_pack.py
    (under Bazel: bazel run //backends:bench_pack -- --experts 256)
"""

from __future__ import annotations

import argparse
import os
import shutil
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

    from llmq.checkpoint import iter_checkpoint
    from llmq.checkpoint.safetensors_io import alloc_bytes

    e, d, f = args.experts, args.hidden, args.inter
    weights = {
        "gate": canonical_experts(e, f, d, args.group, 0),
        "up": canonical_experts(e, f, d, args.group, 1),
        "down": canonical_experts(e, d, f, args.group, 2),
    }
    in_bytes = sum(w.nbytes for w in weights.values())

    def mlx_view():
        return [llmq_mlx.pack_mlx_affine(w) for w in weights.values()]

    def fresh_copy(t):  # llmq's allocator for fresh tensors (huge pages when large), as the reader uses
        return alloc_bytes(t.numel() * t.element_size()).view(t.dtype).view(t.shape).copy_(t)

    def mlx_materialized():  # what a writer pays: the words and metadata in fresh buffers
        return [(fresh_copy(m.weight), fresh_copy(m.scales), fresh_copy(m.biases)) for m in mlx_view()]

    def mlx_arrays():
        import mlx.core as mx

        arrays = [m.to_mx() for m in mlx_view()]
        mx.eval(*[a for t in arrays for a in t])
        return arrays

    def cuda_tinygemm():
        return [llmq_cuda.pack_tinygemm_int4(w, inner_k_tiles=8) for w in weights.values()]

    def cuda_tinygemm_torch_tiles():  # the packer before the compiled kernel: torch word arithmetic
        from llmq_cuda.tinygemm import tile_pack_canonical_bytes, tinygemm_scale_and_zero

        return [(tile_pack_canonical_bytes(w.qdata, 8), tinygemm_scale_and_zero(w, group_size=w.group_size))
                for w in weights.values()]

    import tempfile

    from safetensors.torch import save_file

    tmp = tempfile.mkdtemp(prefix="llmq-bench-pack-")
    io_file = os.path.join(tmp, "canonical.safetensors")
    save_file({f"{k}.{part}": getattr(w, part) for k, w in weights.items() for part in ("qdata", "scale", "bias")},
              io_file)

    def io_only():  # the reference: the canonical bytes read from the page cache into fresh memory
        return [t for _, t in iter_checkpoint(io_file, nonfinite="allow")]

    cases = [
        ("I/O only (iter_checkpoint of the input)", io_only),
        ("mlx affine (zero-copy view)", mlx_view),
        ("mlx affine (copied into fresh huge-page buffers)", mlx_materialized),
        ("mlx affine -> mx.array", mlx_arrays),
        ("cuda tinygemm int4 (T=8, bf16 s/z)", cuda_tinygemm),
        ("same, torch reference tile packer (before)", cuda_tinygemm_torch_tiles),
    ]
    print(
        f"Qwen3.5-MoE layer experts: E={e}, gate/up [{f}, {d}], down [{d}, {f}], int4 g{args.group}; "
        f"canonical input {in_bytes / 1e6:.1f} MB; torch threads {args.threads}"
    )
    try:
        live = []
        for name, fn in cases:
            try:
                fn()  # warm up (and fail early, visibly)
                live.append((name, fn))
            except Exception as exc:  # noqa: BLE001 - a benchmark row reports its failure
                print(f"{name:42s} unavailable: {exc}")
        times = {name: [] for name, _ in live}
        for _ in range(args.repeat):  # round by round: a busy moment hits every case alike
            for name, fn in live:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    io_rate = in_bytes / min(times[cases[0][0]]) if cases[0][0] in times else None
    print("\n| target | best ms | median ms | GB/s (best) | x I/O only |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        best, med = min(ts), statistics.median(ts)
        rate = in_bytes / best / 1e9
        ratio = f"{in_bytes / best / io_rate:.2f}" if io_rate else "-"
        print(f"| {name} | {best * 1e3:.2f} | {med * 1e3:.2f} | {rate:.2f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
