"""bench_pte's agreement measures (free-running divergence, margins there, teacher-forced top-1, first-step
closeness) on two bigram "models" whose answers are known by construction; no executorch needed."""

from __future__ import annotations

import torch

from models.pipeline import bench_pte

V = 16


def bigram(table: torch.Tensor):
    """(prefill, decode) with export_pt2's step signatures: the logits after token t are table[t]."""

    def prefill(input_ids):
        return table[input_ids], ()

    def decode(input_ids, position, cache):
        assert position.dtype == torch.long and position.dim() == 0
        return table[input_ids], cache

    return prefill, decode


def chain_table(seed: int = 0) -> torch.Tensor:
    """Logits whose argmax after t is t+1 (mod V), runner-up t+2, with margins that differ per row."""
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(V, V, generator=g, dtype=torch.float64)  # in [0, 1)
    for t in range(V):
        table[t, (t + 1) % V] = 3.0 + 0.1 * t
        table[t, (t + 2) % V] = 2.0 + 0.05 * t
    return table


def test_identical_models_agree_everywhere():
    table = chain_table()
    a = bench_pte.text_agreement(bigram(table), bigram(table.clone()), [0], 32, eos=set(),
                                 reference_steps=bigram(table.clone()))
    assert a["eager"] == [(i + 1) % V for i in range(32)] == a["pte"]
    assert a["diverges_at"] is None and a["top1"] == a["positions"] == 32
    assert a["forced_disagree_margins"] == [] and "eager_margin" not in a
    assert a["first"]["max_diff"] == 0 and abs(a["first"]["cosine"] - 1) < 1e-12
    assert a["first_reference"]["max_diff"] == 0 and a["first_pte_reference"]["max_diff"] == 0
    assert bench_pte.agreement_row("p", a, 32)[1:4] == ("32/32", "-", "32/32")


def test_one_flipped_row_diverges_there_with_its_margins():
    eager = chain_table()
    pte = eager.clone()
    pte[5, 7] = eager[5, 6] + 0.25  # after token 5 the .pte picks eager's runner-up 7
    pte[0] += 0.5  # the first step's logits differ by a constant: cosine < 1, max diff 0.5
    a = bench_pte.text_agreement(bigram(eager), bigram(pte), [3, 0], 32, eos=set(), reference_steps=bigram(pte))
    assert a["eager"][:6] == [1, 2, 3, 4, 5, 6] and a["pte"][:6] == [1, 2, 3, 4, 5, 7]
    assert a["diverges_at"] == 5
    assert a["eager_margin"] == float(eager[5, 6] - eager[5, 7]) == 1.25
    assert abs(a["pte_margin"] - 0.25) < 1e-12 and a["rank"] == 1
    assert abs(a["eager_top2_at"] - a["eager_margin"]) < 1e-12  # .pte's token is eager's runner-up
    # teacher-forced along eager's 1, 2, ..., 15, 0, 1, ...: the .pte differs wherever the context ends in 5
    assert a["top1"] == 30 and a["positions"] == 32
    assert a["forced_disagree_margins"] == [a["eager_margin"]] * 2
    assert abs(a["first"]["max_diff"] - 0.5) < 1e-12 and a["first"]["max_logit"] == 3.0
    assert 0.9 < a["first"]["cosine"] < 1
    assert a["first_pte_reference"]["max_diff"] == 0  # the reference is the .pte itself
    assert a["first_reference"] == a["first"]
    row = bench_pte.agreement_row("p", a, 32)
    assert row[1] == "5/32" and row[2] == "1.25 / 0.25 (rank 1)" and row[3] == "30/32"


def test_eos_stops_both_and_a_shorter_side_diverges_where_it_stops():
    eager = chain_table()
    a = bench_pte.text_agreement(bigram(eager), bigram(eager.clone()), [0], 32, eos={4})
    assert a["eager"] == [1, 2, 3, 4] and a["diverges_at"] is None and a["positions"] == 4
    assert bench_pte.agreement_row("p", a, 32)[1] == "4/32 (eos)"
    pte = eager.clone()
    pte[2, 4] = 10.0  # the .pte reaches eos one token early
    b = bench_pte.text_agreement(bigram(eager), bigram(pte), [0], 32, eos={4})
    assert b["pte"] == [1, 2, 4] and b["diverges_at"] == 2 and b["rank"] == 1


def test_markdown_table_has_header_rule():
    text = bench_pte.markdown_table([("a", "bb"), ("ccc", "d")])
    assert text.splitlines() == ["| a   | bb |", "|-----|----|", "| ccc | d  |"]


def test_dequantized_once_gives_the_same_outputs_and_restores():
    from llmq.quant import QuantizedLinear
    from llmq.quant.recipe import QuantConfig

    g = torch.Generator().manual_seed(0)
    layers = [torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False)]
    for lin in layers:
        lin.weight.data = torch.randn(lin.weight.shape, generator=g)
    model = torch.nn.Sequential(QuantizedLinear.from_linear(layers[0], QuantConfig(bits=4, group_size=32)),
                                torch.nn.GELU(), QuantizedLinear.from_linear(layers[1], QuantConfig(bits=8)))
    x = torch.randn(3, 64, generator=g)
    before = model(x)
    with bench_pte.dequantized_once(model):
        assert all("_dequantized" in vars(m) for m in model if isinstance(m, QuantizedLinear))
        assert torch.equal(model(x), before) and torch.equal(model(x), before)
    assert not any("_dequantized" in vars(m) for m in model)
    model[2].weight_scale.mul_(2)  # after exit the forward dequantizes again: a changed scale shows
    assert not torch.equal(model(x), before)
