"""--backend=gguf for model-free quantization: the GGUF export of an HF checkpoint of a llama-family architecture.

A model's GGUF export is a module with GGUF_ARCH, ``GGUFConverter`` (its ``to_gguf`` / ``convert``, the name
table both ways) and ``gguf_metadata(hf_config, config)`` (models/pipeline/gguf_output.py reads it; a model
package's is models/<m>/gguf_checkpoint.py). `gguf_export` builds one from the checkpoint alone for the
config.json model_types in `FAMILIES`, following llama.cpp's converter (convert_hf_to_gguf.py's LlamaModel,
Qwen2Model, Qwen3Model, Qwen3MoeModel):

* names: gguf-py's table for the architecture (``gguf.get_tensor_name_map``), over the checkpoint's own tensor
  names (models/common/keymap.py's ``gguf_to_hf_table``); a name the table lacks refuses the export;
* per-expert matrices (``<p>.experts.<e>.<leaf>.weight``) stacked into one [E, N, K] tensor per layer and leaf
  (``ffn_{gate,up,down}_exps``), exactly (quantized rows are copied as they are);
* arch "llama" (llama, mistral, mixtral): the rows of q_proj and k_proj (weights and biases) permuted from HF's
  rotate-half order to llama.cpp's interleaved RoPE order, per head (k_proj per KV head). Each row carries its
  own quantization groups, so permuting a quantized weight's rows is exact; qwen2 / qwen3 / qwen3_moe use
  NEOX RoPE and are not permuted;
* metadata: the ``<arch>.*`` keys llama.cpp's converter writes from config.json (block_count, context_length,
  embedding_length, feed_forward_length, attention.head_count(_kv), key_length / value_length where config.json
  has head_dim, layer_norm_rms_epsilon, rope.freq_base, rope scaling (linear, yarn; llama3 as the rope_freqs
  tensor), expert_count, expert_used_count, expert_feed_forward_length; vocab_size and rope.dimension_count for
  "llama"); the tokenizer is the backend's (gguf-py's vocabulary helpers over the folder's tokenizer files).

Reading such a file back (--verify) is the same table the other way (``convert``: experts unstacked into the
checkpoint's per-expert names, the permutation undone), through models/pipeline/gguf_input.py like any GGUF import.
So is a .gguf --checkpoint of general.architecture llama, qwen2, qwen3 or qwen3moe (which no llmq model imports):
``hf_config_from_gguf`` rebuilds its config.json from the keys, ``hf_shapes`` its transformers tensor names from
gguf-py's table over the names transformers uses for the model_type (`LAYER_TENSORS`), and model-free
quantization (models/pipeline/generic.py) runs on it as on the HF folder it came from.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from llmq.quant import GroupQuantizedWeight
from llmq.quant.formats import first_of_alike
from models.common.keymap import TableConverter, gguf_to_hf_table
from models.pipeline.gguf_input import Value, permute_rows


@dataclasses.dataclass(frozen=True)
class Family:
    """How llama.cpp's converter writes one config.json model_type."""

    arch: str  # gguf.MODEL_ARCH member name
    permute_qk: bool  # q/k rows to llama.cpp's interleaved RoPE order (arch "llama")
    moe: bool = False  # expert_count / expert_used_count (config.json: num_local_experts or num_experts)
    expert_ff_key: Optional[str] = None  # config.json's per-expert FFN width (expert_feed_forward_length)
    # (config.json key, value llama.cpp's graph assumes where the key is absent too, why): other values refused
    requires: Tuple[Tuple[str, Any, str], ...] = ()


FAMILIES: Dict[str, Family] = {
    "llama": Family("LLAMA", True),
    "mistral": Family("LLAMA", True),
    "mixtral": Family("LLAMA", True, moe=True),
    "qwen2": Family("QWEN2", False),
    "qwen3": Family("QWEN3", False),
    "qwen3_moe": Family("QWEN3MOE", False, moe=True, expert_ff_key="moe_intermediate_size", requires=(
        ("norm_topk_prob", True, "llama.cpp's qwen3moe graph always renormalises the chosen experts' weights"),)),
}
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # llama.cpp's converter's order

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<leaf>[A-Za-z0-9_]+)\.weight$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def supported() -> str:
    return ", ".join(FAMILIES)


