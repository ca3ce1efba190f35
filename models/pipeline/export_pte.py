"""ExecuTorch .pte export of a quantized model's prefill and decode steps, lowered to XNNPACK.

The steps and their static cache are export_pt2's (`PrefillStep`, `DecodeStep`, a model's
`StaticCacheLayout`); one .pte holds both as the methods `prefill` and `decode`:

    prefill(input_ids [1, S])                      -> (logits [1, S, V], *cache)
    decode(input_ids [1, 1], position [], *cache)  -> (logits [1, 1, V], *cache')

Before export every llmq-quantized linear becomes an nn.Linear whose weight is torchao's
IntxUnpackedToInt8Tensor in the form Int8DynamicActivationIntxWeightConfig produces (8da4w /
8da8w): the bundle's codes, scales and zero points carried over exactly (llmq.quant.to_torchao,
never requantized), activations quantized to int8 per token at run time. XNNPACK runs those
linears on its integer kernels. Routed experts (Qwen3.5-MoE) run through llmq's quantized_moe_ffn
op, kept as one node and run in the .pte by its ExecuTorch kernel (models/pipeline/moe_pte.py,
cpp/moe/moe_executorch_op.cc); with --pte_experts=dense they become one 8da linear per expert run
as a dense loop over all experts weighted by the routing (every expert's GEMM for every token).
Ops without an ExecuTorch kernel are decomposed first (models/pipeline/pte_decompositions.py: the
delta rule's triangular solve).

Refused before lowering, one line naming the weight (`check_lowerable`): weight-only torchao weights
(IntxWeightOnlyConfig) and asymmetric ones (non-zero zero points), which XNNPACK's partitioner
accepts but the .pte computes garbage for; 8-bit weights in groups (XNNPACK: per channel only) and
4-bit groups not a multiple of 32. The one inexact step is XNNPACK's: it stores 4-bit group scales
as bfloat16 (relative rounding <= 2^-9 per scale); 8-bit per-channel scales stay float32.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from absl import flags
from torch import nn

from llmq.checkpoint import CheckpointError
from llmq.checkpoint.workfolder import publish_file
from llmq.quant import QuantizedLinear, to_torchao
from models.pipeline import export_pt2, quantize_and_save
from models.pipeline.agreement import format_table
from models.pipeline.arch import Architecture
from models.pipeline.export_pt2 import DecodeStep, PrefillStep, StaticCacheLayout
from models.pipeline.quantized_model import QuantizedExperts, _StackedQuantized

FLAGS = flags.FLAGS
flags.DEFINE_enum("pte_experts", "op", ["op", "dense"], "Routed experts in the .pte: 'op' runs llmq's "
                  "quantized_moe_ffn kernel (//cpp/moe:_moe_executorch_kernel.so), 'dense' every expert as 8da "
                  "linears on XNNPACK, weighted by the routing.")

ACTIVATION = "int8_asym_per_token"


class ExecuTorchUnavailable(RuntimeError):
    """executorch is not importable here (it is an optional dependency: docs/executorch.md)."""


def require_executorch() -> None:
    try:
        import executorch.exir  # noqa: F401
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner  # noqa: F401
    except ImportError as e:
        raise ExecuTorchUnavailable(f"executorch is not installed ({e}); pip install executorch==1.5.1 "
                                    "(see docs/executorch.md)") from None


# ---------------------------------------------------------------------------------------------
# llmq quantized modules -> torchao 8da tensors (exact)


def _ao_linear(qw, bias: Optional[torch.Tensor]) -> nn.Linear:
    n, k = qw.shape
    lin = nn.Linear(k, n, bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(to_torchao(qw, activation_quantization=ACTIVATION), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().float().clone(), requires_grad=False)
    return lin


class DenseLoopExperts(nn.Module):
    """QuantizedExperts with each expert's gate_up and down as 8da torchao linears; forward runs every
    expert on every token and weights it by the routing (zero where not routed), as QuantizedExperts
    does under torch.export."""

    def __init__(self, experts: QuantizedExperts):
        super().__init__()
        self.num_experts = experts.num_experts
        self.gate_up = nn.ModuleList(self._expert_linears(experts.gate_up))
        self.down = nn.ModuleList(self._expert_linears(experts.down))

    def _expert_linears(self, holder: nn.Module) -> List[nn.Module]:
        if not isinstance(holder, _StackedQuantized):  # a float stack: keep float linears
            out = []
            for e in range(self.num_experts):
                w = holder.expert(e)
                lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
                lin.weight = nn.Parameter(w.detach().float().clone(), requires_grad=False)
                out.append(lin)
            return out
        from llmq.quant import GroupQuantizedWeight

        n = holder.scale.shape[1]
        return [_ao_linear(GroupQuantizedWeight(qdata=holder.qdata[e], scale=holder.scale[e], bias=holder.bias[e],
                                                bits=holder.bits, group_size=holder.group_size, shape=(n, holder.k),
                                                dtype=torch.float32), None)
                for e in range(self.num_experts)]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        per_expert = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype).scatter_add(1, index, weights)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            gate, up = self.gate_up[e](x).chunk(2, dim=-1)
            out = out + self.down[e](F.silu(gate) * up) * per_expert[:, e, None]
        return out


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@torch.no_grad()
def to_8da(model: nn.Module) -> Dict[str, int]:
    """Swap the model's QuantizedLinear / QuantizedExperts for their torchao 8da form, in place.
    Returns counts {"linears": ..., "expert_blocks": ...}."""
    linears, experts = [], []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            linears.append(name)
        elif isinstance(module, QuantizedExperts):
            experts.append(name)
    for name in linears:
        module = model.get_submodule(name)
        _set_module(model, name, _ao_linear(module.quantized_weight(), module.bias))
    for name in experts:
        _set_module(model, name, DenseLoopExperts(model.get_submodule(name)))
    return {"linears": len(linears), "expert_blocks": len(experts)}


def check_lowerable(model: nn.Module) -> int:
    """Raise ValueError (one line naming the parameter) for the first torchao quantized weight of `model` that
    XNNPACK would lower to a wrong .pte or refuse deep inside lowering; returns how many were checked.

    Measured with executorch 1.5.1 (models/pipeline/export_pte_test.py): weight-only weights and weights with a
    non-zero zero point (asymmetric) are accepted by the partitioner and the .pte computes garbage (XNNPACK's
    per-channel and per-group weight parameters carry no zero point); 8-bit weights lower only per channel and
    4-bit only in groups of a multiple of 32 (an assertion in its serializer otherwise)."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    checked = 0
    for name, p in model.named_parameters():
        if not isinstance(p, IntxUnpackedToInt8Tensor):
            continue
        bits = int(str(p.target_dtype).replace("torch.int", ""))
        k, group = p.shape[-1], p.block_size[-1]
        if p.activation_quantization is None:
            problem = ("weight-only torchao weight (IntxWeightOnlyConfig) refused: XNNPACK lowers it to a .pte that "
                       "returns garbage; use the 8da form (Int8DynamicActivationIntxWeightConfig, "
                       f"to_torchao(..., activation_quantization='{ACTIVATION}'))")
        elif bool(p.zero_point.any()):
            problem = ("asymmetric weight (non-zero zero points) refused: XNNPACK drops zero points and the .pte "
                       "returns garbage; quantize with symmetric=True (e.g. --recipe=int4)")
        elif bits == 8 and group != k:
            problem = (f"8-bit weight in groups of {group} refused: XNNPACK lowers 8-bit weights only per channel "
                       "(group_size -1, e.g. --recipe=int8)")
        elif bits == 4 and group % 32:
            problem = f"4-bit weight in groups of {group} refused: XNNPACK needs a group size that is a multiple of 32"
        elif bits not in (4, 8):
            problem = f"{bits}-bit weight refused: XNNPACK lowers 4-bit (grouped) and 8-bit (per channel) weights only"
        else:
            checked += 1
            continue
        raise ValueError(f"{name}: {problem}")
    return checked


