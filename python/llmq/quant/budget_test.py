"""Mixed precision under a budget (llmq.quant.budget) against brute force on small problems."""

import dataclasses
import itertools
import json

import pytest
import torch

from llmq.quant import dequantize, quantize_weight
from llmq.quant.budget import DEFAULT_OPTIONS, Option, budget_recipe, choose, measure_options, sample_rows
from llmq.quant.recipe import QuantConfig, QuantRecipe
from llmq.quant.storage import Storage, group_tensors


def _half_storage(config):
    """A backend writing a float16 scale and bias per group (as MLX does)."""
    return Storage(torch.float16, group_tensors(config.bits, config.group_size))


def _weights():
    g = torch.Generator().manual_seed(0)
    shapes = {"a.q_proj": (64, 128), "a.down_proj": (128, 256), "b.q_proj": (64, 128), "b.up_proj": (96, 128)}
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        w = torch.randn(shape, generator=g)
        if i % 2:  # heavy tails: these need more bits for the same error
            w = w * torch.exp(2 * torch.randn(shape, generator=g))
        out[name] = w
    return out


def test_options_measure_bits_and_error_independently():
    w = _weights()["a.q_proj"]
    imp = torch.rand(128, generator=torch.Generator().manual_seed(1)) + 0.5
    for opt in measure_options("a.q_proj", w, importance=imp):  # the bundle: float32 scale and bias per group
        q = quantize_weight(w, opt.config)
        groups = w.numel() // opt.config.group_size
        assert opt.config.scale_dtype == torch.float32
        assert opt.bits == w.numel() * opt.config.bits + groups * 64 == 8 * q.nbytes
        manual = float((((w.double() - dequantize(q, torch.float32).double()) ** 2) * imp.double()).sum())
        assert opt.error == pytest.approx(manual, rel=1e-9)
    for opt in measure_options("a.q_proj", w, importance=imp, storage=_half_storage):
        q = quantize_weight(w, opt.config)  # quantized with float16 scales: what that backend writes
        groups = w.numel() // opt.config.group_size
        assert opt.config.scale_dtype == torch.float16 and torch.equal(q.scale.half().float(), q.scale)
        assert opt.bits == w.numel() * opt.config.bits + groups * 32
        manual = float((((w.double() - dequantize(q, torch.float32).double()) ** 2) * imp.double()).sum())
        assert opt.error == pytest.approx(manual, rel=1e-9)


def test_relative_errors_are_the_weighted_error_over_the_weighted_energy_and_ignore_a_weights_scale():
    w = _weights()["b.up_proj"]
    imp = torch.rand(128, generator=torch.Generator().manual_seed(2)) + 0.5
    energy = float(((w.double() ** 2) * imp.double()).sum())
    absolute = measure_options("b.up_proj", w, importance=imp)
    relative = measure_options("b.up_proj", w, importance=imp, relative=True)
    assert [o.bits for o in relative] == [o.bits for o in absolute]
    for a, r in zip(absolute, relative):
        assert r.error == pytest.approx(a.error / energy, rel=1e-12)
    # A power-of-two factor moves every code and scale exactly: the relative errors do not change.
    scaled = measure_options("b.up_proj", w * 8, importance=imp, relative=True)
    assert [o.error for o in scaled] == pytest.approx([o.error for o in relative], rel=1e-9)
    assert all(o.error == 0 for o in measure_options("zero", torch.zeros(4, 64), relative=True))