def _template(name: str) -> str:
    """An HF name with its layer index as {L} and a per-expert matrix as its stack's name (no expert index)."""
    m = _PER_EXPERT.match(name)
    if m is not None:
        name = f"{m['prefix']}.{m['leaf']}.weight"
    return _LAYER.sub(".layers.{L}.", name, count=1)


def _merged(name: str) -> Optional[Tuple[str, int]]:
    """(the stack's name, the expert index) of a per-expert matrix, else None."""
    m = _PER_EXPERT.match(name)
    return None if m is None else (f"{m['prefix']}.{m['leaf']}.weight", int(m["e"]))


def qk_permutation(rows: int, heads: int) -> torch.Tensor:
    """Row order llama.cpp's converter gives q_proj / k_proj of arch "llama": per head, HF's rotate-half rows
    (first halves, then second halves) interleaved (row i of the first half, then row i of the second):
    out = w[perm]."""
    if heads <= 0 or rows % (2 * heads):
        raise ValueError(f"{rows} rows are not {heads} heads of an even head dimension")
    return torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)


def stack_experts(experts: Sequence[Value], name: str) -> Value:
    """[E, N, K] from E weights [N, K] (quantized ones field by field: exact); ValueError naming `name` where
    the experts are not alike (one quantized and one not, or different bit widths / group sizes)."""
    first = experts[0]
    if isinstance(first, GroupQuantizedWeight):
        try:
            first_of_alike(experts, lambda e: {"type": type(e).__name__, "shape": tuple(e.shape),
                                                "bits": getattr(e, "bits", None),
                                                "group_size": getattr(e, "group_size", None)})
        except ValueError as e:
            raise ValueError(f"{name}: GGUF stacks the experts in one tensor, so they need one format: {e}") from None
        return GroupQuantizedWeight(qdata=torch.stack([e.qdata for e in experts]),
                                    scale=torch.stack([e.scale for e in experts]),
                                    bias=torch.stack([e.bias for e in experts]), bits=first.bits,
                                    group_size=first.group_size, shape=(len(experts), *first.shape), dtype=first.dtype)
    if any(not isinstance(e, torch.Tensor) for e in experts):
        raise ValueError(f"{name}: GGUF stacks the experts in one tensor, so they need one format: some are "
                         "quantized and some are not")
    return torch.stack(list(experts))


def _expert(value: Value, e: int) -> Value:
    """Expert `e` of a stack [E, N, K] (exact)."""
    if isinstance(value, GroupQuantizedWeight):
        return dataclasses.replace(value, qdata=value.qdata[e].contiguous(), scale=value.scale[e].contiguous(),
                                   bias=value.bias[e].contiguous(), shape=tuple(value.shape[1:]))
    return value[e].contiguous()


def _rope(hf_config: Dict[str, Any]) -> Dict[str, Any]:
    """The RoPE parameters of a config.json (transformers 5's rope_parameters, or rope_theta + rope_scaling)."""
    rope = dict(hf_config.get("rope_parameters") or {})
    rope.update({k: v for k, v in (hf_config.get("rope_scaling") or {}).items() if k not in rope})
    if "rope_theta" not in rope and "rope_theta" in hf_config:
        rope["rope_theta"] = hf_config["rope_theta"]
    kind = rope.get("rope_type", rope.get("type")) or "default"
    rope["rope_type"] = str(kind).lower()
    return rope


def _required(hf_config: Dict[str, Any], key: str) -> Any:
    if key not in hf_config:
        raise ValueError(f"config.json has no {key!r}, which the GGUF metadata needs")
    return hf_config[key]