# ---------------------------------------------------------------------------------------------
# Lowering and running


def lower_programs(programs: Dict[str, "torch.export.ExportedProgram"]):
    """pte_decompositions -> to_edge_transform_and_lower(XnnpackPartitioner) -> to_executorch(); returns the
    ExecutorchProgramManager. llmq's MoE op stays one node (its out variant after to_executorch)."""
    require_executorch()
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from models.pipeline.pte_decompositions import decompose_for_pte

    programs = {name: decompose_for_pte(p) for name, p in programs.items()}
    has_op = any("quantized_moe_ffn" in str(n.target) for p in programs.values() for n in p.graph.nodes)
    if has_op:
        from models.pipeline import moe_pte  # noqa: F401  (defines the op's out variant for to_executorch)
    # llmq's op is no core ATen op; the IR check would refuse it (the rest is checked by lowering itself)
    config = EdgeCompileConfig(_check_ir_validity=not has_op)
    edge = to_edge_transform_and_lower(programs, partitioner=[XnnpackPartitioner()], compile_config=config)
    return edge.to_executorch()


def export_module_pte(module: nn.Module, example_args: tuple, out_path: str) -> str:
    """One module (method `forward`) -> .pte, refusing weight-only torchao weights first."""
    check_lowerable(module)
    program = torch.export.export(module, example_args, strict=False)
    manager = lower_programs({"forward": program})
    write_pte(manager, out_path)
    return out_path


