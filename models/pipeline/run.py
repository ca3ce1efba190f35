"""The job: input -> recipe -> (quantize) -> backend.write -> summary, then --verify.

Order: backend, recipe and input are checked, then the checkpoint's tensor names and shapes
against the model built from its config (from the headers, before anything is written), then
(optional) --calibration_text runs the unquantized model on a text (models/pipeline/calibration.py;
with --calibration_inputs=quantized each layer is quantized once measured and its outputs feed the next)
and --budget_bits_per_weight replaces the recipe by the chosen one (models/pipeline/size_budget.py),
then the backend refuses what it cannot write (backend.check), then the stream is written (checked again
item by item; the backend publishes the output only when the whole stream passed), then --verify
reloads the published output (models/pipeline/verify.py); if that fails the output is moved to
<out>.failed and the run fails (unless verify_warn_only). Nothing global changes.

Files added to the output: `quant_error.{csv,md,png}` (error_report: one row per tensor quantized by
llmq, llmq.quant.report) and `budget_recipe.json` (the chosen recipe, reusable as --recipe); the writer
puts them in its work folder (WriteJob.add_files) before its one publish, so a failure writing them
(one line naming the file) publishes nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, Optional

import torch

from llmq.backend import BackendError, WriteJob, get_backend, storage_of, with_scale_dtypes
from llmq.checkpoint import checkpoint_shapes, checkpoint_stored_types
from llmq.checkpoint.fileio import write_error
from llmq.quant import (
    GroupQuantizedWeight,
    QuantConfig,
    QuantRecipe,
    dequantize,
    is_quantized,
    load_recipe,
    quantize_stream,
)
from llmq.quant.formats import get_format, nbytes_of
from llmq.quant.report import ErrorReport
from llmq.quant.row_blocks import QuantizedRowBlocks, RowBlocks
from models.pipeline import gguf_input, inputs, verify as verification
from models.pipeline.agreement import format_table
from models.pipeline.arch import Architecture, quantizable_module
from models.pipeline.calibration import (
    INPUTS as CALIBRATION_INPUTS,
    calibrate,
    discard_saved,
    layer_quantizer,
    unreached_experts,
)
from models.pipeline.checks import check_headers, check_stored_types, checked_stream, expected_tensors
from models.pipeline.gguf_output import gguf_fields
from models.pipeline.progress import Progress
from models.pipeline.size_budget import RECIPE_FILE, choose_recipe
from models.pipeline.usage_error import UsageError

ROW_BLOCK_BYTES = 16 << 20  # tensors over this travel as blocks of rows of at most this size


class _Tally:
    """Counts what flows through the stream: tensors, quantized tensors, bytes in and out (a quantized
    weight as its backend writes it: `written_bits`), and the quantized weights' elements and bits."""

    def __init__(self, written_bits=None):
        self.tensors = self.quantized = self.bytes_in = self.bytes_out = 0
        self.quantized_weights = self.quantized_bits = 0
        self.written_bits = written_bits

    def before(self, items):
        for name, value in items:
            self.bytes_in += nbytes_of(value)
            yield name, value

    def after(self, items):
        for name, value in items:
            self.tensors += 1
            quantized = is_quantized(value) or isinstance(value, QuantizedRowBlocks)
            self.quantized += quantized
            if quantized and self.written_bits is not None:
                bits = self.written_bits(name, value)
                self.quantized_bits += bits
                self.quantized_weights += math.prod(value.shape)
                self.bytes_out += bits // 8
            else:
                self.bytes_out += nbytes_of(value)
            yield name, value


def _progress(items, total: int, desc: str, enabled: bool):
    """A tqdm bar on a terminal (or --progress); else a line with counts and ETA every 10 s on stderr."""
    if not enabled:
        return Progress(desc, total, "tensors", interval=10.0).wrap(items)
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)