def metadata(family: Family, hf_config: Dict[str, Any]) -> Dict[str, Any]:
    """The GGUF `<arch>.*` keys llama.cpp's converter writes for `hf_config` (ValueError naming what is missing
    or what llama.cpp's converter does not write for this architecture)."""
    import gguf

    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[family.arch]]
    K = gguf.Keys
    heads = int(_required(hf_config, "num_attention_heads"))
    keys: Dict[str, Any] = {
        K.LLM.BLOCK_COUNT: int(_required(hf_config, "num_hidden_layers")),
        K.LLM.EMBEDDING_LENGTH: int(_required(hf_config, "hidden_size")),
        K.Attention.HEAD_COUNT: heads,
        K.Attention.HEAD_COUNT_KV: int(hf_config.get("num_key_value_heads") or heads),
        K.Attention.LAYERNORM_RMS_EPS: float(_required(hf_config, "rms_norm_eps")),
    }
    if hf_config.get("max_position_embeddings") is not None:
        keys[K.LLM.CONTEXT_LENGTH] = int(hf_config["max_position_embeddings"])
    if hf_config.get("intermediate_size") is not None:
        keys[K.LLM.FEED_FORWARD_LENGTH] = int(hf_config["intermediate_size"])
    if hf_config.get("head_dim") is not None:
        keys[K.Attention.KEY_LENGTH] = keys[K.Attention.VALUE_LENGTH] = int(hf_config["head_dim"])
    rope = _rope(hf_config)
    if rope.get("rope_theta") is not None:
        keys[K.Rope.FREQ_BASE] = float(rope["rope_theta"])
    kind = rope["rope_type"]
    if kind not in _ROPE_TYPES or (kind == "llama3" and not family.permute_qk):
        raise ValueError(f"RoPE type {kind!r} has no GGUF form here (model-free GGUF export writes "
                         f"{', '.join(_ROPE_TYPES)}; llama3 for arch llama)")
    if kind in ("linear", "yarn"):
        keys[K.Rope.SCALING_TYPE] = kind
        keys[K.Rope.SCALING_FACTOR] = float(_required(rope, "factor"))
    if kind == "yarn":
        keys[K.Rope.SCALING_ORIG_CTX_LEN] = int(_required(rope, "original_max_position_embeddings"))
        for key, names in ((K.Rope.SCALING_YARN_EXT_FACTOR, ("extrapolation_factor",)),
                           (K.Rope.SCALING_YARN_ATTN_FACTOR, ("attention_factor", "attn_factor")),
                           (K.Rope.SCALING_YARN_BETA_FAST, ("beta_fast",)),
                           (K.Rope.SCALING_YARN_BETA_SLOW, ("beta_slow",))):
            found = next((rope[n] for n in names if rope.get(n) is not None), None)
            if found is not None:
                keys[key] = float(found)
    for key, value, why in family.requires:
        if hf_config.get(key, value) != value:
            raise ValueError(f"config.json has {key} = {hf_config[key]!r}, but {why}")
    if family.moe:
        keys[K.LLM.EXPERT_COUNT] = expert_count(hf_config)
        keys[K.LLM.EXPERT_USED_COUNT] = int(_required(hf_config, "num_experts_per_tok"))
    if family.expert_ff_key is not None:
        keys[K.LLM.EXPERT_FEED_FORWARD_LENGTH] = int(_required(hf_config, family.expert_ff_key))
    if family.permute_qk:
        keys[K.LLM.VOCAB_SIZE] = int(_required(hf_config, "vocab_size"))
        keys[K.Rope.DIMENSION_COUNT] = int(hf_config.get("head_dim") or keys[K.LLM.EMBEDDING_LENGTH] // heads)
    return {key.format(arch=arch): value for key, value in keys.items()}


def expert_count(hf_config: Dict[str, Any]) -> int:
    found = next((hf_config[k] for k in _EXPERT_KEYS if hf_config.get(k) is not None), None)
    if found is None:
        raise ValueError(f"config.json has none of {', '.join(_EXPERT_KEYS)}, which the GGUF metadata needs")
    return int(found)


def llama3_rope_factors(hf_config: Dict[str, Any]) -> torch.Tensor:
    """llama.cpp's rope_freqs tensor for RoPE type llama3 (one factor per rotary frequency), from the config's
    factor, low/high_freq_factor and original_max_position_embeddings as llama.cpp's converter computes it."""
    rope = _rope(hf_config)
    base = float(rope.get("rope_theta", 10000.0))
    dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"])
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


class _Converter(TableConverter):
    """The table both ways, plus llama.cpp's two transforms: experts stacked, q/k rows permuted (see the module
    docstring). Subclassed per checkpoint by `gguf_export` (the table and the counts)."""

    HEADS: int = 0
    KV_HEADS: int = 0
    PERMUTE: bool = False
    EXPERTS: int = 0
    PER_EXPERT: Dict[str, str] = {}  # stack name template -> per-expert name template ({E})

    def __init__(self, config):
        super().__init__(config)
        self._pending: Dict[str, Dict[int, Value]] = {}

    def _perm(self, hf_name: str, rows: int) -> Optional[torch.Tensor]:
        if not self.PERMUTE:
            return None
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return qk_permutation(rows, self.HEADS)
        if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return qk_permutation(rows, self.KV_HEADS)
        return None

    @staticmethod
    def _rows(value: Value) -> int:
        return int(value.shape[0] if len(value.shape) == 1 else value.shape[-2])

    def redo(self, hf_name: str, gguf_name: str, value: Value) -> Value:
        perm = self._perm(hf_name, self._rows(value))
        return value if perm is None else permute_rows(value, perm)

    def undo(self, hf_name: str, gguf_name: str, value: Value) -> Value:
        perm = self._perm(hf_name, self._rows(value))
        return value if perm is None else permute_rows(value, torch.argsort(perm))

    def to_gguf(self, hf_name: str, value: Value) -> List[Tuple[str, Value]]:
        """As the table says; a per-expert matrix is held until its layer's stack is complete, then the stack goes
        out as one tensor."""
        merged = _merged(hf_name)
        if merged is None:
            return super().to_gguf(hf_name, value)
        stack, e = merged
        parts = self._pending.setdefault(stack, {})
        if e in parts or not 0 <= e < self.EXPERTS:
            raise ValueError(f"{hf_name}: expert {e} twice or outside the {self.EXPERTS} experts the config names")
        parts[e] = value
        if len(parts) < self.EXPERTS:
            return []
        del self._pending[stack]
        return super().to_gguf(stack, stack_experts([parts[i] for i in range(self.EXPERTS)], stack))

    def convert(self, name: str, value: Value) -> List[Tuple[str, Value]]:
        """GGUF -> the checkpoint's names: as the table says, an expert stack split into its per-expert matrices."""
        out = []
        for hf_name, hf_value in super().convert(name, value):
            layer = _LAYER.search(hf_name)
            per_expert = self.PER_EXPERT.get(_LAYER.sub(".layers.{L}.", hf_name, count=1))
            if per_expert is None:
                out.append((hf_name, hf_value))
                continue
            if hf_value.shape[0] != self.EXPERTS:
                raise ValueError(f"{name}: {hf_value.shape[0]} experts stacked; the config names {self.EXPERTS}")
            L = int(layer.group(1)) if layer else 0
            out += [(per_expert.format(L=L, E=e), _expert(hf_value, e)) for e in range(self.EXPERTS)]
        return out

    def close(self) -> None:
        if self._pending:
            stack, parts = next(iter(self._pending.items()))
            raise ValueError(f"{stack}: only {len(parts)} of {self.EXPERTS} experts arrived")


def _expert_stacks(names: Iterable[str], experts: int) -> Dict[str, str]:
    """{stack name template: per-expert name template ({L}, {E})} of the per-expert matrices among `names`;
    ValueError where a layer's stack does not hold experts 0..experts-1."""
    found: Dict[str, set] = {}
    per_expert: Dict[str, str] = {}
    for name in names:
        m = _PER_EXPERT.match(name)
        if m is None:
            continue
        found.setdefault(f"{m['prefix']}.{m['leaf']}.weight", set()).add(int(m["e"]))
        per_expert[_template(name)] = _LAYER.sub(".layers.{L}.", m["prefix"] + ".{E}." + m["leaf"] + ".weight",
                                                 count=1)
    for stack, es in found.items():
        if es != set(range(experts)):
            raise ValueError(f"{stack}: {len(es)} experts (numbered {min(es)}..{max(es)}); config.json names "
                             f"{experts}")
    return per_expert


def gguf_export(hf_config: Dict[str, Any], names: Iterable[str]) -> Tuple[Optional[Any], str]:
    """(the GGUF export of a checkpoint with config.json `hf_config` and tensors `names`, "") where it has one
    (see the module docstring), else (None, why not) in one clause naming the model_type and what is supported."""
    import gguf

    model_type = hf_config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        return None, (f"model_type {model_type!r} has no model-free GGUF export (it covers model_type "
                      f"{supported()}: llama.cpp's llama and qwen families)")
    names = sorted(names)
    where = f"model_type {model_type!r}"
    try:
        keys = metadata(family, hf_config)
        arch = gguf.MODEL_ARCH[family.arch]
        templates = sorted({_template(n) for n in names})
        table = gguf_to_hf_table(arch, templates)
        experts = expert_count(hf_config) if family.moe else 0
        per_expert = _expert_stacks(names, experts)
    except (ValueError, TypeError, KeyError) as e:
        return None, f"{where}: no GGUF export ({e})"
    heads = int(hf_config["num_attention_heads"])
    converter = type("GGUFConverter", (_Converter,), {
        "GGUF_ARCH": gguf.MODEL_ARCH_NAMES[arch], "GGUF_TO_HF": table, "HEADS": heads,
        "KV_HEADS": int(hf_config.get("num_key_value_heads") or heads), "PERMUTE": family.permute_qk,
        "EXPERTS": experts, "PER_EXPERT": per_expert,
        "UNMAPPED": f"expected the tensors of the {model_type} checkpoint it was written from"})
    llama3 = _rope(hf_config)["rope_type"] == "llama3"
    module = types.SimpleNamespace(
        GGUF_ARCH=gguf.MODEL_ARCH_NAMES[arch], GGUFConverter=converter, family=family,
        hf_config_from_gguf=hf_config_from_gguf,
        gguf_metadata=lambda _hf_config, _config: dict(keys),
        gguf_extra_tensors=lambda _hf_config, _config: (
            {"rope_freqs.weight": llama3_rope_factors(hf_config)} if llama3 else {}))
    return module, ""


# ---- reading such a GGUF back as the checkpoint it came from (a .gguf --checkpoint of these architectures) ----

_ATTENTION = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
              "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
              "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_DENSE = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_QK_NORM = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
# transformers' names of each model_type's tensors (per layer; {E}: an expert), the names llama.cpp's converter reads
LAYER_TENSORS = {
    "llama": _ATTENTION + _DENSE,
    "mixtral": _ATTENTION + ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{E}.w1.weight",
                             "block_sparse_moe.experts.{E}.w2.weight", "block_sparse_moe.experts.{E}.w3.weight"),
    "qwen2": _ATTENTION + _DENSE,
    "qwen3": _ATTENTION + _QK_NORM + _DENSE,
    "qwen3_moe": _ATTENTION + _QK_NORM + ("mlp.gate.weight", "mlp.experts.{E}.gate_proj.weight",
                                          "mlp.experts.{E}.up_proj.weight", "mlp.experts.{E}.down_proj.weight"),
}
_TOP = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_CLASS = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")  # general.architecture values read back


