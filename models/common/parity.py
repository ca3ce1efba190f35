"""Logits of a transformers model and of an llmq model over the same greedy path (prefill,
then decode steps through each one's KV cache), and the check the model tests share."""

from typing import List, Sequence

import torch

# Parity tolerance in float32 on CPU: an equivalent order of operations differs by a few ulps per op,
# accumulated over ~10^2 dependent ops; allow 2e-5 * max|logit| (~170 ulps at the logit scale).
FP32_REL_TOL = 2e-5


def hf_logits(hf, prompt: torch.Tensor, steps: int) -> List[torch.Tensor]:
    """transformers: prefill `prompt`, then `steps` greedy decode steps; logits of each call."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        out = hf(input_ids=prompt, cache=cache, use_cache=True)
        logits = [out.logits]
        for _ in range(steps):
            out = hf(input_ids=out.logits[:, -1:].argmax(-1), cache=out.cache, use_cache=True)
            logits.append(out.logits)
    return logits


def llmq_logits(model, prompt: torch.Tensor, steps: int) -> List[torch.Tensor]:
    """An llmq model (`new_cache`, `forward(ids, cache=)`): the same calls as `hf_logits`."""
    cache = model.new_cache(batch_size=prompt.shape[0])
    with torch.no_grad():
        logits = [model(prompt, cache=cache)]
        for _ in range(steps):
            logits.append(model(logits[-1][:, -1:].argmax(-1), cache=cache))
    return logits


def assert_logits_match(name: str, expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor],
                        rel_tol: float) -> None:
    """Max abs error within rel_tol of the largest logit, and the greedy token of every call equal."""
    scale = max(e.abs().max().item() for e in expected)
    worst = max((a - e).abs().max().item() for a, e in zip(actual, expected))
    print(f"{name} parity: max|logit| {scale:.4g}, max abs err {worst:.3g}, rel {worst / scale:.3g}")
    assert worst <= rel_tol * scale, f"max abs error {worst} > {rel_tol} * {scale}"
    for a, e in zip(actual, expected):  # greedy paths agree token for token
        assert torch.equal(a[:, -1].argmax(-1), e[:, -1].argmax(-1))


# The test bodies every model's model_test / keymap_test / param_count_test shares, driven by the model's
# Architecture (models/<m>/architecture.py's ARCHITECTURE) and a transformers model saved to `folder`.

def check_prefill_and_decode(arch, folder, hf, vocab: int, rel_tol: float = FP32_REL_TOL, prompt_len: int = 11, steps: int = 8):
    """Prefill a random [2, prompt_len] prompt, then `steps` greedy decode steps: logits within rel_tol."""
    from models.common.loading import load_model

    ours = load_model(arch, folder, device="cpu").eval()
    prompt = torch.randint(0, vocab, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    assert_logits_match(arch.name, hf_logits(hf, prompt, steps), llmq_logits(ours, prompt, steps), rel_tol)


def check_greedy_generate(arch, folder, hf, prompt: List[int], new_tokens: int = 6) -> None:
    """models.common.generation.generate equals transformers' greedy generate token for token."""
    from models.common.generation import generate
    from models.common.loading import load_model

    ours = load_model(arch, folder, device="cpu").eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(generate(ours, ids, new_tokens, eos_token_id=getattr(ours.config, "eos_token_id", None)),
                       expected)


def check_multimodal_layout_loads_the_same(arch, folder, target, model_type: str, extra_tensors, tensors=None):
    """The text checkpoint in `folder` rewritten in the multimodal layout (``model.language_model.`` prefix,
    `extra_tensors` of the towers to skip, config under ``text_config``) in `target` loads to the same state.
    `tensors`: the text tensors to write (default: folder's model.safetensors)."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    from models.common.loading import load_model

    tensors = load_file(os.path.join(folder, "model.safetensors")) if tensors is None else tensors
    renamed = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t.contiguous()
               for n, t in tensors.items()}
    renamed.update(extra_tensors)
    save_file(renamed, os.path.join(target, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        text = json.load(f)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump({"model_type": model_type, "text_config": text}, f)
    a, b = load_model(arch, folder).state_dict(), load_model(arch, target).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def check_gguf_names_round_trip(arch, anchors) -> None:
    """On the architecture's embedded-default model (meta device): HF name -> GGUF name (its GGUF table) ->
    HF name is the identity on every tensor, every GGUF name is distinct, and each of `anchors`
    ({GGUF name: HF name}, facts from llama.cpp's files) is in the table."""
    import re

    table = arch.gguf_import.GGUFConverter.GGUF_TO_HF
    model = arch.build_model(arch.config_from_hf(arch.tiny_hf_config()), device="meta")
    for gguf_name, hf_name in anchors.items():
        assert table.get(gguf_name) == hf_name, (gguf_name, table.get(gguf_name), hf_name)

    inverse = {}
    for gguf_template, hf_template in table.items():
        for layer in range(len(model.model.layers)) if "{L}" in gguf_template else [None]:
            inverse[gguf_template.format(L=layer)] = hf_template.format(L=layer)
    forward = {hf: g for g, hf in inverse.items()}
    assert len(forward) == len(inverse)
    names = set(model.state_dict())
    missing = sorted(n for n in names if n not in forward)
    assert not missing, f"model tensors without a GGUF name: {missing[:5]}"
    for name in names:
        assert re.match(r"^(blk\.\d+\.|token_embd|output)", forward[name]), (name, forward[name])
        assert inverse[forward[name]] == name


def hf_parameter_count(hf_model_class, hf_config) -> int:
    """Distinct parameter elements of a transformers model built on the meta device (tied weights once)."""
    with torch.device("meta"):
        hf = hf_model_class(hf_config)
    return sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values())