def run(arch: Architecture, *, checkpoint: Optional[str], recipe: Optional[str], backend: str, out: Optional[str],
        resume: bool, max_shard_size: int, verify: Optional[bool], seed: int, progress: bool,
        use_moe_op: bool = False, verify_min_cosine: Optional[float] = None, verify_warn_only: bool = False,
        error_report: bool = False, calibration_text: Optional[str] = None,
        calibration_tokens: int = 512, budget_bits_per_weight: Optional[float] = None,
        budget_method: str = "hqq", requantize_gguf: bool = False, dry_run: bool = False,
        calibration_inputs: str = "float") -> Dict:
    """The whole job; returns the numbers it printed (for tests)."""
    try:
        writer = get_backend(backend)
    except ValueError as e:
        raise UsageError(f"--backend: {e}") from None
    _refuse_ignored_flags(writer, checkpoint, calibration_text=calibration_text, requantize_gguf=requantize_gguf)
    recipe_name = recipe or arch.default_recipe
    try:
        quant_recipe: QuantRecipe = load_recipe(recipe_name, presets=arch.presets)
        loaded_recipe = quant_recipe
        quant_recipe = writer.recipe_for(quant_recipe)  # e.g. int4 g32 -> GGUF's q4_0
        quant_recipe.check_formats(writer.accepts_formats, f"--backend {backend}")  # before any work
    except ValueError as e:
        raise UsageError(f"--recipe: {e}") from None

    with contextlib.ExitStack() as stack:
        workdir = None
        if checkpoint is None:
            kind = "embedded"
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"llmq-{arch.name}-"))
            checkpoint = inputs.write_embedded(arch, workdir, seed)
            if out is None:
                out = os.path.join(workdir, "out")
                print(f"[embedded default] output goes to {out}, a temporary folder deleted at exit "
                      "(pass --out=DIR to keep it)")
            else:
                print(f"[embedded default] output kept at {out}; the temporary checkpoint is deleted at exit")
        else:
            kind = inputs.check_path(arch, checkpoint)
        out = out or _user_path(os.path.join("out", f"{arch.name}-{os.path.basename(recipe_name)}"))
        _check_out(out)
        model_input = inputs.open_input(arch, checkpoint, kind, workdir=workdir)
        config = model_input.config
        if model_input.from_gguf:
            # config.json from the GGUF metadata and its tokenizer (tokenizer.ggml.*) as tokenizer.json +
            # tokenizer_config.json: every output carries them, as it would an HF input's
            side_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"llmq-{arch.name}-side-files-"))
            inputs.gguf_side_files(model_input, side_dir, tokenizer_required=writer.needs_tokenizer_files)

        # The model's parameter list (names and shapes); the checkpoint is checked against it
        # before anything is written (HF headers) and again as it streams (every input).
        expected = expected_tensors(arch, config)
        names = None
        types = checkpoint_stored_types(checkpoint, key_map=None if model_input.from_gguf else arch.key_map)
        if types is not None:
            check_stored_types(types, checkpoint)
        if not model_input.from_gguf:
            shapes = checkpoint_shapes(checkpoint, key_map=arch.key_map)
            if shapes is not None:
                names = check_headers(arch, shapes, getattr(config, "num_experts", 0), expected, checkpoint)
        names = names if names is not None else expected.required()
        _check_recipe(quant_recipe, recipe_name, arch, config, expected)
        if verify and not writer.reloads:
            raise UsageError(f"--verify: --backend {backend} cannot read its output back (pass --noverify)")
        if verify is None:
            verify = writer.reloads  # layer by layer: on at every size (models/pipeline/verify.py)
        job = _write_job(arch, model_input, writer.name, out, quant_recipe, recipe_name, max_shard_size, resume,
                         verify)
        # How the backend writes each config: the methods choose scales in its scale dtype, and every
        # bits per weight below (budget, error report, summary) counts what it writes.
        storage = storage_of(writer, job)
        quant_recipe = with_scale_dtypes(quant_recipe, storage)
        estimate = _estimate(arch, config, checkpoint, model_input.from_gguf, requantize_gguf, loaded_recipe, writer,
                             job, dry_run)
        if dry_run:
            return {"estimate": estimate}

        def model_stream(notes=None, chunk_bytes=None):
            stream = checked_stream(model_input.stream(notes, chunk_bytes), expected, checkpoint)
            # requantize_gguf: the GGUF's quantized tensors, dequantized exactly, go to the recipe like float ones
            return _as_float(stream) if requantize_gguf and model_input.from_gguf else stream

        gptq_rule = next((r for r in quant_recipe.rules if r.config is not None and r.config.method == "gptq"), None)
        if (gptq_rule is not None or budget_method == "gptq") and calibration_text is None:
            what = f"--recipe rule {gptq_rule.pattern!r}" if gptq_rule is not None else "--budget_method=gptq"
            raise UsageError(f"{what} uses method 'gptq', which rounds against each layer's inputs: pass "
                             "--calibration_text=FILE")
        if calibration_inputs not in CALIBRATION_INPUTS:
            raise UsageError(f"--calibration_inputs: expected one of {', '.join(CALIBRATION_INPUTS)}, got "
                             f"{calibration_inputs!r}")
        sequential = calibration_inputs == "quantized"
        if sequential and calibration_text is None:
            raise UsageError("--calibration_inputs=quantized feeds each calibration layer the outputs of the quantized "
                             "layers before it: pass --calibration_text=FILE")
        calibration = None
        if calibration_text is not None:
            what = "model, each layer quantized once measured," if sequential else "unquantized model"
            print(f"calibration: running the {what} on up to {calibration_tokens} tokens of {calibration_text}",
                  flush=True)
            calibration_start = time.perf_counter()
            quantize = None
            if sequential:
                quantize = layer_quantizer(quant_recipe, arch.num_layers(config),
                                           as_float=_as_float if requantize_gguf and model_input.from_gguf else None)
            calibration = calibrate(arch, config, model_input, calibration_text, calibration_tokens, out=out,
                                    hessians=gptq_rule is not None or budget_method == "gptq", quantize=quantize,
                                    quantized_by=json.dumps(quant_recipe.to_dict(), sort_keys=True, default=str))
            calibration_seconds = time.perf_counter() - calibration_start
        recipe_label = recipe_name
        budget = None
        if budget_bits_per_weight is not None:
            budget_options = writer.budget_options()
            if not budget_options:  # the candidates are integer formats
                raise UsageError(f"--budget_bits_per_weight: --backend {backend} writes no integer format "
                                 f"(it takes {', '.join(writer.accepts_formats)})")
            print(f"budget: measuring every candidate format of every matrix, on a sample of rows where it "
                  f"has over 1 Mi weights ({budget_method}; "
                  f"{budget_bits_per_weight} bits per weight)", flush=True)
            budget = choose_recipe(model_stream, quant_recipe, arch.num_layers(config), budget_bits_per_weight,
                                   budget_method, calibration, storage=storage, options=budget_options)
            try:
                quant_recipe = getattr(writer, "recipe_for", lambda r: r)(budget.recipe)
                quant_recipe.check_formats(writer.accepts_formats, f"--backend {backend}")
            except ValueError as e:
                raise UsageError(f"--budget_bits_per_weight: {e}") from None
            recipe_label = f"{budget_bits_per_weight} bits per weight over {recipe_name}'s matrices ({RECIPE_FILE})"
        report = ErrorReport(storage) if error_report and not writer.takes_float else None

        def add_files(folder: str) -> None:
            """The run's own files, written into the writer's work folder before its one publish."""
            if budget is not None:
                path = os.path.join(folder, RECIPE_FILE)
                _named(path, lambda: quant_recipe.to_file(
                    path, description=f"chosen by --budget_bits_per_weight={budget_bits_per_weight} (method "
                                      f"{budget_method}) over the matrices {recipe_name} quantizes"))
            if report is not None:
                _named(folder, lambda: report.write(folder))

        job = _write_job(arch, model_input, writer.name, out, quant_recipe, recipe_name, max_shard_size, resume,
                         verify, add_files)
        try:
            writer.check(job)
        except BackendError as e:
            raise UsageError(str(e)) from None

        tally = _Tally(_written_bits(quant_recipe.bind(arch.num_layers(config)), storage))
        start = time.perf_counter()
        gguf_notes = []
        # Large tensors travel as row blocks where the writer takes them: peak memory stays a block,
        # not a tensor (quantize_stream reads one whole where importance or the report needs it).
        row_blocks = writer.streams_row_blocks
        stream = tally.before(model_stream(gguf_notes, ROW_BLOCK_BYTES if row_blocks else None))
        if writer.takes_float:  # the backend quantizes: it gets float tensors (a GGUF's quantized ones dequantized)
            stream = _as_float(stream)
        else:
            stream = quantize_stream(stream, quant_recipe, num_layers=arch.num_layers(config),
                                     module_of=quantizable_module, calibration=calibration, report=report)
        stream = _progress(tally.after(stream), len(names), "quantize", progress)
        try:
            written = writer.write(stream, job)
        except BackendError as e:
            raise UsageError(str(e)) from None
        seconds = time.perf_counter() - start
        for note in gguf_notes:
            print(f"note: {note}")

        if writer.takes_float:  # the backend quantized: what it wrote is on disk, its weights it counted
            tally.bytes_out = _folder_bytes(written)
            tally.quantized_bits, tally.quantized_weights = writer.written_bits(written)
            written_row = f"{tally.tensors} model tensors in, quantized by the backend"
        else:
            written_row = f"{tally.tensors} ({tally.quantized} quantized)"
        rows = [
            ("architecture", arch.name),
            ("recipe", recipe_label),
            ("backend", backend),
            ("output", written),
            ("tensors written", written_row),
            ("bytes before", f"{tally.bytes_in:,}"),
            ("bytes after", f"{tally.bytes_out:,} ({tally.bytes_out / max(tally.bytes_in, 1):.3f}x)"),
            ("time", f"{seconds:.2f} s"),
        ]
        if estimate is not None and hasattr(estimate, "bytes_out"):  # what was printed before the work
            rows.insert(rows.index(("time", f"{seconds:.2f} s")), ("bytes estimated", f"{estimate.bytes_out:,} "
                                                                   "(before the run, from the headers: the tensors' bytes, "
                                                                   "file headers and side files not counted)"))
        if tally.quantized_weights:
            rows.insert(rows.index(("time", f"{seconds:.2f} s")), ("quantized weights", (
                f"{tally.quantized_bits / tally.quantized_weights:.4f} bits per weight as written "
                f"({tally.quantized_bits // 8:,} bytes for {tally.quantized_weights:,} weights, scales included)")))
        rows += writer.summary(written, job)
        result = {}
        if calibration is not None:
            discard_saved(out)  # the output is published: its saved calibration statistics are done with
            rows.append(("calibration", f"{calibration.tokens} tokens of {calibration_text}, "
                                        f"{len(calibration.importance)} linear layers, layer by layer in "
                                        f"{calibration_seconds:.1f} s" + (", each layer's inputs from the quantized "
                                                                          "layers before it" if sequential else "")))
            unreached, experts = unreached_experts(calibration)
            if experts:
                rows.append(("calibration experts", f"{experts - unreached} of {experts} routed experts reached by "
                                                    f"the text, {unreached} never; expert stacks take no importance "
                                                    "(their plain method)"))
        if budget is not None:
            rows.append(("budget", f"{budget.bits_per_weight:.3f} bits per weight as {backend} writes them, over "
                                   f"{budget.matrices} matrices: " + ", ".join(
                                       f"{c}: {n}" for c, n in sorted(budget.counts.items(), key=lambda kv: -kv[1]))))
            result["budget"] = budget
        if report is not None:
            rows.append(("error report", report.summary()))
            rows.append(("error report files", ", ".join(report.file_names())))
            result["error_report"] = report
        elif error_report:
            rows.append(("error report", f"not made: --backend {backend} quantizes by itself"))
        if model_input.from_gguf:
            rows.insert(1, ("input", f"GGUF {checkpoint}"))
        if tally.quantized_weights:  # the quantized weights as the backend wrote them
            result.update(bits_per_weight=tally.quantized_bits / tally.quantized_weights,
                          quantized_weights=tally.quantized_weights)
        result.update({"bundle": written, "tensors": tally.tensors, "quantized": tally.quantized,
                       "bytes_in": tally.bytes_in, "bytes_out": tally.bytes_out, "progress_total": len(names)})
        failure = None
        if verify:
            check_rows, check, failure = (arch.verify or verification.verify)(
                arch, config, model_input, writer, job, written, lambda: model_stream(), recipe=quant_recipe,
                seed=seed, min_cosine=verify_min_cosine, use_moe_op=use_moe_op,
                requantized_input=model_input.from_gguf and (requantize_gguf or writer.takes_float))
            rows += check_rows
            result.update(check)
        elif use_moe_op:
            raise UsageError("--use_moe_quantized_op needs --verify (it checks the op against the eager path)")
        else:
            rows.append(("verification", "not run (--verify to run it)" if writer.reloads
                         else f"not run (--backend {backend} cannot read its output back)"))
        result["verification_failure"] = failure
        output_row = rows.index(("output", written))
        if failure and not verify_warn_only:
            failed = _move_aside(written)
            rows[output_row] = ("output", f"moved to {failed} (failed verification)")
            result["bundle"] = failed
            print(format_table(rows))
            raise UsageError(f"--verify: {failure}; the output was moved to {failed} "
                             "(--verify_warn_only keeps it at --out)")
        print(format_table(rows))
        if failure:
            print(f"warning: --verify: {failure}; the output at {written} is kept (--verify_warn_only)",
                  file=sys.stderr)
        if kind == "embedded":
            print("[embedded default] pass --checkpoint=<HF folder> to quantize a real model")
        return result


