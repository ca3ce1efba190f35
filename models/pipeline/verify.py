"""--verify: the written output against the unquantized model, layer by layer, at every size.

Three models run the verification prompt (VERIFY_TOKENS deterministic token ids) side by side, one
decoder layer of each in memory at a time (models/pipeline/layerwise.py), never any of them whole:

* the reference: the input (from a GGUF file: the GGUF model itself, its quantized weights
  dequantized exactly);
* the quantized model: the output as its backend reads it back (``backend.reload_stream``; the
  bundle reads only the layer asked for, other backends give their reload);
* round-to-nearest: the reference's weights rounded to nearest ("minmax") in the very formats the
  recipe chose for them, on the fly: what the same formats cost on this model with no method at all.

The quantized model's and round-to-nearest's linears compute with the compiled integer kernel
llmq::quantized_linear (llmq.ops.dense_op: INT4/INT8 in the MoE kernel's tiles, the activations
rounded to int8 per row and weight group) where its library loads, instead of dequantizing every
weight on every call (`quantized_linears`); both sides alike, so the rule below compares like with
like. The reference always dequantizes exactly (a GGUF input's blocks). Where the library is absent
(outside Bazel or the wheel) one line says so and every linear dequantizes.

Numbers on the logits: cosine, SQNR, KL(reference || quantized) per token (mean and max), top-1
agreement, for the quantized model and for round-to-nearest; the hidden states' SQNR after every
layer (where an error enters). The rule (`verdict`): the output fails when its logits are not
finite, or when its noise, on the logits or on the hidden states after any layer, is more than
RTN_NOISE_MARGIN times that of round-to-nearest of the same formats there (its SQNR more than
10*log10(RTN_NOISE_MARGIN) = 6 dB under round-to-nearest's; the per-layer check matters where
round-to-nearest's logits are already near noise, as on a small random model, and the logits saturate). A method
(hqq, search, gptq) does better than round-to-nearest, a correct write of round-to-nearest equals
it; a broken write or pack (wrong bits, scales, layout) is far worse. So the bar is the formats'
own error on this model, not a fixed cosine: a small random model whose int4 logits reach cosine
0.73 passes when round-to-nearest int4 gives the same, and says so. ``--verify_min_cosine``, when
given, is an extra floor.

Where the checkpoint is at most GREEDY_LIMIT_BYTES, greedy tokens and the input tokenizer's text
check run too (layer by layer: each new token re-reads the model's layers, cheap while its file
stays in the page cache; each layer keeps its KV or recurrent state, so a new token runs alone);
where it is at most WHOLE_MODEL_LIMIT_BYTES, the backend's consumer check (e.g. mlx_lm.load) and
--use_moe_quantized_op, which need both models whole. Progress (layers, ETA) goes
to stderr; the step's time is in the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from llmq.quant import QuantRecipe, dequantize, modules, quantize_weight
from llmq.quant.formats import get_format
from llmq.quant.row_blocks import RowBlocks
from models.common.generation import generate
from models.common.text_check import DEFAULT_PROMPT, text_agreement, text_rows
from models.common.tokenizer import has_tokenizer, load_tokenizer
from models.pipeline import layerwise
from models.pipeline.agreement import verification_prompt
from models.pipeline.arch import Architecture, quantizable_module
from models.pipeline.progress import Progress
from models.pipeline.quantized_model import build_quantized_model

VERIFY_TOKENS = 16
GREEDY_TOKENS = 8
RTN_NOISE_MARGIN = 4.0  # the quantized logits' noise may be up to this many times round-to-nearest's (6 dB)
GREEDY_LIMIT_BYTES = 4 << 30
WHOLE_MODEL_LIMIT_BYTES = 4 << 30


def step(message: str) -> None:
    """What a long step is doing, as it starts."""
    print(message, flush=True)


def logits_numbers(reference: torch.Tensor, got: torch.Tensor) -> Dict[str, Any]:
    """cosine, SQNR, KL(reference || got) per token (mean, max), top-1 agreement of two logits [.., T, V]."""
    ref, out = reference.double().reshape(-1, reference.shape[-1]), got.double().reshape(-1, got.shape[-1])
    finite_ref, finite_got = bool(torch.isfinite(ref).all()), bool(torch.isfinite(out).all())
    noise = (ref - out).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return {
        "cosine": torch.nn.functional.cosine_similarity(ref.flatten(), out.flatten(), dim=0).item(),
        "sqnr_db": math.inf if noise == 0 else 10 * math.log10(signal / noise) if signal > 0 else -math.inf,
        "noise": noise,
        "signal": signal,
        "max_abs_error": (ref - out).abs().max().item(),
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1_agreement": (ref.argmax(-1) == out.argmax(-1)).double().mean().item(),
        "finite_reference": finite_ref,
        "finite_quantized": finite_got,
    }


def verdict(check: Dict, *, rtn: Optional[Dict] = None, layers: Optional[List[Dict]] = None,
            min_cosine: Optional[float] = None, margin: float = RTN_NOISE_MARGIN) -> Optional[str]:
    """Why a verification result means a broken output (None: it passed); see the module docstring."""
    if not check.get("finite_quantized", True):
        return "the quantized model's logits are not finite (NaN/Inf)"
    if not check.get("finite_reference", True):
        return "the unquantized reference model's logits are not finite (NaN/Inf)"
    cosine = check["cosine"]
    if math.isnan(cosine):
        return "logits cosine is NaN"
    if rtn is not None and "noise" in check:
        # a floor for outputs that round nothing (round-to-nearest exact): float rounding of the logits
        allowed = margin * rtn["noise"] + 1e-10 * check["signal"]
        if check["noise"] > allowed:
            return (f"logits noise {_ratio(check, rtn)} that of round-to-nearest of the same formats (SQNR "
                    f"{check['sqnr_db']:.1f} dB vs {rtn['sqnr_db']:.1f} dB; allowed: {margin:g}x): worse than "
                    "the plainest rounding of these formats, a fault in the output, not the formats' error")
    for layer in layers or ():
        # the hidden states after each layer: where round-to-nearest's logits are already noisy (a small
        # random model), the logits saturate, the residual stream of the first layers does not
        if layer["noise"] > margin * layer["rtn_noise"] + 1e-10 * layer["signal"]:
            return (f"hidden states after layer {layer['layer']}: noise {layer['noise'] / max(layer['rtn_noise'], 1e-300):.2f}x "
                    f"that of round-to-nearest of the same formats (SQNR {layer['sqnr_db']:.1f} dB vs "
                    f"{layer['rtn_sqnr_db']:.1f} dB; allowed: {margin:g}x): a fault in the output, not the formats' error")
    if min_cosine is not None and cosine < min_cosine:
        return f"logits cosine {cosine:.5f} is under {min_cosine} (--verify_min_cosine)"
    return None


KERNEL_NOTE = ("note: verify: the compiled kernel llmq::quantized_linear (//cpp/moe:_moe_kernel.so) is not loadable "
               "here; the quantized side dequantizes its weights on every call (slower; build it with Bazel or "
               "install the wheel)")


@contextlib.contextmanager
def quantized_linears(use_kernel: bool = True) -> Iterator[str]:
    """Inside, every QuantizedLinear computes with llmq::quantized_linear where the kernel takes its
    weight (llmq.ops.install_dense_kernel) and the library loads (else KERNEL_NOTE is printed and
    they dequantize); yields how they compute, one line. The kernel installed before is restored."""
    old = modules.linear_kernel()
    how = "dequantized weights on every call"
    try:
        if use_kernel:
            from llmq.ops import dense_op

            if dense_op.install_dense_kernel():
                how = ("llmq::quantized_linear (compiled INT4/INT8 kernel, activations rounded to int8 per group; "
                       "other formats dequantize)")
            else:
                print(KERNEL_NOTE, flush=True)
        yield how
    finally:
        modules.set_linear_kernel(old)


def _ratio(check: Dict, rtn: Dict) -> str:
    if rtn["noise"] == 0:
        return "above zero, unlike" if check["noise"] > 0 else "zero, like"
    return f"{check['noise'] / rtn['noise']:.2f}x"


def pass_reason(check: Dict, rtn: Dict, margin: float = RTN_NOISE_MARGIN) -> str:
    return (f"passed: logits noise {_ratio(check, rtn)} that of round-to-nearest of the same formats (at most "
            f"{margin:g}x; cosine {check['cosine']:.4f} vs {rtn['cosine']:.4f}, SQNR {check['sqnr_db']:.1f} vs "
            f"{rtn['sqnr_db']:.1f} dB)")


class RoundToNearest:
    """The reference's tensors with every matrix the recipe quantizes rounded to nearest ("minmax",
    the format's plain method) in its chosen format; the embedding and the head by row blocks."""

    def __init__(self, tensors: layerwise.LayerTensors, recipe: QuantRecipe, num_layers: int, *,
                 requantize: bool = False):
        self.tensors = tensors
        self.recipe = recipe.bind(num_layers)
        self.requantize = requantize  # a GGUF input's blocks are rounded again, as the run did

    def group(self, group: layerwise.Group) -> Dict[str, Any]:
        return {name: self._round(name, value) for name, value in self.tensors.group(group).items()}

    def _round(self, name: str, value: Any) -> Any:
        module = quantizable_module(name)
        config = self.recipe.get_config(module) if module is not None else None
        if config is not None and self.requantize and not isinstance(value, (torch.Tensor, RowBlocks)):
            value = dequantize(value)
        if config is None or not (isinstance(value, RowBlocks) or
                                  (isinstance(value, torch.Tensor) and value.is_floating_point())):
            return value  # kept as is by the recipe, or already quantized in the input (a GGUF's blocks)
        if "minmax" in get_format(config.format).methods:
            config = dataclasses.replace(config, method="minmax", options=None)  # a gptq rule's options go too
        if name in (layerwise.EMBED_WEIGHT, layerwise.HEAD_WEIGHT):
            return layerwise.RoundedRows(value, config, name)
        return quantize_weight(value.whole() if isinstance(value, RowBlocks) else value, config, name=name)


