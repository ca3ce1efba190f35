"""quantize_and_save: read -> recipe -> quantize -> pack(backend) -> save, then reload and check.

Each model package calls `main_for(ARCHITECTURE)`. With no --checkpoint the embedded default
runs: a tiny deterministic model of the architecture is written as an HF checkpoint in a
temporary folder and goes through the same path a real checkpoint does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch
from absl import app, flags

from llmq.checkpoint import (CheckpointError, checkpoint_shapes, iter_checkpoint, load_bundle, save_bundle,
                             source_files)
from llmq.quant import QuantRecipe, is_quantized, load_recipe, quantize_stream, register_preset
from llmq.quant.formats import nbytes_of
from models.pipeline import gguf_input
from models.pipeline.arch import Architecture, quantizable_module
from models.pipeline.checks import check_headers, checked_stream, expected_tensors
from models.pipeline.default_model import write_default_checkpoint
from models.pipeline.quantized_model import build_quantized_model
from models.pipeline.report import compare_logits, format_table, verdict
from models.pipeline.streaming import merge_experts_stream

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "Hugging Face checkpoint folder (config.json + safetensors) or a "
                    "llama.cpp .gguf file. Omit to run the embedded default tiny model.")
flags.DEFINE_string("recipe", None, "Recipe preset name (see --list_recipes) or a JSON/YAML recipe file.")
flags.DEFINE_enum("backend", "bundle", ["bundle", "cuda", "mlx"], "Terminal packer: bundle = portable llmq bundle "
                  "(canonical weights); cuda = tinygemm int4 tiles in the bundle; mlx = a folder mlx_lm.load runs.")
flags.DEFINE_string("out", None, "Output folder (default: out/<arch>-<recipe>; a temp folder for the embedded default).")
flags.DEFINE_boolean("resume", True, "Reuse finished shards of an interrupted run into the same --out.")
flags.DEFINE_integer("max_shard_size", 2 << 30, "Maximum bytes per output shard.", lower_bound=1 << 16)
flags.DEFINE_boolean("verify", None, "Reload the output and compare logits with the unquantized model "
                     "(default: on for checkpoints under 4 GiB). A failed check (non-finite logits, or a logits "
                     "cosine under --verify_min_cosine) exits with status 2 and moves the output to <out>.failed.")
flags.DEFINE_float("verify_min_cosine", 0.9, "--verify fails below this logits cosine with the unquantized model "
                   "(working INT4/INT8 recipes give >= 0.95; a broken one is far lower).", lower_bound=-1.0,
                   upper_bound=1.0)
flags.DEFINE_boolean("verify_warn_only", False, "A failed --verify only warns: the run exits 0 and the output stays "
                     "at --out.")
flags.DEFINE_integer("seed", 0, "Seed of the embedded default model and of the verification prompt.")
flags.DEFINE_boolean("list_recipes", False, "Print the recipe presets and exit.")
flags.DEFINE_boolean("use_moe_quantized_op", False, "Verify with the MoE blocks running through "
                     "torch.ops.llmq.quantized_moe_ffn (the fused C++ kernel) instead of eager PyTorch.")
flags.DEFINE_boolean("progress", None, "Show progress bars (default: when stderr is a terminal).")

VERIFY_LIMIT_BYTES = 4 << 30


class UsageError(Exception):
    """A bad flag or path: reported as one line, exit status 2."""


class _Tally:
    """Counts what flows through the stream: tensors, quantized tensors, bytes in and out."""

    def __init__(self):
        self.tensors = self.quantized = self.bytes_in = self.bytes_out = 0

    def before(self, items):
        for name, value in items:
            self.bytes_in += nbytes_of(value)
            yield name, value

    def after(self, items):
        for name, value in items:
            self.tensors += 1
            self.quantized += is_quantized(value)
            self.bytes_out += nbytes_of(value)
            yield name, value


def _progress(items, total: int, desc: str, enabled: bool):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)


def _read_hf_config(folder: str) -> Dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"--checkpoint {folder}: no config.json (expected a Hugging Face checkpoint folder)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not valid JSON ({e})") from None


def _checkpoint_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def model_tensors(arch: Architecture, folder: str, config) -> Iterator[Tuple[str, torch.Tensor]]:
    """The checkpoint as a stream of model-layout tensors (renamed, experts stacked per layer)."""
    stream = iter_checkpoint(folder, key_map=arch.key_map)
    return merge_experts_stream(stream, arch, getattr(config, "num_experts", 0))


def run(arch: Architecture, *, checkpoint: Optional[str], recipe: Optional[str], backend: str, out: Optional[str],
        resume: bool, max_shard_size: int, verify: Optional[bool], seed: int, progress: bool,
        use_moe_op: bool = False, verify_min_cosine: float = 0.9, verify_warn_only: bool = False,
        others: Sequence[Architecture] = ()) -> Dict:
    """The whole job; returns the numbers it printed (for tests).

    Order: flags, checkpoint, config and recipe are checked, then the checkpoint's tensor names
    and shapes against the model built from its config (from the headers, before anything is
    written), then the stream is written (checked again item by item; the output is published
    only when the whole stream passed), then --verify reloads the published output; if that
    fails the output is moved to <out>.failed and the run fails (unless verify_warn_only).
    """
    if backend not in ("bundle", "cuda", "mlx"):
        raise UsageError(f"--backend {backend!r} unknown; expected bundle, cuda or mlx")
    for name, preset in arch.presets.items():
        register_preset(name, preset, overwrite=True)
    recipe_name = recipe or arch.default_recipe
    try:
        quant_recipe: QuantRecipe = load_recipe(recipe_name)
        quant_recipe.check_formats(_backend_formats(backend), f"--backend {backend}")  # before any work
    except ValueError as e:
        raise UsageError(f"--recipe: {e}") from None

    with contextlib.ExitStack() as stack:
        embedded = checkpoint is None
        if embedded:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"llmq-{arch.name}-"))
            checkpoint = write_default_checkpoint(arch, os.path.join(workdir, "checkpoint"), seed=seed)
            print(f"[embedded default] tiny deterministic {arch.name} model (seed {seed}) written to {checkpoint}")
            if out is None:
                out = os.path.join(workdir, "out")
                print(f"[embedded default] output goes to {out}, a temporary folder deleted at exit "
                      "(pass --out=DIR to keep it)")
            else:
                print(f"[embedded default] output kept at {out}; the temporary checkpoint is deleted at exit")
        elif gguf_input.is_gguf(checkpoint):
            if not os.path.isfile(checkpoint):
                raise UsageError(f"--checkpoint {checkpoint}: no such file")
            if arch.gguf_import is None:
                raise UsageError(f"--checkpoint {checkpoint}: {arch.name} has no GGUF import")
            if backend == "mlx":
                raise UsageError("--backend mlx needs the tokenizer files of an HF folder; a GGUF checkpoint has none")
        elif os.path.isfile(checkpoint):
            raise UsageError(f"--checkpoint {checkpoint}: is a file; expected a Hugging Face checkpoint folder "
                             "(config.json + safetensors) or a .gguf file")
        elif not os.path.isdir(checkpoint):
            raise UsageError(f"--checkpoint {checkpoint}: no such folder")
        out = out or _user_path(os.path.join("out", f"{arch.name}-{os.path.basename(recipe_name)}"))
        _check_out(out)
        from_gguf = gguf_input.is_gguf(checkpoint)
        if from_gguf:
            _refuse_other_gguf(arch, others, checkpoint)
            try:  # config.json's place is taken by the GGUF metadata
                hf_config = gguf_input.hf_config(arch, checkpoint)
            except ValueError as e:
                if isinstance(e, CheckpointError):
                    raise
                raise UsageError(f"{checkpoint}: cannot rebuild a {arch.name} config from its metadata ({e})") from None
        else:
            hf_config = _read_hf_config(checkpoint)
            _refuse_other_config(arch, others, hf_config, checkpoint)
        try:
            config = arch.config_from_hf(hf_config)
        except (ValueError, KeyError, NotImplementedError) as e:
            source = checkpoint if from_gguf else f"{checkpoint}/config.json"
            raise UsageError(f"{source}: not a supported {arch.name} config ({e})") from None

        # The model's parameter list (names and shapes); the checkpoint is checked against it
        # before anything is written (HF headers) and again as it streams (every input).
        expected = expected_tensors(arch, config)
        experts = getattr(config, "num_experts", 0)
        names = None
        if not from_gguf:
            shapes = checkpoint_shapes(checkpoint, key_map=arch.key_map)
            if shapes is not None:
                names = check_headers(arch, shapes, experts, expected, checkpoint)
        names = names if names is not None else expected.required()
        _check_recipe(quant_recipe, recipe_name, arch, config, expected)

        def model_stream(notes=None):
            if from_gguf:
                stream = gguf_input.model_tensors(arch, checkpoint, config, notes=notes)
            else:
                stream = model_tensors(arch, checkpoint, config)
            return checked_stream(stream, expected, checkpoint)

        if verify is None:
            size = os.path.getsize(checkpoint) if from_gguf else _checkpoint_bytes(checkpoint)
            verify = embedded or size < VERIFY_LIMIT_BYTES
        tally = _Tally()
        total = len(names)  # what the stream yields: model-layout tensors (experts merged)
        start = time.perf_counter()
        gguf_notes = []
        stream = tally.before(model_stream(gguf_notes))
        stream = quantize_stream(stream, quant_recipe, num_layers=arch.num_layers(config), module_of=quantizable_module)
        stream = _progress(tally.after(stream), total, "quantize", progress)
        reload = load_bundle
        if backend == "cuda":
            from models.pipeline import cuda_backend

            stream = cuda_backend.pack_stream(stream)
            reload = lambda path: cuda_backend.to_canonical(load_bundle(path))  # noqa: E731
        elif backend == "mlx":
            # The folder is mlx-lm's, not a bundle: verification runs our model on the same quantized
            # tensors, kept from the stream (verify is on only for small checkpoints).
            quantized_tensors: Dict = {}
            if verify:
                stream = _keep(stream, quantized_tensors)
            reload = lambda path: quantized_tensors  # noqa: E731
        if backend == "mlx":
            bundle = _write_mlx(arch, stream, out, hf_config, checkpoint, embedded, config, max_shard_size)
        else:
            bundle = save_bundle(stream, out, recipe=quant_recipe, max_shard_bytes=max_shard_size, resume=resume,
                                 metadata={"architecture": arch.name, "backend": backend, "recipe": recipe_name},
                                 extra_files=() if from_gguf else source_files(checkpoint))  # config, tokenizer
        seconds = time.perf_counter() - start
        for note in gguf_notes:
            print(f"note: {note}")

        rows = [
            ("architecture", arch.name),
            ("recipe", recipe_name),
            ("backend", backend),
            ("output", bundle),
            ("tensors written", f"{tally.tensors} ({tally.quantized} quantized)"),
            ("bytes before", f"{tally.bytes_in:,}"),
            ("bytes after", f"{tally.bytes_out:,} ({tally.bytes_out / max(tally.bytes_in, 1):.3f}x)"),
            ("time", f"{seconds:.2f} s"),
        ]
        if from_gguf:
            rows.insert(1, ("input", f"GGUF {checkpoint}"))
        result = {"bundle": bundle, "tensors": tally.tensors, "quantized": tally.quantized,
                  "bytes_in": tally.bytes_in, "bytes_out": tally.bytes_out, "progress_total": total}
        failure = None
        if verify:
            # From a GGUF file the unquantized model is not available: the reference is the GGUF
            # model itself (its quantized weights dequantized exactly).
            _step(f"verify: loading the unquantized reference model from {checkpoint}")
            reference = build_quantized_model(arch.build_model(config, device="meta"), dict(model_stream()))
            if from_gguf:
                print("verification reference: the GGUF model, its quantized weights dequantized")
            _step(f"verify: reloading {bundle}")
            quantized = build_quantized_model(arch.build_model(config, device="meta"), reload(bundle))
            _step("verify: running both models on a 16-token prompt, then 8 greedy tokens each")
            check = compare_logits(reference, quantized, vocab_size=config.vocab_size, seed=seed)
            result.update(check)
            rows += [
                ("logits cosine", f"{check['cosine']:.5f}"),
                ("logits SQNR", f"{check['sqnr_db']:.1f} dB"),
                ("greedy (unquantized)", " ".join(map(str, check["tokens_reference"]))),
                ("greedy (quantized)", " ".join(map(str, check["tokens_quantized"]))),
            ]
            failure = verdict(check, min_cosine=verify_min_cosine)
            if backend == "mlx" and failure is None:
                from models.pipeline import mlx_backend

                _step("verify: loading the folder with mlx_lm and comparing its logits")
                mlx_check = mlx_backend.compare_with_mlx(bundle, reference, quantized, vocab_size=config.vocab_size,
                                                         seed=seed)
                result["mlx"] = mlx_check
                ours, ref = mlx_check["mlx_vs_quantized"], mlx_check["mlx_vs_reference"]
                rows += [  # all three models evaluated in float32 (see mlx_backend.compare_with_mlx)
                    ("mlx-lm vs ours (fp32)", f"cosine {ours['cosine']:.6f}, SQNR {ours['sqnr_db']:.1f} dB, "
                                              f"max |diff| {ours['max_abs_error']:.2e}"),
                    ("mlx-lm vs unquantized (fp32)", f"cosine {ref['cosine']:.5f}, SQNR {ref['sqnr_db']:.1f} dB"),
                ]
            if use_moe_op and failure is None:
                from models.pipeline.moe_op import use_quantized_moe_op

                with_op = build_quantized_model(arch.build_model(config, device="meta"), reload(bundle))
                swapped = use_quantized_moe_op(with_op)
                if not swapped:
                    raise UsageError("--use_moe_quantized_op: no MoE block to swap; the kernel needs routed experts "
                                     "quantized INT4/INT8 with one group size (32/64/128) for gate_up and down, "
                                     "e.g. --recipe=int4 or mixed")
                _step("verify: running the MoE blocks through torch.ops.llmq.quantized_moe_ffn")
                op_check = compare_logits(quantized, with_op, vocab_size=config.vocab_size, seed=seed)
                result["moe_op"] = dict(op_check, blocks=len(swapped))
                rows += [
                    ("MoE op blocks", f"{len(swapped)} via torch.ops.llmq.quantized_moe_ffn"),
                    ("op vs eager quantized", f"cosine {op_check['cosine']:.6f}, SQNR {op_check['sqnr_db']:.1f} dB"),
                    ("greedy (quantized, op)", " ".join(map(str, op_check["tokens_quantized"]))),
                ]
            rows.append(("verification", "FAILED: " + failure if failure else
                         f"passed (logits cosine >= {verify_min_cosine})"))
        elif use_moe_op:
            raise UsageError("--use_moe_quantized_op needs --verify (it checks the op against the eager path)")
        else:
            rows.append(("verification", "not run (--verify to run it)"))
        result["verification_failure"] = failure
        if failure and not verify_warn_only:
            failed = _move_aside(bundle)
            rows[3] = ("output", f"moved to {failed} (failed verification)")
            result["bundle"] = failed
            print(format_table(rows))
            raise UsageError(f"--verify: {failure}; the output was moved to {failed} "
                             "(--verify_warn_only keeps it at --out)")
        print(format_table(rows))
        if failure:
            print(f"warning: --verify: {failure}; the output at {bundle} is kept (--verify_warn_only)",
                  file=sys.stderr)
        if embedded:
            print("[embedded default] pass --checkpoint=<HF folder> to quantize a real model")
        return result


# The module of each terminal packer; each declares ACCEPTS_FORMATS (the bundle: every registered format).
_BACKEND_MODULES = {"bundle": "models.pipeline.bundle_backend", "cuda": "models.pipeline.cuda_backend",
                    "mlx": "models.pipeline.mlx_backend"}


def _backend_formats(backend: str):
    import importlib

    if backend not in _BACKEND_MODULES:
        raise UsageError(f"--backend {backend!r} unknown; expected one of {', '.join(_BACKEND_MODULES)}")
    return importlib.import_module(_BACKEND_MODULES[backend]).ACCEPTS_FORMATS


def _check_out(out: str) -> None:
    """--out must be a folder or not exist yet, and its nearest existing parent a folder."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out}: exists and is not a folder")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"--out {out}: {parent} is a file, not a folder")