def write_pte(manager, out_path: str) -> str:
    """The lowered program's .pte at `out_path`, atomically (llmq.checkpoint.workfolder.publish_file:
    locked, written in `<out>.partial/`, fsynced, renamed): a failed or killed export leaves no
    file there, and another run writing the same path is refused at once."""
    return publish_file(out_path, manager.write_to_file, writer="pte", overwrite=True)


def delegated_fraction(manager, method: str) -> Dict[str, int]:
    """{"delegates": lowered XNNPACK subgraphs, "linear_outside": aten linear/mm nodes left outside them}."""
    graph = manager.exported_program(method).graph
    delegates = sum(1 for n in graph.nodes if n.op == "call_function" and "executorch_call_delegate" in str(n.target))
    outside = sum(1 for n in graph.nodes if n.op == "call_function"
                  and any(op in str(n.target) for op in ("aten.linear", "aten.mm", "aten.addmm", "aten.bmm")))
    return {"delegates": delegates, "linear_outside": outside}


class PteRunner:
    """The .pte's methods through executorch.runtime, with export_pt2's step signatures."""

    def __init__(self, path: str, moe_kernel: bool = False):
        """moe_kernel: the program calls llmq::quantized_moe_ffn.out; load its kernel library first (done
        anyway when the file names the op; a missing library is one clear error, not ExecuTorch's 0x14)."""
        require_executorch()
        from llmq.ops.executorch_kernel import load_executorch_kernel, load_method, load_program

        start = time.perf_counter()
        if moe_kernel:
            load_executorch_kernel()
        self.program = load_program(path)
        self.prefill_method = load_method(self.program, "prefill", path)
        self.decode_method = load_method(self.program, "decode", path)
        self.load_seconds = time.perf_counter() - start

    def prefill(self, input_ids: torch.Tensor):
        out = self.prefill_method.execute([input_ids])
        return out[0], tuple(out[1:])

    def decode(self, input_ids: torch.Tensor, position: torch.Tensor, cache: Sequence[torch.Tensor]):
        out = self.decode_method.execute([input_ids, position, *cache])
        return out[0], tuple(out[1:])


@torch.no_grad()
def export_steps_pte(model: nn.Module, layout: StaticCacheLayout, *, prompt_len: int, max_seq_len: int,
                     dynamic_prompt: bool, out_path: str):
    """torch.export both steps of an 8da model, lower to XNNPACK, write one .pte; returns the manager."""
    check_lowerable(model)
    prefill, decode = export_pt2.export_steps(model, layout, prompt_len=prompt_len, max_seq_len=max_seq_len,
                                              dynamic_prompt=dynamic_prompt)
    manager = lower_programs({"prefill": prefill, "decode": decode})
    write_pte(manager, out_path)
    return manager, (prefill, decode)