class LayerwiseLM(nn.Module):
    """A LayerwiseModel as models.common.generation.generate and text_agreement call a model
    (``new_cache()``, ``forward(ids, cache)``): each call builds the layers one at a time again, and
    with a cache runs only the new tokens through each (its KV or recurrent state kept per layer:
    tokens x layers of small state, never a layer's weights)."""

    class _Cache:
        def __init__(self, states: List[Any]):
            self.layers = states
            self.position = 0

    def __init__(self, model: layerwise.LayerwiseModel, exact: bool = False):
        super().__init__()
        self.layerwise = model
        self.exact = exact  # the reference: its quantized linears (a GGUF's blocks) dequantize, kernel or not

    def new_cache(self, batch_size: int = 1):
        return LayerwiseLM._Cache([layer.new_state() for layer in self.layerwise.skeleton.model.layers])

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
        model = self.layerwise
        position = 0 if cache is None else cache.position
        hidden = model.embed([input_ids])
        for i in range(model.num_layers):
            with model.layer(i) as layer, (modules.reference_linears() if self.exact else contextlib.nullcontext()):
                hidden = model.run_layer(layer, hidden, position, None if cache is None else [cache.layers[i]])
        if cache is not None:
            cache.position += input_ids.shape[1]
        return model.logits(hidden)[0]


