"""The Hugging Face export backends: a quantized HF folder in the ModelOpt style (hf_quant_config.json;
vLLM, TensorRT-LLM) or the compressed-tensors style (vLLM, transformers), written by
llmq.export.write_hf_quantized_checkpoint (docs/export.md).

The export quantizes by itself (takes_float): it receives the unquantized model-layout stream, turns
each tensor into its HF names (job.to_hf) and asks job.recipe for each module's format. A recipe names
fused experts (`<p>.experts.gate_up_proj`, `<p>.experts.down_proj`); the export quantizes them per
expert (`<p>.experts.<e>.gate_proj`, ...), so those names are looked up as their fused module.
Embeddings, lm_head, MoE routers and shared-expert gates stay in high precision (the export's
default, what vLLM and TensorRT-LLM load).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from llmq.backend import Backend, BackendError, WriteJob, register_backend
from llmq.quant.formats import format_names, get_format
from llmq.quant.storage import Storage

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.\d+\.(?P<leaf>gate_proj|up_proj|down_proj)$")


def config_for_hf_module(job: WriteJob) -> Callable[[str], Any]:
    """HF module fqn -> the recipe's config (or None): per-expert modules as their fused stack."""
    bound = job.recipe.bind(job.num_layers)

    def lookup(fqn: str):
        m = _PER_EXPERT.match(fqn)
        if m is not None:
            fused = "gate_up_proj" if m["leaf"] in ("gate_proj", "up_proj") else "down_proj"
            return bound.get_config(f"{m['prefix']}.{fused}")
        return bound.get_config(fqn)

    return lookup


def hf_stream(stream: Iterable[Tuple[str, Any]], job: WriteJob) -> Iterator[Tuple[str, torch.Tensor]]:
    for name, value in stream:
        yield from job.to_hf(name, value).items()


def _text_config(hf_config) -> Dict[str, Any]:
    """The folder holds the text model only: a multimodal config.json is replaced by its text_config."""
    hf_config = dict(hf_config)
    text = hf_config.get("text_config")
    return dict(text) if isinstance(text, dict) else hf_config


def _high_precision_dtype(path: str) -> torch.dtype:
    """The dtype the folder keeps unquantized weights in (its first float `.weight`), float32 if none:
    decoded weights are cast to it, as the consumer's model holds them."""
    from safetensors import safe_open

    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as st:
                for k in st.keys():
                    dtype = names.get(st.get_slice(k).get_dtype())
                    if k.endswith(".weight") and dtype is not None:
                        return dtype
    return torch.float32


