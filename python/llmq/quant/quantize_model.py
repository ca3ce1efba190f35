"""quantize_model: swap a model's Linear (and, if the recipe says so, Embedding) modules for
their quantized counterparts, and report what changed."""

from __future__ import annotations

import copy
import dataclasses
from typing import List, Optional, Tuple

from torch import nn

from llmq.quant.modules import QuantizedEmbedding, QuantizedLinear
from llmq.quant.recipe import QuantConfig, QuantRecipe, layer_index


@dataclasses.dataclass(frozen=True)
class ReportEntry:
    """One replaced module."""

    fqn: str
    kind: str  # "linear" or "embedding"
    config: QuantConfig
    shape: Tuple[int, ...]
    bytes_before: int
    bytes_after: int


@dataclasses.dataclass
class QuantizationReport:
    """What quantize_model did: one entry per quantized module, plus the kept ones' names."""

    model: Optional[nn.Module] = dataclasses.field(default=None, repr=False)  # the quantized model (a copy when inplace=False)
    entries: List[ReportEntry] = dataclasses.field(default_factory=list)
    kept: List[str] = dataclasses.field(default_factory=list)

    @property
    def bytes_before(self) -> int:
        return sum(e.bytes_before for e in self.entries)

    @property
    def bytes_after(self) -> int:
        return sum(e.bytes_after for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def format_table(self) -> str:
        """A short text table for people (one line per module, then totals)."""
        lines = [f"{'module':<48} {'config':<16} {'shape':<18} {'before':>12} {'after':>12}"]
        for e in self.entries:
            lines.append(f"{e.fqn:<48} {e.config.describe():<16} {str(list(e.shape)):<18} {e.bytes_before:>12,} {e.bytes_after:>12,}")
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 0.0
        lines.append(f"{len(self.entries)} modules quantized, {len(self.kept)} kept: "
                     f"{self.bytes_before:,} -> {self.bytes_after:,} bytes ({ratio:.3f}x)")
        return "\n".join(lines)


def _infer_num_layers(model: nn.Module) -> Optional[int]:
    indices = [i for i in (layer_index(name) for name, _ in model.named_modules()) if i is not None]
    return max(indices) + 1 if indices else None


def _set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def quantize_model(model: nn.Module, recipe: QuantRecipe, *, inplace: bool = True):
    """Replace each nn.Linear / nn.Embedding whose fqn the recipe maps to a config by a
    QuantizedLinear / QuantizedEmbedding. Returns a QuantizationReport whose `.model` is the
    quantized model: `model` itself, or with inplace=False a deep copy (input untouched)."""
    if not isinstance(recipe, QuantRecipe):
        raise ValueError(f"quantize_model expects a QuantRecipe, got {type(recipe).__name__}")
    target = model if inplace else copy.deepcopy(model)
    if recipe.needs_num_layers:
        n = _infer_num_layers(target)
        if n is None:
            raise ValueError("the recipe counts layers from the end, but the model has no 'layers.N' modules")
        recipe = recipe.bind(n)
    report = QuantizationReport(model=target)
    todo = []
    for fqn, module in target.named_modules():
        if type(module) not in (nn.Linear, nn.Embedding):
            continue
        config = recipe.get_config(fqn)
        if config is None:
            report.kept.append(fqn)
        else:
            todo.append((fqn, module, config))
    for fqn, module, config in todo:
        if isinstance(module, nn.Linear):
            new, kind = QuantizedLinear.from_linear(module, config, name=fqn), "linear"
        else:
            new, kind = QuantizedEmbedding.from_embedding(module, config, name=fqn), "embedding"
        w = module.weight
        qw = new.quantized_weight()
        report.entries.append(ReportEntry(fqn, kind, config, tuple(w.shape), w.numel() * w.element_size(), qw.nbytes))
        _set_submodule(target, fqn, new)
    return report
