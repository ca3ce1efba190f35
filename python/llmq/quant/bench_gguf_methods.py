"""Weight error of the GGUF block methods (llmq.quant.formats.gguf_fit): minmax, search, hqq, and the
importance-weighted search / hqq, for every block type, next to llama.cpp's own quantizer.

Not a test: prints one markdown table (docs/formats.md, "GGUF block methods"). Per block type and weight
set, the relative squared error sum (w - w_q)^2 / sum w^2 of each method, and, weighted by a per-column
importance a (sum a (w - w_q)^2 / sum a w^2), of minmax and of search / hqq given that importance. The
weights:

* gaussian: N(0, 1) [64, 2048]; student-t: t with 3 degrees of freedom [64, 2048] (heavy tails);
* gemma3: the first 128 rows of the ffn_down matrices of blocks 0 and 7 of the Gemma 3 270M GGUF given
  by --gguf (stored as Q6_K there, dequantized with gguf-py; [128, 2048] each). They already lie on a Q6_K grid,
  so the q6_k and q8_0 rows of this set flatter every method.

The importance is synthetic (no calibration run): a = exp(1.5 z), z ~ N(0, 1) per input column, a
heavy-tailed profile like the mean squared activations an imatrix holds. Column "llama.cpp": the same
matrices quantized by llama.cpp itself, `llama-quantize --allow-requantize --pure <gguf> <out> <TYPE>`
(its reference quantizer, no imatrix), one file per type given by --llama_cpp_dir (files
lq-<TYPE>.gguf); for q4_0 .. q8_0 it equals minmax by construction (tested byte for byte against
gguf-py). Without those files the column shows "-".

    PYTHONPATH=python .venv/bin/python python/llmq/quant/bench_gguf_methods.py \\
        --gguf /path/gemma-3-270m-q4_k_m.gguf --llama_cpp_dir /path/to/lq
"""

from __future__ import annotations

import argparse
import os
from typing import Dict, Optional

import numpy as np
import torch

from llmq.quant import QuantConfig, dequantize, quantize_weight
from llmq.quant.formats.gguf_fit import BLOCK_TYPES

GEMMA_TENSORS = ("blk.0.ffn_down.weight", "blk.7.ffn_down.weight")
GEMMA_ROWS = 128  # the first rows of each


def _gguf_tensors(path: str, names) -> Dict[str, np.ndarray]:
    import gguf

    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        if t.name in names:
            out[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))[:GEMMA_ROWS]
    return out


def weight_sets(gguf_path: Optional[str]) -> Dict[str, torch.Tensor]:
    torch.manual_seed(0)
    sets = {"gaussian": torch.randn(64, 2048),
            "student-t": torch.distributions.StudentT(3.0).sample((64, 2048))}
    if gguf_path:
        found = _gguf_tensors(gguf_path, GEMMA_TENSORS)
        sets["gemma3"] = torch.from_numpy(np.concatenate([found[n] for n in GEMMA_TENSORS]).astype(np.float32))
    return sets


def rel_error(w: torch.Tensor, approx: torch.Tensor, a: Optional[torch.Tensor] = None) -> float:
    d = (w.double() - approx.double()) ** 2
    e = w.double() ** 2
    if a is not None:
        d, e = d * a.double(), e * a.double()
    return float(d.sum() / e.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=None, help="a Gemma 3 270M GGUF (its ffn_down matrices are the real set)")
    ap.add_argument("--llama_cpp_dir", default=None, help="folder of llama-quantize outputs lq-<TYPE>.gguf")
    ap.add_argument("--kinds", default=",".join(BLOCK_TYPES), help="block types, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(1)  # a shared machine: one core, no spinning worker threads
    sets = weight_sets(args.gguf)
    torch.manual_seed(1)
    imp = torch.exp(1.5 * torch.randn(2048))
    print("| type | bpw | weights | llama.cpp | minmax | search | hqq | minmax (a) | search + a (a) | hqq + a (a) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        t = BLOCK_TYPES[kind]
        import gguf

        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.ggml]]
        bpw = nbytes * 8 / block
        for set_name, w in sets.items():
            row = {}
            for method in ("minmax", "search", "hqq"):
                cfg = QuantConfig(format=kind, bits=t.bits, group_size=t.group, symmetric=t.symmetric, method=method)
                plain = dequantize(quantize_weight(w, cfg), torch.float32)
                row[method] = rel_error(w, plain)
                if method == "minmax":  # minmax takes no importance: its error, weighted
                    row["minmax a"] = rel_error(w, plain, imp)
                else:
                    q = quantize_weight(w, cfg, importance=imp)
                    row[method + " a"] = rel_error(w, dequantize(q, torch.float32), imp)
            ref = "-"
            lq = os.path.join(args.llama_cpp_dir or "", f"lq-{t.ggml}.gguf")
            if set_name == "gemma3" and args.llama_cpp_dir and os.path.exists(lq):
                got = _gguf_tensors(lq, GEMMA_TENSORS)
                ref = f"{rel_error(w, torch.from_numpy(np.concatenate([got[n] for n in GEMMA_TENSORS]))):.3e}"
            elif set_name != "gemma3" and t.sub is None:  # gguf-py's reference quantizer of the blocks of 32
                ref_q = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[t.ggml])
                ref = f"{rel_error(w, torch.from_numpy(gguf.quants.dequantize(ref_q, gguf.GGMLQuantizationType[t.ggml]))):.3e}"
            print(f"| {kind} | {bpw:.4g} | {set_name} | {ref} | " + " | ".join(
                f"{row[k]:.3e}" for k in ("minmax", "search", "hqq", "minmax a", "search a", "hqq a")) + " |", flush=True)


if __name__ == "__main__":
    main()
