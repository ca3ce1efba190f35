"""Print the parameter count of Gemma 4 31B's text model (dense: every parameter is active).

Builds the model on the meta device from ``configs/gemma4_31b.json`` (or ``--config``).

    bazel run //models/gemma4:param_count [-- --config=path/to/config.json]
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict

from models.common.params import count_by_group, count_parameters, format_count
from models.gemma4.config import ModelConfig
from models.gemma4.model import build_model

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "gemma4_31b.json")


def _group(name: str) -> str:
    if name.startswith("model.embed_tokens"):
        return "embed_tokens (tied lm_head)"
    if ".self_attn." in name and "norm" not in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return "norms"


def parameter_counts(config: ModelConfig) -> Dict[str, int]:
    model = build_model(config, device="meta")
    return {"total": count_parameters(model), **count_by_group(model, _group)}


def main(argv=None) -> None:
    from absl import app, flags

    flags.DEFINE_string("config", DEFAULT_CONFIG, "Hugging Face config.json of a Gemma 4 model")

    def run(_):
        path = flags.FLAGS.config
        try:
            with open(path) as f:
                config = ModelConfig.from_hf_dict(json.load(f))
        except (OSError, ValueError, NotImplementedError) as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            sys.exit(1)
        counts = parameter_counts(config)
        full = config.layer_types.count("full_attention")
        print(f"Gemma 4 text model from {path}")
        print(f"  layers {config.num_hidden_layers} ({config.num_hidden_layers - full} sliding, {full} full), "
              f"hidden {config.hidden_size}, tied embeddings {config.tie_word_embeddings}")
        for name, n in counts.items():
            if name != "total":
                print(f"  {name:28s} {format_count(n)}")
        print(f"  {'total (all active)':28s} {format_count(counts['total'])}")
        print(f"  {'layer scalars (buffers)':28s} {config.num_hidden_layers}")

    app.run(run, argv=argv)


if __name__ == "__main__":
    main()
