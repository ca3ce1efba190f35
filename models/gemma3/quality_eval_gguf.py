"""The GGUF quality table (docs/quality.md): llama.cpp's own quantizations and llmq's `--backend=gguf`
files of the off-grid Gemma 3 270M, every one measured by llama.cpp's `llama-perplexity --kl-divergence`
against the F32 reference; prints a Markdown table.

bazel run //models/gemma3:quality_eval_gguf -- --llama_cpp_bin=DIR --checkpoint=gemma-3-270m-q4_k_m.gguf \\
    --held_text=FILE --calibration_text=FILE [--work=DIR] [--rows=...] [--llmq_eval=ROW,...]

Steps (each skipped when its output is already in --work, so an interrupted run resumes):
1. the reference: quality_eval's off-grid Gemma 3 (quality_eval.off_grid) written as an F32 GGUF;
2. `llama-perplexity --kl-divergence-base` on --chunks windows of --ctx tokens of the held text (it scores
   the second half of each window), and `llama-imatrix` on --calibration_chunks windows of the calibration
   text (a different text);
3. the files: `llama-quantize --token-embedding-type f32` (Q4_0, Q4_0 / Q4_K_M / IQ4_NL with the
   imatrix), and llmq's `quantize_and_save --backend=gguf` from the F32 reference with the recipes below
   (the token embedding stays F32 in every file, as llama.cpp's rows are made);
4. `llama-perplexity --kl-divergence` per file: mean KL(reference || file) in nats per scored token,
   perplexity, and "same top p" (top-1 agreement);
5. bits per weight read from each written file: the quantized projections' tensor bytes x 8 / their
   weights, and the whole file's size;
6. with --llmq_eval: llmq's own evaluator (quality_eval --windows_from_kld) on the same files, same tokens
   and windows, next to llama-perplexity's mean KL.

The budget rows aim at the projections' bits per weight of llama.cpp's Q4_0 + imatrix and Q4_K_M + imatrix
files as written (measured in step 5). Not run in CI: about 20 minutes of 2 CPU cores per row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Tuple

PROJECTION_TENSOR = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# llama.cpp's rows: name -> (llama-quantize type, with the imatrix)
LLAMA_CPP_ROWS = {"llama.cpp Q4_0": ("Q4_0", False), "llama.cpp Q4_0 + imatrix": ("Q4_0", True),
                  "llama.cpp Q4_K_M + imatrix": ("Q4_K_M", True), "llama.cpp IQ4_NL + imatrix": ("IQ4_NL", True)}


def _keep(extra_pattern_rules: List[dict]) -> List[dict]:
    return [{"pattern": r"(.*\.)?(embed_tokens|lm_head)", "config": None},
            {"pattern": r".*norm.*", "config": None}] + extra_pattern_rules


def _all(config: dict) -> dict:
    return {"name": "quality", "rules": _keep([{"pattern": ".*", "config": config}])}


# llmq's rows: name -> (recipe, extra quantize_and_save flags); "{q4_0}" / "{q4_k_m}" in a flag stand for
# the projections' bits per weight of llama.cpp's Q4_0 + imatrix / Q4_K_M + imatrix files
Q4 = {"bits": 4, "group_size": 32}
LLMQ_ROWS: Dict[str, Tuple[dict, List[str]]] = {
    "llmq rtn (Q4_0 minmax)": (_all({**Q4, "symmetric": True, "method": "minmax"}), []),
    "llmq search (Q4_0)": (_all({**Q4, "symmetric": True, "method": "search"}), []),
    "llmq hqq (Q4_1)": (_all({**Q4, "symmetric": False, "method": "hqq"}), []),
    "llmq search + imatrix (Q4_0)": (_all({**Q4, "symmetric": True, "method": "search"}), ["--calibration_text"]),
    "llmq hqq + imatrix (Q4_1)": (_all({**Q4, "symmetric": False, "method": "hqq"}), ["--calibration_text"]),
    "llmq budget @ Q4_0 size": (_all({**Q4, "symmetric": True, "method": "search"}),
                                ["--calibration_text", "--budget_bits_per_weight={q4_0}", "--budget_method=search"]),
    "llmq budget @ Q4_K_M size": (_all({**Q4, "symmetric": True, "method": "search"}),
                                  ["--calibration_text", "--budget_bits_per_weight={q4_k_m}", "--budget_method=search"]),
    "llmq gptq + imatrix (Q4_0)": (_all({**Q4, "symmetric": True, "method": "gptq"}), ["--calibration_text"]),
    # Gemma 3 270M's rows of 640 (q, k, v, gate, up) are no whole K-quant super-block; o_proj's and down_proj's
    # (1024, 2048) are: the budget chooses per matrix among every block type, K-quants where they tile, all by gptq
    "llmq gptq budget @ Q4_K_M size": (_all({**Q4, "symmetric": True, "method": "gptq"}),
                                       ["--calibration_text", "--budget_bits_per_weight={q4_k_m}", "--budget_method=gptq"]),
}


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _run(cmd: List[str], log: str) -> None:
    """Run `cmd` (nice'd) with its output in `log`; skipped when an earlier run of it finished (`log`.ok)."""
    if os.path.exists(log + ".ok"):
        print(f"  done before: {log}", flush=True)
        return
    print(f"  $ {' '.join(cmd)} > {log}", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(["nice"] + cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed (exit {rc}); see {log}")
    open(log + ".ok", "w").close()
    print(f"    {time.time() - t0:.0f} s", flush=True)


def file_bits(path: str) -> Dict[str, object]:
    """Bits per weight of a GGUF as written: the projections' tensor bytes x 8 / their weights, their
    tensor types, and the whole file's bytes."""
    import gguf

    reader = gguf.GGUFReader(path)
    bits, count, types = 0, 0, {}
    for t in reader.tensors:
        if PROJECTION_TENSOR.fullmatch(t.name):
            bits += int(t.n_bytes) * 8
            count += int(t.n_elements)
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"bpw": bits / count, "types": types, "file_bytes": os.path.getsize(path)}


def parse_kld_log(log: str) -> Dict[str, float]:
    """Mean KL, the file's perplexity, the reference's, and "same top p" from llama-perplexity's output."""
    text = open(log).read()
    out = {}
    for key, pattern in (("mean_kl", r"Mean\s+KLD:\s+([-\d.]+)\s+±\s+([\d.]+)"),
                         ("ppl", r"Mean PPL\(Q\)\s+:\s+([\d.]+)\s+±\s+([\d.]+)"),
                         ("ppl_base", r"Mean PPL\(base\)\s+:\s+([\d.]+)\s+±\s+([\d.]+)"),
                         ("top1", r"Same top p:\s+([\d.]+)\s+±\s+([\d.]+)\s+%")):
        m = re.search(pattern, text)
        if m is None:
            raise RuntimeError(f"{log}: no {key} in llama-perplexity's output")
        out[key], out[key + "_err"] = float(m.group(1)), float(m.group(2))
    out["top1"] /= 100
    out["top1_err"] /= 100
    return out


def running_kl(log: str, windows: int) -> float:
    """llama-perplexity's running mean KL after its first `windows` windows (its per-chunk table)."""
    for line in open(log):
        cells = line.split()
        if len(cells) >= 11 and cells[0] == str(windows) and cells[2] == "±":
            return float(cells[7])
    raise RuntimeError(f"{log}: no row for window {windows} in llama-perplexity's per-chunk table")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama_cpp_bin", required=True, help="Folder with llama-perplexity, llama-quantize, llama-imatrix.")
    parser.add_argument("--checkpoint", required=True, help="Gemma 3 270M GGUF (the source of the off-grid reference).")
    parser.add_argument("--held_text", required=True)
    parser.add_argument("--calibration_text", required=True)
    parser.add_argument("--work", default="quality_gguf", help="Folder for the files, logs and the table.")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=32, help="Held-text windows of --ctx tokens.")
    parser.add_argument("--calibration_chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default=",".join(list(LLAMA_CPP_ROWS) + list(LLMQ_ROWS)),
                        help="Comma-separated rows to make and measure, in this order (default: all).")
    parser.add_argument("--llmq_eval", default="", help="Comma-separated rows also measured by llmq's own evaluator.")
    parser.add_argument("--llmq_eval_windows", type=int, default=0,
                        help="llmq's evaluator on the first N windows only (0: all --chunks); compared with "
                             "llama-perplexity's running mean KL after the same N windows.")
    args = parser.parse_args(argv)

    def user(p: str) -> str:
        base = os.environ.get("BUILD_WORKING_DIRECTORY")
        return p if base is None or os.path.isabs(p) else os.path.join(base, p)

    work = os.path.abspath(user(args.work))
    os.makedirs(work, exist_ok=True)
    checkpoint, held, calib = (os.path.abspath(user(p)) for p in (args.checkpoint, args.held_text, args.calibration_text))
    tool = {t: os.path.join(user(args.llama_cpp_bin), t) for t in ("llama-perplexity", "llama-quantize", "llama-imatrix")}
    for t in tool.values():
        if not os.access(t, os.X_OK):
            raise SystemExit(f"error: --llama_cpp_bin: no executable {t}")
    rows = [r for r in args.rows.split(",") if r]
    for r in rows + [r for r in args.llmq_eval.split(",") if r]:
        if r not in LLAMA_CPP_ROWS and r not in LLMQ_ROWS:
            raise SystemExit(f"error: --rows/--llmq_eval: unknown row {r!r}; rows: {', '.join(list(LLAMA_CPP_ROWS) + list(LLMQ_ROWS))}")
    py = [sys.executable]
    # the two llmq steps run as child processes of this interpreter, seeing the modules it sees
    repo_paths = [os.path.join(ROOT, p) for p in ("python", "", "backends/gguf", "backends/hf", "backends/mlx",
                                                 "backends/cuda")]
    os.environ["PYTHONPATH"] = os.pathsep.join(repo_paths + [p for p in sys.path if p])
    threads = ["-t", str(args.threads)]
    ppl_args = ["-c", str(args.ctx), "--chunks", str(args.chunks)] + threads
    ref = os.path.join(work, "reference-f32.gguf")
    kld = os.path.join(work, "reference.kld")
    imatrix = os.path.join(work, "imatrix.gguf")

    print("1. reference", flush=True)
    _run(py + [os.path.join(HERE, "quality_eval.py"), f"--checkpoint={checkpoint}", f"--held_text={held}",
               f"--calibration_text={calib}", f"--write_reference_gguf={ref}"], os.path.join(work, "reference.log"))
    print("2. reference logits and imatrix", flush=True)
    _run([tool["llama-perplexity"], "-m", ref, "-f", held, "--kl-divergence-base", kld] + ppl_args,
         os.path.join(work, "reference-ppl.log"))
    budget_rows = [r for r in rows if any("{q4_" in f for f in LLMQ_ROWS.get(r, ({}, []))[1])]
    if any(LLAMA_CPP_ROWS.get(r, ("", False))[1] for r in rows) or budget_rows:
        _run([tool["llama-imatrix"], "-m", ref, "-f", calib, "-o", imatrix, "-c", str(args.ctx),
              "--chunks", str(args.calibration_chunks)] + threads, os.path.join(work, "imatrix.log"))

    files: Dict[str, str] = {}
    failed: Dict[str, str] = {}
    budget_of: Dict[str, str] = {}

    def llama_cpp_file(name: str) -> str:
        qtype, with_imatrix = LLAMA_CPP_ROWS[name]
        out = os.path.join(work, _slug(name) + ".gguf")
        _run([tool["llama-quantize"], "--token-embedding-type", "f32"] + (["--imatrix", imatrix] if with_imatrix else [])
             + [ref, out, qtype] + [str(args.threads)], os.path.join(work, _slug(name) + "-quantize.log"))
        return out

    def llmq_file(name: str) -> str:
        recipe, extra = LLMQ_ROWS[name]
        flags = []
        for f in extra:
            if f == "--calibration_text":
                flags += [f"--calibration_text={calib}", f"--calibration_tokens={args.calibration_chunks * args.ctx}"]
                continue
            for key, row in (("{q4_0}", "llama.cpp Q4_0 + imatrix"), ("{q4_k_m}", "llama.cpp Q4_K_M + imatrix")):
                if key in f:
                    budget = file_bits(llama_cpp_file(row))["bpw"]
                    f = f.replace(key, f"{budget:.4f}")
                    budget_of[name] = f"{budget:.4f}"
            flags.append(f)
        recipe_file = os.path.join(work, _slug(name) + ".json")
        with open(recipe_file, "w") as fh:
            json.dump(recipe, fh)
        out_dir = os.path.join(work, _slug(name))
        _run(py + [os.path.join(HERE, "quantize_and_save.py"), "--backend=gguf", "--requantize_gguf", "--noverify",
                   f"--recipe={recipe_file}", f"--checkpoint={ref}", f"--out={out_dir}"] + flags,
             os.path.join(work, _slug(name) + "-quantize.log"))
        return os.path.join(out_dir, "model.gguf")

    print("3. per row: the file, then llama-perplexity --kl-divergence", flush=True)
    results: Dict[str, Dict[str, object]] = {}
    for name in rows:
        try:
            path = files[name] = llama_cpp_file(name) if name in LLAMA_CPP_ROWS else llmq_file(name)
            log = os.path.join(work, _slug(name) + "-kld.log")
            _run([tool["llama-perplexity"], "-m", path, "-f", held, "--kl-divergence-base", kld, "--kl-divergence"]
                 + ppl_args, log)
            results[name] = {**parse_kld_log(log), **file_bits(path)}
            r = results[name]
            print(f"  {name}: {r['bpw']:.3f} bpw, mean KL {r['mean_kl']:.4f}, ppl {r['ppl']:.3f}, "
                  f"same top p {r['top1']:.4f}", flush=True)
        except RuntimeError as e:
            failed[name] = str(e)
            print(f"  {name}: {e}", flush=True)

    llmq_kl: Dict[str, float] = {}
    wanted = [r for r in args.llmq_eval.split(",") if r and r in results]
    if wanted:
        print("6. llmq's own evaluator on the same windows", flush=True)
        log = os.path.join(work, "llmq-eval.log")
        _run(py + [os.path.join(HERE, "quality_eval.py"), f"--checkpoint={checkpoint}", f"--held_text={held}",
                   f"--calibration_text={calib}", f"--windows_from_kld={kld}", "--variants=",
                   f"--kld_windows={args.llmq_eval_windows}"]
             + [f"--llama_cpp={r}={files[r]}" for r in wanted], log)
        for line in open(log):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 5 and cells[0] in wanted:
                llmq_kl[cells[0]] = float(cells[2])

    ref_ppl = next((r["ppl_base"] for r in results.values()), float("nan"))
    print(f"\nReference (F32, off-grid): perplexity {ref_ppl:.3f}; {args.chunks} windows of {args.ctx} tokens, "
          f"the second half of each scored ({args.chunks * (args.ctx - 1 - args.ctx // 2)} tokens)\n")
    print("| variant | projections bpw | file MiB | mean KL (nats) | perplexity | same top p | projection types |")
    print("|---|---|---|---|---|---|---|")
    for name in [r for r in list(LLAMA_CPP_ROWS) + list(LLMQ_ROWS) if r in results]:
        r = results[name]
        types = ", ".join(f"{k} {v}" for k, v in sorted(r["types"].items()))
        budget = f" (budget {budget_of[name]})" if name in budget_of else ""
        print(f"| {name}{budget} | {r['bpw']:.3f} | {r['file_bytes'] / 2**20:.1f} | {r['mean_kl']:.4f} ± {r['mean_kl_err']:.4f} "
              f"| {r['ppl']:.3f} | {r['top1']:.4f} | {types} |")
    for name, why in failed.items():
        print(f"| {name} | - | - | not measured: {why} | - | - | - |")
    if llmq_kl:
        n = args.llmq_eval_windows or args.chunks
        print(f"\nThe same files, the first {n} windows: llama-perplexity's running mean KL and llmq's evaluator's\n")
        print("| file | llama-perplexity mean KL | llmq evaluator mean KL | ratio |")
        print("|---|---|---|---|")
        for name, kl in llmq_kl.items():
            lc = running_kl(os.path.join(work, _slug(name) + "-kld.log"), n)
            print(f"| {name} | {lc:.4f} | {kl:.4f} | {kl / lc:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
