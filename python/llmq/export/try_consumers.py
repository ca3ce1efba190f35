"""Load llmq-written HF folders with transformers as a user would, and print a markdown table.

For each style x format x {tiny Qwen3, tiny Qwen3-MoE}: write the folder, load it with
``AutoModelForCausalLM.from_pretrained(folder)`` (defaults), and report the logits cosine against
the model the folder was written from, next to the cosine of llmq's own read-back (read_export,
the consumer formulas) and whether consumer_warnings flags the folder. docs/export.md
("Consumers tried") holds the result. Manual (a couple of minutes on 2 cores):

    bazel run //python/llmq/export:try_consumers
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

import torch

from llmq.export import consumer_warnings, read_export, write_hf_quantized_checkpoint
from llmq.quant.formats import get_format
from llmq.quant.recipe import QuantConfig

KEEP = ("lm_head", "embed_tokens", "mlp.gate")
CONFIGS = {
    "fp8 channel": QuantConfig(format="fp8", granularity="channel"),
    "nvfp4": QuantConfig(format="nvfp4", bits=4, group_size=16),
    "mxfp4": QuantConfig(format="mxfp4", bits=4, group_size=32),
    "mxfp8": QuantConfig(format="mxfp8", bits=8, group_size=32),
    "int4 g32": QuantConfig(format="int", bits=4, group_size=32),
}


def _cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def _restack(model, decoded):
    """The model's state dict from read_export's per-module weights (fused experts re-stacked)."""
    out = {}
    n = getattr(model.config, "num_experts", 0)
    for k in model.state_dict():
        if k.endswith("experts.gate_up_proj"):
            p = k[: -len(".gate_up_proj")]
            out[k] = torch.stack([torch.cat([decoded[f"{p}.{e}.gate_proj.weight"], decoded[f"{p}.{e}.up_proj.weight"]]) for e in range(n)])
        elif k.endswith("experts.down_proj"):
            p = k[: -len(".down_proj")]
            out[k] = torch.stack([decoded[f"{p}.{e}.down_proj.weight"] for e in range(n)])
        else:
            out[k] = decoded[k]
    return out


def _row(label, model, style, config, workdir) -> str:
    from transformers import AutoModelForCausalLM

    folder = os.path.join(workdir, f"{label}-{style}".replace(" ", "_"))
    recipe = lambda fqn: None if fqn.endswith(KEEP) else config  # noqa: E731
    write_hf_quantized_checkpoint(folder, iter(model.state_dict().items()), recipe, style=style,
                                  config={**model.config.to_dict(), "architectures": [type(model).__name__]})
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    ours = type(model)(model.config).to(torch.bfloat16)
    ours.load_state_dict(_restack(model, dict(read_export(folder, torch.bfloat16))))
    with torch.no_grad():
        ref = model(ids).logits
        readback = _cos(ref, ours(ids).logits)
        try:
            loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
            result = f"loads; logits cosine {_cos(ref, loaded(ids).logits):.3f}"
        except Exception as e:  # noqa: BLE001 -- a refusal is a result here
            result = f"refuses ({type(e).__name__})"
    flagged = "yes" if consumer_warnings(folder) else "no"
    return f"| {style} | {label} | {result} | {readback:.3f} | {flagged} |"


def main() -> int:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")
    import compressed_tensors
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    transformers.logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, compressed-tensors {compressed_tensors.__version__}, torch {torch.__version__}")
    torch.manual_seed(0)
    small = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
                 tie_word_embeddings=False)
    models = {"Qwen3": Qwen3ForCausalLM(Qwen3Config(intermediate_size=256, **small)).to(torch.bfloat16),
              "Qwen3-MoE": Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                                                              num_experts_per_tok=2, **small)).to(torch.bfloat16)}
    print("| style | format, model | transformers from_pretrained | llmq read-back cosine | consumer_warnings |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as workdir:
        for style in ("modelopt", "compressed-tensors"):
            for fname, config in CONFIGS.items():
                if style not in get_format(config.format).hf_export.styles:
                    continue
                for mname, model in models.items():
                    print(_row(f"{fname}, {mname}", model, style, config, workdir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