def _estimate(arch: Architecture, config, checkpoint: str, from_gguf: bool, requantize_gguf: bool, recipe: QuantRecipe,
              writer, job, every_backend: bool):
    """The output's size from the headers (models/pipeline/size_estimate.py), printed before any work:
    this backend's line, or with every_backend (--dry_run) every registered backend's."""
    from llmq.backend import backend_names
    from models.pipeline import size_estimate

    tensors = size_estimate.input_tensors(checkpoint, arch.key_map, from_gguf)
    if not tensors:
        print("estimate: not available (the input's shapes need reading its tensors)")
        return None
    layers = arch.num_layers(config)
    blocks = from_gguf and not requantize_gguf
    received = size_estimate.gguf_received(checkpoint, tensors, getattr(
        getattr(arch.gguf_import, "GGUFConverter", None), "DEQUANTIZED", ())) if from_gguf else None
    mine = size_estimate.for_backend(writer, recipe, tensors, layers, quantizable_module, job=job, gguf=blocks,
                                     received=received)
    if not every_backend:
        print(f"estimate (--backend {writer.name}): {mine.line() if hasattr(mine, 'line') else mine}"
              + ("; the tensors' bytes: file headers and side files not counted" if hasattr(mine, "line") else ""),
              flush=True)
        return mine
    rows = []
    for name in backend_names():
        other = get_backend(name)
        why = getattr(arch, "refuses", lambda w: "")(other)
        rows.append((name, f"not written: {why}" if why else mine if other is writer else size_estimate.for_backend(
            other, recipe, tensors, layers, quantizable_module, gguf=blocks, received=received)))
    print(f"--dry_run: {checkpoint} with --recipe {job.recipe_name}, nothing written; estimated output "
          "(the tensors' bytes; file headers and side files not counted):")
    print(size_estimate.table(rows))
    return mine


