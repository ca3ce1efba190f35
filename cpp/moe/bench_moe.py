"""Benchmark of torch.ops.llmq.quantized_moe_ffn against eager PyTorch MoE layers.

    bazel run //cpp/moe:bench_moe -- [--quick] [--shapes qwen,small] [--tokens 1,8,64,512]
        [--formats int4g32,int4g128,int8g128,int4g32-bf,int4g128-bf] [--threads 1,2] [--no-baselines]

Per case it prints the median and minimum wall time of one MoE layer (router + routed
experts + shared expert) for
  (a) eager PyTorch, dense experts in bf16 and fp32 (loop over active experts:
      index_select, F.linear, silu*mul, F.linear, index_add),
  (b) eager PyTorch, INT4 experts through aten._weight_int4pack_mm_for_cpu (bf16 activations),
  (c) this op,
and, at T=1, (b') and (c'): the same calls each right after some torch work (four bf16
projections and a norm, as between two MoE layers of a decoding model), which is what the
op meets in a model: torch's OpenMP worker still spinning on the other core, caches just
used by other work (their "x op" is relative to (c')),
and "% limit" = floor time / median time, the floor measured on this machine at start-up:
the larger of (bytes of the experts the batch hits, in that path's format) / (measured read
bandwidth) and 2 * MACs / (measured peak of the instruction set the path uses: fp32 FMA,
bf16 dot, int8 VNNI). Decode (T=1) is bandwidth-bound, prefill (T=512) compute-bound.
Each (shape, format) runs in a fresh process. The methods of one case are timed side by side (five rounds, each running every method's
share of the calls; see timed()), so a burst of load from other processes on this shared VM
slows all of them alike and the "x op" ratios stay meaningful; the minimum is the better estimate of the uncontended time,
the median of what a user sees. Machine limits are the best seen over the whole run: read
bandwidth is probed again before every case (other tenants' memory traffic moves it
between ~40 and ~75 GB/s here), so the table is printed at the end. Consecutive calls use
different random tokens, so different experts are hit and decode weights come from memory
(the dense baselines share one pool of 64 distinct experts across the 256 slots to bound RAM).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from llmq._extensions import find_extension, load_first
from llmq.ops import load_kernel, pack_moe_experts, quantized_moe_ffn
from llmq.ops.moe_testing import random_moe
from llmq.quant.formats import dequantize_canonical, unpack_bits

SHAPES = {  # name: (D, F, E, top_k, shared F)
    "qwen": (2048, 512, 256, 8, 512),
    "small": (1024, 256, 64, 4, 0),
}
# name: (bits, group size, scale/bias dtype); "-bf" = compact bfloat16 scales and biases
FORMATS = {"int4g32": (4, 32, torch.float32), "int4g128": (4, 128, torch.float32),
           "int8g128": (8, 128, torch.float32), "int8g32": (8, 32, torch.float32),
           "int4g32-bf": (4, 32, torch.bfloat16), "int4g128-bf": (4, 128, torch.bfloat16)}
DENSE_POOL = 64


def load_machine_probe():
    """The benchmark-only probe module (cpp/moe/_machine_probe.so, a data dependency of this binary)."""
    probe, problems = load_first("_machine_probe", find_extension("moe", "_machine_probe"))
    if probe is None:
        sys.exit("error: cpp/moe/_machine_probe.so not found or not loadable (run this as "
                 "`bazel run //cpp/moe:bench_moe`)" + "".join("; " + p for p in problems))
    return probe
ROTATE_BYTES = 128 << 20


def timed(fns, inputs, reps, rounds=5):
    """{name: (median, min)} seconds over reps calls of every fn(x, i), side by side: in each
    of `rounds` rounds every method runs its share of the calls back to back, after a 50 ms
    pause and, when calls are short, one untimed call. The pause matters: torch's OpenMP
    workers keep spinning for milliseconds after a torch op, and on 2 cores a spinning
    worker takes the core the op's second thread needs (measured: the op's T=1 median rose
    from 0.32-0.38 to 0.43-0.59 ms when it ran right after torch calls). A burst of load from
    other processes on this shared VM thus hits all methods alike."""
    rounds = max(1, min(rounds, reps))
    times = {name: [] for name in fns}
    i = 0
    for r in range(rounds):
        block = reps // rounds + (1 if r < reps % rounds else 0)
        for name, fn in fns.items():
            prelude, fn = fn if isinstance(fn, tuple) else (None, fn)  # prelude: untimed work before each call
            time.sleep(float(os.environ.get("BENCH_PAUSE", "0.05")))  # let the previous method's threads (torch's OpenMP team spins) go idle
            if reps >= 10:
                fn(inputs[(i + block) % len(inputs)], i + block)  # untimed first call of the block
            for j in range(i, i + block):
                if prelude is not None:
                    prelude(inputs[j % len(inputs)])
                t0 = time.perf_counter()
                fn(inputs[j % len(inputs)], j)
                times[name].append(time.perf_counter() - t0)
        i += block
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


class AttentionStandIn:
    """The torch work a decode step does between two MoE layers, roughly: four bf16 [D, D]
    projections and an RMS norm. Run untimed before each call of the "in a decode loop" rows,
    so the op meets what it meets in a model: torch's OpenMP workers still spinning, caches
    and the helper thread's core just used by other work."""

    def __init__(self, d, generator):
        self.w = [torch.randn(d, d, generator=generator).div_(math.sqrt(d)).bfloat16() for _ in range(4)]

    def __call__(self, x):
        h = x.bfloat16()
        for w in self.w:
            h = F.linear(h, w)
        return F.rms_norm(h.float(), (h.shape[-1],))