def _step(message: str) -> None:
    """What a long step is doing, as it starts (verification takes ~35 s on an 844 MB model)."""
    print(message, flush=True)


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
    """Before anything is written: every integer group size divides the dimension it groups, and
    a recipe that quantizes nothing is said out loud."""
    bound = recipe.bind(arch.num_layers(config))
    quantized = 0
    for name, shape in expected.shapes.items():
        module = quantizable_module(name)
        cfg = bound.get_config(module) if module is not None else None
        if cfg is None:
            continue
        quantized += 1
        if getattr(cfg, "format", "int") != "int" or not shape:
            continue
        k = shape[-1]
        gs = cfg.group_size_for(k)
        if gs <= 0 or k % gs:
            raise UsageError(f"--recipe {recipe_name}: group_size={gs} does not divide the input dimension K={k} "
                             f"of {name} (shape {list(shape)})")
    if quantized == 0:
        print(f"warning: --recipe {recipe_name}: no rule quantizes any of the model's {len(expected.shapes)} "
              "tensors; the output will hold them all unquantized", file=sys.stderr)


def _refuse_other_config(arch: Architecture, others: Sequence[Architecture], hf_config: Dict, checkpoint: str) -> None:
    if arch.reads(hf_config):
        return
    for other in others:
        if other.reads(hf_config):
            raise UsageError(f"--checkpoint {checkpoint}: a {other.name} checkpoint (model_type "
                             f"{hf_config.get('model_type')!r}); this binary quantizes {arch.name}: use "
                             f"`bazel run {other.target} -- --checkpoint=...`")