def _quantized_side(arch: Architecture, config, backend, job, path: str) -> layerwise.LayerwiseModel:
    skeleton = arch.build_model(config, device="meta")
    tensors = layerwise.LayerTensors(lambda only: backend.reload_stream(path, job, only),
                                     selective=backend.reloads_selectively,
                                     expected=layerwise.expected_groups(skeleton))
    return layerwise.LayerwiseModel(skeleton, tensors)


@torch.no_grad()
def compare_layerwise(reference: layerwise.LayerwiseModel, quantized: layerwise.LayerwiseModel,
                      rounded: layerwise.LayerwiseModel, prompt: torch.Tensor,
                      progress: Optional[Progress] = None) -> Tuple[Dict, Dict, List[Dict]]:
    """(quantized numbers, round-to-nearest numbers, per-layer hidden SQNR) on `prompt` [1, T]."""
    models = (reference, quantized, rounded)
    hidden = [m.embed([prompt]) for m in models]
    per_layer = []
    for i in range(reference.num_layers):
        for k, m in enumerate(models):  # the reference first: round-to-nearest reuses its tensors (keep_last)
            with m.layer(i) as layer, (modules.reference_linears() if k == 0 else contextlib.nullcontext()):
                hidden[k] = m.run_layer(layer, hidden[k])
        ref = hidden[0][0].double()
        noise, rtn_noise = _noise(ref, hidden[1][0]), _noise(ref, hidden[2][0])
        signal = ref.pow(2).sum().item()
        per_layer.append({"layer": i, "noise": noise, "rtn_noise": rtn_noise, "signal": signal,
                          "sqnr_db": _db(signal, noise), "rtn_sqnr_db": _db(signal, rtn_noise)})
        if progress is not None:
            progress.advance()
    logits = [m.logits(h)[0] for m, h in zip(models, hidden)]
    if progress is not None:
        progress.advance()
    return logits_numbers(logits[0], logits[1]), logits_numbers(logits[0], logits[2]), per_layer


def _noise(ref: torch.Tensor, got: torch.Tensor) -> float:
    return (ref - got.double()).pow(2).sum().item()


def _db(signal: float, noise: float) -> float:
    return math.inf if noise == 0 else 10 * math.log10(max(signal, 1e-300) / noise)