def _refuse_ignored_flags(writer, checkpoint: Optional[str], *, calibration_text: Optional[str],
                          requantize_gguf: bool) -> None:
    """A flag the run would compute and then not use is refused, before any work."""
    if requantize_gguf and not gguf_input.is_gguf(checkpoint):
        raise UsageError(f"--requantize_gguf applies to a .gguf --checkpoint only; {checkpoint or 'the embedded default'} "
                         "is not one")
    if calibration_text is not None and writer.takes_float:
        raise UsageError(f"--calibration_text: --backend {writer.name} quantizes by itself and uses no calibration; "
                         "drop the flag or pick a backend llmq quantizes for (e.g. bundle)")


def _write_job(arch: Architecture, model_input, backend: str, out: str, recipe: QuantRecipe, recipe_name: str,
               max_shard_size: int, resume: bool, verify: bool, add_files=None) -> WriteJob:
    def to_hf(name, value):
        return arch.to_hf_tensors(name, value)

    def from_hf(tensors):
        return arch.merge_experts(tensors) if arch.merge_experts is not None else tensors

    return WriteJob(
        out=out, recipe=recipe, recipe_name=recipe_name, architecture=arch.name, hf_config=model_input.hf_config,
        model_config=model_input.config, num_layers=arch.num_layers(model_input.config), to_hf=to_hf, from_hf=from_hf,
        source_files=model_input.source_files, tokenizer_files=model_input.tokenizer_files,
        source_kind=model_input.kind, source_path=model_input.path, max_shard_bytes=max_shard_size, resume=resume,
        metadata={"architecture": arch.name, "backend": backend, "recipe": recipe_name}, verify=verify,
        add_files=add_files, **gguf_fields(arch, model_input))