def _refuse_other_gguf(arch: Architecture, others: Sequence[Architecture], checkpoint: str) -> None:
    from llmq.checkpoint import read_gguf_metadata

    found = read_gguf_metadata(checkpoint).get("general.architecture")
    if found == arch.gguf_import.GGUF_ARCH:
        return
    for other in others:
        if other.gguf_import is not None and found == other.gguf_import.GGUF_ARCH:
            raise UsageError(f"--checkpoint {checkpoint}: a {other.name} GGUF (general.architecture {found!r}); "
                             f"this binary quantizes {arch.name}: use `bazel run {other.target} -- --checkpoint=...`")


def _keep(items, into: Dict):
    """Pass the stream through, remembering each (name, value) in `into`."""
    for name, value in items:
        into[name] = value
        yield name, value


def _write_mlx(arch: Architecture, stream, out: str, hf_config: Dict, checkpoint: str, embedded: bool, config,
               max_shard_size: int) -> str:
    """--backend=mlx: write the mlx-lm folder (tokenizer: a tiny offline one for the embedded default,
    the checkpoint's own files otherwise)."""
    from models.pipeline import mlx_backend

    if arch.mlx_export is None:
        raise UsageError(f"--backend mlx: no MLX export for {arch.name}")
    if os.path.exists(out):
        raise UsageError(f"--out {out} already exists; an MLX folder is written whole: remove it or pick another --out")
    if embedded:
        tokenizer = mlx_backend.write_tiny_tokenizer(checkpoint, config.vocab_size)
    else:
        tokenizer = mlx_backend.tokenizer_files(checkpoint)
        if not mlx_backend.has_tokenizer(checkpoint):
            print(f"note: {checkpoint} has no tokenizer files; mlx_lm.load({out}) will need them copied in")
    try:
        return str(mlx_backend.write_mlx_folder(out, stream, arch, hf_config, tokenizer=tokenizer,
                                                max_shard_bytes=max_shard_size))
    except CheckpointError:  # a failed write, already one line naming the file
        raise
    except ValueError as e:  # a config or tensor mlx-lm cannot express
        raise UsageError(f"--backend mlx: {e}") from None


