"""Per-input-channel importance from a calibration run (the imatrix idea).

`collect_importance(model, batches)` runs the unquantized model on a few token batches and
returns, for every `nn.Linear` (by the module name a recipe sees), the mean over tokens of the
squared input activation of each input column: E[x_k^2]. A weight error on column k then costs
about importance[k] times its square in the layer's output (for independent activations), so
quantizers and the budget weight their squared error by it (`llmq.quant.budget.weight_error`).

Only the statistics are kept (one float64 vector per layer), never the activations;
`collect_calibration` also keeps a small sample of input rows per layer (at most
`sample_rows` tokens, spread over the text) so a report can measure each layer's output error,
and with ``hessians=True`` the inputs' second moment X^T X / tokens per layer (float32 [K, K]: what
error-compensating rounding such as GPTQ needs). `CalibrationAccumulator` is the one place these
statistics are gathered: the whole-model run here and the layer-by-layer run
(models/pipeline/layerwise.py) feed it the same rows in the same order.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Optional

import torch
from torch import nn


class CalibrationAccumulator:
    """Per-module running sums of what a calibration run sees at a linear's input: sum of x^2 per
    column (float64), the token count, every `sample_every`-th row (at most `sample_rows`), and with
    `hessians` the sum of x x^T (float64 [K, K]). ``hook(name)`` is a forward pre-hook feeding
    ``observe(name, x)``; ``calibration(tokens, floor)`` gives the result."""

    def __init__(self, sample_rows: int = 0, sample_every: int = 1, hessians: bool = False):
        self.sum_sq: Dict[str, torch.Tensor] = {}
        self.count: Dict[str, int] = {}
        self.samples: Dict[str, list] = {}
        self.xtx: Dict[str, torch.Tensor] = {}
        self.sample_rows = sample_rows
        self.sample_every = max(1, sample_every)
        self.hessians = hessians

    def observe(self, name: str, x: torch.Tensor) -> None:
        flat = x.detach().reshape(-1, x.shape[-1]).double()
        acc = self.sum_sq.get(name)
        add = flat.pow(2).sum(dim=0)
        self.sum_sq[name] = add if acc is None else acc + add
        if self.hessians:  # X^T X in float64: a sum over many tokens
            prev = self.xtx.get(name)
            self.xtx[name] = flat.T @ flat if prev is None else prev.addmm_(flat.T, flat)
        seen = self.count.get(name, 0)
        self.count[name] = seen + flat.shape[0]
        if self.sample_rows:
            kept = self.samples.setdefault(name, [])
            have = sum(t.shape[0] for t in kept)
            # token t of the text is kept when t % sample_every == 0 (evenly spread)
            first = (-seen) % self.sample_every
            rows = flat[first::self.sample_every][: self.sample_rows - have]
            if rows.shape[0]:
                kept.append(rows.float().clone())

    def hook(self, name: str):
        def record(module: nn.Module, args) -> None:
            self.observe(name, args[0])

        return record

    def calibration(self, tokens: int, floor: float = 1e-6) -> "Calibration":
        inputs = {name: torch.cat(rows) for name, rows in self.samples.items() if rows}
        hessians = {name: (total / self.count[name]).float() for name, total in self.xtx.items()}
        return Calibration(_importance(self, floor), inputs, tokens, hessians)


@torch.no_grad()
def collect_importance(model: nn.Module, batches: Iterable[torch.Tensor], floor: float = 1e-6) -> Dict[str, torch.Tensor]:
    """{linear module name: float32 [in_features] E[x^2]} over every token of every batch
    (each batch a LongTensor of token ids [batch, seq] passed as model(ids)). A column the text
    never excites (E[x^2] = 0) gets `floor` times the layer's mean instead, so every weight
    stays > 0 (quantizers take a positive importance; a dead column's error then costs little)."""
    acc = CalibrationAccumulator()
    _run(model, batches, acc)
    return _importance(acc, floor)


def _run(model: nn.Module, batches: Iterable[torch.Tensor], acc: CalibrationAccumulator) -> None:
    handles = [m.register_forward_pre_hook(acc.hook(name)) for name, m in model.named_modules()
               if isinstance(m, nn.Linear)]
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in handles:
            h.remove()


def _importance(acc: CalibrationAccumulator, floor: float) -> Dict[str, torch.Tensor]:
    out = {}
    for name, total in acc.sum_sq.items():
        mean_sq = total / acc.count[name]
        out[name] = mean_sq.clamp_min(floor * max(float(mean_sq.mean()), 1e-30)).float()
    return out


@dataclasses.dataclass
class Calibration:
    """What a calibration text tells about each linear layer (keyed by module name):
    `importance` [K] = E[x_k^2] (floored as in collect_importance), `inputs` [R, K] float32 =
    R <= sample_rows input rows seen by the layer (tokens spread evenly over the text),
    `tokens` = how many tokens were run; `hessians` [K, K] float32 = the mean over the tokens of
    x x^T (X^T X / tokens, what method "gptq" rounds against), only when collected with
    hessians=True (else empty); `expert_tokens` [E]
    int64 = per stacked routed-experts module, the tokens routed to each expert (where the run
    counted them: models/pipeline/calibration.py)."""

    importance: Dict[str, torch.Tensor]
    inputs: Dict[str, torch.Tensor]
    tokens: int
    hessians: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    expert_tokens: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def importance_of(self, module: str) -> Optional[torch.Tensor]:
        return self.importance.get(module)

    def inputs_of(self, module: str) -> Optional[torch.Tensor]:
        return self.inputs.get(module)

    def hessian_of(self, module: str) -> Optional[torch.Tensor]:
        return self.hessians.get(module)


@torch.no_grad()
def collect_calibration(model: nn.Module, batches: Iterable[torch.Tensor], *, sample_rows: int = 64,
                        floor: float = 1e-6, hessians: bool = False) -> Calibration:
    """collect_importance plus, per linear, every (tokens // sample_rows)-th input row (at most
    sample_rows of them): enough to measure a layer's output error ||X (W - W')^T|| on real
    activations without keeping them all (sample_rows * K floats per layer); with `hessians`, the
    mean of x x^T per linear as well (K * K floats per layer)."""
    batches = list(batches)  # token ids only: the count sets the sampling stride before the run
    tokens = sum(int(b.numel()) for b in batches)
    acc = CalibrationAccumulator(sample_rows=sample_rows, sample_every=sample_stride(tokens, sample_rows),
                                 hessians=hessians)
    _run(model, batches, acc)
    return acc.calibration(tokens, floor)


def sample_stride(tokens: int, sample_rows: int) -> int:
    """Every how many tokens a sampled input row is kept, for `sample_rows` spread over `tokens`."""
    return max(1, tokens // max(sample_rows, 1))


def token_batches(ids: torch.Tensor, seq_len: int) -> Iterable[torch.Tensor]:
    """A 1-D token stream cut into [1, seq_len] batches (the last one shorter)."""
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"calibration tokens must be a non-empty 1-D tensor, got shape {list(ids.shape)}")
    for start in range(0, ids.numel(), seq_len):
        yield ids[start:start + seq_len].unsqueeze(0)
