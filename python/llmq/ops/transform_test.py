"""replace_moe_blocks on a tiny random Qwen3.5-MoE text model (transformers' own modelling
code): the transformed model runs the op and matches the same model whose blocks run the
float64 eager reference of the same quantized math."""

import pytest
import torch
from transformers import Qwen3_5MoeForCausalLM
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from llmq.ops.moe_testing import random_group_quantized
from llmq.ops.packing import pack_matrix_tiles, unpack_matrix_tiles
from llmq.ops.transform import QuantizedMoEBlock, replace_moe_blocks
from llmq.quant import QuantConfig, QuantRecipe, QuantRule


def tiny_model(seed=0):
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # random, non-trivial parameters everywhere (HF init leaves some at zero)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


class _ReferenceBlock(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block.reference_forward(x)


def logits(model, ids):
    # one torch thread: the tiny model is hundreds of small ops, and torch's OpenMP barriers
    # stall on a shared 2-core machine when the other core is busy (the op uses its own pool)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits.double()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("shared_cfg", ["int8", "int4", "dense"])
def test_transformed_model_matches_reference_math(shared_cfg):
    model = tiny_model()
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    original = logits(model, ids)
    routed = QuantConfig(bits=4, group_size=32, symmetric=False)
    shared = {"int8": QuantConfig(bits=8, group_size=64), "int4": routed, "dense": None}[shared_cfg]
    recipe = QuantRecipe([QuantRule(r".*\.mlp\.experts", routed), QuantRule(r".*\.shared_expert\..*", shared)])
    replaced = replace_moe_blocks(model, recipe, num_threads=2)
    assert replaced == ["model.layers.0.mlp", "model.layers.1.mlp"]
    blocks = [model.get_submodule(n) for n in replaced]
    assert all(isinstance(b, QuantizedMoEBlock) for b in blocks)
    assert all((b.dense_shared is not None) == (shared_cfg == "dense") for b in blocks)
    seen = []
    hooks = [b.register_forward_hook(lambda m, a, o: seen.append((m, a[0].detach(), o.detach()))) for b in blocks]
    got = logits(model, ids)
    for h in hooks:
        h.remove()
    # each block, on the activations it saw inside the model, against the float64 reference;
    # tolerance as in moe_op_test: fp32 accumulation over the groups and experts, plus two
    # int8 rounding flips of the intermediate h
    eps = torch.finfo(torch.float32).eps
    assert len(seen) == 2
    for b, x, y in seen:
        ref, mag, flip = b.reference_forward(x, return_bounds=True)
        n_terms = 64 // 32 + 64 // 32 + b.top_k + 8 + 8  # + 8 for the dense shared expert sum
        assert ((y.double() - ref).abs() <= 4 * n_terms * eps * mag + 2 * flip).all()
    for name, b in zip(replaced, blocks):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, _ReferenceBlock(b))
    want = logits(model, ids)
    # whole model: the per-block differences above, propagated (no bound derived; a rare
    # int8 flip of h moves a logit by up to ~1%), so the close-agreement check is statistical
    scale = want.abs().max()
    close = (got - want).abs() <= 1e-4 * scale
    assert close.float().mean() > 0.95 and (got - want).abs().max() <= 0.05 * scale
    # and quantization changed the model by a visible but bounded amount (the check is not vacuous)
    assert 1e-4 * scale < (got - original).abs().max() < 0.5 * scale


def test_recipe_keeping_experts_leaves_blocks_alone():
    model = tiny_model()
    assert replace_moe_blocks(model, QuantRecipe([QuantRule(r".*\.mlp\.experts", None)])) == []
    with pytest.raises(ValueError, match="INT4/INT8"):
        replace_moe_blocks(model, QuantConfig(bits=2, group_size=32))


def test_unpack_inverts_pack():
    w = random_group_quantized((3, 32, 128), 4, 64, torch.Generator().manual_seed(4))
    q, sb = pack_matrix_tiles(w)
    back = unpack_matrix_tiles(q, sb, 4, 64, w.shape)
    assert torch.equal(back.qdata, w.qdata) and torch.equal(back.scale, w.scale) and torch.equal(back.bias, w.bias)
