"""Streaming writer for quantized Hugging Face folders (ModelOpt or compressed-tensors style).

Input: an iterator of (hf_name, tensor) in checkpoint order, and a recipe (which module gets
which format). Each 2-D ``<module>.weight`` the recipe quantizes becomes its exported tensors;
fused stacked experts (``<prefix>.experts.gate_up_proj`` [E, 2I, H] and
``<prefix>.experts.down_proj`` [E, H, I], transformers' layout) become per-expert
``experts.<e>.{gate,up,down}_proj`` tensors, quantized; every other tensor passes through
unchanged and any unquantized 2-D weight's module is listed as excluded (embeddings,
lm_head, routers...). Fused siblings (q/k/v, gate/up) in a format with a tensor-level scale
(NVFP4, per-tensor FP8) are held until the group is complete and share one global scale.

Memory: one input tensor plus at most one sibling group plus their outputs (shards are
streamed to disk tensor by tensor, llmq.export.shards). The folder is built in
``<out>.partial`` (llmq.checkpoint.workfolder: locked, journalled, fsynced) and renamed into
place only when complete; completed shards are journalled so an interrupted run can resume
(resume=True).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from llmq.checkpoint.errors import ResumeMismatchError
from llmq.checkpoint.fileio import copy_file, write_file_atomic
from llmq.checkpoint.shard_file import placeholder
from llmq.checkpoint.workfolder import WorkFolder
from llmq.export.quant_config import build_hf_quantization_config, build_modelopt_hf_quant_config
from llmq.export.shards import ShardWriter
from llmq.export.spec import (
    STYLES,
    ExportState,
    WeightExportSpec,
    compute_export_state,
    make_spec,
    merge_export_states,
    needs_tensor_amax,
)
from llmq.export.tensors import export_quantized_weight_tensors
from llmq.quant.codecs import FLOAT_DTYPES
from llmq.quant.row_blocks import SECOND_PASS_KEPT_BLOCKS, RowBlocks

_SIBLINGS = {
    "q_proj": ("qkv", ("q_proj", "k_proj", "v_proj")),
    "k_proj": ("qkv", ("q_proj", "k_proj", "v_proj")),
    "v_proj": ("qkv", ("q_proj", "k_proj", "v_proj")),
    "gate_proj": ("gate_up", ("gate_proj", "up_proj")),
    "up_proj": ("gate_up", ("gate_proj", "up_proj")),
}
# Modules kept in high precision whatever the recipe says, unless the caller passes
# keep_unquantized=() (vLLM and TensorRT-LLM load these as plain layers): token embeddings,
# the output head, MoE routers and shared-expert gates.
DEFAULT_KEEP_UNQUANTIZED = (r".*embed_tokens", r".*lm_head", r".*\.mlp\.gate", r".*\.router", r".*shared_expert_gate")
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)(?:\.weight)?$")


def recipe_lookup(recipe: Any) -> Callable[[str], Any]:
    """fqn -> config or None, from a QuantRecipe-like (.get_config), a mapping of exact module
    fqns, or a callable."""
    if hasattr(recipe, "get_config"):
        return recipe.get_config
    if isinstance(recipe, Mapping):
        return lambda fqn: recipe.get(fqn)
    if callable(recipe):
        return recipe
    raise ValueError(f"recipe must be a QuantRecipe, a mapping fqn -> config, or a callable; got {type(recipe).__name__}")


@dataclasses.dataclass
class ExportSummary:
    """What a writer run did (for the CLI's table and the benchmark)."""

    folder: str
    style: str
    quantized_modules: int = 0
    excluded_modules: List[str] = dataclasses.field(default_factory=list)
    input_bytes: int = 0
    output_bytes: int = 0
    shards: List[str] = dataclasses.field(default_factory=list)
    resumed_tensors: int = 0  # tensors taken from an interrupted run's completed shards
    seconds: float = 0.0
    model_dtype: Optional[str] = None  # config.json "dtype" where the consumer needs one (ct_model_dtype)


# compressed-tensors' packed FP4 decompressors (NVFP4PackedCompressor and MXFP4PackedCompressor, 0.20)
# unpack the codes to bfloat16 whatever the model's dtype: a model loaded in float32 or float16 then
# fails its first matmul ("expected m1 and m2 to have the same dtype"). Folders holding them say
# "dtype": "bfloat16", so transformers' default load (dtype="auto") builds the model in bfloat16.
CT_BFLOAT16_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")


def ct_model_dtype(quantization_config: Mapping[str, Any]) -> Optional[str]:
    """The model dtype a compressed-tensors folder must name for transformers' default load to run
    (None: any). "bfloat16" where a config group holds packed FP4 (CT_BFLOAT16_FORMATS)."""
    if quantization_config.get("quant_method") != "compressed-tensors":
        return None
    formats = {quantization_config.get("format")}
    formats |= {g.get("format") for g in (quantization_config.get("config_groups") or {}).values()}
    return "bfloat16" if formats & set(CT_BFLOAT16_FORMATS) else None


class _Exporter:
    def __init__(self, lookup, style: str, input_amax: Mapping[str, float], shards: ShardWriter, keep=()):
        self.lookup = lookup
        self.keep = [re.compile(p) for p in keep]
        self.style = style
        self.input_amax = dict(input_amax or {})
        self.shards = shards
        self.specs: Dict[str, WeightExportSpec] = {}
        self.excluded: List[str] = []
        self.pending: Dict[Tuple[str, str], Dict[str, Tuple[torch.Tensor, WeightExportSpec]]] = {}

    def spec_for(self, module: str) -> Optional[WeightExportSpec]:
        if any(p.fullmatch(module) for p in self.keep):
            return None
        config = self.lookup(module)
        if config is None:
            return None
        return make_spec(module, config, style=self.style, static_input_scale=module in self.input_amax)

    def state_for(self, weight: torch.Tensor, spec: WeightExportSpec, next_emitted: bool = True) -> ExportState:
        """next_emitted: the weight is emitted right after (its last row blocks are kept from the
        amax pass for it)."""
        if isinstance(weight, RowBlocks):  # the amax over the blocks (exact: a max of maxima)
            keep = SECOND_PASS_KEPT_BLOCKS if next_emitted else 0
            amax = weight.abs_max(keep) if needs_tensor_amax(spec) else None
            probe = torch.zeros((1, weight.shape[-1]), dtype=weight.dtype)
            return dataclasses.replace(compute_export_state(probe, spec, self.input_amax.get(spec.module)),
                                       weight_amax=amax)
        return compute_export_state(weight, spec, self.input_amax.get(spec.module))

    def emit(self, spec: WeightExportSpec, weight: torch.Tensor, state: ExportState) -> None:
        if spec.module in self.specs:
            raise ValueError(f"module {spec.module!r} exported twice")
        self.specs[spec.module] = spec
        names = list(spec.tensor_names().values())
        if all(self.shards.has(n) for n in names):  # done by an interrupted run: skip the work
            for n in names:
                self.shards.add(n, None)
            return
        if isinstance(weight, RowBlocks):
            if self.emit_row_blocks(spec, weight, state):
                return
            weight = weight.whole()
        for name, t in export_quantized_weight_tensors(weight, spec, state).items():
            self.shards.add(name, t)

    def emit_row_blocks(self, spec: WeightExportSpec, weight: RowBlocks, state: ExportState) -> bool:
        """Quantize and write a weight block of rows by block (same bytes as whole); False where
        its format, shape or the shard layout does not allow it (nothing is written then)."""
        n, k = weight.shape if weight.dim() == 2 else (0, 0)
        multiple = spec.hook.row_block_rows(spec)  # the format says whether its tensors split by rows
        if multiple is None or not n or n % multiple or weight.dtype not in FLOAT_DTYPES:
            return False
        try:  # names, order and dtypes of what the whole weight gives, from a block of zeros
            probe = export_quantized_weight_tensors(torch.zeros((multiple, k), dtype=weight.dtype), spec, state)
        except (ValueError, RuntimeError):
            return False
        role_of = {name: role for role, name in spec.tensor_names().items()}
        shapes = spec.tensor_shapes(n, k)
        placed = [(name, placeholder(t.dtype, shapes[role_of[name]])) for name, t in probe.items()]

        def row_parts():
            # With a tensor-level amax the blocks were checked for NaN/Inf when it was measured.
            for r0, block in weight.blocks(multiple, check=state.weight_amax is None):
                try:
                    parts = export_quantized_weight_tensors(block, spec, state)
                except (ValueError, RuntimeError):  # the whole weight raises its own message
                    export_quantized_weight_tensors(weight.whole(), spec, state)
                    raise
                yield r0, r0 + block.shape[0], parts
                del block, parts

        return self.shards.add_row_blocks(placed, n, row_parts)

    def pass_through(self, name: str, tensor: torch.Tensor) -> None:
        # Written to the shard file at once, so no reference (and no mapping of the input) is kept.
        self.shards.add(name, None if self.shards.has(name) else tensor)

    # ---- one input tensor ---------------------------------------------------------------

    def feed(self, name: str, tensor: torch.Tensor) -> None:
        """One input tensor (or RowBlocks, see write_hf_quantized_checkpoint)."""
        m = _FUSED_EXPERTS.match(name)
        if m and tensor.dim() == 3:
            if isinstance(tensor, RowBlocks):
                tensor = tensor.whole()
            self.feed_fused_experts(m.group("prefix"), m.group("proj"), name, tensor)
            return
        if not name.endswith(".weight") or tensor.dim() != 2:
            self.pass_through(name, tensor)
            return
        module = name[: -len(".weight")]
        spec = self.spec_for(module)
        if spec is None:
            self.excluded.append(module)
            self.pass_through(name, tensor)
            return
        parent, _, leaf = module.rpartition(".")
        if leaf in _SIBLINGS and needs_tensor_amax(spec):
            # Held until its siblings arrive (or the stream ends). Row blocks stay row blocks, read
            # at the flush for the group's amax, then to quantize (flush_group), not held whole.
            kind, members = _SIBLINGS[leaf]
            group = self.pending.setdefault((parent, kind), {})
            group[leaf] = (tensor, spec)
            if set(group) == set(members):
                self.flush_group((parent, kind))
            return
        self.emit(spec, tensor, self.state_for(tensor, spec))

    def flush_group(self, key) -> None:
        """Export a sibling group; members sharing one format share one merged state."""
        group = self.pending.pop(key)
        by_format: Dict[Tuple, List[str]] = {}
        for leaf, (_, spec) in group.items():
            by_format.setdefault((spec.format, spec.granularity), []).append(leaf)
        for leaves in by_format.values():
            # The first emitted is measured last, so its last row blocks are the ones kept.
            order = sorted(leaves)
            states = {leaf: self.state_for(*group[leaf], next_emitted=leaf == order[0]) for leaf in reversed(order)}
            merged = merge_export_states([states[leaf] for leaf in order])
            for leaf in order:
                weight, spec = group[leaf]
                self.emit(spec, weight, merged)

    def feed_fused_experts(self, prefix: str, proj: str, name: str, w: torch.Tensor) -> None:
        """[E, 2I, H] gate_up (gate rows first, as transformers computes it) or [E, H, I] down
        -> per-expert quantized tensors; never left in high precision without a recipe rule."""
        n_experts = w.shape[0]
        leaves = _fused_leaves(proj, name, w)
        for e in range(n_experts):
            parts = _split_expert(w, e, leaves)
            specs = {leaf: self.spec_for(f"{prefix}.{e}.{leaf}") for leaf in leaves}
            missing = [f"{prefix}.{e}.{leaf}" for leaf, s in specs.items() if s is None]
            if missing:
                raise ValueError(
                    f"{name}: the recipe gives no quantization for expert module(s) {missing}; fused experts are "
                    "never written unquantized silently - add a rule for them"
                )
            if len(leaves) == 2 and all(needs_tensor_amax(s) for s in specs.values()) and len({(s.format, s.granularity) for s in specs.values()}) == 1:
                merged = merge_export_states([self.state_for(parts[leaf], specs[leaf]) for leaf in leaves])
                states = {leaf: merged for leaf in leaves}
            else:
                states = {leaf: self.state_for(parts[leaf], specs[leaf]) for leaf in leaves}
            for leaf in leaves:
                self.emit(specs[leaf], parts[leaf], states[leaf])

    def finish(self) -> None:
        for key in list(self.pending):
            self.flush_group(key)


def _fused_leaves(proj: str, name: str, w: torch.Tensor) -> Tuple[str, ...]:
    if proj == "gate_up_proj" and w.shape[1] % 2:
        raise ValueError(f"{name}: fused gate_up has an odd number of rows {w.shape[1]}")
    return ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)