def _user_path(path: Optional[str]) -> Optional[str]:
    """`bazel run` starts the binary in its runfiles tree: relative paths mean the user's cwd."""
    base = os.environ.get("BUILD_WORKING_DIRECTORY")
    if path is None or base is None or os.path.isabs(path):
        return path
    return os.path.join(base, os.path.expanduser(path))


def main_for(arch: Architecture, others: Sequence[Architecture] = ()) -> None:
    """absl entry point of a model's quantize_and_save binary; `others` are the architectures of the
    sibling binaries (a checkpoint of one of them is told which target to use)."""

    def _main(argv):
        if len(argv) > 1:
            print(f"error: unexpected arguments {argv[1:]} (flags are --name=value)", file=sys.stderr)
            return 2
        if FLAGS.list_recipes:
            print(list_recipes(arch))
            return 0
        progress = sys.stderr.isatty() if FLAGS.progress is None else FLAGS.progress
        try:
            recipe = FLAGS.recipe
            if recipe and os.path.sep in recipe:
                recipe = _user_path(recipe)
            run(arch, checkpoint=_user_path(FLAGS.checkpoint), recipe=recipe, backend=FLAGS.backend,
                out=_user_path(FLAGS.out),
                resume=FLAGS.resume, max_shard_size=FLAGS.max_shard_size, verify=FLAGS.verify, seed=FLAGS.seed,
                use_moe_op=FLAGS.use_moe_quantized_op, verify_min_cosine=FLAGS.verify_min_cosine,
                verify_warn_only=FLAGS.verify_warn_only, progress=progress, others=others)
        except (UsageError, CheckpointError, FileExistsError) as e:
            print(f"error: {cli_wording(str(e))}", file=sys.stderr)
            return 2
        except OSError as e:  # the output's place: read-only, full, under /proc, a parent that is a file
            where = e.filename if e.filename is not None else "--out"
            print(f"error: {where}: {e.strerror or e}", file=sys.stderr)
            return 2
        return 0

    app.run(lambda argv: sys.exit(_main(argv)), flags_parser=parse_flags_or_exit)


