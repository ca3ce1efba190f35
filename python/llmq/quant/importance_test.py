"""collect_importance against the activations computed by hand."""

import pytest
import torch
from torch import nn

from llmq.quant.importance import collect_calibration, collect_importance, token_batches


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8, bias=False)

    def forward(self, ids):
        return self.down(torch.relu(self.up(self.embed(ids))))


def test_importance_is_the_mean_squared_input_of_every_linear():
    torch.manual_seed(0)
    model = Tiny()
    ids = torch.randint(0, 50, (37,))
    got = collect_importance(model, token_batches(ids, 10))
    assert set(got) == {"up", "down"}
    x = model.embed.weight[ids].double()  # every token once, by hand
    h = torch.relu(x @ model.up.weight.double().T + model.up.bias.double())
    torch.testing.assert_close(got["up"].double(), (x ** 2).mean(0), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got["down"].double(), (h ** 2).mean(0), rtol=1e-5, atol=1e-7)
    assert not model.up._forward_pre_hooks  # hooks removed


def test_a_column_never_excited_gets_a_small_positive_floor():
    model = nn.Sequential(nn.Linear(4, 3))
    x = torch.tensor([[[1.0, 0.0, 2.0, 0.0]]])
    got = collect_importance(model, [x])["0"]
    mean = (1 + 4) / 4
    assert got.tolist() == pytest.approx([1.0, 1e-6 * mean, 4.0, 1e-6 * mean])


def test_token_batches_cover_the_stream_and_refuse_bad_input():
    ids = torch.arange(25)
    assert torch.equal(torch.cat([b[0] for b in token_batches(ids, 10)]), ids)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        list(token_batches(torch.zeros(2, 3, dtype=torch.long), 4))


def test_calibration_keeps_evenly_spread_input_rows():
    torch.manual_seed(1)
    model = Tiny()
    ids = torch.randint(0, 50, (37,))
    cal = collect_calibration(model, token_batches(ids, 10), sample_rows=6)
    assert cal.tokens == 37
    x = model.embed.weight[ids].detach()
    every = 37 // 6  # token t kept when t % every == 0, at most 6 rows
    torch.testing.assert_close(cal.inputs_of("up"), x[::every][:6])
    assert cal.inputs_of("down").shape == (6, 32)
    torch.testing.assert_close(cal.importance_of("up"), collect_importance(model, token_batches(ids, 10))["up"])
    assert cal.inputs_of("embed") is None


def test_hessians_are_the_mean_outer_product_of_each_linears_inputs_when_asked():
    torch.manual_seed(2)
    model = Tiny()
    ids = torch.randint(0, 50, (37,))
    assert collect_calibration(model, token_batches(ids, 10)).hessians == {}
    cal = collect_calibration(model, token_batches(ids, 10), hessians=True)
    x = model.embed.weight[ids].detach().double()  # every token once, by hand
    h = torch.relu(x @ model.up.weight.detach().double().T + model.up.bias.detach().double())
    assert cal.hessian_of("up").dtype == torch.float32 and cal.hessian_of("up").shape == (16, 16)
    torch.testing.assert_close(cal.hessian_of("up").double(), x.T @ x / 37, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(cal.hessian_of("down").double(), h.T @ h / 37, rtol=1e-5, atol=1e-7)
    # its diagonal is the importance (before the floor)
    torch.testing.assert_close(cal.hessian_of("up").diagonal(), cal.importance_of("up"), rtol=1e-5, atol=1e-7)
    assert cal.hessian_of("embed") is None
