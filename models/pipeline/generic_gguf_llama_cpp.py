"""llama.cpp runs what model-free --backend=gguf writes: perplexity in llama.cpp vs transformers, same tokens.

Not a test (llama.cpp is not a dependency): for each model_type, a tiny random transformers checkpoint (weights
drawn wide, so that attention and the MLP shape the output: near-uniform logits would hide a wrong name or row
order) with a byte-level tokenizer (token id = byte) is written through //models:quantize --backend=gguf with a
recipe that keeps every tensor (F32) and with the int4 preset. `llama-perplexity` scores a text with each file;
transformers scores the same tokens the same way (windows of --ctx, the second half of each window scored, the
first token BOS where the tokenizer adds one: here none). F32 must agree to float rounding; a file written
without llama.cpp's q/k row permutation is scored as the negative control (arch "llama" only). With
--llama_cpp_src, llama.cpp's own convert_hf_to_gguf.py converts each checkpoint to F32 too, and the two files
are compared tensor by tensor (names, types, bytes) and key by key (<arch>.*).

    bazel run //models/pipeline:generic_gguf_llama_cpp -- \\
      --llama_cpp_bin=/path/to/llama.cpp/build/bin --llama_cpp_src=/path/to/llama.cpp \\
      --text=$PWD/README.md --work=/tmp/llmq-gguf-check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from typing import Dict, List

import torch

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.25, tie_word_embeddings=False)
CONFIGS = {
    "llama": dict(COMMON),
    "qwen3": dict(COMMON, head_dim=16),
    "mistral": dict(COMMON, sliding_window=None),
    "qwen3_moe": dict(COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, norm_topk_prob=True),
    "mixtral": dict(COMMON, num_local_experts=4, num_experts_per_tok=2),
}
F32_RECIPE = {"name": "f32", "description": "every tensor kept", "rules": [{"pattern": ".*", "config": None}]}


def checkpoint(root: str, model_type: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.pipeline.default_model import write_tiny_tokenizer

    folder = os.path.join(root, model_type)
    if not os.path.isdir(folder):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **CONFIGS[model_type]))
        model.save_pretrained(folder)
        write_tiny_tokenizer(folder, CONFIGS[model_type]["vocab_size"])
        # llama.cpp refuses a BPE vocabulary without merges (and gguf-py writes no empty array): one merge of
        # bytes 0x00 0x01, which no text file holds, as token 257, so that token id = byte still
        path = os.path.join(folder, "tokenizer.json")
        with open(path) as f:
            tok = json.load(f)
        vocab = tok["model"]["vocab"]
        first, second = (next(s for s, i in vocab.items() if i == b) for b in (0, 1))
        del vocab[next(s for s, i in vocab.items() if i == 257)]
        vocab[first + second] = 257
        tok["model"]["merges"] = [[first, second]]
        with open(path, "w") as f:
            json.dump(tok, f)
    return folder


def quantize(folder: str, out: str, recipe: str) -> str:
    from models.pipeline.cli import main_model_free

    if not os.path.isdir(out):
        argv = sys.argv
        # --verify_warn_only: int4 of these wide random weights may fall under --verify's fixed cosine floor
        sys.argv = ["quantize", f"--checkpoint={folder}", f"--recipe={recipe}", "--backend=gguf", f"--out={out}",
                    "--verify_warn_only"]
        try:
            main_model_free()
        except SystemExit as e:
            if e.code:
                raise
        finally:
            sys.argv = argv
    return os.path.join(out, "model.gguf")


_CONVERT = """import sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"  # a tokenizer it has no hash for
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def same_as_convert_hf_to_gguf(src: str, folder: str, ours: str) -> str:
    """llama.cpp's own converter (convert_hf_to_gguf.py in the llama.cpp tree `src`) on `folder`, F32, compared
    with our F32 file: "yes" where every tensor (name, type, bytes) and every <arch>.* key is the same, else what
    differs. The tiny tokenizer's BPE pre-tokenizer is unknown to the converter, so it is told "default"."""
    import gguf

    reference = ours[: -len(".gguf")] + "-convert_hf_to_gguf.gguf"
    if not os.path.exists(reference):
        subprocess.run([sys.executable, "-c", _CONVERT.format(src=src), folder, "--outtype", "f32", "--outfile",
                        reference], check=True, capture_output=True, timeout=600)
    a, b = gguf.GGUFReader(ours), gguf.GGUFReader(reference)
    ta, tb = ({t.name: (t.tensor_type, bytes(t.data)) for t in r.tensors} for r in (a, b))
    arch = a.fields["general.architecture"].contents()
    ka, kb = ({k: f.contents() for k, f in r.fields.items() if k.startswith(arch + ".")} for r in (a, b))
    problems = [f"tensor {n}" for n in sorted(set(ta) | set(tb)) if ta.get(n) != tb.get(n)]
    problems += [f"key {k}" for k in sorted(set(ka) | set(kb)) if ka.get(k) != kb.get(k)]
    return "yes" if not problems else "no: " + ", ".join(problems[:3])


def llama_perplexity(binary: str, model: str, text: str, ctx: int, chunks: int) -> float:
    cache = model + f".ppl-{os.path.basename(text)}-{ctx}-{chunks}"
    if os.path.exists(cache):
        with open(cache) as f:
            return float(f.read())
    value = _llama_perplexity(binary, model, text, ctx, chunks)
    with open(cache, "w") as f:
        f.write(repr(value))
    return value