# The library's errors suggest its Python arguments; on the command line, say what the CLI offers.
_CLI_WORDING = (
    ("pass nonfinite='allow' or 'warn' to accept them", "quantize_and_save does not quantize NaN/Inf weights"),
    ("pass overwrite=True to replace it", "remove it or pick another --out"),
    ("pass resume=False", "pass --noresume"),
)


def cli_wording(message: str) -> str:
    for library, cli in _CLI_WORDING:
        message = message.replace(library, cli)
    return message


def list_recipes(arch: Architecture) -> str:
    """--list_recipes: every preset name with what it does (the recipe file's description, or a
    summary of the rules for llmq's generic presets)."""
    for name, preset in arch.presets.items():
        register_preset(name, preset, overwrite=True)
    from llmq.quant import PRESETS

    width = max(len(n) for n in PRESETS)
    lines = []
    for name in sorted(PRESETS):
        about = arch.recipe_descriptions.get(name) if name in arch.presets else None
        if about is None:
            about = "generic llmq preset: " + "; ".join(
                f"{r.pattern}{'' if r.layers is None else f' layers {list(r.layers)}'} -> "
                f"{r.config.describe() if r.config is not None else 'kept'}" for r in PRESETS[name].rules)
        lines.append(f"{name:<{width}}  {about}")
    return "\n".join(lines)


