"""Export throughput and peak memory: a synthetic bf16 checkpoint -> NVFP4 / FP8 HF folders.

    bazel run //python/llmq/export:bench_export -- --size-gb=2
    PYTHONPATH=python .venv/bin/python python/llmq/export/bench_export.py --size-gb=2

Writes a synthetic checkpoint (Llama-like decoder layers of 4096x4096 / 4096x11008 bf16
linears, sharded safetensors) once, then for each format runs the streaming writer in a fresh
subprocess that reads the shards one tensor at a time, and prints GB/s of bf16 input and the
subprocess's peak RSS (shards are written tensor by tensor, so the peak is baseline + about
one tensor and its outputs). Format "io" is the reference in the same run: the same read
and the same shard writer with no quantization (bf16 in, bf16 out), so its RSS is the
baseline and its rate the I/O ceiling. The input is read from the page cache (it was just
written), so the numbers measure quantize + pack + write, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch

HIDDEN, INTER = 4096, 11008


def _layer_shapes(i):
    p = f"model.layers.{i}"
    return [
        (f"{p}.self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
        (f"{p}.self_attn.k_proj.weight", (HIDDEN // 4, HIDDEN)),
        (f"{p}.self_attn.v_proj.weight", (HIDDEN // 4, HIDDEN)),
        (f"{p}.self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
        (f"{p}.mlp.gate_proj.weight", (INTER, HIDDEN)),
        (f"{p}.mlp.up_proj.weight", (INTER, HIDDEN)),
        (f"{p}.mlp.down_proj.weight", (HIDDEN, INTER)),
        (f"{p}.input_layernorm.weight", (HIDDEN,)),
    ]


def make_checkpoint(folder: str, size_gb: float) -> int:
    """Write a deterministic synthetic bf16 checkpoint of about size_gb; return its bytes."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    total, layer = 0, 0
    target = int(size_gb * 1e9)
    while total < target:
        shard = {}
        for name, shape in _layer_shapes(layer):
            shard[name] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            total += shard[name].numel() * 2
        save_file(shard, os.path.join(folder, f"layer-{layer:04d}.safetensors"))
        layer += 1
    return total


def iter_folder(folder: str):
    """(name, tensor) one at a time from every shard of `folder`, through llmq's reader (one
    tensor in fresh memory at a time, as the integer stream reads; safe_open's mmap views would
    leave the shards' pages mapped into the process and count them as its RSS)."""
    from llmq.checkpoint import iter_checkpoint

    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            yield from iter_checkpoint(os.path.join(folder, f))


def run_one(src: str, dst: str, fmt: str, style: str, max_shard_bytes: int = 512 << 20) -> dict:
    """Export src to dst in one format (runs inside the measuring subprocess)."""
    from llmq.export import ShardWriter, write_hf_quantized_checkpoint

    if fmt == "io":  # read + write through the same shard writer, no quantization
        start, n = time.perf_counter(), 0
        os.makedirs(dst, exist_ok=True)
        shards = ShardWriter(dst, max_shard_bytes)
        for name, t in iter_folder(src):
            shards.add(name, t)
            n += t.numel() * t.element_size()
        shards.close()
        seconds = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"format": fmt, "style": style, "input_bytes": n, "output_bytes": n, "seconds": seconds, "gb_per_s": n / seconds / 1e9, "peak_rss_bytes": rss}
    config = {"fp8": {"format": "fp8", "granularity": "channel"}, "fp8_block": {"format": "fp8", "granularity": "block128"},
              "nvfp4": {"format": "nvfp4"}, "mxfp4": {"format": "mxfp4"}}[fmt]
    def recipe(fqn):
        return config
    start = time.perf_counter()
    s = write_hf_quantized_checkpoint(dst, iter_folder(src), recipe, style=style, max_shard_bytes=max_shard_bytes, overwrite=True)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"format": fmt, "style": style, "input_bytes": s.input_bytes, "output_bytes": s.output_bytes,
            "seconds": seconds, "gb_per_s": s.input_bytes / seconds / 1e9, "peak_rss_bytes": rss}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="synthetic checkpoint size in GB of bf16")
    ap.add_argument("--formats", default="nvfp4,fp8", help="comma list of io, nvfp4, fp8, fp8_block, mxfp4 (io: read + write, no quantization)")
    ap.add_argument("--style", default="modelopt", choices=["modelopt", "compressed-tensors"])
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one, removed afterwards)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in the export (0 = torch default)")
    ap.add_argument("--max-shard-mb", type=int, default=512, help="output shard size")
    ap.add_argument("--_child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(run_one(*args._child, max_shard_bytes=args.max_shard_mb << 20)))
        return 0
    work = args.workdir or tempfile.mkdtemp(prefix="llmq-bench-export-")
    try:
        src = os.path.join(work, "src")
        if not os.path.isdir(src):
            print(f"writing a synthetic {args.size_gb:g} GB bf16 checkpoint to {src} ...", flush=True)
            make_checkpoint(src, args.size_gb)
        print(f"{'format':<10} {'style':<19} {'input GB':>9} {'output GB':>10} {'seconds':>8} {'GB/s':>6} {'peak RSS GB':>12}")
        for fmt in args.formats.split(","):
            dst = os.path.join(work, f"out-{fmt}")
            cmd = [sys.executable, os.path.abspath(__file__), "--threads", str(args.threads),
                   "--max-shard-mb", str(args.max_shard_mb), "--_child", src, dst, fmt, args.style]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if res.returncode:
                print(res.stderr[-2000:], file=sys.stderr)
                return 1
            r = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{fmt:<10} {args.style:<19} {r['input_bytes'] / 1e9:>9.2f} {r['output_bytes'] / 1e9:>10.2f} "
                  f"{r['seconds']:>8.1f} {r['gb_per_s']:>6.2f} {r['peak_rss_bytes'] / 1e9:>12.2f}", flush=True)
            shutil.rmtree(dst, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