def model_to_pte(model: nn.Module, layout: StaticCacheLayout, *, prompt_len: int, max_seq_len: int,
                 dynamic_prompt: bool, out_path: str, experts: str = "op"):
    """The eager quantized model (changed in place) -> .pte at `out_path`: MoE blocks to llmq's op (experts="op",
    where the model has any) or dense 8da loops, every other quantized linear to 8da, then export_steps_pte.
    Returns (manager, (prefill, decode) programs, counts {"linears", "expert_blocks", "moe_op_blocks"})."""
    op_blocks: List[str] = []
    if experts == "op" and any(isinstance(m, QuantizedExperts) for m in model.modules()):
        op_blocks = _swap_in_moe_op(model)
    counts = to_8da(model)
    counts["moe_op_blocks"] = len(op_blocks)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    manager, programs = export_steps_pte(model, layout, prompt_len=prompt_len, max_seq_len=max_seq_len,
                                         dynamic_prompt=dynamic_prompt, out_path=out_path)
    return manager, programs, counts


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@torch.no_grad()
def compare(reference_steps, pte: PteRunner, prompt: torch.Tensor, decode_steps: int, tokens: Optional[List[int]] = None):
    """Prefill + decode steps through (prefill, decode) callables `reference_steps` and the .pte, feeding both the
    reference's greedy tokens (or `tokens`); returns per-step logits of each."""
    ref_prefill, ref_decode = reference_steps
    ref_logits, ref_cache = ref_prefill(prompt)
    got_logits, got_cache = pte.prefill(prompt)
    ref_all, got_all, fed = [ref_logits], [got_logits], []
    position = prompt.shape[1]
    for i in range(decode_steps):
        token = torch.tensor([[tokens[i]]]) if tokens is not None else ref_logits[:, -1:].argmax(-1)
        fed.append(int(token))
        pos = torch.tensor(position, dtype=torch.long)
        ref_logits, ref_cache = ref_decode(token, pos, tuple(ref_cache))
        got_logits, got_cache = pte.decode(token, pos, got_cache)
        ref_all.append(ref_logits)
        got_all.append(got_logits)
        position += 1
    return {"reference": ref_all, "pte": got_all, "tokens": fed}


# ---------------------------------------------------------------------------------------------
# The job


def run(arch: Architecture, make_layout: Callable[[nn.Module, int], StaticCacheLayout], *, dynamic_prompt: bool,
        bundle: Optional[str] = None, checkpoint: Optional[str] = None, recipe: Optional[str] = None,
        out: Optional[str] = None, max_seq_len: int = 128, decode_steps: int = 4, prompt_len: int = 8, seed: int = 0,
        quiet: bool = False, experts: str = "op") -> Dict:
    """Load the quantized model, swap MoE blocks for the op (experts="op") or not ("dense"), convert the rest to
    8da, export + lower + write the .pte, run it, compare with eager."""
    require_executorch()
    if experts not in ("op", "dense"):
        raise quantize_and_save.UsageError(f"--pte_experts {experts!r}: expected op or dense")
    if prompt_len + decode_steps > max_seq_len:
        raise quantize_and_save.UsageError(f"--prompt_len {prompt_len} + --decode_steps {decode_steps} exceeds "
                                           f"--max_seq_len {max_seq_len} (the cache capacity)")
    recipe = recipe or arch.default_recipe
    log = (lambda *a: None) if quiet else print
    with tempfile.TemporaryDirectory(prefix=f"llmq-pte-{arch.name}-") as workdir:
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            model, bundle_path = export_pt2.load_quantized_model(arch, bundle=bundle, checkpoint=checkpoint,
                                                                 recipe=recipe, seed=seed, workdir=workdir)
    export_pt2.to_float32(model)
    layout = make_layout(model, max_seq_len)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=g)
    with torch.no_grad():  # the llmq eager model's own steps, before the swap
        eager = {"prefill": PrefillStep(model, layout), "decode": DecodeStep(model, layout)}
        eager_logits = _eager_logits(eager, prompt, decode_steps)
    if out is None:
        out = os.path.join(tempfile.mkdtemp(prefix=f"llmq-pte-{arch.name}-"), "model.pte")
    start = time.perf_counter()
    manager, programs, counts = model_to_pte(model, layout, prompt_len=prompt_len, max_seq_len=max_seq_len,
                                             dynamic_prompt=dynamic_prompt, out_path=out, experts=experts)
    lower_seconds = time.perf_counter() - start
    op_blocks = counts["moe_op_blocks"]
    pte = PteRunner(out, moe_kernel=bool(op_blocks))
    tokens = eager_logits["tokens"]
    ao = compare((programs[0].module(), programs[1].module()), pte, prompt, decode_steps, tokens)
    scale = max(t.abs().max().item() for t in eager_logits["logits"])
    vs_eager = [_max_diff(a, b) for a, b in zip(eager_logits["logits"], ao["pte"])]
    vs_ao = [_max_diff(a, b) for a, b in zip(ao["reference"], ao["pte"])]
    stats = {d: delegated_fraction(manager, d) for d in ("prefill", "decode")}
    rows = [
        ("architecture", arch.name), ("recipe", recipe),
        ("bundle", bundle_path + (" (temporary)" if bundle is None else "")),
        ("output", out), ("size", f"{os.path.getsize(out):,} bytes"),
        ("converted to 8da", f"{counts['linears']} linears, {counts['expert_blocks']} expert blocks (dense loop)"),
        ("MoE op blocks", f"{op_blocks} (llmq::quantized_moe_ffn.out; prefill/decode calls "
                          f"{_op_calls(manager, 'prefill')} / {_op_calls(manager, 'decode')})"),
        ("XNNPACK delegates prefill/decode", f"{stats['prefill']['delegates']} / {stats['decode']['delegates']}"),
        ("linears outside XNNPACK", f"{stats['prefill']['linear_outside']} / {stats['decode']['linear_outside']}"),
        ("export + lower time", f"{lower_seconds:.1f} s"), ("load time", f"{pte.load_seconds * 1e3:.1f} ms"),
        ("max |logit| (eager llmq)", f"{scale:.3f}"),
    ]
    for i, (a, b) in enumerate(zip(vs_eager, vs_ao)):
        rows.append((f"max |diff| {'prefill' if i == 0 else f'decode {i}'}",
                     f".pte vs eager llmq {a:.2e}; .pte vs torchao eager 8da {b:.2e}"))
    log(format_table(rows))
    return {"out": out, "counts": counts, "op_calls": {d: _op_calls(manager, d) for d in ("prefill", "decode")},
            "stats": stats, "vs_eager": vs_eager, "vs_ao": vs_ao, "scale": scale,
            "eager": eager_logits, "ao": ao, "pte": pte, "model": model, "layout": layout, "prompt": prompt}