@pytest.mark.parametrize("shape", [(96, 256), (3, 40, 128)])  # a matrix, a stack of experts
@pytest.mark.parametrize("storage", [None, _half_storage])
def test_a_sampled_matrix_counts_the_whole_matrix_bits_and_its_sampled_rows_exact_errors(shape, storage):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))
    k = shape[-1]
    imp = torch.rand(k, generator=g) + 0.5
    rows = w.reshape(-1, k)
    kw = dict(importance=imp) if storage is None else dict(importance=imp, storage=storage)
    configs = [dataclasses.replace(c, method="hqq") for c in DEFAULT_OPTIONS[:3]]
    whole = measure_options("w", w, configs, **kw)
    sampled = measure_options("w", w, configs, sample_weights=16 * k, **kw)
    picked = sample_rows(w, 16 * k)
    index = (torch.arange(16) * 2 + 1) * rows.shape[0] // 32  # evenly spaced, every part of the stack
    assert torch.equal(picked, rows[index])
    assert [o.bits for o in sampled] == [o.bits for o in whole]  # exact: the whole matrix's
    for o in sampled:  # rows quantize on their own: the sampled rows' errors, scaled to all rows
        q = quantize_weight(w, o.config, importance=imp)
        d = (w.double() - dequantize(q, torch.float32).double()).reshape(-1, k)[index]
        assert o.error == pytest.approx(float((d ** 2 * imp.double()).sum()) * rows.shape[0] / 16, rel=1e-9)
    # at most sample_weights: every row, the same numbers as without sampling
    assert measure_options("w", w, configs, sample_weights=w.numel(), **kw) == whole


def test_a_config_whose_group_does_not_divide_k_is_not_an_option():
    opts = measure_options("x", torch.randn(8, 96), [QuantConfig(bits=4, group_size=64), QuantConfig(bits=4, group_size=32)])
    assert [o.config.group_size for o in opts] == [32]


@pytest.mark.parametrize("budget", [4.1, 4.5, 4.8, 5.5, 6.5])
def test_choice_fits_and_is_near_the_brute_force_optimum(budget):
    weights = _weights()
    options = {n: measure_options(n, w, storage=_half_storage) for n, w in weights.items()}
    numel = {n: w.numel() for n, w in weights.items()}
    choice = choose(options, numel, budget)
    limit = budget * sum(numel.values())
    bits = sum(options[n][i].bits for n, i in choice.items())
    assert bits <= limit
    err = sum(options[n][i].error for n, i in choice.items())
    names = list(options)
    best = min(sum(options[n][i].error for n, i in zip(names, combo))
               for combo in itertools.product(*(range(len(options[n])) for n in names))
               if sum(options[n][i].bits for n, i in zip(names, combo)) <= limit)
    assert err <= best * 1.05  # the Lagrangian choice plus the greedy fill: within 5% of the optimum here
    # never worse than any one uniform config that fits the same budget
    for k in range(len(DEFAULT_OPTIONS)):
        if all(len(o) == len(DEFAULT_OPTIONS) for o in options.values()):
            uniform_bits = sum(o[k].bits for o in options.values())
            if uniform_bits <= limit:
                assert err <= sum(o[k].error for o in options.values()) + 1e-9


def test_a_budget_below_every_assignment_is_refused_with_the_reachable_minimum():
    options = {"x": [Option(QuantConfig(bits=4), 400, 1.0), Option(QuantConfig(bits=8), 800, 0.1)]}
    with pytest.raises(ValueError, match=r"below the smallest candidate assignment \(4.000 bits per weight\)"):
        choose(options, {"x": 100}, 3.0)


def test_the_choice_is_an_ordinary_recipe_file_that_reads_back(tmp_path):
    chosen = [("model.layers.0.self_attn.q_proj", QuantConfig(bits=4, group_size=32)),
              ("model.layers.0.mlp.down_proj", QuantConfig(bits=6, group_size=32, symmetric=False))]
    recipe = budget_recipe(chosen)
    path = tmp_path / "budget.json"
    path.write_text(json.dumps(recipe.to_dict(), indent=1))
    back = QuantRecipe.from_file(path)
    assert back.get_config("model.layers.0.self_attn.q_proj") == chosen[0][1]
    assert back.get_config("model.layers.0.mlp.down_proj") == chosen[1][1]
    assert back.get_config("model.layers.10.self_attn.q_proj") is None  # exact names only