def _model_type(gguf_arch: Any, names: Iterable[str]) -> str:
    if gguf_arch == "llama":
        return "mixtral" if any(n.endswith(".ffn_gate_exps.weight") for n in names) else "llama"
    return {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}[gguf_arch]


def hf_shapes(gguf_arch: str, shapes: Dict[str, Tuple[int, ...]]) -> Dict[str, Tuple[int, ...]]:
    """{transformers name: shape} of a GGUF's tensors ({GGUF name: torch-order shape}): gguf-py's table over the
    model_type's names, each expert stack as its per-expert matrices; ValueError naming a tensor it has no
    name for (e.g. llama3 RoPE's rope_freqs, which is no checkpoint tensor)."""
    import gguf

    from models.common.keymap import block_template

    model_type = _model_type(gguf_arch, shapes)
    family = FAMILIES[model_type]
    templates = [t for t in _TOP] + [f"model.layers.{{L}}.{t}" for t in LAYER_TENSORS[model_type]]
    per_expert = {_template(t.replace("{E}", "0")): t for t in templates if "{E}" in t}
    table = gguf_to_hf_table(gguf.MODEL_ARCH[family.arch], [_template(t.replace("{E}", "0")) for t in templates])
    out: Dict[str, Tuple[int, ...]] = {}
    for name, shape in shapes.items():
        layer, template = block_template(name)
        hf = table.get(template)
        if hf is None:
            raise ValueError(f"GGUF tensor {name!r} has no {model_type} checkpoint name (model-free reading of a "
                             f"{gguf_arch} GGUF knows {', '.join(sorted(table))})")
        if hf in per_expert:
            out.update({per_expert[hf].format(L=layer, E=e): tuple(shape[1:]) for e in range(shape[0])})
        else:
            out[hf.format(L=layer)] = tuple(shape)
    return out


