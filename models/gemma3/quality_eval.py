"""Quantization quality on a real Gemma 3, measured fairly; prints a Markdown table.

PYTHONPATH=python:. .venv/bin/python models/gemma3/quality_eval.py --checkpoint=gemma-3-270m-q4_k_m.gguf \
    --held_text=FILE --calibration_text=FILE [--tokens=16384] [--write_reference_gguf=F32.gguf] \
    [--llama_cpp=NAME=FILE.gguf ...]

The checkpoint is itself Q4_K_M: its dequantized weights sit on llama.cpp's grids, which
flatters any quantizer whose grid matches. So the reference is moved off-grid first by an
exact, function-preserving rescaling (`off_grid`): per layer, per-input-channel factors s
multiply the input columns of q/k/v_proj and divide the effective input-norm scale (Gemma's
1 + w), likewise for gate/up_proj and the pre-feed-forward norm; factors t multiply v_proj's
rows and divide o_proj's matching columns (every query head sharing that KV head); factors u
multiply up_proj's rows and divide down_proj's columns. The script checks and prints both
facts: how much the logits moved, and how many int4 groups of 32 still lie on a grid.

Each variant quantizes the seven projection matrices of every layer (embeddings stay float,
as in the llama.cpp runs, made with --token-embedding-type f32); `bpw` counts their bits as
--backend (default mlx: a 16-bit scale and bias per group) writes them, and every llmq variant is
quantized with the scale dtype that backend writes.
On --tokens of the held text (non-overlapping windows of --window tokens) it reports, against
the reference: mean KL(reference || variant) of the next-token distribution, perplexity, and
top-1 agreement. The calibration text (a different file) feeds the importance statistics
(imatrix) of the weighted variants. `--llama_cpp NAME=FILE` adds a GGUF written by llama.cpp's
quantizer from --write_reference_gguf's file: its tensors are read back with gguf-py's own
dequantizer (an independent reader) and evaluated the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _user_path(path):
    base = os.environ.get("BUILD_WORKING_DIRECTORY")
    return path if path is None or base is None or os.path.isabs(path) else os.path.join(base, path)


def projection_names(config) -> List[str]:
    return [f"model.layers.{i}.{p}.weight" for i in range(config.num_hidden_layers) for p in PROJECTIONS]


def off_grid(tensors: Dict[str, torch.Tensor], config, seed: int = 0, spread: float = 0.4) -> Dict[str, torch.Tensor]:
    """The exact function-preserving rescaling of the module docstring (factors exp(U(-spread, spread)))."""
    g = torch.Generator().manual_seed(seed)
    out = dict(tensors)
    offset = float(getattr(config, "norm_offset", 1.0))

    def factors(n: int) -> torch.Tensor:
        return torch.exp((torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1) * spread)

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.head_dim
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        w = {k: out[p + k].double() for k in ("input_layernorm.weight", "pre_feedforward_layernorm.weight",
                                                 "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
        s = factors(config.hidden_size)
        w["input_layernorm.weight"] = (offset + w["input_layernorm.weight"]) / s - offset
        for k in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            w[k] = w[k] * s
        s2 = factors(config.hidden_size)
        w["pre_feedforward_layernorm.weight"] = (offset + w["pre_feedforward_layernorm.weight"]) / s2 - offset
        for k in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            w[k] = w[k] * s2
        t = factors(kv_heads * head_dim)
        w["self_attn.v_proj.weight"] = w["self_attn.v_proj.weight"] * t[:, None]
        per_query = t.view(kv_heads, 1, head_dim).expand(kv_heads, heads // kv_heads, head_dim).reshape(-1)
        w["self_attn.o_proj.weight"] = w["self_attn.o_proj.weight"] / per_query
        u = factors(w["mlp.up_proj.weight"].shape[0])
        w["mlp.up_proj.weight"] = w["mlp.up_proj.weight"] * u[:, None]
        w["mlp.down_proj.weight"] = w["mlp.down_proj.weight"] / u
        for k, v in w.items():
            out[p + k] = v.to(tensors[p + k].dtype)
    return out


def on_grid_fraction(w: torch.Tensor, group: int = 32, max_levels: int = 64, tol: float = 1e-4) -> float:
    """Share of groups of `group` whose values all lie on one affine grid of at most `max_levels`
    levels (what a llama.cpp block's dequantized values do: Q4_K 16, Q5 32, Q6_K 64): the smallest
    gap between distinct values divides every offset from the group's minimum."""
    x = w.double().reshape(-1, group).sort(dim=1).values
    gaps = x.diff(dim=1)
    span = x[:, -1] - x[:, 0]
    big = gaps > span[:, None] * 1e-9
    step = torch.where(big, gaps, torch.full_like(gaps, float("inf"))).min(dim=1).values
    q = (x - x[:, :1]) / step[:, None]
    on = ((q - q.round()).abs() <= tol * q.abs().clamp_min(1)).all(dim=1) & (span / step <= max_levels - 1)
    return float((on | (span == 0)).double().mean())


class Evaluator:
    """Reference log-probabilities per window, compared with each variant's (one model, weights swapped)."""

    def __init__(self, build: Callable[[Dict[str, torch.Tensor]], torch.nn.Module], reference: Dict[str, torch.Tensor],
                 windows: List[torch.Tensor], score_from: int = 0):
        """Each window's tokens 1.. are predicted; only the predictions at positions >= score_from count
        (llama-perplexity scores the second half of each window: score_from = window // 2)."""
        # the model gets its own copy: loading assigns tensors (no copy), and swapping a variant in
        # writes into the model's parameters, which must never be the reference's tensors
        self.model = build({n: t.clone() for n, t in reference.items()}).eval()
        self.params = dict(self.model.named_parameters())
        self.reference = {n: reference[n] for n in reference if n in self.params}
        self.windows = windows
        self.score_from = score_from

    def _set(self, weights: Dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, v in weights.items():
                self.params[n].copy_(v)

    @torch.no_grad()
    def run(self, variants: Dict[str, Dict[str, torch.Tensor]]) -> Dict[str, Dict[str, float]]:
        stats = {name: {"kl": 0.0, "nll": 0.0, "top1": 0.0} for name in ["reference"] + list(variants)}
        tokens = 0
        tokens_done: List[int] = []
        start = time.time()
        for ids in self.windows:
            self._set(self.reference)
            # float32 log-probabilities: each KL term is off by ~1e-7 * p, far below the differences measured
            ref = F.log_softmax(self.model(ids[None, :-1])[0].float(), dim=-1)[self.score_from:]
            target = ids[1:][self.score_from:]
            ref_top = ref.argmax(-1)
            stats["reference"]["nll"] -= float(ref.gather(-1, target[:, None]).sum())
            stats["reference"]["top1"] += len(target)
            for name, weights in variants.items():
                self._set(weights)
                got = F.log_softmax(self.model(ids[None, :-1])[0].float(), dim=-1)[self.score_from:]
                stats[name]["kl"] += float((ref.exp() * (ref - got)).sum(-1).double().sum())
                stats[name]["nll"] -= float(got.gather(-1, target[:, None]).sum())
                stats[name]["top1"] += float((got.argmax(-1) == ref_top).sum())
            tokens += len(target)
            running = ", ".join(f"{name} {s['kl'] / tokens:.4f}" for name, s in stats.items() if name != "reference")
            print(f"  window {len(tokens_done) + 1}/{len(self.windows)}: {tokens} tokens, "
                  f"{time.time() - start:.0f} s; mean KL so far: {running}", flush=True)
            tokens_done.append(tokens)
        self._set(self.reference)
        return {name: {"mean_kl": s["kl"] / tokens, "ppl": math.exp(s["nll"] / tokens), "top1": s["top1"] / tokens,
                       "tokens": tokens} for name, s in stats.items()}


def llmq_variant(tensors: Dict[str, torch.Tensor], names: List[str], recipe_for: Callable[[str], object],
                 storage: Callable[[object], object],
                 importance: Optional[Dict[str, torch.Tensor]] = None,
                 hessians: Optional[Dict[str, torch.Tensor]] = None) -> Tuple[Dict[str, torch.Tensor], float]:
    """Quantize (with the scale dtype `storage`, a backend's declaration, writes) then dequantize every
    projection; (dequantized weights, bits per weight as that backend writes them)."""
    from llmq.quant import dequantize, quantize_weight
    from llmq.quant.quantize import takes_importance

    out, bits, count = {}, 0, 0
    for n in names:
        stored = storage(recipe_for(n))
        config = dataclasses.replace(recipe_for(n), scale_dtype=stored.scale_dtype)
        imp = importance[n] if importance is not None and takes_importance(config) else None
        hessian = hessians[n] if hessians is not None and config.method == "gptq" else None
        key = (n, config, imp is not None)
        if key not in _QUANTIZED:  # a matrix quantized once per config (gptq-budget's options, gptq's own)
            q = quantize_weight(tensors[n], config, name=n, importance=imp, hessian=hessian)
            _QUANTIZED[key] = (dequantize(q, torch.float32), stored.bits(tuple(tensors[n].shape), q))
        out[n], b = _QUANTIZED[key]
        bits += b
        count += tensors[n].numel()
    return out, bits / count


_QUANTIZED: Dict[tuple, Tuple[torch.Tensor, int]] = {}


def gguf_variant(path: str, names: List[str], gguf_names: Dict[str, str], reference: Dict[str, torch.Tensor]
                 ) -> Tuple[Dict[str, torch.Tensor], float, Dict[str, int]]:
    """A llama.cpp GGUF's projections through gguf-py's dequantizer; (weights, bpw, tensor types used)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    out, bits, count, types = {}, 0, 0, {}
    for n in names:
        t = by_name[gguf_names[n]]
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(reference[n].shape)
        out[n] = w
        bits += int(t.n_bytes) * 8
        count += w.numel()
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return out, bits / count, types


def _gptq(bits: int, group_size: int, symmetric: bool, **options):
    from llmq.quant import QuantConfig

    return QuantConfig(bits=bits, group_size=group_size, symmetric=symmetric, method="gptq", options=options or None)


# The gptq variants: H from the calibration text run through the unquantized (off-grid) model.
GPTQ_CONFIGS = {
    "gptq": _gptq(4, 64, False),  # int4 g64 asym: 4.5 bpw as MLX writes it (16-bit scale and bias per 64)
    "gptq-noact": _gptq(4, 64, False, act_order=False),
    "gptq-minmax": _gptq(4, 64, False, fit="minmax"),
    "gptq-g32": _gptq(4, 32, True),  # Q4_0's layout: 4.5 bpw counted, 5.0 as MLX writes it
}
# gptq-budget's options: int3/4/5 asymmetric groups of 64 (3.5, 4.5, 5.5 bpw as MLX writes them).
GPTQ_BUDGET_OPTIONS = tuple(_gptq(b, 64, False) for b in (3, 4, 5))


def gptq_variants(wanted: List[str]) -> List[str]:
    return [v for v in wanted if v in GPTQ_CONFIGS or v == "gptq-budget"]


def sequential_gptq(architecture, config, tensors: Dict[str, torch.Tensor], names: List[str], ids: torch.Tensor,
                    gptq_config, storage) -> Tuple[Dict[str, torch.Tensor], float]:
    """Variant "gptq-seq": `gptq_config` on the projections with --calibration_inputs=quantized's
    sequential calibration (models/pipeline/calibration.py, the pipeline's own code): layer by layer, each
    layer rounded against the H its inputs give when the layers before it are already quantized, the
    text then run on through the quantized layer. The layers fed forward are the variant (what
    quantize_and_save writes); (dequantized weights, bits per weight as `storage` writes them)."""
    from llmq.quant import QuantRecipe, dequantize
    from models.pipeline import calibration, layerwise

    config_here = dataclasses.replace(gptq_config, scale_dtype=storage(gptq_config).scale_dtype)
    pattern = "|".join(n[: -len(".weight")].replace(".", r"\.") for n in names)
    recipe = QuantRecipe([{"pattern": f"({pattern})", "config": config_here.to_dict()}])
    skeleton = architecture.build_model(config, device="meta")
    held = layerwise.LayerTensors(lambda only: ((n, v) for n, v in tensors.items() if only is None or only(n)),
                                  selective=True, expected=layerwise.expected_groups(skeleton))
    model = layerwise.LayerwiseModel(skeleton, held)
    quantizer = calibration.layer_quantizer(recipe, config.num_hidden_layers)
    out: Dict[str, torch.Tensor] = {}
    bits = count = 0

    def quantize(i, layer_tensors, statistics):
        nonlocal bits, count
        done = quantizer(i, layer_tensors, statistics)
        for n in names:
            if n in done:
                out[n] = dequantize(done[n], torch.float32)
                bits += storage(config_here).bits(tuple(tensors[n].shape), done[n])
                count += tensors[n].numel()
        return done

    calibration.calibrate_layerwise(model, ids, hessians=True, progress=False, quantize=quantize)
    missing = sorted(set(names) - set(out))
    if missing:
        raise SystemExit(f"error: gptq-seq: {len(missing)} projections not quantized, e.g. {missing[0]}")
    return out, bits / count


def compressed_tensors_variant(folder: str, names: List[str]) -> Tuple[Dict[str, torch.Tensor], float]:
    """The projections of a compressed-tensors "pack-quantized" integer folder (llm-compressor's output,
    e.g. its GPTQModifier), decoded here from the file: int32 words of LSB-first b-bit codes q_u =
    q + 2^(b-1), zero points packed the same way along the output dimension, w = (q - zp) * scale with
    q, zp signed; (weights, bits per weight of the tensors it stores for them)."""
    import json

    from safetensors import safe_open

    from llmq.quant.codecs import unpack_bits

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        scheme = json.load(f)["quantization_config"]
    (group,) = scheme["config_groups"].values()
    bits, symmetric = group["weights"]["num_bits"], group["weights"]["symmetric"]
    out, stored, count = {}, 0, 0
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        for n in names:
            m = n[: -len(".weight")]
            n_out, k = (int(v) for v in f.get_tensor(m + ".weight_shape").tolist())
            words = f.get_tensor(m + ".weight_packed")
            scale = f.get_tensor(m + ".weight_scale").double()
            q = unpack_bits(words.contiguous().view(torch.uint8)[:, : k * bits // 8], bits, k).double() - (1 << (bits - 1))
            stored += sum(f.get_tensor(m + suffix).numel() * f.get_tensor(m + suffix).element_size() * 8
                          for suffix in (".weight_packed", ".weight_scale", ".weight_shape"))
            zp = torch.zeros_like(scale)
            if not symmetric:
                zwords = f.get_tensor(m + ".weight_zero_point")
                stored += zwords.numel() * zwords.element_size() * 8
                zbytes = zwords.t().contiguous().view(torch.uint8)[:, : n_out * bits // 8]
                zp = unpack_bits(zbytes, bits, n_out).t().double() - (1 << (bits - 1))
            gs = k // scale.shape[1]
            w = (q.reshape(n_out, -1, gs) - zp[..., None]) * scale[..., None]
            out[n] = w.reshape(n_out, k).float()
            count += n_out * k
    return out, stored / count


def kld_windows(path: str, bos: int) -> Tuple[List[torch.Tensor], int]:
    """The windows llama-perplexity scored when it wrote `path` (its --kl-divergence-base file: "_logits_",
    int32 n_ctx, n_vocab, n_chunk, then n_chunk * n_ctx int32 token ids): window i is tokens
    [i * n_ctx, (i + 1) * n_ctx) with its first token replaced by BOS, as llama-perplexity runs it;
    (windows, n_ctx)."""
    import numpy as np

    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise SystemExit(f"error: {path}: not a llama-perplexity --kl-divergence-base file (no _logits_ magic)")
        n_ctx, _n_vocab, n_chunk = (int(v) for v in np.frombuffer(f.read(12), dtype="<i4"))
        ids = torch.from_numpy(np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype="<i4").astype(np.int64))
    if ids.numel() != n_ctx * n_chunk:
        raise SystemExit(f"error: {path}: truncated token list ({ids.numel()} of {n_ctx * n_chunk} ids)")
    windows = [ids[i * n_ctx:(i + 1) * n_ctx].clone() for i in range(n_chunk)]
    for w in windows:
        w[0] = bos
    return windows, n_ctx


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--held_text", required=True)
    parser.add_argument("--calibration_text", required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--calibration_tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write_reference_gguf", help="Write the off-grid reference as an F32 GGUF here and exit.")
    parser.add_argument("--hessians", help="File of the gptq variants' H per linear: read when it exists (from "
                        "an earlier run on the same checkpoint, --seed, calibration text and tokens), else written.")
    parser.add_argument("--dequantized", action="append", default=[],
                        help="NAME=FILE[,FILE...]: projections already quantized and dequantized (float32 safetensors "
                             "with metadata 'bits' and 'count': the bits as written and the weights they hold).")
    parser.add_argument("--compressed_tensors", action="append", default=[],
                        help="NAME=DIR: an integer pack-quantized HF folder of the reference (e.g. llm-compressor's).")
    parser.add_argument("--llama_cpp", action="append", default=[],
                        help="NAME=FILE.gguf: a GGUF of the reference's quantized projections (llama-quantize's, or "
                             "llmq's --backend=gguf), read with gguf-py's dequantizer.")
    parser.add_argument("--windows_from_kld",
                        help="Evaluate on the windows of this llama-perplexity --kl-divergence-base file (its tokens, BOS "
                             "first, the second half of each window scored, as llama-perplexity does) instead of "
                             "--tokens of --held_text; mean KL then compares with llama-perplexity --kl-divergence.")
    parser.add_argument("--kld_windows", type=int, default=0,
                        help="With --windows_from_kld: only its first N windows (0: all); llama-perplexity prints the "
                             "running mean KL after each window to compare with.")
    parser.add_argument("--variants", default="rtn,search,hqq,search-imatrix,imatrix,imatrix-g64,budget,budget-rel,int8",
                        help="Comma-separated llmq variants to run (also gptq, gptq-noact, gptq-minmax, gptq-g32, gptq-budget, "
                             "gptq-seq: gptq's sequential form, --calibration_inputs=quantized).")
    parser.add_argument("--backend", default="mlx",
                        help="Count bits per weight as this backend writes them (and quantize with its scale dtype).")
    parser.add_argument("--budget_bits_per_weight", default="4.5",
                        help="Comma-separated budgets; variant 'budget' runs one per value (budget@<bpw>).")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    import backends.registered  # noqa: F401  every backend's storage declaration
    from llmq.backend import get_backend, storage_of

    storage = storage_of(get_backend(args.backend))

    from llmq.quant import GroupQuantizedWeight
    from llmq.quant.formats import dequantize_canonical
    from models.gemma3.architecture import ARCHITECTURE
    from models.gemma3.config import ModelConfig
    from models.pipeline import gguf_input
    from models.pipeline.quantized_model import build_quantized_model

    path = _user_path(args.checkpoint)
    hf_config = gguf_input.hf_config(ARCHITECTURE, path)
    config = ModelConfig.from_hf_dict(hf_config)
    plain = {n: dequantize_canonical(v).float() if isinstance(v, GroupQuantizedWeight) else v.float()
             for n, v in gguf_input.model_tensors(ARCHITECTURE, path, config)}
    reference = off_grid(plain, config, seed=args.seed)
    names = projection_names(config)

    def build(tensors):
        return build_quantized_model(ARCHITECTURE.build_model(config, device="meta"), dict(tensors))

    from models.common.tokenizer import load_tokenizer

    tok = load_tokenizer(path)

    def token_ids(file: str, n: int) -> torch.Tensor:
        with open(_user_path(file), encoding="utf-8", errors="replace") as f:
            ids = tok.encode(f.read())
        if len(ids) < n:
            raise SystemExit(f"error: {file}: {len(ids)} tokens, fewer than the {n} asked for")
        return torch.tensor(ids[:n])

    held = token_ids(args.held_text, args.tokens)
    windows = [held[i:i + args.window + 1] for i in range(0, len(held) - 1, args.window) if len(held[i:i + args.window + 1]) > 1]
    score_from = 0
    if args.windows_from_kld:
        import gguf

        bos = int(gguf.GGUFReader(path).fields["tokenizer.ggml.bos_token_id"].contents())
        windows, n_ctx = kld_windows(_user_path(args.windows_from_kld), bos)
        windows = windows[: args.kld_windows or len(windows)]
        score_from = n_ctx // 2

    # The two facts the off-grid reference rests on.
    probe = held[: args.window + 1][None, :-1]
    with torch.no_grad():
        a, b = build(plain)(probe).double(), build(reference)(probe).double()
    pa, pb = F.log_softmax(a, -1), F.log_softmax(b, -1)
    moved = {"max |logit change|": float((a - b).abs().max()), "KL(plain || off-grid)": float((pa.exp() * (pa - pb)).sum(-1).mean())}
    grid = {"on-grid groups, plain": sum(on_grid_fraction(plain[n]) for n in names) / len(names),
            "on-grid groups, off-grid": sum(on_grid_fraction(reference[n]) for n in names) / len(names)}
    for k, v in {**moved, **grid}.items():
        print(f"{k}: {v:.3g}", flush=True)

    if args.write_reference_gguf:
        from models.gemma3.reference_gguf import write_f32_gguf

        write_f32_gguf(_user_path(args.write_reference_gguf), path, reference, config)
        print(f"wrote {args.write_reference_gguf}")
        return 0

    from llmq.quant import QuantConfig

    wanted = [v for v in args.variants.split(",") if v]
    variants: Dict[str, Dict[str, torch.Tensor]] = {}
    bpw: Dict[str, float] = {}
    importance = None
    hessians: Dict[str, torch.Tensor] = {}
    if args.hessians and os.path.exists(_user_path(args.hessians)) and not (
            {"imatrix", "imatrix-g64", "budget", "budget-rel", "search-imatrix"} & set(wanted)):
        hessians = {f"{m}.weight": h for m, h in torch.load(_user_path(args.hessians), weights_only=True).items()}
        print(f"H of {len(hessians)} linears read from {args.hessians}", flush=True)
    elif {"imatrix", "imatrix-g64", "budget", "budget-rel", "search-imatrix"} & set(wanted) or gptq_variants(wanted):
        from llmq.quant.importance import collect_calibration, token_batches

        calib = token_ids(args.calibration_text, args.calibration_tokens)
        t0 = time.time()
        calibration = collect_calibration(build(reference), token_batches(calib, args.window), sample_rows=0,
                                          hessians=bool(gptq_variants(wanted)))
        importance = calibration.importance
        hessians = {f"{m}.weight": h for m, h in calibration.hessians.items()}
        if args.hessians and hessians:
            torch.save(calibration.hessians, _user_path(args.hessians))
        print(f"importance{' and H' if hessians else ''} from {len(calib)} calibration tokens in "
              f"{time.time() - t0:.0f} s", flush=True)
    int4 = QuantConfig(bits=4, group_size=32, symmetric=True)
    simple = {"rtn": int4, "search": QuantConfig(bits=4, group_size=32, symmetric=True, method="search"),
              "hqq": QuantConfig(bits=4, group_size=32, symmetric=False, method="hqq"),
              "int8": QuantConfig(bits=8, group_size=32, symmetric=True)}
    for name in wanted:
        t0 = time.time()
        if name in simple:
            variants[name], bpw[name] = llmq_variant(reference, names, lambda n, c=simple[name]: c, storage)
        elif name == "search-imatrix":  # the error search minimising the importance-weighted error
            qconfig = QuantConfig(bits=4, group_size=32, symmetric=True, method="search")
            variants[name], bpw[name] = llmq_variant(reference, names, lambda n, c=qconfig: c, storage,
                                                     importance={n: importance[n[: -len(".weight")]] for n in names})
        elif name in ("imatrix", "imatrix-g64"):  # HQQ minimising the importance-weighted error
            qconfig = simple["hqq"] if name == "imatrix" else QuantConfig(bits=4, group_size=64, symmetric=False,
                                                                           method="hqq")
            variants[name], bpw[name] = llmq_variant(reference, names, lambda n, c=qconfig: c, storage,
                                                     importance={n: importance[n[: -len(".weight")]] for n in names})
        elif name == "gptq-seq":  # gptq's sequential form: each layer's H from the quantized layers before it
            variants[name], bpw[name] = sequential_gptq(ARCHITECTURE, config, reference, names,
                                                        token_ids(args.calibration_text, args.calibration_tokens),
                                                        GPTQ_CONFIGS["gptq"], storage)
        elif name in GPTQ_CONFIGS:  # error-compensating rounding against each layer's H (float inputs)
            variants[name], bpw[name] = llmq_variant(reference, names, lambda n, c=GPTQ_CONFIGS[name]: c, storage,
                                                     hessians=hessians)
        elif name == "gptq-budget":  # per matrix the gptq option with the least relative output error that fits
            from llmq.quant.budget import Option, choose, output_error

            for c in GPTQ_BUDGET_OPTIONS:  # (what budget.measure_options(..., hessian=) measures, kept for reuse)
                llmq_variant(reference, names, lambda n, c=c: c, storage, hessians=hessians)
            options = {}
            for n in names:
                energy = output_error(reference[n], torch.zeros_like(reference[n]), hessians[n])
                options[n] = []
                for c in GPTQ_BUDGET_OPTIONS:
                    config = dataclasses.replace(c, scale_dtype=storage(c).scale_dtype)
                    approx, bits = _QUANTIZED[(n, config, False)]
                    options[n].append(Option(config, bits, output_error(reference[n], approx, hessians[n]) / energy))
            for budget in (float(b) for b in args.budget_bits_per_weight.split(",")):
                choice = choose(options, {n: reference[n].numel() for n in names}, budget)
                chosen = {n: options[n][i].config for n, i in choice.items()}
                counts = {}
                for c in chosen.values():
                    counts[c.describe()] = counts.get(c.describe(), 0) + 1
                print(f"{name} {budget}: {counts}", flush=True)
                key = f"{name}@{budget:g}"
                variants[key], bpw[key] = llmq_variant(reference, names, chosen.__getitem__, storage,
                                                       hessians=hessians)
            print(f"{name}: measured and quantized in {time.time() - t0:.0f} s", flush=True)
            continue
        elif name in ("budget", "budget-rel"):
            from llmq.quant.budget import choose, measure_options

            candidates = [QuantConfig(bits=b, group_size=g, symmetric=False, method="hqq")
                          for b, g in ((3, 32), (4, 128), (4, 64), (4, 32), (5, 32), (6, 32), (8, 32))]
            if name == "budget-rel":  # relative (per-layer output SNR) objective, symmetric search options too
                candidates = [QuantConfig(bits=b, group_size=32, symmetric=True, method="search")
                              for b in (3, 4, 5, 6, 8)] + [
                    QuantConfig(bits=b, group_size=g, symmetric=False, method="hqq")
                    for b, g in ((3, 32), (4, 128), (4, 64), (4, 32), (5, 32))]
            options = {n: measure_options(n, reference[n], candidates, importance=importance[n[: -len(".weight")]],
                                          relative=name == "budget-rel", storage=storage)
                       for n in names}
            for budget in (float(b) for b in args.budget_bits_per_weight.split(",")):
                choice = choose(options, {n: reference[n].numel() for n in names}, budget)
                chosen = {n: options[n][i].config for n, i in choice.items()}
                counts: Dict[str, int] = {}
                for c in chosen.values():
                    counts[c.describe()] = counts.get(c.describe(), 0) + 1
                print(f"{name} {budget}: {counts}", flush=True)
                key = f"{name}@{budget:g}"
                variants[key], bpw[key] = llmq_variant(reference, names, chosen.__getitem__, storage,
                                                       importance={n: importance[n[: -len(".weight")]] for n in names})
            continue
        else:
            raise SystemExit(f"error: --variants: unknown {name!r}")
        print(f"{name}: quantized in {time.time() - t0:.0f} s, {bpw[name]:.3f} bpw", flush=True)
    if args.llama_cpp:
        import gguf

        table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
        gguf_names = {n: table.get_name(n[: -len(".weight")]) + ".weight" for n in names}
        for spec in args.llama_cpp:
            name, _, file = spec.partition("=")
            out, bits, types = gguf_variant(_user_path(file), names, gguf_names, reference)
            variants[name], bpw[name] = out, bits
            print(f"{name}: {bits:.3f} bpw, tensor types {types}", flush=True)

    for spec in args.dequantized:  # e.g. a variant quantized in parallel processes, layer ranges per file
        from safetensors import safe_open

        name, _, files = spec.partition("=")
        out, bits, count = {}, 0, 0
        for file in files.split(","):
            with safe_open(_user_path(file), "pt") as f:
                out.update({n: f.get_tensor(n) for n in f.keys()})
                meta = f.metadata()
                bits, count = bits + int(meta["bits"]), count + int(meta["count"])
        missing = sorted(set(names) - set(out))
        if missing:
            raise SystemExit(f"error: --dequantized {name}: {len(missing)} projections missing, e.g. {missing[0]}")
        variants[name], bpw[name] = out, bits / count
        print(f"{name}: {bpw[name]:.3f} bpw, read from {files}", flush=True)
    for spec in args.compressed_tensors:
        name, _, folder = spec.partition("=")
        variants[name], bpw[name] = compressed_tensors_variant(_user_path(folder), names)
        print(f"{name}: {bpw[name]:.3f} bpw as stored in {folder}", flush=True)

    t0 = time.time()
    results = Evaluator(build, reference, windows, score_from=score_from).run(variants)
    print(f"evaluated {len(variants)} variants on {results['reference']['tokens']} tokens in {time.time() - t0:.0f} s\n")
    print("| variant | bpw | mean KL (nats) | perplexity | top-1 agreement |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        b = "-" if name == "reference" else f"{bpw[name]:.3f}"
        kl = "0" if name == "reference" else f"{r['mean_kl']:.4f}"
        print(f"| {name} | {b} | {kl} | {r['ppl']:.3f} | {r['top1']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
