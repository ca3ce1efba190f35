"""quantize_and_save at the real shapes of Gemma 4 31B and Qwen3.5-35B-A3B, with fewer layers.

    bazel run //models/pipeline:bench_real_shapes -- [--models=gemma4_31b,qwen3_5_35b_a3b] [--layers=4,8]
        [--workdir=/path/with/room] [--calibration_text=FILE] [--max_rss_gb=18] [--timeout_s=5400]
        [--budget_method=hqq] [--grow]

For each model and layer count: writes the synthetic checkpoint (real_shapes.write_real_shapes, in a
child process under /usr/bin/time -v, so the generator's own peak is measured too), runs

    quantize_and_save --checkpoint=<it> --calibration_text=<text> --budget_bits_per_weight=4.5 --verify

under /usr/bin/time -v (peak RSS of the whole run, from outside), timestamps every line the run prints
and reads the per-layer progress lines ("<pass>: i/n layers, s each"), then deletes both folders
before the next case (with --grow, each larger layer count of a model is copied from the previous
count's checkpoint, `real_shapes --grow_from`, which is deleted after that). A watchdog stops a run whose process tree passes --max_rss_gb (the machine is
shared; a stopped run is reported as such, with the RSS it had reached). Prints the table and the
arithmetic of the full 60-layer / 40-layer runs on a 24 GB machine from the measured peaks.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

from absl import app, flags

from models.pipeline import real_shapes

REPO = real_shapes.REPO
PACKAGES = {"gemma4_31b": "gemma4", "qwen3_5_35b_a3b": "qwen"}
REAL_LAYERS = {"gemma4_31b": 60, "qwen3_5_35b_a3b": 40}
PROGRESS = re.compile(r"^(?P<what>[^:]+): (?P<i>\d+)/(?P<n>\d+) (?P<unit>\w+), (?P<each>[\d.]+) s each")
PHASE = re.compile(r"^(?P<what>[a-z][a-z ]*): ")

flags.DEFINE_list("models", ["gemma4_31b", "qwen3_5_35b_a3b"], "Real configs to run.")
flags.DEFINE_list("layers", ["4", "8"], "Layer counts.")
flags.DEFINE_string("workdir", None, "Where the checkpoints and outputs go (default: a temporary folder).")
flags.DEFINE_string("calibration_text", None, "Calibration text (default: the repository's README.md).")
flags.DEFINE_float("budget_bits_per_weight", 4.5, "--budget_bits_per_weight of the runs.")
flags.DEFINE_string("budget_method", "hqq", "--budget_method of the runs (the method of every candidate).")
flags.DEFINE_boolean("grow", False, "Write each model's first layer count by drawing, each next one by copying layers from "
                     "the previous checkpoint (real_shapes --grow_from: disk speed instead of drawing again).")
flags.DEFINE_float("max_rss_gb", 18.0, "Stop a run whose processes together pass this resident size.")
flags.DEFINE_integer("timeout_s", 5400, "Stop a run after this many seconds.")
flags.DEFINE_boolean("keep", False, "Keep the checkpoints and outputs.")
flags.DEFINE_boolean("reuse_checkpoints", False, "Use a checkpoint already in --workdir (<model>-<layers>l, written "
                     "by write_real_shapes) instead of writing it again (its generator columns are then empty).")
flags.DEFINE_boolean("tiny_shapes", False, "Smoke test: the embedded tiny configs instead of the real ones.")
FLAGS = flags.FLAGS


def _tree_rss(pid: int) -> int:
    """Resident bytes of pid and its descendants (Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def timed_run(cmd: List[str], *, max_rss: float, timeout_s: int, env: Dict[str, str]) -> Dict:
    """Run cmd under /usr/bin/time -v; returns lines (seconds since start, text), peak RSS, status."""
    start = time.perf_counter()
    proc = subprocess.Popen(["/usr/bin/time", "-v"] + cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, text=True, errors="replace", bufsize=1, start_new_session=True)
    state = {"stopped": None, "seen_rss": 0}

    def watch():
        while proc.poll() is None:
            rss = _tree_rss(proc.pid)
            state["seen_rss"] = max(state["seen_rss"], rss)
            if rss > max_rss:
                state["stopped"] = f"stopped at {rss / 1e9:.1f} GB resident (--max_rss_gb)"
                os.killpg(proc.pid, signal.SIGKILL)  # time -v and the run under it
            elif time.perf_counter() - start > timeout_s:
                state["stopped"] = f"stopped after {timeout_s} s (--timeout_s)"
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    lines = []
    assert proc.stdout is not None
    for raw in proc.stdout:
        for part in raw.replace("\r", "\n").split("\n"):
            if part.strip():
                lines.append((time.perf_counter() - start, part.rstrip()))
    proc.wait()
    peak = None
    for _, text in lines:
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
        if m:
            peak = int(m.group(1)) * 1024
    # time -v's figure when the run ended by itself; the watchdog's largest sample when it was stopped
    return {"lines": lines, "peak_rss": peak or state["seen_rss"], "seconds": time.perf_counter() - start,
            "rc": proc.returncode, "stopped": state["stopped"]}


def passes(lines, total_s: float) -> Dict[str, Dict[str, float]]:
    """Per pass: seconds per layer from its progress lines (the last one), else the pass's span
    between the first line naming it and the first line of the next pass."""
    per_layer: Dict[str, float] = {}
    for _, text in lines:
        m = PROGRESS.match(text)
        if m and m["unit"] == "layers":
            per_layer[m["what"]] = float(m["each"])
    spans: Dict[str, List[float]] = {}
    order: List[str] = []
    for t, text in lines:
        m = PHASE.match(text)
        if m:
            what = m["what"].strip()
            if what not in spans:
                spans[what] = [t, t]
                order.append(what)
            spans[what][1] = t
    out = {}
    for i, what in enumerate(order):
        end = spans[order[i + 1]][0] if i + 1 < len(order) else spans[what][1]
        out[what] = {"span_s": end - spans[what][0]}
    for what, each in per_layer.items():
        out.setdefault(what, {})["s_per_layer"] = each
    return out


def run_case(model: str, layers: int, workdir: str, text: str, env: Dict[str, str],
             grow_from: Optional[str] = None, keep_checkpoint: bool = False) -> Dict:
    ckpt = os.path.join(workdir, f"{model}-{layers}l")
    out = ckpt + "-q"
    reuse = FLAGS.reuse_checkpoints and os.path.isfile(os.path.join(ckpt, "config.json"))
    for folder in (out,) if reuse else (ckpt, out):
        shutil.rmtree(folder, ignore_errors=True)
    row: Dict = {"model": model, "layers": layers, "gen_s": None, "gen_rss": None, "grown": bool(grow_from)}
    try:
        write = [sys.executable, "-m", "models.pipeline.real_shapes", f"--model={model}", f"--layers={layers}",
                 f"--out={ckpt}"] + (["--tiny"] if FLAGS.tiny_shapes else []) + (
                     [f"--grow_from={grow_from}"] if grow_from else [])
        gen: Dict = ({"rc": 0, "seconds": None, "peak_rss": None, "lines": []} if reuse
                     else timed_run(write, max_rss=8e9, timeout_s=3600, env=env))
        if gen["rc"] != 0:
            row["error"] = "generator failed: " + " | ".join(t for _, t in gen["lines"][-5:])
            return row
        row.update(checkpoint_bytes=_folder_bytes(ckpt), gen_s=gen["seconds"], gen_rss=gen["peak_rss"])
        pkg = PACKAGES[model]
        run = timed_run([sys.executable, "-m", f"models.{pkg}.quantize_and_save", f"--checkpoint={ckpt}",
                         f"--calibration_text={text}", f"--budget_bits_per_weight={FLAGS.budget_bits_per_weight}",
                         f"--budget_method={FLAGS.budget_method}",
                         "--verify", "--progress", f"--out={out}"], max_rss=FLAGS.max_rss_gb * 1e9,
                        timeout_s=FLAGS.timeout_s, env=env)
        row.update(run_s=run["seconds"], peak_rss=run["peak_rss"], rc=run["rc"], stopped=run["stopped"],
                   passes=passes(run["lines"], run["seconds"]),
                   output_bytes=_folder_bytes(out) if os.path.isdir(out) else None,
                   tail=[t for _, t in run["lines"] if not t.startswith("\t")][-30:])
        return row
    finally:
        if grow_from:
            shutil.rmtree(grow_from, ignore_errors=True)
        if not FLAGS.keep:
            for folder in ((out, out + ".partial") if keep_checkpoint else (ckpt, out, out + ".partial")):
                shutil.rmtree(folder, ignore_errors=True)


def _gb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def _layer_bytes(model: str) -> Dict[str, float]:
    """bf16 bytes of the largest decoder layer and of the embedding (+ untied head) at the real config."""
    arch = real_shapes._architecture(model)
    hf = real_shapes.real_config(model, REAL_LAYERS[model])
    per_layer: Dict[int, int] = {}
    outside = 0
    for name, shape, _ in real_shapes.planned_tensors(arch, hf):
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + 2 * math.prod(shape)
        else:
            outside += 2 * math.prod(shape)
    return {"largest_layer": max(per_layer.values()), "outside": outside, "total": sum(per_layer.values()) + outside}


def main(argv):
    del argv
    workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="llmq-real-shapes-")
    os.makedirs(workdir, exist_ok=True)
    text = FLAGS.calibration_text or os.path.join(REPO, "README.md")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    rows = []
    counts = [int(n) for n in FLAGS.layers]
    for model in FLAGS.models:
        previous = None
        for k, layers in enumerate(counts):
            print(f"== {model}, {layers} layers", flush=True)
            grow = FLAGS.grow and not FLAGS.keep and k + 1 < len(counts)  # the next count copies from this one
            row = run_case(model, layers, workdir, text, env, grow_from=previous, keep_checkpoint=grow)
            previous = os.path.join(workdir, f"{model}-{layers}l") if grow else None
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tail"}, default=str), flush=True)
            print("\n".join(row.get("tail", [])), flush=True)  # the run's summary (budget, verification) or error
    print("\n| model | layers | checkpoint (bf16) | generator peak RSS | run | peak RSS (time -v) | "
          "time per layer, per pass | output | result |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['layers']} | | | | | | | {r['error']} |")
            continue
        per = []
        for what, p in r["passes"].items():
            if "s_per_layer" in p:
                per.append(f"{what} {p['s_per_layer']:.1f} s")
            elif p.get("span_s", 0) >= 1:
                per.append(f"{what} {p['span_s'] / r['layers']:.1f} s (span / layers)")
        result = r["stopped"] or ("ok" if r["rc"] == 0 else f"exit {r['rc']}")
        gen = _gb(r["gen_rss"]) + ("" if r["gen_s"] is None else f", {r['gen_s']:.0f} s") + (
            " (grown)" if r.get("grown") else "")
        print(f"| {r['model']} | {r['layers']} | {_gb(r['checkpoint_bytes'])} | {gen} | "
              f"{r['run_s']:.0f} s | {_gb(r['peak_rss'])} | {'; '.join(per)} | {_gb(r['output_bytes'])} | {result} |")
    print("\nAt the real layer counts (bf16 bytes from the real configs; peak extrapolated linearly from the two "
          "measured layer counts):")
    for model in FLAGS.models:
        sizes = _layer_bytes(model)
        got = {r["layers"]: r["peak_rss"] for r in rows if r["model"] == model and r.get("rc") == 0
               and not r.get("stopped")}
        line = (f"- {model}, {REAL_LAYERS[model]} layers: checkpoint {_gb(sizes['total'])}, largest layer "
                f"{_gb(sizes['largest_layer'])} (fp32 {_gb(2 * sizes['largest_layer'])}), embedding/head "
                f"{_gb(sizes['outside'])}")
        if len(got) >= 2:
            (l0, p0), (l1, p1) = sorted(got.items())[:2]
            slope = max(0.0, (p1 - p0) / (l1 - l0))  # a drop is noise: flat
            est = max(p0, p1) + slope * (REAL_LAYERS[model] - l1)
            line += (f"; measured peak {_gb(p0)} at {l0} layers, {_gb(p1)} at {l1} ({_gb(slope)} per layer) -> "
                     f"{_gb(est)} at {REAL_LAYERS[model]} layers: {'fits' if est < 24e9 else 'does NOT fit'} 24 GB")
        print(line)
    if FLAGS.workdir is None and not FLAGS.keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
