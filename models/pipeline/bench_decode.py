"""Eager quantized decode: the compiled dense kernel against the dequantize path, side by side.

    bazel run //models/pipeline:bench_decode -- --arch=gemma3 --checkpoint=$PWD/gemma-3-270m-q4_k_m.gguf
        [--recipe=int4-e8] [--bundle=DIR] [--prompt_len=64] [--decode_steps=16] [--repeat=2]

Quantizes the checkpoint with the recipe (or reads --bundle), builds the eager quantized model with
float32 activations and the static cache of export_pt2 (the same PrefillStep / DecodeStep that
bench_pte times as "eager llmq"), then alternates rounds of (kernel) every QuantizedLinear through
llmq::quantized_linear where its format fits and (dequantize) the same model under
llmq.quant.modules.reference_linears(). A round is a prefill of --prompt_len random ids and
--decode_steps decode steps fed the same tokens; best of --repeat. Prints tokens/s of both, their
ratio, and the agreement of the two sides' logits (the kernel quantizes activations to int8 per
weight group, docs/moe_kernel.md).
"""

from __future__ import annotations

import importlib
import tempfile
import time

import torch
from absl import app, flags

import llmq.ops.dense_op as dense_op
from llmq.quant import QuantizedLinear, modules
from models.pipeline import export_pt2
from models.pipeline.export_pt2 import DecodeStep, PrefillStep

flags.DEFINE_string("arch", "gemma3", "Model package under models/: gemma3, gemma4 or qwen.")
flags.DEFINE_integer("repeat", 2, "Rounds per side (best is reported).", lower_bound=1)
flags.DEFINE_integer("threads", 0, "torch.set_num_threads (and the kernel's threads); 0 = torch's default.",
                     lower_bound=0)
# --checkpoint, --recipe are quantize_and_save's flags, --bundle, --prompt_len and --decode_steps export_pt2's.
FLAGS = flags.FLAGS


@torch.no_grad()
def _round(prefill, decode, prompt, tokens):
    start = time.perf_counter()
    logits, cache = prefill(prompt)
    prefill_s = time.perf_counter() - start
    first, position = logits, prompt.shape[1]
    start = time.perf_counter()
    for token in tokens:
        logits, cache = decode(torch.tensor([[token]]), torch.tensor(position, dtype=torch.long), tuple(cache))
        position += 1
    return prefill_s, time.perf_counter() - start, first, logits


def main(argv):
    del argv
    if FLAGS.threads:
        torch.set_num_threads(FLAGS.threads)
    if not dense_op.install_dense_kernel():
        raise SystemExit("the compiled kernel (//cpp/moe:_moe_kernel.so) is not loaded; build it or set LLMQ_MOE_KERNEL")
    arch = importlib.import_module(f"models.{FLAGS.arch}.architecture").ARCHITECTURE
    layout_module = importlib.import_module(f"models.{FLAGS.arch}.export_pt2")
    model, _ = export_pt2.load_quantized_model(arch, bundle=FLAGS.bundle, checkpoint=FLAGS.checkpoint,
                                               recipe=(FLAGS.recipe or "int4-e8") if FLAGS.bundle is None else None, seed=0,
                                               workdir=tempfile.mkdtemp(prefix="llmq-bench-decode-"))
    export_pt2.to_float32(model).eval()
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    kernel = modules.linear_kernel()
    served = sum(kernel is not None and kernel.pack(m.quantized_weight()) is not None for m in linears)
    steps = (PrefillStep(model, layout_module.cache_layout(model, FLAGS.prompt_len + FLAGS.decode_steps + 1)),)
    steps += (DecodeStep(model, layout_module.cache_layout(model, FLAGS.prompt_len + FLAGS.decode_steps + 1)),)
    prompt = torch.randint(0, model.config.vocab_size, (1, FLAGS.prompt_len), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, model.config.vocab_size, (FLAGS.decode_steps,), generator=torch.Generator().manual_seed(1))
    best = {"kernel": [float("inf")] * 2, "dequantize": [float("inf")] * 2}
    out = {}
    with torch.no_grad():  # pack every weight the kernel takes before timing
        for m in linears:
            if kernel is not None:
                m._packed_for(kernel)
    for _ in range(FLAGS.repeat):
        for side in best:
            if side == "kernel":
                p_s, d_s, first, last = _round(*steps, prompt, tokens.tolist())
            else:
                with modules.reference_linears():
                    p_s, d_s, first, last = _round(*steps, prompt, tokens.tolist())
            best[side] = [min(best[side][0], p_s), min(best[side][1], d_s)]
            out[side] = (first, last)
    (kf, _), (rf, _) = out["kernel"], out["dequantize"]
    top1 = (kf[0].argmax(-1) == rf[0].argmax(-1)).float().mean().item()
    cos = torch.nn.functional.cosine_similarity(kf[0].double(), rf[0].double(), dim=-1).mean().item()
    n = FLAGS.decode_steps
    print(f"{FLAGS.arch} {FLAGS.checkpoint or '(embedded)'} {FLAGS.bundle or FLAGS.recipe or 'int4-e8'}: {len(linears)} QuantizedLinear, "
          f"{served} served by the kernel; {torch.get_num_threads()} threads; best of {FLAGS.repeat}")
    print("| | kernel | dequantize | kernel / dequantize |")
    print("|---|---|---|---|")
    pk, pr = FLAGS.prompt_len / best["kernel"][0], FLAGS.prompt_len / best["dequantize"][0]
    dk, dr = n / best["kernel"][1], n / best["dequantize"][1]
    print(f"| prefill, {FLAGS.prompt_len} tokens | {pk:.1f} tokens/s | {pr:.1f} tokens/s | {pk / pr:.1f}x |")
    print(f"| decode | {dk:.2f} tokens/s | {dr:.2f} tokens/s | {dk / dr:.1f}x |")
    print(f"prefill logits, kernel vs dequantize: top-1 agreement {top1:.3f}, mean cosine {cos:.5f}")


if __name__ == "__main__":
    app.run(main)
