"""--verify's time, the quantized side through the compiled dense kernel against the dequantize path.

    bazel run //models/pipeline:bench_verify -- --arch=gemma3 --checkpoint=$PWD/gemma-3-270m-q4_k_m.gguf \
        --recipe=int4 --requantize_gguf [--repeat=1]

Runs quantize_and_save (bundle backend, --verify) on the checkpoint and times its verification step
(`verify_seconds`: the layer-by-layer comparison of the three models; with --greedy also the greedy
tokens and the text check)
with the quantized side's linears (and round-to-nearest's) through llmq::quantized_linear
(models/pipeline/verify.py, `quantized_linears`) and, alternately, with use_kernel=False (every
QuantizedLinear dequantizes its weight on every call). Best of --repeat rounds per side. Prints both
times, their ratio, and both sides' logits figures (the kernel's int8 activations move them a little).
"""

from __future__ import annotations

import functools
import importlib
import os
import tempfile

from absl import app, flags

import models.architectures  # noqa: F401
from llmq.ops import dense_op
from models.pipeline import verify as verification
from models.pipeline.quantize_and_save import run

flags.DEFINE_string("arch", "gemma3", "Model package under models/: gemma3, gemma4 or qwen.")
flags.DEFINE_integer("repeat", 1, "Rounds per side (best is reported).", lower_bound=1)
flags.DEFINE_boolean("greedy", False, "Also time the greedy tokens and the text check (each token re-reads every "
                     "layer of both models from their files; default: the layer-by-layer comparison alone).")
# --checkpoint, --recipe, --requantize_gguf are quantize_and_save's flags (models/pipeline/cli.py).
FLAGS = flags.FLAGS


def _once(arch, folder: str, name: str, use_kernel: bool):
    real, limit = verification.verify, verification.GREEDY_LIMIT_BYTES
    verification.verify = functools.partial(real, use_kernel=use_kernel)
    if not FLAGS.greedy:
        verification.GREEDY_LIMIT_BYTES = -1
    try:
        return run(arch, checkpoint=FLAGS.checkpoint, recipe=FLAGS.recipe, backend="bundle",
                   out=os.path.join(folder, name), resume=False, max_shard_size=2 << 30, verify=True, seed=0,
                   progress=False, requantize_gguf=FLAGS.requantize_gguf)
    finally:
        verification.verify, verification.GREEDY_LIMIT_BYTES = real, limit


def main(argv) -> None:
    del argv
    if not dense_op.quantized_linear_available():
        raise SystemExit("error: the compiled kernel //cpp/moe:_moe_kernel.so is not loadable here (bazel run this)")
    arch = importlib.import_module(f"models.{FLAGS.arch}.architecture").ARCHITECTURE
    best = {}
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as folder:
        for r in range(FLAGS.repeat):
            for side, use_kernel in (("dequantize", False), ("kernel", True)):
                result = _once(arch, folder, f"{side}-{r}", use_kernel)
                if side not in best or result["verify_seconds"] < best[side]["verify_seconds"]:
                    best[side] = result
    print("\n| quantized linears | verification s | logits cosine | logits SQNR dB | KL mean | top-1 |")
    print("|---|---|---|---|---|---|")
    for side, r in best.items():
        print(f"| {side} | {r['verify_seconds']:.1f} | {r['cosine']:.5f} | {r['sqnr_db']:.2f} | {r['kl_mean']:.4g} | "
              f"{r['top1_agreement']:.3f} |")
    ratio = best["dequantize"]["verify_seconds"] / best["kernel"]["verify_seconds"]
    print(f"\nverification with the kernel: {ratio:.2f}x faster than dequantizing every call "
          f"({best['kernel']['quantized_linears']})")


if __name__ == "__main__":
    app.run(main)