class Layer:
    """One random MoE layer in every form the benchmark needs."""

    def __init__(self, shape, bits, gs, need_dense, need_int4pack, scale_dtype=torch.float32):
        d, f, e, k, fs = shape
        self.d, self.f, self.e, self.k, self.fs = d, f, e, k, fs
        router, w13, w2, shared = random_moe(e, d, f, bits, gs, seed=0, shared_inter=fs)
        self.router = router
        self.packed = pack_moe_experts(w13, w2, scale_dtype)
        # enough copies that consecutive calls cannot find their weights in the 32 MiB L3
        self.copies = [self.packed] + [
            _clone(self.packed) for _ in range(max(0, math.ceil(ROTATE_BYTES / self.packed.nbytes) - 1))]
        self.shared = pack_moe_experts(shared[0], shared[1], scale_dtype) if shared else None
        self.shared_gate = shared[2] if shared else None
        self.bits, self.gs = bits, gs
        self.expert_bytes = self.packed.nbytes / e
        self.shared_bytes = self.shared.nbytes if self.shared else 0
        pool = min(e, DENSE_POOL)
        self.dense = {}
        if need_dense:
            w13d = dequantize_canonical(_slice(w13, pool))
            w2d = dequantize_canonical(_slice(w2, pool))
            s = (dequantize_canonical(shared[0]), dequantize_canonical(shared[1])) if shared else None
            for dt in (torch.bfloat16, torch.float32):
                self.dense[dt] = (w13d.to(dt), w2d.to(dt), tuple(t.to(dt) for t in s) if s else None)
        self.int4 = None
        if need_int4pack and bits == 4:
            self.int4 = ([_int4pack(_slice(w13, pool), i) for i in range(pool)],
                         [_int4pack(_slice(w2, pool), i) for i in range(pool)],
                         (_int4pack(_unsq(shared[0]), 0), _int4pack(_unsq(shared[1]), 0)) if shared else None)
        self.pool = pool

    def run_op(self, x, threads, i=0):
        p, s = self.copies[i % len(self.copies)], self.shared
        kw = {}
        if s is not None:
            kw = dict(shared_w13_qdata=s.w13_qdata, shared_w13_sb=s.w13_sb, shared_w2_qdata=s.w2_qdata,
                      shared_w2_sb=s.w2_sb, shared_gate_weight=self.shared_gate, shared_bits=s.bits,
                      shared_group_size=s.group_size)
        return quantized_moe_ffn(x, self.router, None, p.w13_qdata, p.w13_sb, p.w2_qdata, p.w2_sb, self.k, p.bits,
                                 p.group_size, num_threads=threads, **kw)

    def _route(self, x):
        logits = F.linear(x.float(), self.router)
        w, idx = torch.topk(torch.softmax(logits, -1), self.k, dim=-1)
        return idx, w / w.sum(-1, keepdim=True)

    def run_eager(self, x, expert_fn, shared_fn, dtype):
        """Loop over active experts; expert_fn(e, tokens) -> [n, D]."""
        idx, wts = self._route(x)
        xd = x.to(dtype)
        out = torch.zeros(x.shape[0], self.d, dtype=dtype)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            y = expert_fn(e % self.pool, xd.index_select(0, tok))
            out.index_add_(0, tok, y * wts[tok, slot].unsqueeze(-1).to(dtype))
        if shared_fn is not None:
            out += torch.sigmoid(F.linear(x.float(), self.shared_gate)).to(dtype) * shared_fn(xd)
        return out

    def run_dense(self, x, i, dtype):
        w13, w2, s = self.dense[dtype]

        def expert(e, h, a=w13, b=w2):
            gu = F.linear(h, a[e])
            return F.linear(F.silu(gu[:, : gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2 :], b[e])

        shared = (lambda h: expert(0, h, s[0].unsqueeze(0), s[1].unsqueeze(0))) if s else None
        return self.run_eager(x, expert, shared, dtype)

    def run_int4pack(self, x, i=0):
        w13, w2, s = self.int4

        def mm(h, packed):
            return torch.ops.aten._weight_int4pack_mm_for_cpu(h, packed[0], self.gs, packed[1])

        def expert(e, h, a=w13, b=w2):
            gu = mm(h, a[e])
            return mm(F.silu(gu[:, : gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2 :], b[e])

        shared = (lambda h: expert(0, h, [s[0]], [s[1]])) if s else None
        return self.run_eager(x, expert, shared, torch.bfloat16)


def _clone(p):
    import dataclasses

    return dataclasses.replace(p, w13_qdata=p.w13_qdata.clone(), w13_sb=p.w13_sb.clone(),
                               w2_qdata=p.w2_qdata.clone(), w2_sb=p.w2_sb.clone())


def _slice(w, n):
    from llmq.quant.formats import GroupQuantizedWeight

    return GroupQuantizedWeight(w.qdata[:n], w.scale[:n], w.bias[:n], w.bits, w.group_size, (n,) + tuple(w.shape[1:]))


def _unsq(w):
    from llmq.quant.formats import GroupQuantizedWeight

    return GroupQuantizedWeight(w.qdata[None], w.scale[None], w.bias[None], w.bits, w.group_size, (1,) + tuple(w.shape))


def _int4pack(w, i):
    """Expert i of a canonical INT4 weight as tinygemm-CPU operands: w = (q - 8)*scale + zero."""
    n, k = w.shape[-2:]
    q = unpack_bits(w.qdata[i], 4, k).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    zero = w.bias[i] + 8 * w.scale[i]
    sz = torch.stack([w.scale[i].T, zero.T], dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz


def measure_case(probe, sname, fname, tokens, threads, dense, int4pack):
    """Timings of one (shape, format) over every T and thread count, in this process:
    [(shape, fmt, T, threads, method, (median, min), isa, expert_bytes, shared_bytes, macs,
    d, f, e, k, fs, gs)], and the read bandwidths probed before each case {threads: [GB/s]}."""
    shape = SHAPES[sname]
    d, f, e, k, fs = shape
    bits, gs, scale_dtype = FORMATS[fname]
    gen = torch.Generator().manual_seed(123)
    layer = Layer(shape, bits, gs, need_dense=dense, need_int4pack=int4pack and bits == 4, scale_dtype=scale_dtype)
    results, bw_seen = [], {th: [] for th in threads}
    for t in tokens:
        inputs = [torch.randn(t, d, generator=gen) for _ in range(8)]
        reps = 50 if t == 1 else 20 if t <= 8 else 6 if t <= 64 else 3
        macs = t * (k * 3 * d * f + 3 * d * fs + e * d)
        for th in threads:
            torch.set_num_threads(th)
            bw_seen[th].append(probe.measure_read_gbps(th, 256 << 20, 4))
            fns = {"(c) llmq op " + fname: lambda x, i, th=th: layer.run_op(x, th, i)}
            isas = {"(c) llmq op " + fname: "int8"}
            layer.run_op(inputs[0], th)  # warm-up (pool threads, workspace)
            if layer.int4 is not None:
                fns[f"(b) int4pack g{gs}"] = lambda x, i: layer.run_int4pack(x.bfloat16(), i)
                isas[f"(b) int4pack g{gs}"] = "bf16"
            if dense:
                for dt, nm in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                    fns[f"(a) dense {nm}"] = lambda x, i, dt=dt: layer.run_dense(x, i, dt)
                    isas[f"(a) dense {nm}"] = nm
            if t == 1:  # the same calls, each right after torch work (see AttentionStandIn)
                attn = AttentionStandIn(d, gen)
                for name in [n for n in fns if n.startswith(("(b)", "(c)"))]:
                    looped = name[:2] + "')" + name[3:] + ", loop"  # "(c) x" -> "(c') x, loop"
                    fns[looped], isas[looped] = (attn, fns[name]), isas[name]
            for name, res in timed(fns, inputs, reps).items():
                results.append((sname, fname, t, th, name, res, isas[name], layer.expert_bytes,
                                layer.shared_bytes, macs, d, f, e, k, fs, gs))
            print(f"  measured {sname} {fname} T={t} threads={th}", file=sys.stderr, flush=True)
    return results, bw_seen


def run_child(sname, fname, args, dense):
    """measure_case in a fresh process: each (shape, format) starts from the same state (in
    one process, formats measured after the first showed 1.3-1.9x slower medians at T=1
    while the same calls in a tight loop did not change; a fresh process removes the doubt)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--shapes", sname, "--formats", fname,
           "--tokens", args.tokens, "--threads", args.threads] + (["--dense"] if dense else []) + (
        ["--no-baselines"] if args.no_baselines else [])
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    if proc.returncode:
        raise RuntimeError(f"bench_moe child for {sname} {fname} failed (exit {proc.returncode})")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return [tuple(r[:5]) + (tuple(r[5]),) + tuple(r[6:]) for r in data["results"]], {
        int(th): v for th, v in data["bw"].items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen,small")
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--formats", default="int4g32,int4g128,int8g128,int4g32-bf,int4g128-bf")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--no-baselines", action="store_true", help="time only the op")
    ap.add_argument("--quick", action="store_true",
                    help="qwen + small, T=1 and 512, int4g128 (float32 and bfloat16 scales), 2 threads")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dense", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.formats, args.threads = "1,512", "int4g128,int4g128-bf", "2"
    try:
        shapes = [(s, SHAPES[s]) for s in args.shapes.split(",")]
        formats = [(f, FORMATS[f]) for f in args.formats.split(",")]
        tokens = [int(t) for t in args.tokens.split(",")]
        threads = [int(t) for t in args.threads.split(",")]
    except (KeyError, ValueError) as e:
        print(f"bench_moe: bad argument {e}; shapes {list(SHAPES)}, formats {list(FORMATS)}", file=sys.stderr)
        return 2
    kernel = load_kernel()
    if args.child:
        results, bw = measure_case(load_machine_probe(), shapes[0][0], formats[0][0], tokens, threads, args.dense,
                                   not args.no_baselines)
        print(json.dumps({"results": results, "bw": bw}))
        return 0
    print(f"kernel isa: {kernel.best_isa()}; torch {torch.__version__}")
    probe = load_machine_probe()
    peak = {}
    for th in threads:
        # compute peaks are stable; bandwidth is re-probed before every case (see the docstring)
        peak[th] = {
            "bw": probe.measure_read_gbps(th, 1 << 30, 6),
            "fp32": max(probe.measure_peak_gops("fp32_fma", th, 0.2) for _ in range(3)),
            "bf16": max(probe.measure_peak_gops("bf16_dot", th, 0.2) for _ in range(3)),
            "int8": max(probe.measure_peak_gops("int8_vnni", th, 0.2) for _ in range(3)),
        }
    bw_seen = {th: [peak[th]["bw"]] for th in threads}
    results = []
    for sname, _ in shapes:
        for fi, (fname, _) in enumerate(formats):
            # dense baselines once per shape (with the first format's experts)
            res, bw = run_child(sname, fname, args, dense=not args.no_baselines and fi == 0)
            results += res
            for th, v in bw.items():
                bw_seen[th] += v
    for th in threads:
        lim = peak[th]
        lim["bw"] = max(bw_seen[th])
        print(f"machine, {th} thread(s): read {lim['bw']:.1f} GB/s (best of {len(bw_seen[th])} probes; "
              f"lowest {min(bw_seen[th]):.1f}); peak fp32 FMA {lim['fp32']:.0f}, bf16 dot {lim['bf16']:.0f}, "
              f"int8 VNNI {lim['int8']:.0f} Gop/s")
    header = (f"{'shape':6} {'fmt':11} {'T':>4} {'thr':>3} | {'method':32} {'median ms':>10} {'min ms':>9} "
              f"{'x op':>6} {'% limit':>8}")
    print(header)
    print("-" * len(header))
    op_time = {}  # (shape, fmt, T, threads, in a decode loop?) -> the op's median
    for r in results:
        if r[4].startswith(("(c)", "(c')")):
            op_time[r[:4] + (r[4].startswith("(c')"),)] = r[5][0]
    for (sname, fname, t, th, name, (sec, best), isa, expert_bytes, shared_bytes, macs, d, f, e, k, fs,
         gs) in results:
        lim = peak[th]
        # the floor is the larger of: reading the weights of the experts this batch hits
        # (expected distinct experts for uniform routing) at the best bandwidth seen, and its
        # multiply-adds at the measured peak of the path's ISA
        is_op = name.startswith(("(c)", "(c')"))
        in_loop = name[2] == "'"
        per_expert = expert_bytes if is_op else (
            3 * d * f * (2 if isa == "bf16" and name.startswith("(a)") else 4 if isa == "fp32"
                         else 0.5 + 4 / gs))
        shared_b = shared_bytes if is_op else per_expert * fs / f
        hit = e * (1 - (1 - k / e) ** t)
        need = max((hit * per_expert + shared_b) / (lim["bw"] * 1e9), 2 * macs / (lim[isa] * 1e9))
        # "x op": median time relative to the op's; "% limit": limit time / median time
        print(f"{sname:6} {fname:11} {t:>4} {th:>3} | {name:32} {sec * 1e3:10.3f} {best * 1e3:9.3f} "
              f"{sec / op_time[(sname, fname, t, th, in_loop)]:6.2f} {100 * need / sec:7.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