def verify(arch: Architecture, config, model_input, backend, job, path: str, reference_stream: Callable, *,
           recipe: QuantRecipe, seed: int, min_cosine: Optional[float] = None,
           use_moe_op: bool = False, requantized_input: bool = False,
           use_kernel: bool = True) -> Tuple[List[Tuple[str, str]], Dict, Optional[str]]:
    """(summary rows, numbers, failure or None). requantized_input: the run quantized a GGUF input's blocks
    again (--requantize_gguf, or a backend that quantizes float tensors itself), so round-to-nearest
    rounds their dequantized values too instead of keeping them. use_kernel: the quantized linears of the
    layer-by-layer comparison and the greedy tokens compute with the compiled kernel where it loads
    (`quantized_linears`); False: they dequantize (the reference path, e.g. to time the difference)."""
    start = time.perf_counter()
    with quantized_linears(use_kernel) as linears:
        rows, result, failure = _layerwise_checks(arch, config, model_input, backend, job, path, recipe=recipe,
                                                  seed=seed, min_cosine=min_cosine,
                                                  requantized_input=requantized_input)
    rows.append(("quantized linears", linears))
    size = model_input.size_bytes
    whole = size <= WHOLE_MODEL_LIMIT_BYTES
    if failure is None and (backend.checks_consumer or use_moe_op):
        if not whole:
            rows.append(("whole-model checks", f"not run: the checkpoint ({size / 2**30:.1f} GiB) is over "
                                               f"{WHOLE_MODEL_LIMIT_BYTES / 2**30:.0f} GiB"))
        else:
            failure = _whole_model_checks(arch, config, backend, job, path, reference_stream, seed, use_moe_op, rows,
                                          result)
    seconds = time.perf_counter() - start
    result["verify_seconds"] = seconds
    result["quantized_linears"] = linears
    rows.append(("verification", ("FAILED: " + failure if failure else pass_reason(result, result["rtn"])) +
                 f" [{seconds:.1f} s]"))
    return rows, result, failure


def _layerwise_checks(arch: Architecture, config, model_input, backend, job, path: str, *, recipe: QuantRecipe,
                      seed: int, min_cosine: Optional[float], requantized_input: bool
                      ) -> Tuple[List[Tuple[str, str]], Dict, Optional[str]]:
    """The checks that run layer by layer: the three models side by side, then greedy tokens and text."""
    num_layers = arch.num_layers(config)
    reference = layerwise.from_input(arch, config, model_input)
    reference.tensors.keep_last = True
    rounded = layerwise.LayerwiseModel(arch.build_model(config, device="meta"),
                                       RoundToNearest(reference.tensors, recipe, num_layers,
                                                      requantize=requantized_input))  # type: ignore[arg-type]
    quantized = _quantized_side(arch, config, backend, job, path)
    if model_input.from_gguf:
        print("verification reference: the GGUF model, its quantized weights dequantized")
    step(f"verify: {num_layers} layers of the unquantized model, the output at {path} and round-to-nearest of the "
         f"same formats, side by side on a {VERIFY_TOKENS}-token prompt")
    bar = Progress("verify", num_layers + 1, "layers")
    prompt = verification_prompt(config.vocab_size, seed, VERIFY_TOKENS)
    check, rtn, per_layer = compare_layerwise(reference, quantized, rounded, prompt, bar)
    result: Dict[str, Any] = dict(check, rtn=rtn, layers=per_layer)
    worst = min(per_layer, key=lambda r: r["sqnr_db"] - r["rtn_sqnr_db"]) if per_layer else None
    rows = [
        ("logits cosine", f"{check['cosine']:.5f} (round-to-nearest of the same formats: {rtn['cosine']:.5f})"),
        ("logits SQNR", f"{check['sqnr_db']:.1f} dB (round-to-nearest: {rtn['sqnr_db']:.1f} dB)"),
        ("KL per token", f"mean {check['kl_mean']:.4g}, max {check['kl_max']:.4g} nats (round-to-nearest: mean "
                         f"{rtn['kl_mean']:.4g})"),
        ("top-1 agreement", f"{check['top1_agreement']:.3f} of {VERIFY_TOKENS} tokens (round-to-nearest: "
                            f"{rtn['top1_agreement']:.3f})"),
    ]
    if worst is not None:
        rows.append(("hidden SQNR by layer", f"last {per_layer[-1]['sqnr_db']:.1f} dB; furthest under "
                                             f"round-to-nearest: layer {worst['layer']} ({worst['sqnr_db']:.1f} vs "
                                             f"{worst['rtn_sqnr_db']:.1f} dB)"))
    failure = verdict(check, rtn=rtn, layers=per_layer, min_cosine=min_cosine)
    size = model_input.size_bytes
    if failure is None and size <= GREEDY_LIMIT_BYTES:
        step(f"verify: {GREEDY_TOKENS} greedy tokens from each model (layer by layer)")
        ref_lm, q_lm = LayerwiseLM(reference, exact=True), LayerwiseLM(quantized)
        reference.tensors.keep_last = False
        result["tokens_reference"] = generate(ref_lm, prompt, GREEDY_TOKENS)[0, VERIFY_TOKENS:].tolist()
        result["tokens_quantized"] = generate(q_lm, prompt, GREEDY_TOKENS)[0, VERIFY_TOKENS:].tolist()
        rows += [("greedy (unquantized)", " ".join(map(str, result["tokens_reference"]))),
                 ("greedy (quantized)", " ".join(map(str, result["tokens_quantized"])))]
        if model_input.kind != "embedded" and has_tokenizer(model_input.path):
            tokenizer, skipped = _text_check_tokenizer(model_input.path, config.vocab_size)
            if skipped:
                rows.append(("text check", f"not run: {skipped}"))
            else:
                step(f"verify: the input's tokenizer turns {DEFAULT_PROMPT!r} into ids; greedy text from both models")
                text = text_agreement(tokenizer, ref_lm, q_lm)
                result["text"] = text
                rows += text_rows(text)
    elif failure is None:
        rows.append(("greedy tokens", f"not run: the checkpoint ({size / 2**30:.1f} GiB) is over "
                                      f"{GREEDY_LIMIT_BYTES / 2**30:.0f} GiB (each token re-reads the model)"))
    return rows, result, failure


