"""Manual real-model check of a Gemma 3 GGUF: text in, greedy text out, and a bundle's agreement with it.

bazel run //models/gemma3:gguf_text_check -- --checkpoint=model.gguf [--bundle=DIR] [--prompt=TEXT]
    [--max_new_tokens=24] [--write_hf=DIR]

The prompt becomes ids through the GGUF's own tokenizer (models.common.tokenizer: tokenizer.ggml.*
converted by transformers' GGUF builders); the reference is the GGUF model with its quantized weights
dequantized exactly. --bundle: the same prompt through a quantize_and_save bundle, compared by
models.common.text_check.text_agreement (greedy texts, token agreement, prompt logits cosine). --write_hf: the dequantized model as an HF
folder (config.json + float32 safetensors + the tokenizer files), e.g. to quantize it from float with a recipe
(quantize_and_save keeps weights that arrive GGUF-quantized as they are).
Not a test: it reads a real checkpoint (see docs/models.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from llmq.checkpoint import load_bundle
from llmq.quant import GroupQuantizedWeight
from llmq.quant.formats import dequantize_canonical
from models.common.text_check import text_agreement, text_rows
from models.common.tokenizer import load_tokenizer, write_tokenizer_files
from models.gemma3.architecture import ARCHITECTURE
from models.gemma3.config import ModelConfig
from models.pipeline import gguf_input
from models.pipeline.agreement import format_table
from models.pipeline.hf_checkpoint import write_hf_checkpoint
from models.pipeline.quantized_model import build_quantized_model


def _user_path(path):
    """`bazel run` starts in the runfiles tree: relative paths mean the user's cwd."""
    base = os.environ.get("BUILD_WORKING_DIRECTORY")
    return path if path is None or base is None or os.path.isabs(path) else os.path.join(base, path)


def _flags(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="A Gemma 3 llama.cpp .gguf file (with tokenizer.ggml.*).")
    parser.add_argument("--bundle", help="A quantize_and_save output folder (bundle backend) to compare.")
    parser.add_argument("--prompt", default="The capital of France is", help="Prompt text.")
    parser.add_argument("--max_new_tokens", type=int, default=24, help="Greedy tokens to generate.")
    parser.add_argument("--write_hf", help="Also write the dequantized model as an HF folder here.")
    return parser.parse_args(argv)


def _main(FLAGS) -> int:
    path = _user_path(FLAGS.checkpoint)
    if path is None or not os.path.isfile(path) or not gguf_input.is_gguf(path):
        print(f"error: --checkpoint {FLAGS.checkpoint!r}: expected an existing .gguf file", file=sys.stderr)
        return 2
    hf_config = gguf_input.hf_config(ARCHITECTURE, path)
    config = ModelConfig.from_hf_dict(hf_config)
    tensors = {n: dequantize_canonical(v) if isinstance(v, GroupQuantizedWeight) else v
               for n, v in gguf_input.model_tensors(ARCHITECTURE, path, config)}
    rows = []
    start = time.perf_counter()
    tokenizer = load_tokenizer(path)
    rows.append(("tokenizer", f"{len(tokenizer)} tokens, built in {time.perf_counter() - start:.1f} s"))
    if FLAGS.write_hf:
        folder = _user_path(FLAGS.write_hf)
        rows.append(("dequantized HF folder", write_hf_checkpoint(folder, hf_config, tensors, max_shard_bytes=2 << 30)))
        write_tokenizer_files(path, folder)
    reference = build_quantized_model(ARCHITECTURE.build_model(config, device="meta"), tensors).eval()
    if FLAGS.bundle:
        quantized = build_quantized_model(ARCHITECTURE.build_model(config, device="meta"),
                                          load_bundle(_user_path(FLAGS.bundle))).eval()
    else:
        quantized = reference
    start = time.perf_counter()
    result = text_agreement(tokenizer, reference, quantized, prompt=FLAGS.prompt, new_tokens=FLAGS.max_new_tokens)
    rows += [("prompt ids", " ".join(map(str, result["prompt_ids"])))]
    rows += [r for r in text_rows(result) if FLAGS.bundle or r[0] in ("prompt", "greedy text (unquantized)")]
    rows.append(("text check time", f"{time.perf_counter() - start:.1f} s"))
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(_main(_flags(sys.argv[1:])))