def read_folder(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a folder's *.safetensors files."""
    from safetensors import safe_open

    tensors: Dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as st:
                for k in st.keys():
                    tensors[k] = st.get_tensor(k)
    return tensors


def hf_storage(config: Any, style: str) -> Storage:
    """What the folder holds for a weight quantized with `config`: the export spec's tensors
    (llmq.export.WeightExportSpec.tensor_dtypes / tensor_shapes: codes, scales, global scales, zero
    points, the weight shape), once per expert for stacked experts. Integer scales are float32."""
    from llmq.export import make_spec

    spec = make_spec("weight", config, style=style)

    def tensors(scale_dtype: torch.dtype, shape):
        *lead, n, k = shape
        copies = math.prod(lead)
        shapes = spec.tensor_shapes(n, k)
        return {role: (dtype, (copies,) + tuple(shapes[role])) for role, dtype in spec.tensor_dtypes().items()}

    return Storage(scale_dtype=torch.float32, tensors=tensors)


def _count_written(stream: Iterable[Tuple[str, Any]], lookup: Callable[[str], Any], style: str, into: List[int]):
    """Pass the HF stream through, adding to `into` [bits, weights] what the export writes for each
    weight it quantizes (every 2-D `.weight` and each expert of fused experts the recipe gives a config)."""
    from llmq.export import iter_module_weights

    for name, tensor in stream:
        probe = torch.empty(tuple(tensor.shape), dtype=torch.float32, device="meta")  # shapes only
        for module, part in iter_module_weights([(name, probe)]):
            config = lookup(module)
            if config is not None:
                into[0] += hf_storage(config, style).bits(tuple(part.shape))
                into[1] += part.numel()
        yield name, tensor


class HfExportBackend(Backend):
    takes_float = True
    checks_consumer = True  # the folder read back as its consumer reads it (llmq.export.verify_export)
    streams_row_blocks = True  # write_hf_quantized_checkpoint quantizes and writes row blocks block by block

    def __init__(self, style: str, name: str, description: str):
        self.style, self.name, self.description = style, name, description
        self._summaries: Dict[str, Any] = {}
        self._written: Dict[str, Tuple[int, int]] = {}

    def storage(self, config: Any, job: Optional[WriteJob]) -> Storage:
        return hf_storage(config, self.style)

    def check(self, job: WriteJob) -> None:
        """ModelOpt NVFP4 is refused: what llmq writes is weight-only (W4A16_NVFP4, no input_scale), and
        ModelOpt's NVFP4 readers (vLLM, TensorRT-LLM, compressed-tensors' ModelOptNvfp4Converter) take
        W4A4 NVFP4 with a calibrated input_scale per module; transformers has no ModelOpt reader."""
        if self.style != "modelopt":
            return
        for rule in getattr(job.recipe, "rules", ()):
            if rule.config is not None and rule.config.format == "nvfp4":
                raise BackendError(
                    f"--backend {self.name}: recipe rule {rule.pattern!r} is nvfp4, which ModelOpt's readers (vLLM, "
                    "TensorRT-LLM, compressed-tensors' ModelOptNvfp4Converter) load only with a calibrated input_scale "
                    "(W4A4) and llmq writes weight-only NVFP4; use --backend hf-compressed-tensors (NVFP4A16, loaded by "
                    "transformers and vLLM)")

    def recipe_for(self, recipe: Any) -> Any:
        """The recipe with the modules the export keeps in high precision (embeddings, lm_head, MoE routers
        and shared-expert gates: llmq.export's DEFAULT_KEEP_UNQUANTIZED, what vLLM and TensorRT-LLM load
        as plain layers) kept first, so the counts and estimates say what the folder holds."""
        from llmq.export.writer import DEFAULT_KEEP_UNQUANTIZED
        from llmq.quant import QuantRecipe, QuantRule

        return QuantRecipe([QuantRule(p, None) for p in DEFAULT_KEEP_UNQUANTIZED] + list(recipe.rules),
                           num_layers=getattr(recipe, "num_layers", None))

    def written_bits(self, path: str) -> Tuple[int, int]:
        """(bits, weights) of the weights the export quantized into `path` (counted by `storage`)."""
        return self._written.pop(path, (0, 0))

    @property
    def accepts_formats(self) -> Tuple[str, ...]:
        """The registered formats whose HF export hook writes this style (asked of the registry at each
        call, so a format registered later is written too)."""
        return tuple(n for n in format_names(quantizable=True)
                     if get_format(n).hf_export is not None and self.style in get_format(n).hf_export.styles)

    def write(self, stream: Iterable[Tuple[str, Any]], job: WriteJob) -> str:
        from llmq.export import write_hf_quantized_checkpoint

        extra = [f for f in job.source_files if os.path.basename(f) != "config.json"]  # config.json: written here
        written = [0, 0]
        lookup = config_for_hf_module(job)
        summary = write_hf_quantized_checkpoint(
            job.out, _count_written(hf_stream(stream, job), lookup, self.style, written), lookup, style=self.style,
            config=_text_config(job.hf_config), max_shard_bytes=job.max_shard_bytes, extra_files=extra,
            resume=job.resume, add_files=job.add_files)
        self._summaries[summary.folder] = summary
        self._written[summary.folder] = (written[0], written[1])
        return summary.folder

    def summary(self, path: str, job: WriteJob) -> List[Tuple[str, str]]:
        s = self._summaries.pop(path, None)
        if s is None:
            return []
        rows = [("quantized modules", f"{s.quantized_modules} ({self.style} style)"),
                ("kept in high precision", f"{len(s.excluded_modules)} modules")]
        if s.model_dtype:
            rows.append(("model dtype", f"{s.model_dtype} in config.json (compressed-tensors unpacks FP4 weights to "
                                        "bfloat16; transformers' default load then runs)"))
        if s.resumed_tensors:
            rows.append(("resumed", f"{s.resumed_tensors} tensors from an interrupted run's shards"))
        from llmq.export import consumer_warnings

        rows += [("consumer warning", w) for w in consumer_warnings(path)]  # known misreads (docs/export.md)
        return rows

    def reload(self, path: str, job: WriteJob) -> Dict[str, torch.Tensor]:
        """The folder as its consumer loads it (llmq.export.read_export: the folder's own
        quantization_config decides which modules are quantized and how; each decoded by the
        reader's formula), in model layout."""
        from llmq.export import read_export

        return job.from_hf(dict(read_export(path, dtype=_high_precision_dtype(path))))

    def check_consumer(self, path: str, job: WriteJob, reference, quantized, prompt: torch.Tensor):
        """Every quantized module read back by the consumer's formula, against the unquantized weights it
        came from (llmq.export.verify_export: within each format's error bound); then transformers itself
        loads the folder in a process without llmq (llmq.consumer_run) and its logits for `prompt` are
        compared with llmq's model on the read-back weights. A consumer that disagrees fails the run
        unless consumer_warnings already names it (a known misread)."""
        from llmq.export import iter_module_weights, verify_export

        hf_items = (item for name, value in reference.state_dict().items()
                    for item in job.to_hf(name, value).items())
        report = verify_export(path, reference=dict(iter_module_weights(hf_items)))
        worst = max(report.max_error.items(), key=lambda kv: kv[1], default=None)
        rows = [("read back by its formula", f"{len(report.modules)} quantized modules ({self.style} config), "
                 + (f"largest |error| {worst[1]:.3g} ({worst[0]})" if worst else "no float reference")
                 + ("" if report.ok else f"; {len(report.problems)} problem(s)"))]
        rows += [("problem", p) for p in report.problems[:5]]
        result = {"export_problems": list(report.problems), "consumer_warnings": list(report.warnings)}
        if not report.ok:
            result["failure"] = f"the folder read back as its consumer reads it: {report.problems[0]}"
        line, tried = try_transformers(path, quantized, prompt)
        if self.style == "modelopt":
            line += "; vLLM, TensorRT-LLM: not tried"
        else:
            ct_line, ct = try_compressed_tensors(path)
            line += f"; {ct_line}"
            result["compressed_tensors"] = ct
            if not ct["agrees"] and "failure" not in result:
                result["failure"] = f"compressed-tensors decompresses {path} differently from llmq: {ct_line}"
        rows.append(("consumer", line))
        result["consumer"] = tried
        if tried.get("agrees") is False and not report.warnings and "failure" not in result:
            result["failure"] = f"transformers reads {path} differently from llmq (logits cosine {tried['cosine']:.4f})"
        return rows, result


# The consumer runs the folder's own weights: what separates its logits from llmq's model on the same
# weights is its arithmetic (bfloat16 for a bfloat16 config), cosine > 0.999 on the tiny models; a
# misread weight gives far less (ModelOpt FP8 codes taken as weights: 0.06).
CONSUMER_MIN_COSINE = 0.99


def try_transformers(path: str, quantized, prompt: torch.Tensor) -> Tuple[str, Dict[str, Any]]:
    """(summary text, numbers): transformers' from_pretrained + forward + generate on the folder, in a
    process without llmq, its logits against `quantized` (llmq's model on the read-back weights)."""
    from llmq.consumer_run import run_consumer

    tried = run_consumer("transformers", path, prompt[0].tolist(), new_tokens=8)
    numbers: Dict[str, Any] = {"consumer": "transformers", "version": tried.version, "ok": tried.ok,
                               "error": tried.error, "tokens": tried.tokens}
    if not tried.ok:
        return tried.line(), numbers
    with torch.no_grad():
        ours = quantized(prompt)[0].float()
    cos = torch.nn.functional.cosine_similarity(ours.double().flatten(), tried.logits.double().flatten(), dim=0).item()
    numbers.update(cosine=cos, agrees=cos >= CONSUMER_MIN_COSINE, dtype=tried.details.get("dtype"))
    verdict = "agrees with" if numbers["agrees"] else "MISREADS the folder: differs from"
    return (f"{tried.line()} ({tried.details.get('dtype')}); logits cosine {cos:.4f} vs llmq's read-back, "
            f"{verdict} it"), numbers


# The dtype compressed-tensors decodes a module's weight in, from its stored scale's safetensors dtype:
# FP4 and MX weights (e4m3 / E8M0 scales) unpack to bfloat16 (compressors.nvfp4.helpers.unpack_fp4_from_uint8,
# mx_utils), int and FP8 weights dequantize in their scale's dtype (quantization.lifecycle.forward.dequantize).
_CT_DECODE_DTYPE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                    "F8_E4M3": torch.bfloat16, "U8": torch.bfloat16}