def _split_expert(w: torch.Tensor, e: int, leaves: Tuple[str, ...]) -> Dict[str, torch.Tensor]:
    rows = w.shape[1] // len(leaves)
    return {leaf: w[e, i * rows : (i + 1) * rows] for i, leaf in enumerate(leaves)}


def iter_module_weights(tensors: Iterable[Tuple[str, torch.Tensor]]) -> Iterable[Tuple[str, torch.Tensor]]:
    """(module fqn, 2-D weight) for every weight the writer may quantize, from the same input it
    takes: each 2-D ``<module>.weight`` and every expert of fused stacked experts, split exactly as
    the writer splits them (views, no copies). A float reference for verify_export."""
    for name, tensor in tensors:
        m = _FUSED_EXPERTS.match(name)
        if m and tensor.dim() == 3:
            leaves = _fused_leaves(m.group("proj"), name, tensor)
            for e in range(tensor.shape[0]):
                for leaf, part in _split_expert(tensor, e, leaves).items():
                    yield f"{m.group('prefix')}.{e}.{leaf}", part
        elif name.endswith(".weight") and tensor.dim() == 2:
            yield name[: -len(".weight")], tensor


def write_hf_quantized_checkpoint(
    out_dir: str,
    tensors: Iterable[Tuple[str, torch.Tensor]],
    recipe: Any,
    *,
    style: str = "modelopt",
    config: Optional[Mapping[str, Any]] = None,
    input_amax: Optional[Mapping[str, float]] = None,
    kv_cache_quant_algo: Optional[str] = None,
    max_shard_bytes: int = 5 << 30,
    extra_files: Iterable[str] = (),
    overwrite: bool = False,
    resume: bool = False,
    keep_unquantized: Iterable[str] = DEFAULT_KEEP_UNQUANTIZED,
    fsync: bool = True,
    add_files: Optional[Callable[[str], None]] = None,
) -> ExportSummary:
    """Write a quantized HF folder at out_dir, atomically.

    tensors: (hf_name, tensor) pairs, streamed once; a tensor may be a RowBlocks
    (``iter_checkpoint(..., chunk_bytes=)``): written block by block when it passes through,
    and quantized and written block by block in FP8, MX and NVFP4 (a tensor-level amax is
    measured in a first pass over the blocks) unless it joins a fused sibling group (q/k/v,
    gate/up with a shared scale), is a stacked expert tensor or is integer-quantized: those are
    read whole. The bytes are the same either way. recipe: fqn -> config (see recipe_lookup).
    config: the model's config.json dict; its "quantization_config" is replaced.
    input_amax: module fqn -> activation amax, for static input scales (FP8 / NVFP4 W4A4).
    extra_files: files copied into the folder (tokenizer, generation_config.json...).
    keep_unquantized: module fqn regexes (re.fullmatch) kept in high precision whatever the
    recipe says; default: embeddings, lm_head, MoE routers and shared-expert gates.
    resume: continue an interrupted export of the same input and recipe to the same out_dir:
    shards it completed are kept and their tensors are not quantized again (the result is
    byte-identical to an uninterrupted run). With resume=False a failed run removes its
    partial folder; with resume=True the partial folder is kept for the next attempt.
    fsync: every file and the folder are fsynced before the rename that publishes them.
    add_files(folder): called with the work folder once everything else is written, before the
    publish; what it writes there is published with the folder (a run's error report, say).
    The work folder, its lock, journal and publish are llmq.checkpoint.workfolder's (another run
    into the same out_dir is refused at once; a folder there that no llmq run left is refused).
    """
    if style not in STYLES:
        raise ValueError(f"style {style!r} unknown; expected one of {STYLES}")
    out_dir = os.path.abspath(out_dir)
    extra_files = list(extra_files)
    for path in extra_files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"extra file {path} does not exist")
    # <out>.partial, locked until published (or released for a resume); refuses another run
    # into the same out_dir and a folder there that is not an interrupted llmq run's
    work = WorkFolder(out_dir, writer="hf", overwrite=overwrite, fsync=fsync)
    start = time.perf_counter()
    summary = ExportSummary(folder=out_dir, style=style)
    shards = None
    try:
        if work.other_writer is not None and resume:
            raise ResumeMismatchError(f"an interrupted run of another writer ({work.other_writer}) left this "
                                      "folder; delete it or start over (resume=False)", path=work.path)
        journal = work.journal if resume else None
        settings = {"style": style, "max_shard_bytes": int(max_shard_bytes)}
        if journal is not None and journal.get("settings") != settings:
            raise ResumeMismatchError("an interrupted export with another style or shard size left this folder; "
                                      "resume with the same settings or start over (resume=False)", path=work.path)
        record = lambda data: work.write_journal({"settings": settings, "shards": data})  # noqa: E731
        if journal is not None:
            shards = ShardWriter.resume(work.path, max_shard_bytes, journal["shards"], record=record, fsync=fsync)
        else:
            shards = ShardWriter(work.path, max_shard_bytes, record=record, fsync=fsync)
        work.clear(keep=shards.kept_files())  # everything else an interrupted run left is redone
        shards.record_progress()  # from now on the folder is recognisably this run's
        exporter = _Exporter(recipe_lookup(recipe), style, input_amax or {}, shards, keep=tuple(keep_unquantized))
        for name, tensor in tensors:
            if not isinstance(tensor, (torch.Tensor, RowBlocks)):
                raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
            summary.input_bytes += tensor.numel() * tensor.element_size()
            exporter.feed(name, tensor)
            del tensor  # not held while the next one is read
        exporter.finish()
        if not exporter.specs:
            raise ValueError("the recipe quantized no weight; nothing to export")
        summary.shards = shards.close()
        summary.output_bytes = shards.total_bytes
        summary.resumed_tensors = shards.skipped
        summary.quantized_modules = len(exporter.specs)
        summary.excluded_modules = sorted(set(exporter.excluded))
        summary.model_dtype = _write_configs(work.path, exporter.specs, summary.excluded_modules, style, config,
                                             kv_cache_quant_algo, fsync)
        for path in extra_files:
            copy_file(path, os.path.join(work.path, os.path.basename(path)), fsync=fsync)
        if add_files is not None:
            add_files(work.path)
        work.publish(synced=summary.shards)
    except BaseException:
        if shards is not None:
            shards.abort()
        if resume:
            work.release()  # the folder stays for the next attempt
        else:
            work.discard()
        raise
    summary.seconds = time.perf_counter() - start
    return summary


def _write_configs(folder, specs, excluded, style, config, kv_cache_quant_algo, fsync) -> Optional[str]:
    """config.json (and ModelOpt's hf_quant_config.json); returns the model dtype set for the consumer."""
    cfg = dict(config or {})
    cfg["quantization_config"] = build_hf_quantization_config(specs, style=style, exclude_modules=excluded, kv_cache_quant_algo=kv_cache_quant_algo)
    dtype = ct_model_dtype(cfg["quantization_config"])
    if dtype is not None:
        cfg["dtype"] = dtype  # transformers 5 reads "dtype"; 4.x's "torch_dtype" where the config has one
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = dtype
    write_file_atomic(os.path.join(folder, "config.json"), json.dumps(cfg, indent=2, sort_keys=True).encode(),
                      fsync=fsync)
    if style == "modelopt":
        hf = build_modelopt_hf_quant_config(specs, exclude_modules=excluded, kv_cache_quant_algo=kv_cache_quant_algo)
        write_file_atomic(os.path.join(folder, "hf_quant_config.json"),
                          json.dumps(hf, indent=2, sort_keys=True).encode(), fsync=fsync)
    return dtype