def _llama_perplexity(binary: str, model: str, text: str, ctx: int, chunks: int) -> float:
    """llama-perplexity's estimate after the last of min(chunks, windows in the text) windows, F32 KV cache. Its
    running estimates ("[N]ppl,") and its "Final estimate" come through llama.cpp's log thread, which may drop the
    last lines at exit: a run whose output has neither is run again (at most 5 times)."""
    windows = min(os.path.getsize(text) // ctx, chunks)  # the byte-level tokenizer: token id = byte
    for _ in range(5):
        proc = subprocess.run([binary, "-m", model, "-f", text, "-c", str(ctx), "-b", str(ctx), "-t", "2",
                               "--chunks", str(chunks), "-ctk", "f32", "-ctv", "f32"],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"{binary} -m {model}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        found = dict(re.findall(r"\[(\d+)\]([0-9.]+|nan|inf),", proc.stdout))
        final = re.search(r"Final estimate: PPL = ([0-9.]+|nan|inf)", proc.stderr)
        if str(windows) in found or final:
            return float(found[str(windows)] if str(windows) in found else final.group(1))
    raise RuntimeError(f"{binary} -m {model}: no estimate for window {windows} in five runs")


@torch.no_grad()
def transformers_perplexity(folder: str, text: str, ctx: int, chunks: int) -> float:
    """llama-perplexity's measure: the first `chunks` windows of ctx tokens, tokens ctx/2 .. ctx-1 scored (no BOS:
    none is added)."""
    from transformers import AutoModelForCausalLM

    with open(text, "rb") as f:
        ids = list(f.read())  # the byte-level tokenizer: token id = byte
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    nll: List[float] = []
    for start in range(0, min(len(ids) // ctx, chunks) * ctx, ctx):
        window = torch.tensor([ids[start:start + ctx]])
        logp = torch.log_softmax(model(input_ids=window).logits[0].double(), -1)
        for j in range(ctx // 2, ctx - 1):
            nll.append(-logp[j, window[0, j + 1]].item())
    return math.exp(sum(nll) / len(nll))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama_cpp_bin", required=True, help="folder holding llama-perplexity")
    parser.add_argument("--text", required=True, help="a text file (its bytes are the tokens)")
    parser.add_argument("--work", required=True, help="folder for the checkpoints and GGUF files")
    parser.add_argument("--llama_cpp_src", default=None,
                        help="a llama.cpp source tree: also compare each F32 file with its convert_hf_to_gguf.py's")
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=24, help="windows scored (llama-perplexity --chunks)")
    parser.add_argument("--model_types", default="llama,qwen3,mistral,qwen3_moe,mixtral")
    args = parser.parse_args()
    import llmq_gguf.backend  # noqa: F401  --backend=gguf registered
    import models.architectures  # noqa: F401
    from models.pipeline import generic_gguf

    base = os.environ.get("BUILD_WORKING_DIRECTORY", "")
    text, work = os.path.join(base, args.text), os.path.join(base, args.work)
    binary = os.path.join(base, args.llama_cpp_bin, "llama-perplexity")
    os.makedirs(work, exist_ok=True)
    recipe = os.path.join(work, "f32.json")
    with open(recipe, "w") as f:
        json.dump(F32_RECIPE, f)
    rows: List[Dict[str, str]] = []
    for model_type in args.model_types.split(","):
        folder = checkpoint(work, model_type)
        hf = transformers_perplexity(folder, text, args.ctx, args.chunks)
        f32_file = quantize(folder, os.path.join(work, f"{model_type}-f32"), recipe)
        f32 = llama_perplexity(binary, f32_file, text, args.ctx, args.chunks)
        int4 = llama_perplexity(binary, quantize(folder, os.path.join(work, f"{model_type}-int4"), "int4"), text,
                                args.ctx, args.chunks)
        control = "-"
        if generic_gguf.FAMILIES[model_type].permute_qk:  # the same file without llama.cpp's q/k row order
            family = generic_gguf.FAMILIES[model_type]
            generic_gguf.FAMILIES[model_type] = dataclasses.replace(family, permute_qk=False)
            try:
                unpermuted = quantize(folder, os.path.join(work, f"{model_type}-f32-unpermuted"), recipe)
            finally:
                generic_gguf.FAMILIES[model_type] = family
            control = f"{llama_perplexity(binary, unpermuted, text, args.ctx, args.chunks):.4f}"
        rows.append({"model_type": model_type, "transformers": f"{hf:.4f}", "llama.cpp F32": f"{f32:.4f}",
                     "rel. diff": f"{abs(f32 - hf) / hf:.1e}", "llama.cpp int4 (Q4_0/Q8_0)": f"{int4:.4f}",
                     "F32 not permuted": control})
        if args.llama_cpp_src:
            rows[-1]["F32 = convert_hf_to_gguf"] = same_as_convert_hf_to_gguf(
                os.path.join(base, args.llama_cpp_src), folder, f32_file)
    keys = list(rows[0])
    widths = [max(len(k), *(len(r[k]) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(r[k].ljust(w) for k, w in zip(keys, widths)))


if __name__ == "__main__":
    main()