def decompression_bound(scale_dtype: str) -> float:
    """How far (relative, per element) compressed-tensors' decompressed weight may lie from llmq's exact
    read-back of the same tensors: 0 where it decodes in float32 (the same formula, one float32 rounding,
    as llmq's read-back), else two roundings in its decode dtype (the scale's conversion and the product):
    2u, u its unit roundoff (bfloat16 2^-9, float16 2^-11)."""
    dtype = _CT_DECODE_DTYPE.get(scale_dtype, torch.bfloat16)
    return 0.0 if dtype == torch.float32 else 2.0 * torch.finfo(dtype).eps / 2


def compare_decompressed(path: str, theirs: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """compressed-tensors' decompressed weights (float32) against llmq's read-back of the folder
    (llmq.export.read_export: each module decoded exactly), element by element, each module within
    decompression_bound of its scale dtype: {"modules", "agrees", "worst" (module, max |diff| / |ours|
    relative to its bound), "problems"}."""
    from safetensors import safe_open

    from llmq.export import read_export, verify_export

    quantized = set(verify_export(path).modules)
    scale_dtypes: Dict[str, str] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as st:
                for name in st.keys():
                    if name.endswith(".weight_scale"):
                        scale_dtypes[name[: -len(".weight_scale")]] = st.get_slice(name).get_dtype()
    problems: List[str] = []
    worst: Tuple[str, float] = ("", 0.0)
    checked = 0
    for name, ours in read_export(path, torch.float32):
        module = name[: -len(".weight")]
        if not name.endswith(".weight") or module not in quantized:
            continue
        got = theirs.get(name)
        if got is None or tuple(got.shape) != tuple(ours.shape):
            problems.append(f"{name}: compressed-tensors gave {None if got is None else list(got.shape)}, "
                            f"expected {list(ours.shape)}")
            continue
        bound = decompression_bound(scale_dtypes.get(module, "F32"))
        diff = (got.float() - ours).abs()
        excess = diff - bound * ours.abs()
        if bool((excess > 0).any()):
            i = int(excess.flatten().argmax())
            problems.append(f"{name}: element {i} decompressed to {got.flatten()[i].item():.9g}, llmq reads "
                            f"{ours.flatten()[i].item():.9g} (allowed relative difference {bound:.3g})")
        rel = (diff / ours.abs().clamp_min(torch.finfo(torch.float32).tiny)).max().item()
        if rel > worst[1]:
            worst = (name, rel)
        checked += 1
    if checked != len(quantized):
        problems.append(f"{len(quantized) - checked} quantized modules not checked")
    return {"modules": checked, "agrees": not problems and checked > 0, "worst": worst, "problems": problems}


def try_compressed_tensors(path: str) -> Tuple[str, Dict[str, Any]]:
    """(summary text, numbers): compressed-tensors' own dequantizer on the folder, in a process without llmq,
    its weights against llmq's read-back (compare_decompressed)."""
    from llmq.consumer_run import run_consumer

    tried = run_consumer("compressed-tensors", path)
    numbers: Dict[str, Any] = {"consumer": "compressed-tensors", "version": tried.version, "ok": tried.ok,
                               "error": tried.error, "agrees": False}
    if not tried.ok:
        return tried.line(), numbers
    numbers.update(compare_decompressed(path, tried.weights))
    name, rel = numbers["worst"]
    if numbers["agrees"]:
        detail = ("equal to llmq's read-back element by element" if rel == 0 else
                  f"within its decode dtype's rounding of llmq's read-back (largest relative difference {rel:.2g})")
        return f"{tried.line()}: {numbers['modules']} modules {detail}", numbers
    return f"{tried.line()}, but DIFFERS from llmq's read-back: {numbers['problems'][0]}", numbers


register_backend(HfExportBackend(
    "modelopt", "hf-modelopt",
    "a quantized Hugging Face folder in NVIDIA ModelOpt's layout (hf_quant_config.json; vLLM, TensorRT-LLM): "
    "FP formats"))
register_backend(HfExportBackend(
    "compressed-tensors", "hf-compressed-tensors",
    "a quantized Hugging Face folder in the compressed-tensors layout (vLLM, transformers): FP and int formats"))
