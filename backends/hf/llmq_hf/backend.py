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

import json
import os
import re
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from llmq.backend import WriteJob, register_backend

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.\d+\.(?P<leaf>gate_proj|up_proj|down_proj)$")


def recipe_lookup(job: WriteJob) -> Callable[[str], Any]:
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


class HfExportBackend:
    takes_float = True

    def __init__(self, style: str, name: str, description: str, accepts_formats: Tuple[str, ...]):
        self.style, self.name, self.description, self.accepts_formats = style, name, description, accepts_formats
        self._summaries: Dict[str, Any] = {}

    def write(self, stream: Iterable[Tuple[str, Any]], job: WriteJob) -> str:
        from llmq.export import write_hf_quantized_checkpoint

        extra = [f for f in job.source_files if os.path.basename(f) != "config.json"]  # config.json: written here
        summary = write_hf_quantized_checkpoint(
            job.out, hf_stream(stream, job), recipe_lookup(job), style=self.style,
            config=_text_config(job.hf_config), max_shard_bytes=job.max_shard_bytes, extra_files=extra,
            resume=job.resume)
        self._summaries[summary.folder] = summary
        return summary.folder

    def summary(self, path: str, job: WriteJob) -> List[Tuple[str, str]]:
        s = self._summaries.pop(path, None)
        if s is None:
            return []
        rows = [("quantized modules", f"{s.quantized_modules} ({self.style} style)"),
                ("kept in high precision", f"{len(s.excluded_modules)} modules")]
        if s.resumed_tensors:
            rows.append(("resumed", f"{s.resumed_tensors} tensors from an interrupted run's shards"))
        return rows

    def reload(self, path: str, job: WriteJob) -> Dict[str, torch.Tensor]:
        """The folder's weights dequantized by the formula of its style's reader (llmq.export's
        dequantize_exported_tensors), in the folder's high-precision dtype, in model layout."""
        from llmq.export import dequantize_exported_tensors, make_spec

        tensors = read_folder(path)
        with open(os.path.join(path, "config.json")) as f:
            if "quantization_config" not in json.load(f):
                raise ValueError(f"{path}/config.json: no quantization_config")
        lookup = recipe_lookup(job)
        float_dtype = next((t.dtype for n, t in tensors.items() if n.endswith(".weight") and t.dtype in
                            (torch.bfloat16, torch.float16, torch.float32)), torch.float32)
        modules = sorted(n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale"))
        out = dict(tensors)
        for module in modules:
            config = lookup(module)
            if config is None:
                raise ValueError(f"{path}: {module} is quantized in the folder but the recipe keeps it")
            spec = make_spec(module, config, style=self.style,
                             static_input_scale=f"{module}.input_scale" in tensors
                             or f"{module}.input_global_scale" in tensors)
            names = spec.tensor_names()
            weight = dequantize_exported_tensors({n: tensors[n] for n in names.values() if n in tensors}, spec)
            for n in names.values():
                out.pop(n, None)
            out[f"{module}.weight"] = weight.to(float_dtype)
        return job.from_hf(out)


FP_FORMATS = ("fp8", "mxfp8", "mxfp4", "nvfp4")

register_backend(HfExportBackend(
    "modelopt", "hf-modelopt",
    "a quantized Hugging Face folder in NVIDIA ModelOpt's layout (hf_quant_config.json; vLLM, TensorRT-LLM): "
    "FP formats", FP_FORMATS))
register_backend(HfExportBackend(
    "compressed-tensors", "hf-compressed-tensors",
    "a quantized Hugging Face folder in the compressed-tensors layout (vLLM, transformers): FP and int formats",
    FP_FORMATS + ("int",)))