def hf_config_from_gguf(metadata: Dict[str, Any], tensors) -> Dict[str, Any]:
    """The config.json of a GGUF this module's export writes (the inverse of `metadata`), from its keys and
    tensor shapes (gguf_input.GGUFTensors); ValueError naming what it cannot rebuild."""
    from models.pipeline.gguf_input import Metadata

    arch = metadata.get("general.architecture")
    model_type = _model_type(arch, tensors.shapes)
    m = Metadata(metadata, arch, tensors)
    if m.has("rope.scaling.type") or "rope_freqs.weight" in tensors.shapes:
        raise ValueError("GGUF with RoPE scaling (rope.scaling.type or rope_freqs): not read back model-free")
    heads = m.dim_per_layer("attention.head_count")
    hidden = m.dim("embedding_length")
    head_dim = m.dim("attention.key_length", hidden // heads)
    if m.dim("attention.value_length", head_dim) != head_dim:
        raise ValueError("GGUF attention.value_length != key_length has no transformers config here")
    config: Dict[str, Any] = {
        "model_type": model_type, "architectures": [_CLASS[model_type]], "vocab_size": m.vocab_size(),
        "hidden_size": hidden, "num_hidden_layers": m.layers(), "num_attention_heads": heads,
        "num_key_value_heads": m.dim_per_layer("attention.head_count_kv") if m.has("attention.head_count_kv")
        else heads, "head_dim": head_dim, "rms_norm_eps": m.number("attention.layer_norm_rms_epsilon", hi=1.0),
        "max_position_embeddings": m.count("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors.shapes,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.number("rope.freq_base", 10000.0, lo_open=True)},
    }
    if m.has("feed_forward_length"):
        config["intermediate_size"] = m.dim("feed_forward_length")
    if FAMILIES[model_type].moe:
        experts = m.dim("expert_count")
        config["num_local_experts"] = experts
        config["num_experts_per_tok"] = m.count("expert_used_count", hi=experts, why=" (expert_count)")
    if model_type == "qwen3_moe":
        config.update(num_experts=config["num_local_experts"], norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], moe_intermediate_size=m.dim("expert_feed_forward_length"))
    for key in ("bos", "eos"):
        token = m.token_id(f"tokenizer.ggml.{key}_token_id", config["vocab_size"])
        if token is not None:
            config[f"{key}_token_id"] = token
    return config
