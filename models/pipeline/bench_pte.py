"""ExecuTorch .pte against eager llmq on one quantized model: size, load time, prefill and decode tokens/s.

    bazel run //models/pipeline:bench_pte -- --arch=gemma3 --checkpoint=$PWD/gemma-3-270m-q4_k_m.gguf
        [--recipe=int4-e8] [--prompt_len=64] [--decode_steps=32] [--max_seq_len=128] [--repeat=3]
        [--out=$PWD/gemma3.pte [--reuse_pte]] [--prompt="The capital of France is" --prompt=...] [--text_tokens=32]

Both sides hold the same quantized weights (the bundle's codes and scales) and the same static cache
(export_pt2's steps, float32 activations): "eager llmq" is the quantized model's own PrefillStep /
DecodeStep in torch, the .pte is export_pte's (8da linears on XNNPACK, MoE blocks through llmq's op)
run by executorch.runtime. One round is a prefill of --prompt_len tokens then --decode_steps decode
steps fed the eager model's greedy tokens; rounds alternate eager and .pte, best of --repeat. Load:
eager = read the bundle and build the model; .pte = Runtime.load_program + both methods. Needs
executorch (optional: docs/executorch.md).

Agreement on text (where the checkpoint has a tokenizer), for every --prompt: both sides continue it
greedily for --text_tokens tokens ("diverges at" = the first generated token where the .pte's choice
differs from eager llmq's), and the .pte is teacher-forced along eager's continuation ("top-1" = the
share of those positions where the .pte's argmax is eager's token).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import tempfile
import time
from typing import Dict, List, Tuple

import torch
from absl import app, flags

from llmq.checkpoint import load_bundle
from llmq.quant import QuantizedLinear
from models.common.tokenizer import has_tokenizer, load_tokenizer
from models.pipeline import export_pt2, export_pte
from models.pipeline.export_pt2 import DecodeStep, PrefillStep
from models.pipeline.quantized_model import QuantizedExperts, build_quantized_model

flags.DEFINE_string("arch", "gemma3", "Model package under models/: gemma3, gemma4 or qwen.")
flags.DEFINE_integer("repeat", 3, "Rounds per side (best is reported).", lower_bound=1)
# Varied real text: prose, code, a question, a list, French and Chinese, a fact.
DEFAULT_PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: Why is the sky blue?\nAnswer:",
    "Five fruits that are rich in vitamin C:\n1.",
    "La Révolution française a commencé en 1789, lorsque",
    "东京是日本的首都，也是",
    "The capital of France is",
]
flags.DEFINE_multi_string("prompt", DEFAULT_PROMPTS, "Texts both sides continue greedily (where the checkpoint has a "
                          "tokenizer); repeat the flag for several.")
flags.DEFINE_integer("text_tokens", 32, "Tokens of each greedy continuation.", lower_bound=1)
flags.DEFINE_boolean("reuse_pte", False, "Load the .pte at --out (written by an earlier run with the same "
                     "--checkpoint, --recipe and --max_seq_len) instead of exporting again.")
# --checkpoint, --recipe, --out (the .pte; default temporary) are quantize_and_save's flags, --prompt_len,
# --decode_steps and --max_seq_len export_pt2's.
FLAGS = flags.FLAGS


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


@torch.no_grad()
def _round(prefill, decode, prompt, tokens):
    """(prefill seconds, decode seconds, prefill logits, last decode logits) of one prefill + len(tokens) steps."""
    start = time.perf_counter()
    logits, cache = prefill(prompt)
    prefill_s = time.perf_counter() - start
    first = logits
    position = prompt.shape[1]
    start = time.perf_counter()
    for token in tokens:
        logits, cache = decode(torch.tensor([[token]]), torch.tensor(position, dtype=torch.long), tuple(cache))
        position += 1
    return prefill_s, time.perf_counter() - start, first, logits


@contextlib.contextmanager
def dequantized_once(model: torch.nn.Module):
    """Within: every QuantizedLinear of `model` reuses its weight dequantized once (the same float32 tensor its
    forward recomputes on each call, so the same outputs) instead of dequantizing it per call: the agreement
    runs take hundreds of eager steps, and eager dequantizes the 262,144-row head on each. Restored on exit."""
    patched = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, QuantizedLinear):
                    weight = module._dequantized(module.in_features)
                    module._dequantized = lambda k, ids=None, w=weight: w if ids is None else w[ids]
                    patched.append(module)
        yield model
    finally:
        for module in patched:
            del module._dequantized


@torch.no_grad()
def _greedy(prefill, decode, ids, new_tokens: int, eos) -> Tuple[List[int], List[torch.Tensor]]:
    """Greedy tokens and, for each, the logits [V] it was chosen from."""
    logits, cache = prefill(torch.tensor([ids]))
    out: List[int] = []
    steps: List[torch.Tensor] = []
    position = len(ids)
    for _ in range(new_tokens):
        steps.append(logits[0, -1].detach().double().clone())
        out.append(int(steps[-1].argmax()))
        if out[-1] in eos:
            break
        logits, cache = decode(torch.tensor([[out[-1]]]), torch.tensor(position, dtype=torch.long), tuple(cache))
        position += 1
    return out, steps


@torch.no_grad()
def _forced_top1(prefill, decode, ids, tokens: list) -> list:
    """The argmax at each of len(tokens) positions when `tokens` (another side's continuation) are fed."""
    logits, cache = prefill(torch.tensor([ids]))
    top, position = [], len(ids)
    for i, token in enumerate(tokens):
        top.append(int(logits[0, -1].argmax()))
        if i + 1 < len(tokens):
            logits, cache = decode(torch.tensor([[token]]), torch.tensor(position, dtype=torch.long), tuple(cache))
            position += 1
    return top


def logits_closeness(reference: torch.Tensor, other: torch.Tensor) -> Dict[str, float]:
    """Cosine and max |difference| of two logit vectors [V], and max |reference| (the scale)."""
    a, b = reference.double().flatten(), other.double().flatten()
    return {"cosine": torch.nn.functional.cosine_similarity(a, b, dim=0).item(),
            "max_diff": (a - b).abs().max().item(), "max_logit": a.abs().max().item()}


def text_agreement(eager_steps, pte_steps, ids, new_tokens: int, eos, reference_steps=None) -> dict:
    """The .pte against eager llmq on one prompt `ids`:

    - free-running greedy: both continue `ids` for `new_tokens` tokens; "diverges_at" is the index of the first
      generated token where they differ (None: identical);
    - at that token (both sides have seen the same prefix), each side's margin for its own choice over the
      other's: eager_margin = eager logit(eager's token) - eager logit(.pte's token) >= 0, pte_margin the same
      for the .pte; "rank" is the .pte token's rank in eager's logits (1: eager's runner-up), and eager_top2
      eager's top-1 minus top-2 logit;
    - teacher-forced: the .pte fed eager's continuation; "top1" counts positions where its argmax is eager's token,
      "forced_disagree_margins" are eager's top-2 margins (top-1 minus top-2 logit) where it is not;
    - "first": logits_closeness of the first generated token's logits (the prefill's last position), eager vs .pte,
      and with `reference_steps` (another implementation, e.g. torchao's eager 8da model) "first_reference"
      (eager vs it) and "first_pte_reference" (it vs the .pte).
    """
    eager, eager_logits = _greedy(*eager_steps, ids, new_tokens, eos)
    pte, pte_logits = _greedy(*pte_steps, ids, new_tokens, eos)
    diverges = next((i for i, (a, b) in enumerate(zip(eager, pte)) if a != b), None)
    if diverges is None and len(eager) != len(pte):
        diverges = min(len(eager), len(pte))
    forced = _forced_top1(*pte_steps, ids, eager)
    top2 = [float(torch.topk(x, 2).values.diff().neg()) for x in eager_logits]
    result = {"eager": eager, "pte": pte, "diverges_at": diverges, "top1": sum(int(a == b) for a, b in zip(forced, eager)),
              "positions": len(eager), "eager_top2": top2,
              "forced_disagree_margins": [top2[i] for i, (a, b) in enumerate(zip(forced, eager)) if a != b],
              "first": logits_closeness(eager_logits[0], pte_logits[0])}
    if diverges is not None and diverges < min(len(eager), len(pte)):
        e, p, a, b = eager_logits[diverges], pte_logits[diverges], eager[diverges], pte[diverges]
        result.update(eager_margin=float(e[a] - e[b]), pte_margin=float(p[b] - p[a]),
                      rank=int((e > e[b]).sum()), eager_top2_at=top2[diverges])
    if reference_steps is not None:
        with torch.no_grad():
            ref_first = reference_steps[0](torch.tensor([ids]))[0][0, -1]
        result["first_reference"] = logits_closeness(eager_logits[0], ref_first)
        result["first_pte_reference"] = logits_closeness(ref_first, pte_logits[0])
    return result


AGREEMENT_HEADER = ("prompt", "greedy: same tokens", "margin at divergence (eager / .pte)", "teacher-forced top-1",
                    "step 1: cosine", "step 1: max abs diff (max logit)", "torchao 8da eager vs eager / vs .pte")


def agreement_row(label: str, a: dict, text_tokens: int) -> Tuple[str, ...]:
    """One row of the agreement table for text_agreement's result `a`."""
    same = a["positions"] if a["diverges_at"] is None else a["diverges_at"]
    of = f"{same}/{text_tokens}" + (" (eos)" if a["positions"] < text_tokens and a["diverges_at"] is None else "")
    margin = ("-" if "eager_margin" not in a else
              f"{a['eager_margin']:.2f} / {a['pte_margin']:.2f} (rank {a['rank']})")
    first = a["first"]
    ref = "-"
    if "first_reference" in a:
        ref = (f"cos {a['first_reference']['cosine']:.4f}, {a['first_reference']['max_diff']:.2f} / "
               f"cos {a['first_pte_reference']['cosine']:.5f}, {a['first_pte_reference']['max_diff']:.2f}")
    return (label, of, margin, f"{a['top1']}/{a['positions']}", f"{first['cosine']:.4f}",
            f"{first['max_diff']:.2f} ({first['max_logit']:.1f})", ref)


def agreement_tables(eager_steps, pte_steps, reference_steps, tok, texts, text_tokens: int,
                     max_seq_len: int) -> Tuple[list, list]:
    """(agreement table rows, texts table rows) of text_agreement over every prompt in `texts`."""
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    agreement_rows, text_rows = [AGREEMENT_HEADER], [("prompt", "", "greedy continuation")]
    top1 = positions = 0
    for text in texts:
        ids = tok.encode(text)
        if len(ids) + text_tokens > max_seq_len:
            raise SystemExit(f"--prompt {text!r} ({len(ids)} tokens) + --text_tokens {text_tokens} exceeds --max_seq_len")
        a = text_agreement(eager_steps, pte_steps, ids, text_tokens, eos, reference_steps)
        top1, positions = top1 + a["top1"], positions + a["positions"]
        label = repr(text if len(text) <= 32 else text[:29] + "...")
        agreement_rows.append(agreement_row(label, a, text_tokens))
        margins = ", ".join(f"{m:.2f}" for m in a["forced_disagree_margins"]) or "-"
        text_rows += [(label, "eager llmq", repr(tok.decode(a["eager"]))), ("", ".pte", repr(tok.decode(a["pte"]))),
                      ("", "eager top-1 - top-2 logit where the teacher-forced .pte differs",
                       f"{margins} (median over all {a['positions']} positions: {statistics.median(a['eager_top2']):.2f})")]
    agreement_rows.append((f"all {len(texts)} prompts", "", "", f"{top1}/{positions} = {top1 / positions:.3f}", "", "", ""))
    return agreement_rows, text_rows


def bench(arch_name: str, *, checkpoint, recipe, prompt_len: int, decode_tokens: int, max_seq_len: int, repeat: int,
          out, reuse_pte: bool = False, texts: tuple = (), text_tokens: int = 32) -> Tuple[list, list, list]:
    """(speed table rows, agreement table rows (text_agreement per prompt), texts rows)."""
    arch = importlib.import_module(f"models.{arch_name}.architecture").ARCHITECTURE
    layout_module = importlib.import_module(f"models.{arch_name}.export_pt2")
    if prompt_len + decode_tokens > max_seq_len:
        raise SystemExit(f"--prompt_len {prompt_len} + --decode_steps {decode_tokens} exceeds --max_seq_len {max_seq_len}")
    workdir = tempfile.mkdtemp(prefix=f"llmq-bench-pte-{arch_name}-")
    model, bundle = export_pt2.load_quantized_model(arch, bundle=None, checkpoint=checkpoint, recipe=recipe, seed=0,
                                                    workdir=workdir)
    start = time.perf_counter()
    eager = build_quantized_model(arch.build_model(model.config, device="meta"), load_bundle(bundle))
    eager_load = time.perf_counter() - start
    for m in (model, eager):
        export_pt2.to_float32(m)
    layout = layout_module.cache_layout(eager, max_seq_len)
    eager_steps = (PrefillStep(eager, layout), DecodeStep(eager, layout))
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the greedy continuation both sides are fed
        tokens = export_pte._eager_logits(dict(zip(("prefill", "decode"), eager_steps)), prompt, decode_tokens)["tokens"]

    out = out or os.path.join(workdir, "model.pte")
    if reuse_pte:
        if not os.path.isfile(out):
            raise SystemExit(f"--reuse_pte: no .pte at --out {out}")
        lower_s, counts = None, {"linears": "-", "moe_op_blocks": int(any(isinstance(m, QuantizedExperts)
                                                                            for m in model.modules()))}
    else:
        start = time.perf_counter()
        _, _, counts = export_pte.model_to_pte(model, layout_module.cache_layout(model, max_seq_len), prompt_len=prompt_len,
                                               max_seq_len=max_seq_len, dynamic_prompt=layout_module.DYNAMIC_PROMPT,
                                               out_path=out)
        lower_s = time.perf_counter() - start
    pte = export_pte.PteRunner(out, moe_kernel=counts["moe_op_blocks"] > 0)
    export_pte.to_8da(model)  # torchao's eager 8da numerics (already converted where this run exported)
    reference_steps = (PrefillStep(model, layout), DecodeStep(model, layout))
    agreement_rows: list = []
    text_rows: list = []
    if texts and checkpoint is not None and has_tokenizer(checkpoint):
        with dequantized_once(eager):
            agreement_rows, text_rows = agreement_tables(eager_steps, (pte.prefill, pte.decode), reference_steps,
                                                         load_tokenizer(checkpoint), texts, text_tokens, max_seq_len)
    del model

    best = {"eager": [float("inf")] * 2, "pte": [float("inf")] * 2}
    outputs = {}
    for _ in range(repeat):
        for side, (prefill, decode) in (("eager", eager_steps), ("pte", (pte.prefill, pte.decode))):
            p_s, d_s, first, last = _round(prefill, decode, prompt, tokens)
            best[side] = [min(best[side][0], p_s), min(best[side][1], d_s)]
            outputs[side] = (first, last)
    (e_first, e_last), (p_first, p_last) = outputs["eager"], outputs["pte"]
    scale = max(e_first.abs().max().item(), e_last.abs().max().item())
    agree = (e_first[0].argmax(-1) == p_first[0].argmax(-1)).float().mean().item()
    diff = max((e_first - p_first).abs().max().item(), (e_last - p_last).abs().max().item())

    def row(label, e, p, fmt):
        return (label, f"{fmt(e)}", f"{fmt(p)}", f"{p / e:.2f}x")

    rate = "{:,.1f}".format
    return [
        ("", "eager llmq", ".pte (ExecuTorch, XNNPACK)", ".pte / eager"),
        row("size (bytes; eager: the bundle)", _folder_bytes(bundle), os.path.getsize(out), "{:,}".format),
        row("load (s)", eager_load, pte.load_seconds, "{:.3f}".format),
        row(f"prefill, {prompt_len} tokens (tokens/s)", prompt_len / best["eager"][0], prompt_len / best["pte"][0], rate),
        row("decode (tokens/s)", decode_tokens / best["eager"][1], decode_tokens / best["pte"][1], rate),
        ("export + lower (s)", "", "reused" if lower_s is None else f"{lower_s:.1f}", ""),
        ("8da linears / MoE op blocks", "", f"{counts['linears']} / {counts['moe_op_blocks']}", ""),
        ("prefill argmax agreement", "", f"{agree:.3f}", ""),
        ("max |logit diff| / max |logit|", "", f"{diff / scale:.2e} (max |logit| {scale:.2f})", ""),
    ], agreement_rows, text_rows


def main(argv):
    del argv
    export_pte.require_executorch()
    tables = bench(FLAGS.arch, checkpoint=FLAGS.checkpoint, recipe=FLAGS.recipe, prompt_len=FLAGS.prompt_len,
                   decode_tokens=FLAGS.decode_steps, max_seq_len=FLAGS.max_seq_len, repeat=FLAGS.repeat, out=FLAGS.out,
                   reuse_pte=FLAGS.reuse_pte, texts=tuple(FLAGS.prompt), text_tokens=FLAGS.text_tokens)
    print(f"threads: torch {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}; .pte {FLAGS.out or '(temporary)'}")
    for rows in tables:
        print()
        print(markdown_table(rows))


def markdown_table(rows: List[Tuple]) -> str:
    """Rows (the first is the header) as a Markdown table, columns padded."""
    if not rows:
        return ""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines[:1] + ["|" + "|".join("-" * (w + 2) for w in widths) + "|"] + lines[1:])

if __name__ == "__main__":
    app.run(main)