def _swap_in_moe_op(model: nn.Module) -> List[str]:
    """MoE blocks -> llmq's op (models/pipeline/moe_op_swap.py), checking first that the .pte will find its
    ExecuTorch kernel (one-line errors); blocks the kernel cannot take stay eager (the dense 8da loop)."""
    from models.pipeline.moe_op_swap import swap_in_moe_op

    flag, alternative = "--pte_experts=op", "; or use --pte_experts=dense"
    try:
        from models.pipeline import moe_pte
    except ImportError as e:
        raise quantize_and_save.UsageError(f"{flag}: llmq.ops is not importable ({e}){alternative}") from None
    try:
        moe_pte.load_executorch_kernel()
    except moe_pte.MoEExecuTorchKernelUnavailable as e:
        raise quantize_and_save.UsageError(f"{flag}: {e}{alternative}") from None
    return swap_in_moe_op(model, flag, required=False, alternative=alternative)


def _op_calls(manager, method: str) -> int:
    graph = manager.exported_program(method).graph
    return sum(1 for n in graph.nodes if n.op == "call_function" and "quantized_moe_ffn" in str(n.target))


def _eager_logits(steps: Dict, prompt: torch.Tensor, decode_steps: int) -> Dict:
    logits, cache = steps["prefill"](prompt)
    out, tokens = [logits], []
    position = prompt.shape[1]
    for _ in range(decode_steps):
        token = logits[:, -1:].argmax(-1)
        tokens.append(int(token))
        logits, cache = steps["decode"](token, torch.tensor(position, dtype=torch.long), cache)
        out.append(logits)
        position += 1
    return {"logits": out, "tokens": tokens}


def main_for(arch: Architecture, make_layout: Callable[[nn.Module, int], StaticCacheLayout], *,
             dynamic_prompt: bool) -> None:
    """absl entry point of a model's export_pte binary (flags: export_pt2's and quantize_and_save's)."""
    from models.pipeline.export_pt2 import export_main

    def run_once(flags) -> int:
        run(arch, make_layout, dynamic_prompt=dynamic_prompt, experts=FLAGS.pte_experts, **flags)
        return 0

    export_main(run_once, (quantize_and_save.UsageError, CheckpointError, ValueError, ExecuTorchUnavailable))
