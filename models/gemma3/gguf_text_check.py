"""Manual real-model check of a Gemma 3 GGUF: text in, greedy text out, and a bundle's agreement with it.

bazel run //models/gemma3:gguf_text_check -- --checkpoint=model.gguf [--bundle=DIR] [--prompt=TEXT]
    [--max_new_tokens=24] [--write_hf=DIR]

The prompt becomes ids through the GGUF's own tokenizer (tokenizer.ggml.*, read by transformers'
GGUF support); the reference is the GGUF model with its quantized weights dequantized exactly.
--bundle: the same prompt through a quantize_and_save bundle, with the logits cosine over the
prompt and the number of greedy tokens that agree. --write_hf: the dequantized model as an HF
folder (config.json + float32 safetensors), e.g. to quantize it from float with a recipe
(quantize_and_save keeps weights that arrive GGUF-quantized as they are).
Not a test: it reads a real checkpoint (see docs/models.md).
"""

from __future__ import annotations

import os
import sys

import torch
import argparse

from llmq.checkpoint import load_bundle
from llmq.quant import GroupQuantizedWeight
from llmq.quant.formats import dequantize_canonical
from models.common.generation import generate
from models.gemma3.config import ModelConfig
from models.gemma3.pipeline import ARCHITECTURE
from models.pipeline import gguf_input
from models.pipeline.hf_checkpoint import write_hf_checkpoint
from models.pipeline.quantized_model import build_quantized_model
from models.pipeline.report import format_table


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
    if FLAGS.write_hf:
        rows.append(("dequantized HF folder", write_hf_checkpoint(_user_path(FLAGS.write_hf), hf_config, tensors,
                                                                  max_shard_bytes=2 << 30)))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    prompt = torch.tensor([tokenizer(FLAGS.prompt).input_ids])
    reference = build_quantized_model(ARCHITECTURE.build_model(config, device="meta"), tensors).eval()
    n = FLAGS.max_new_tokens
    with torch.no_grad():
        ref_ids = generate(reference, prompt, n, eos_token_id=config.eos_token_id)[0, prompt.shape[1]:]
    rows += [("prompt ids", " ".join(map(str, prompt[0].tolist()))),
             ("GGUF model (dequantized)", repr(tokenizer.decode(ref_ids)))]
    if FLAGS.bundle:
        quantized = build_quantized_model(ARCHITECTURE.build_model(config, device="meta"),
                                          load_bundle(_user_path(FLAGS.bundle))).eval()
        with torch.no_grad():
            q_ids = generate(quantized, prompt, n, eos_token_id=config.eos_token_id)[0, prompt.shape[1]:]
            ref_logits, q_logits = reference(prompt).double(), quantized(prompt).double()
        cosine = torch.nn.functional.cosine_similarity(ref_logits.flatten(), q_logits.flatten(), dim=0).item()
        agree = next((i for i, (a, b) in enumerate(zip(ref_ids.tolist(), q_ids.tolist())) if a != b), len(q_ids))
        rows += [("bundle", repr(tokenizer.decode(q_ids))),
                 ("prompt logits cosine", f"{cosine:.5f}"),
                 ("greedy tokens equal", f"first {agree} of {len(ref_ids)}")]
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(_main(_flags(sys.argv[1:])))