def _written_bits(recipe: QuantRecipe, storage):
    """(name, quantized value) -> the bits the backend writes for it (its Storage), the config taken
    from the recipe, or from the value where it arrived quantized in another shape (a GGUF's block)."""

    def bits(name, value):
        module = quantizable_module(name)
        config = recipe.get_config(module) if module is not None else None
        if isinstance(value, GroupQuantizedWeight) and (  # (an "int" config, or a GGUF block format's: q4_k ...)
                config is None or config.bits != value.bits
                or config.group_size_for(value.shape[-1]) != value.group_size):
            half = 1 << (value.bits - 1)
            config = QuantConfig(bits=value.bits, group_size=value.group_size,
                                 symmetric=bool(torch.equal(value.bias, -half * value.scale)))
        if config is None:  # another format's import: counted as the bundle holds it
            return nbytes_of(value) * 8
        return storage(config).bits(tuple(value.shape), value)

    return bits


def _as_float(items):
    """Quantized values (a GGUF's exact imports) dequantized to the dtype they were quantized from."""
    for name, value in items:
        yield name, value if isinstance(value, (torch.Tensor, RowBlocks)) else dequantize(value)


def _named(path: str, write) -> None:
    """write(); an OSError becomes one line naming the file (the report's own, else `path`)."""
    try:
        write()
    except OSError as e:
        raise write_error(e, e.filename or path, "writing") from None


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def _check_out(out: str) -> None:
    """--out must be a folder or not exist yet, and its nearest existing parent a folder."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out}: exists and is not a folder")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"--out {out}: {parent} is a file, not a folder")


def _move_aside(path: str) -> str:
    """Move an output that failed verification out of --out's place: `<out>.failed`."""
    failed = path.rstrip(os.sep) + ".failed"
    if os.path.isdir(failed):
        shutil.rmtree(failed)
    elif os.path.lexists(failed):
        os.unlink(failed)
    os.rename(path, failed)
    return failed