USAGE = """Quantize a checkpoint: read -> recipe -> quantize -> pack (--backend) -> save to --out, then (--verify)
reload the output and compare its logits with the unquantized model's. With no --checkpoint a tiny
deterministic model of this architecture is written to a temporary folder and quantized (its output is
deleted at exit unless --out is given). Failures: one line on stderr, exit status 2.
"""

HELP_FLAGS = ("--help", "-help", "-h", "--helpshort", "-helpshort", "-?", "--helpfull", "-helpfull")


def parse_flags_or_exit(argv):
    """absl's parser, but --help lists this tool's flags (absl would list only the main module's,
    and this one is not it) and exits 0, and a bad flag is one line on stderr and exit status 2."""
    asked = [a.split("=", 1)[0] for a in argv[1:] if a.split("=", 1)[0] in HELP_FLAGS]
    if asked:
        prog = os.path.basename(argv[0]) if argv else "quantize_and_save"
        print(f"usage: {prog} [--checkpoint=DIR|FILE.gguf] [--recipe=NAME|FILE] [--backend=bundle|cuda|mlx] "
              "[--out=DIR] [flags]\n")
        print(USAGE)
        if asked[0].endswith("helpfull"):
            print(FLAGS.get_help())
        else:
            print(FLAGS.module_help(sys.modules[__name__]))
        sys.exit(0)
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e} (see --help)", file=sys.stderr)
        sys.exit(2)