def _whole_model_checks(arch, config, backend, job, path, reference_stream, seed, use_moe_op, rows, result):
    """The checks that need both models whole: the backend's consumer check, the MoE op."""
    failure = None
    step("verify: both models whole in memory for the consumer check / MoE op")
    reference = build_quantized_model(arch.build_model(config, device="meta"), dict(reference_stream()))
    reloaded = backend.reload(path, job)
    quantized = build_quantized_model(arch.build_model(config, device="meta"), reloaded)
    if backend.checks_consumer:
        step(f"verify: loading {path} as its consumer does (--backend {backend.name}) and comparing its logits")
        consumer_rows, consumer_result = backend.check_consumer(path, job, reference, quantized,
                                                                verification_prompt(config.vocab_size, seed))
        rows += consumer_rows
        result.update(consumer_result)
        if "consumer_text" in consumer_result:  # the quantized greedy text as the consumer itself generates it
            rows[:] = [(f"greedy text (quantized, {consumer_result['consumer']['consumer']})",
                        repr(consumer_result["consumer_text"])) if label == "greedy text (quantized)" else (label, value)
                       for label, value in rows]
        failure = consumer_result.get("failure")
    if use_moe_op and failure is None:
        from models.pipeline.agreement import compare_logits
        from models.pipeline.moe_op_swap import swap_in_moe_op

        with_op = build_quantized_model(arch.build_model(config, device="meta"), reloaded)
        swapped = swap_in_moe_op(with_op, "--use_moe_quantized_op")
        step("verify: running the MoE blocks through torch.ops.llmq.quantized_moe_ffn")
        op_check = compare_logits(quantized, with_op, vocab_size=config.vocab_size, seed=seed)
        result["moe_op"] = dict(op_check, blocks=len(swapped))
        rows += [
            ("MoE op blocks", f"{len(swapped)} via torch.ops.llmq.quantized_moe_ffn"),
            ("op vs eager quantized", f"cosine {op_check['cosine']:.6f}, SQNR {op_check['sqnr_db']:.1f} dB"),
            ("greedy (quantized, op)", " ".join(map(str, op_check["tokens_quantized"]))),
        ]
    return failure


def _text_check_tokenizer(path: str, vocab_size: int):
    """(the input's tokenizer, None), or (None, why the text check is skipped): a tokenizer that
    cannot be built (e.g. hostile GGUF tokenizer metadata) or that gives ids outside the model."""
    try:
        tokenizer = load_tokenizer(path)
    except ValueError as e:  # e.g. a GGUF vocabulary of a tokenizer kind transformers cannot build
        return None, str(e)
    outside = [int(i) for i in tokenizer.encode(DEFAULT_PROMPT) if not 0 <= int(i) < vocab_size]
    if outside:
        return None, f"the tokenizer gives id {outside[0]} for the prompt, outside the model's vocabulary of {vocab_size}"
    return tokenizer, None