def _check_recipe(recipe: QuantRecipe, recipe_name: str, arch: Architecture, config, expected) -> None:
    """Before anything is written: every tensor's format can quantize its shape (Format.shape_problem:
    e.g. an integer group size divides the dimension it groups), and a recipe that quantizes nothing
    is said out loud."""
    bound = recipe.bind(arch.num_layers(config))
    quantized = 0
    for name, shape in expected.shapes.items():
        module = quantizable_module(name)
        cfg = bound.get_config(module) if module is not None else None
        if cfg is None:
            continue
        quantized += 1
        problem = get_format(cfg.format).shape_problem(cfg, shape) if shape else None
        if problem:
            raise UsageError(f"--recipe {recipe_name}: {problem} of {name} (shape {list(shape)})")
    if quantized == 0:
        print(f"warning: --recipe {recipe_name}: no rule quantizes any of the model's {len(expected.shapes)} "
              "tensors; the output will hold them all unquantized", file=sys.stderr)


def _user_path(path: Optional[str]) -> Optional[str]:
    """`bazel run` starts the binary in its runfiles tree: relative paths mean the user's cwd."""
    base = os.environ.get("BUILD_WORKING_DIRECTORY")
    if path is None or base is None or os.path.isabs(path):
        return path
    return os.path.join(base, os.path.expanduser(path))
