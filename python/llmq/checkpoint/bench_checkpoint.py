"""Checkpoint I/O benchmark: read throughput, streaming quantize+save, GGUF import.

Writes synthetic bf16 Hugging Face checkpoints (sharded, with an index) of the given
sizes under --workdir, then measures, each in a fresh subprocess (so peak RSS is the
phase's own):

  read      iter_checkpoint vs safetensors.safe_open (get_tensor, and get_tensor +
            clone) over the same tensors, page cache warm; ratio in one run.
  stream    iter_checkpoint -> llmq.quant.quantize_stream (INT4, g32, asymmetric) ->
            save_bundle: throughput (GB of input per second; median and best of --repeat
            fresh processes, this machine being shared) and peak RSS (the worst run's).
            The stream and fp variants run interleaved, one of each per round, so a slow
            spell of the shared disk falls on all of them; every phase starts after os.sync().
            Tensors over --chunk-mb travel as blocks of rows (iter_checkpoint chunk_bytes).
  torchao   the usual way: load every shard whole (safetensors.torch.load_file), assign
            into a model, torchao.quantize_(IntxWeightOnlyConfig(int4, PerGroup(32))); in the
            same rounds as stream and fp. After the rounds, once per FP path, the same with
            torchao's config of that format (Float8WeightOnly per row, NVFP4WeightOnly).
  fp        iter_checkpoint -> llmq.export (ModelOpt-style NVFP4 and FP8 per-channel folder,
            streaming shards): the FP paths, same input, same repeat rule as stream.
  gguf      iter_checkpoint over a GGUF of Q4_0/Q8_0/Q4_K/Q6_K tensors: GB/s of input, next to
            reading the same tensor bytes raw (GGUF I/O only).

The closing table puts every path side by side as GB/s of input, its ratio to the I/O-only
stream (read -> save_bundle, no quantization) of the same run and to torchao's load +
quantize_ of the same run, and peak RSS above the import baseline.

Never run by tests. Usage (deletes its files at the end unless --keep):
  python -m llmq.checkpoint.bench_checkpoint --sizes 2,4 --workdir /tmp/llmq_bench
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

GB = 1e9
HIDDEN, INTER, VOCAB = 2048, 5632, 32000
SHARD_BYTES = 1 << 30


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def layer_shapes():
    h, i = HIDDEN, INTER
    return [("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (h, h)), ("self_attn.v_proj", (h, h)),
            ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
            ("mlp.down_proj", (h, i))]


def make_checkpoint(folder: str, size_gb: float) -> dict:
    """A llama-like bf16 checkpoint of about size_gb GB, in 1 GiB shards plus an index."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    per_layer = sum(n * k for _, (n, k) in layer_shapes()) * 2
    fixed = 2 * VOCAB * HIDDEN * 2
    n_layers = max(1, round((size_gb * GB - fixed) / per_layer))
    # One random pool, sliced per tensor: realistic values without minutes of randn.
    pool = (torch.randn(VOCAB * HIDDEN + 4096, generator=g) * 0.02).to(torch.bfloat16)

    def tensor(shape, salt):
        n = shape[0] * shape[1]
        start = (salt * 7919) % 4096
        return pool[start:start + n].reshape(shape).clone()

    names = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for li in range(n_layers):
        for mod, shape in layer_shapes():
            names.append((f"model.layers.{li}.{mod}.weight", shape))
        names.append((f"model.layers.{li}.input_layernorm.weight", (HIDDEN,)))
    names += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    weight_map, shard, shard_bytes, idx, total = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, shard_bytes, idx
        if shard:
            idx += 1
            fname = f"model-{idx:05d}.safetensors"
            save_file(shard, os.path.join(folder, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
            shard, shard_bytes = {}, 0

    for salt, (name, shape) in enumerate(names):
        t = torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else tensor(shape, salt)
        if shard_bytes + t.numel() * 2 > SHARD_BYTES:
            flush()
        shard[name] = t
        shard_bytes += t.numel() * 2
        total += t.numel() * 2
    flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return {"bytes": total, "layers": n_layers, "shards": idx}


def make_gguf(path: str, size_gb: float) -> dict:
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    T = gguf.GGMLQuantizationType
    half_at = {"Q4_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}
    w = gguf.GGUFWriter(path, "llama")
    total, i = 0, 0
    per_type = {}
    while total < size_gb * GB:
        for type_name in ("Q4_0", "Q8_0", "Q4_K", "Q6_K"):
            block, type_size = gguf.GGML_QUANT_SIZES[T[type_name]]
            n, k = INTER, HIDDEN
            raw = rng.integers(0, 256, size=(n * k // block, type_size), dtype=np.uint8)
            for off in half_at[type_name]:
                raw[:, off:off + 2] = (rng.uniform(1e-4, 1e-2, size=(raw.shape[0], 1))
                                       .astype(np.float16).view(np.uint8))
            w.add_tensor(f"blk.{i}.{type_name.lower()}.weight", raw.reshape(n, -1), raw_dtype=T[type_name])
            total += raw.nbytes
            per_type[type_name] = per_type.get(type_name, 0) + raw.nbytes
            i += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"bytes": total, "per_type_bytes": per_type}


def warm(paths):
    """Read files once so the measured passes see the page cache (the 'warm' numbers)."""
    buf = bytearray(1 << 24)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def files_of(folder):
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith((".safetensors", ".gguf")))


# ---- phases (each runs in its own process) -------------------------------------------------------

def phase_read(ckpt: str) -> dict:
    import torch
    from safetensors import safe_open

    from llmq.checkpoint import iter_checkpoint, safetensors_io as sio

    warm(files_of(ckpt))
    base = rss_bytes()
    out = {}
    for _rep in range(2):  # interleave, keep the best of two for each reader
        t0 = time.perf_counter()
        n = 0
        for _, t in iter_checkpoint(ckpt, nonfinite="allow"):
            n += t.numel() * t.element_size()
        out.setdefault("iter_checkpoint_s", []).append(time.perf_counter() - t0)
        parallel, sio._PARALLEL_READ_MAX_THREADS = sio._PARALLEL_READ_MAX_THREADS, 1  # before: one preadv
        try:
            t0 = time.perf_counter()
            for _ in iter_checkpoint(ckpt, nonfinite="allow"):
                pass
            out.setdefault("iter_checkpoint_one_range_s", []).append(time.perf_counter() - t0)
        finally:
            sio._PARALLEL_READ_MAX_THREADS = parallel
        t0 = time.perf_counter()
        n2 = 0
        for path in files_of(ckpt):
            with safe_open(path, "pt") as f:
                for k in f.keys():
                    t = f.get_tensor(k)
                    n2 += t.numel() * t.element_size()
        out.setdefault("safe_open_s", []).append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for path in files_of(ckpt):
            with safe_open(path, "pt") as f:
                for k in f.keys():
                    t = f.get_tensor(k).clone()
        out.setdefault("safe_open_clone_s", []).append(time.perf_counter() - t0)
        assert n == n2
        t0 = time.perf_counter()
        for _ in iter_checkpoint(ckpt, nonfinite="error"):
            pass
        out.setdefault("iter_checkpoint_nonfinite_check_s", []).append(time.perf_counter() - t0)
    res = {k: min(v) for k, v in out.items()}
    res.update(bytes=n, baseline_rss=base, peak_rss=peak_rss_bytes(), threads=torch.get_num_threads())
    return res


def int4_recipe():
    from llmq.quant import QuantConfig, QuantRecipe, QuantRule

    cfg = QuantConfig(bits=4, group_size=32, symmetric=False)
    return QuantRecipe([QuantRule(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj", cfg)])


def phase_stream(ckpt: str, out: str, fsync: bool, quantize: bool = True, max_shard_bytes: int = 0,
                 chunk_bytes: int = 0) -> dict:
    """read -> (INT4 quantize_stream) -> save_bundle; quantize=False measures the I/O path alone.

    max_shard_bytes=0 keeps save_bundle's default; chunk_bytes=0 reads every tensor whole."""
    from llmq.checkpoint import iter_checkpoint, save_bundle
    from llmq.quant import quantize_stream

    warm(files_of(ckpt))
    recipe = int4_recipe()
    shutil.rmtree(out, ignore_errors=True)
    base = rss_bytes()
    t0 = time.perf_counter()
    items = iter_checkpoint(ckpt, chunk_bytes=chunk_bytes or None)
    if quantize:
        items = quantize_stream(items, recipe)
    kwargs = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
    save_bundle(items, out, recipe=recipe if quantize else None, fsync=fsync, **kwargs)
    dt = time.perf_counter() - t0
    out_bytes = sum(os.path.getsize(p) for p in files_of(out))
    return {"seconds": dt, "baseline_rss": base, "peak_rss": peak_rss_bytes(), "out_bytes": out_bytes}


def phase_quant_only(ckpt: str) -> dict:
    """The quantization arithmetic alone, on tensors already in memory (one layer, repeated)."""
    from llmq.checkpoint import iter_checkpoint
    from llmq.quant import quantize_weight

    recipe = int4_recipe()
    tensors = []
    for name, t in iter_checkpoint(ckpt):
        if ".layers.0." in name and recipe.get_config(name.removesuffix(".weight")):
            tensors.append((name, t))
        elif tensors:
            break
    n = sum(t.numel() * 2 for _, t in tensors)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for name, t in tensors:
            quantize_weight(t, recipe.get_config(name.removesuffix(".weight")))
        best = min(best, time.perf_counter() - t0)
    return {"bytes": n, "seconds": best}


def torchao_config(fmt: str):
    """torchao's config for the reference of a path: int4 g32 (the common reference), or the
    FP path's own format (per-row FP8 as the FP8 path's per-channel, NVFP4 with its per-tensor scale)."""
    import torch
    from torchao.quantization import Float8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup, PerRow

    if fmt == "int4":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    if fmt == "fp8":
        return Float8WeightOnlyConfig(granularity=PerRow())
    if fmt == "nvfp4":
        from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig

        return NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=True)
    raise ValueError(fmt)


TORCHAO_NAMES = {"int4": "IntxWeightOnly int4 g32", "fp8": "Float8WeightOnly per row",
                 "nvfp4": "NVFP4WeightOnly, per-tensor scale"}


def phase_torchao(ckpt: str, fmt: str = "int4") -> dict:
    import torch
    from safetensors.torch import load_file
    from torchao.quantization import quantize_

    warm(files_of(ckpt))
    base = rss_bytes()
    t0 = time.perf_counter()
    sd = {}
    for path in files_of(ckpt):
        sd.update(load_file(path))
    t_load = time.perf_counter() - t0
    model = torch.nn.Module()
    for name, t in sd.items():
        if t.dim() == 2 and ".layers." in name:
            mod = torch.nn.Linear(t.shape[1], t.shape[0], bias=False, device="meta", dtype=torch.bfloat16)
            mod.weight = torch.nn.Parameter(t, requires_grad=False)
            model.add_module(name.removesuffix(".weight").replace(".", "_"), mod)
    del sd
    quantize_(model, torchao_config(fmt))
    dt = time.perf_counter() - t0
    return {"seconds": dt, "load_seconds": t_load, "baseline_rss": base, "peak_rss": peak_rss_bytes()}


FP_CONFIGS = {"nvfp4": {"format": "nvfp4"}, "fp8": {"format": "fp8", "granularity": "channel"}}


def phase_fp(ckpt: str, out: str, fmt: str, chunk_bytes: int = 0) -> dict:
    """read -> FP quantization -> ModelOpt-style HF folder (llmq.export's streaming shard writer)."""
    from llmq.checkpoint import iter_checkpoint
    from llmq.export import write_hf_quantized_checkpoint

    warm(files_of(ckpt))
    config = FP_CONFIGS[fmt]
    shutil.rmtree(out, ignore_errors=True)
    base = rss_bytes()
    t0 = time.perf_counter()
    s = write_hf_quantized_checkpoint(out, iter_checkpoint(ckpt, chunk_bytes=chunk_bytes or None), lambda fqn: config,
                                      style="modelopt",
                                      max_shard_bytes=SHARD_BYTES * 2, overwrite=True)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "baseline_rss": base, "peak_rss": peak_rss_bytes(), "out_bytes": s.output_bytes}


def phase_gguf(path: str) -> dict:
    from llmq.checkpoint import iter_checkpoint
    from llmq.checkpoint.gguf_import import GGUFFile

    warm([path])
    base = rss_bytes()
    best, raw = float("inf"), float("inf")
    for _ in range(2):  # interleaved: import, then the same bytes read raw
        t0 = time.perf_counter()
        for _ in iter_checkpoint(path):
            pass
        best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        with GGUFFile(path) as f:
            for info in f.tensors:
                f.read_raw(info)
        raw = min(raw, time.perf_counter() - t0)
    return {"seconds": best, "raw_seconds": raw, "baseline_rss": base, "peak_rss": peak_rss_bytes()}


PHASES = {"read": phase_read, "stream": phase_stream, "torchao": phase_torchao, "gguf": phase_gguf, "fp": phase_fp,
          "quant_only": phase_quant_only, "make": make_checkpoint, "make_gguf": make_gguf}


def run_phase(name: str, *args) -> dict:
    """Runs one phase in a fresh process, after os.sync(): no phase starts while the disk still
    writes back an earlier one's output."""
    os.sync()
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", name, "--args", json.dumps(list(args))]
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"phase {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(table, io_rate, torchao_rate) -> None:
    """Every path of this run as a markdown table: rates and ratios to the same run's references."""
    print("\n| input | path | GB/s median (best) | x I/O only | x torchao | peak RSS above baseline |")
    print("|---|---|---|---|---|---|")
    for size, gb, label, med, best, r, nbytes in table:
        io, ao = io_rate.get(size), torchao_rate.get(size)
        above = r["peak_rss"] - r["baseline_rss"]
        print(f"| {gb:.2f} GB | {label} | {med:.2f} ({best:.2f}) | {f'{med / io:.2f}' if io else '-'} | "
              f"{f'{med / ao:.2f}' if ao else '-'} | {above / 1e6:.0f} MB = {above / nbytes:.3f}x |")
    print("(x I/O only: the median rate over the I/O-only stream's median of the same checkpoint size; GGUF rows "
          "use the smallest size's. x torchao likewise. Read rows are best of 2 interleaved passes.)", flush=True)


def print_paired(paired) -> None:
    """Ratios taken round by round (each path's time against the I/O-only and torchao runs of the
    same round), then the median and range over rounds: a slow spell of the machine falls on one
    round's runs together and cancels out of its ratios."""
    def cell(ref, secs):
        if len(ref) != len(secs) or not ref:
            return "-"
        ratios = sorted(r / s for r, s in zip(ref, secs))
        return f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"

    if not paired:
        return
    print("\n| input | path | x I/O only, per round: median (range) | x torchao, per round: median (range) |")
    print("|---|---|---|---|")
    for gb, paths, io, ao in paired:
        for label, secs in paths:
            print(f"| {gb:.2f} GB | {label} | {cell(io, secs)} | {cell(ao, secs)} |")
    print("(each round runs every path once, interleaved; a ratio above 1 means faster than the reference)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="2,4", help="checkpoint sizes in GB (comma-separated)")
    p.add_argument("--gguf-gb", type=float, default=1.0)
    p.add_argument("--workdir", default="/tmp/llmq_bench")
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    p.add_argument("--max-shard-mb", type=int, default=0,
                   help="output shard size for the stream phases (default: save_bundle's, 2 GiB)")
    p.add_argument("--chunk-mb", type=int, default=16,
                   help="stream and fp phases: tensors over this many MiB travel as blocks of rows of at most "
                        "this size (iter_checkpoint chunk_bytes); 0 reads every tensor whole")
    p.add_argument("--no-fsync-row", action="store_true",
                   help="also time the INT4 stream with fsync=False (how much the disk costs)")
    p.add_argument("--repeat", type=int, default=3,
                   help="fresh-process runs of each stream variant (median and best are printed)")
    p.add_argument("--skip", default="",
                   help="comma-separated phases to skip (read,stream,fp,torchao,torchao_fp,gguf); torchao_fp: "
                        "the FP paths' same-format torchao references")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--args", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.phase:
        print(json.dumps(PHASES[a.phase](*json.loads(a.args))))
        return 0
    skip = set(filter(None, a.skip.split(",")))
    os.makedirs(a.workdir, exist_ok=True)
    table, io_rate, torchao_rate, paired, same_format = [], {}, {}, [], []
    try:
        for size in [float(s) for s in a.sizes.split(",")]:
            ckpt = os.path.join(a.workdir, f"ckpt_{size:g}gb")
            info = run_phase("make", ckpt, size)
            gb = info["bytes"] / GB
            print(f"\n== checkpoint {gb:.2f} GB bf16, {info['layers']} layers, {info['shards']} shards ==",
                  flush=True)
            if "read" not in skip:
                r = run_phase("read", ckpt)
                ours, ref, ref_c = (gb / r["iter_checkpoint_s"], gb / r["safe_open_s"], gb / r["safe_open_clone_s"])
                chk = gb / r["iter_checkpoint_nonfinite_check_s"]
                print(f"read (warm, {r['threads']} threads): iter_checkpoint {ours:.2f} GB/s | safe_open get_tensor+clone "
                      f"{ref_c:.2f} GB/s | ratio {ours / ref_c:.2f} | (get_tensor alone returns mmap views, no copy: "
                      f"{ref:.0f} GB/s) | "
                      f"with NaN/Inf check {chk:.2f} GB/s | peak RSS {r['peak_rss'] / 1e6:.0f} MB "
                      f"(baseline {r['baseline_rss'] / 1e6:.0f} MB)", flush=True)
                one = gb / r["iter_checkpoint_one_range_s"]
                table.append((size, gb, "`iter_checkpoint` read (no write)", ours, ours, r, info["bytes"]))
                table.append((size, gb, "same, one `preadv` per tensor (the reader before this change)", one, one, r,
                              info["bytes"]))
                table.append((size, gb, "`safe_open` get_tensor + clone (reference)", ref_c, ref_c, r, info["bytes"]))
            timed = []  # (key, phase args, table label): run interleaved, round by round
            if "stream" not in skip:
                for quantize, fsync in [(False, True), (True, True)] + ([(True, False)] if a.no_fsync_row else []):
                    label = (f"read -> INT4 g32 -> bundle (fsync={fsync})" if quantize
                             else f"I/O only: read -> bundle (fsync={fsync})")
                    out = os.path.join(a.workdir, f"bundle_{size:g}gb")
                    timed.append((("stream", quantize, fsync), ("stream", ckpt, out, fsync, quantize,
                                                                a.max_shard_mb << 20, a.chunk_mb << 20), label))
            if "fp" not in skip:
                for fmt in FP_CONFIGS:
                    out = os.path.join(a.workdir, f"fp_{size:g}gb")
                    timed.append((("fp", fmt), ("fp", ckpt, out, fmt, a.chunk_mb << 20),
                                  f"read -> {fmt.upper()} -> HF folder (ModelOpt style)"))
            if "torchao" not in skip:
                timed.append((("torchao",), ("torchao", ckpt), "whole load + torchao `quantize_` (int4 g32)"))
            runs = {key: [] for key, _, _ in timed}
            for _ in range(max(1, a.repeat)):
                for key, args, _ in timed:
                    runs[key].append(run_phase(*args))
                    if len(args) > 2:
                        shutil.rmtree(args[2], ignore_errors=True)
            paired.append((gb, [(label, [r["seconds"] for r in runs[key]]) for key, _, label in timed],
                           [r["seconds"] for r in runs.get(("stream", False, True), [])],
                           [r["seconds"] for r in runs.get(("torchao",), [])]))
            for key, _args, label in timed:
                if key[0] == "torchao":
                    secs = sorted(r["seconds"] for r in runs[key])
                    t = dict(max(runs[key], key=lambda r: r["peak_rss"]), seconds=statistics.median(secs))
                    print(f"whole load + torchao quantize_ ({TORCHAO_NAMES['int4']}): {gb / t['seconds']:.2f} GB/s "
                          f"median of {len(secs)} ({', '.join(f'{x:.2f}' for x in secs)} s), peak RSS "
                          f"{t['peak_rss'] / 1e6:.0f} MB = {t['peak_rss'] / info['bytes']:.2f}x checkpoint", flush=True)
                    table.append((size, gb, label, gb / t["seconds"], gb / secs[0], t, info["bytes"]))
                    torchao_rate[size] = gb / t["seconds"]
                    continue
                secs = sorted(r["seconds"] for r in runs[key])
                s = max(runs[key], key=lambda r: r["peak_rss"] - r["baseline_rss"])  # the worst run's memory
                s = dict(s, seconds=statistics.median(secs), best_seconds=secs[0], all_seconds=secs)
                print(f"{label}: {gb / s['seconds']:.2f} GB/s median, {gb / secs[0]:.2f} best of {len(secs)} "
                      f"({', '.join(f'{x:.2f}' for x in secs)} s), peak RSS above baseline "
                      f"{(s['peak_rss'] - s['baseline_rss']) / 1e6:.0f} MB = "
                      f"{(s['peak_rss'] - s['baseline_rss']) / info['bytes']:.3f}x; output {s['out_bytes'] / 1e9:.2f} GB",
                      flush=True)
                if key[0] == "stream" and not key[1] and key[2]:
                    io_rate[size] = gb / s["seconds"]
                table.append((size, gb, label, gb / s["seconds"], gb / secs[0], s, info["bytes"]))
            if "fp" not in skip and "torchao" not in skip and "torchao_fp" not in skip:
                # Each FP path against torchao's quantize_ of the same format: one run each (torchao's
                # NVFP4 on CPU takes ~15 s per GB), after the rounds, next to the median FP run.
                for fmt in FP_CONFIGS:
                    t = run_phase("torchao", ckpt, fmt)
                    ours = statistics.median(r["seconds"] for r in runs[("fp", fmt)])
                    print(f"whole load + torchao quantize_ ({TORCHAO_NAMES[fmt]}): {gb / t['seconds']:.3f} GB/s "
                          f"(one run; load {t['load_seconds']:.2f} s), peak RSS {t['peak_rss'] / 1e6:.0f} MB; "
                          f"the {fmt.upper()} path's median is {t['seconds'] / ours:.1f}x faster", flush=True)
                    same_format.append((gb, fmt, gb / ours, gb / t["seconds"]))
            if "stream" not in skip:
                q = run_phase("quant_only", ckpt)
                print(f"quantize_weight arithmetic alone (one layer in memory): {q['bytes'] / GB / q['seconds']:.2f} GB/s",
                      flush=True)
            shutil.rmtree(ckpt, ignore_errors=True) if not a.keep else None
        if "gguf" not in skip:
            path = os.path.join(a.workdir, "synthetic.gguf")
            info = run_phase("make_gguf", path, a.gguf_gb)
            g = run_phase("gguf", path)
            ggb = info["bytes"] / GB
            print(f"\n== GGUF import ({ggb:.2f} GB of Q4_0/Q8_0/Q4_K/Q6_K) ==\n"
                  f"iter_checkpoint -> canonical: {ggb / g['seconds']:.2f} GB/s of input "
                  f"(the same bytes read raw: {ggb / g['raw_seconds']:.2f} GB/s), "
                  f"peak RSS {g['peak_rss'] / 1e6:.0f} MB", flush=True)
            gsize = min(io_rate) if io_rate else None
            table.append((gsize, ggb, "GGUF raw tensor read (GGUF I/O only)", ggb / g["raw_seconds"],
                          ggb / g["raw_seconds"], g, info["bytes"]))
            table.append((gsize, ggb, "GGUF import -> canonical (Q4_0/Q8_0/Q4_K/Q6_K)", ggb / g["seconds"],
                          ggb / g["seconds"], g, info["bytes"]))
        print_table(table, io_rate, torchao_rate)
        print_paired(paired)
        if same_format:
            print("\n| input | path | GB/s (median) | torchao load + quantize_, same format: GB/s (one run) | x torchao |")
            print("|---|---|---|---|---|")
            for gb, fmt, ours, ao in same_format:
                print(f"| {gb:.2f} GB | read -> {fmt.upper()} -> HF folder | {ours:.2f} | {ao:.3f} ({TORCHAO_NAMES[fmt]}) "
                      f"| {ours / ao:.1f} |")
    finally:
        if not a.keep:
            shutil.rmtree(a.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
