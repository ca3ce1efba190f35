"""Print the parameter counts of Qwen3.5-35B-A3B's text model (total and active per token).

Builds the model on the meta device from ``configs/qwen3_5_35b_a3b.json`` (or ``--config``), so
it needs no memory and no download. "Active" counts the routed experts at top_k / num_experts;
everything else (attention, DeltaNet, router, shared expert, norms, embeddings, head) runs for every token.

    bazel run //models/qwen:param_count [-- --config=path/to/config.json]
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict

from models.common.params import count_by_group, count_parameters, format_count
from models.qwen.config import ModelConfig
from models.qwen.model import build_model

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "qwen3_5_35b_a3b.json")


def _group(name: str) -> str:
    if name.startswith("model.embed_tokens"):
        return "embed_tokens"
    if name.startswith("lm_head"):
        return "lm_head"
    for key, group in ((".mlp.experts.", "routed experts"), (".mlp.gate.", "router"),
                       (".mlp.shared_expert", "shared expert (+gate)"), (".linear_attn.", "Gated DeltaNet"),
                       (".self_attn.", "gated attention")):
        if key in name:
            return group
    return "norms"


def parameter_counts(config: ModelConfig) -> Dict[str, int]:
    """{"total", "active", per-component groups...} for the text model built on the meta device."""
    model = build_model(config, device="meta")
    groups = count_by_group(model, _group)
    total = count_parameters(model)
    routed = groups["routed experts"]
    active = total - routed + routed * config.num_experts_per_tok // config.num_experts
    return {"total": total, "active": active, **groups}


def main(argv=None) -> None:
    from absl import app, flags

    flags.DEFINE_string("config", DEFAULT_CONFIG, "Hugging Face config.json of a Qwen3.5-MoE model")

    def run(_):
        path = flags.FLAGS.config
        try:
            with open(path) as f:
                config = ModelConfig.from_hf_dict(json.load(f))
        except (OSError, ValueError, NotImplementedError) as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            sys.exit(1)
        counts = parameter_counts(config)
        print(f"Qwen3.5-MoE text model from {path}")
        print(f"  layers {config.num_hidden_layers} ({config.layer_types.count('linear_attention')} DeltaNet, "
              f"{config.layer_types.count('full_attention')} full attention), experts {config.num_experts} top-{config.num_experts_per_tok}")
        for name, n in counts.items():
            if name not in ("total", "active"):
                print(f"  {name:24s} {format_count(n)}")
        print(f"  {'total':24s} {format_count(counts['total'])}")
        print(f"  {'active per token':24s} {format_count(counts['active'])}")
        print(f"  {'active w/o embeddings':24s} {format_count(counts['active'] - counts['embed_tokens'])}")

    app.run(run, argv=argv)


if __name__ == "__main__":
    main()
