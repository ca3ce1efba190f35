"""Peak memory of quantize_and_save against the checkpoint size, for a tiny and a mid-size model.

    bazel run //models/pipeline:bench_pipeline -- [--arch=qwen] [--layers=4,8]

Each run happens in a fresh child process (so peak RSS is that run's alone); a child that
only imports the same modules gives the baseline. The claim under test: peak RSS above the
baseline is bounded by one layer's tensors (plus one output shard), not by the model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from absl import app, flags

flags.DEFINE_string("arch", "qwen", "qwen, gemma3 or gemma4")
flags.DEFINE_list("layers", ["4", "8"], "Decoder-layer counts of the mid-size model (peak should stay flat).")
flags.DEFINE_string("recipe", "int4", "Recipe preset.")
FLAGS = flags.FLAGS

MID_SIZE = {
    "qwen": dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, moe_intermediate_size=512,
                 shared_expert_intermediate_size=512, num_experts=64, num_experts_per_tok=8, vocab_size=8192),
    # Gemma 3 270M's shapes: its 262k-row embedding is most of the checkpoint
    "gemma3": dict(hidden_size=640, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                   vocab_size=262144),
    "gemma4": dict(hidden_size=1536, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                   global_head_dim=256, num_global_key_value_heads=2, vocab_size=8192),
}

_CHILD = r"""
import json, os, resource, sys, time
arch_name, mode, ckpt, out, recipe, config_json = sys.argv[1:7]
import importlib
arch = importlib.import_module(f"models.{arch_name}.architecture").ARCHITECTURE
from models.pipeline.quantize_and_save import run
from models.pipeline.default_model import write_default_checkpoint
if mode == "write":
    write_default_checkpoint(arch, ckpt, hf_config=json.loads(config_json), max_shard_bytes=256 << 20)
elif mode == "run":
    start = time.perf_counter()
    run(arch, checkpoint=ckpt, recipe=recipe, backend="bundle", out=out, resume=False, max_shard_size=256 << 20,
        verify=False, seed=0, progress=False)
    print("SECONDS", time.perf_counter() - start)
print("PEAK_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _child(*args) -> dict:
    res = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"child {args[:2]} failed:\n{res.stderr[-3000:]}")
    values = dict(line.split()[:2] for line in res.stdout.splitlines() if line.startswith(("PEAK_KB", "SECONDS")))
    return {"peak": int(values["PEAK_KB"]) * 1024, "seconds": float(values.get("SECONDS", "nan"))}


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def _config(arch_name: str, layers: int):
    import importlib

    arch = importlib.import_module(f"models.{arch_name}.architecture").ARCHITECTURE
    config = dict(arch.tiny_hf_config())
    if layers:
        config.update(MID_SIZE[arch_name], num_hidden_layers=layers)
        kinds = config["layer_types"]
        config["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    return config


def main(argv):
    del argv
    rows = []
    baseline = _child(FLAGS.arch, "baseline", "", "", FLAGS.recipe, "{}")["peak"]
    for layers in [0] + [int(n) for n in FLAGS.layers]:
        work = tempfile.mkdtemp(prefix="llmq-bench-")
        try:
            ckpt, out = os.path.join(work, "ckpt"), os.path.join(work, "out")
            _child(FLAGS.arch, "write", ckpt, out, FLAGS.recipe, json.dumps(_config(FLAGS.arch, layers)))
            size = _size(ckpt)
            got = _child(FLAGS.arch, "run", ckpt, out, FLAGS.recipe, "{}")
            rows.append(("tiny" if not layers else f"mid, {layers} layers", size, got["peak"], got["peak"] - baseline,
                         got["seconds"], _size(out)))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{FLAGS.arch} quantize_and_save --recipe={FLAGS.recipe}; baseline RSS (imports only) {baseline / 2**20:.0f} MiB")
    print(f"{'model':<16}{'checkpoint':>12}{'peak RSS':>11}{'above base':>12}{'above/ckpt':>12}{'seconds':>9}{'GB/s':>7}{'output':>10}")
    for name, size, peak, above, seconds, out_size in rows:
        print(f"{name:<16}{size / 2**20:>10.0f}Mi{peak / 2**20:>9.0f}Mi{above / 2**20:>10.0f}Mi{above / size:>12.2f}"
              f"{seconds:>9.2f}{size / seconds / 1e9:>7.2f}{out_size / 2**20:>8.0f}Mi")


if __name__ == "__main__":
    app.run(main)
