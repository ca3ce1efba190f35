"""The quantize_and_save command line: flags, --help, --list_recipes, main_for, and the wording of errors.

Each model package's binary calls `main_for(ARCHITECTURE)`. --backend takes any registered backend
(llmq.backend; `backends.registered` registers this repository's).
"""

from __future__ import annotations

import math
import os
import sys

from absl import app, flags

import backends.registered  # noqa: F401  every backend registers itself
from llmq.backend import backend_names, get_backend
from llmq.checkpoint import CheckpointError
from llmq.quant.presets import all_presets
from models.pipeline.arch import Architecture
from models.pipeline.run import _user_path, run
from models.pipeline.usage_error import UsageError

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "Hugging Face checkpoint folder (config.json + safetensors) or a "
                    "llama.cpp .gguf file. Omit to run the embedded default tiny model.")
flags.DEFINE_string("recipe", None, "Recipe preset name (see --list_recipes) or a JSON/YAML recipe file.")
flags.DEFINE_enum("backend", "bundle", backend_names(), "Terminal writer (one of the backends listed above --help's "
                  "flags): " + "; ".join(f"{n} = {get_backend(n).description}" for n in backend_names()) + ".")
flags.DEFINE_string("out", None, "Output folder (default: out/<arch>-<recipe>; a temp folder for the embedded default).")
flags.DEFINE_boolean("resume", True, "Reuse finished shards of an interrupted run into the same --out.")


class ByteSizeParser(flags.ArgumentParser):
    """A size in bytes: a plain integer, or a number with a unit (kB/MB/GB/TB: powers of 1000, KiB/MiB/
    GiB/TiB: of 1024, case-insensitive; "5GB", "500MiB", "1.5 GiB")."""

    UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9}
    MINIMUM = 1 << 16
    syntactic_help = "bytes, or a number with a unit: 5GB, 500MiB"

    def parse(self, argument):
        import re

        if isinstance(argument, int):
            value = argument
        else:
            m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(argument))
            unit = m.group(2).lower() if m else None
            if m is None or unit not in self.UNITS:
                raise ValueError(f"{argument!r} is not a size (expected bytes or a number with a unit: 5GB, 500MiB, "
                                 "2GiB)")
            value = int(float(m.group(1)) * self.UNITS[unit])
        if value < self.MINIMUM:
            raise ValueError(f"{argument!r} is under the minimum of {self.MINIMUM} bytes (64 KiB)")
        return value

    def flag_type(self):
        return "size"


flags.DEFINE(ByteSizeParser(), "max_shard_size", 2 << 30, "Maximum size of one output shard: bytes or a number with "
             "a unit (\"5GB\", \"500MiB\"; default 2 GiB).")
flags.DEFINE_boolean("dry_run", False, "Print the estimated output size and real bits per weight for every backend "
                     "(from the checkpoint's headers and the recipe), then exit without writing anything.")
flags.DEFINE_boolean("verify", None, "Read the output back and compare it with the unquantized model layer by "
                     "layer, in bounded memory (default: on at every size, where the backend reads its output back). "
                     "A failed check (non-finite logits, or logits noise over 4x that of round-to-nearest of the "
                     "same formats) exits with status 2 and moves the output to <out>.failed.")
flags.DEFINE_float("verify_min_cosine", None, "An extra --verify floor: fail below this logits cosine with the "
                   "unquantized model (default: none; the rule is relative to round-to-nearest).", lower_bound=-1.0,
                   upper_bound=1.0)
flags.DEFINE_boolean("verify_warn_only", False, "A failed --verify only warns: the run exits 0 and the output stays "
                     "at --out.")
flags.DEFINE_integer("seed", 0, "Seed of the embedded default model and of the verification prompt.")
flags.DEFINE_boolean("list_recipes", False, "Print the recipe presets, with the bits per weight each format takes as "
                     "--backend writes it, and exit.")
flags.DEFINE_boolean("use_moe_quantized_op", False, "Verify with the MoE blocks running through "
                     "torch.ops.llmq.quantized_moe_ffn (the fused C++ kernel) instead of eager PyTorch.")
flags.DEFINE_boolean("error_report", None, "Write quant_error.csv/.md/.png into the output (per quantized tensor: "
                     "format, bits, relative error, SQNR; with --calibration_text the layer's output error) and "
                     "summarise it in the final table. Default: on with --calibration_text or "
                     "--budget_bits_per_weight, else off (it measures every tensor in float64: ~0.1 GB/s, far "
                     "below the plain stream's speed).")
flags.DEFINE_string("calibration_text", None, "A UTF-8 text file (not the text you evaluate on). The unquantized model "
                    "runs on its first --calibration_tokens tokens; each layer's mean squared input per column "
                    "weights the error that methods 'hqq' and 'search' and --budget_bits_per_weight minimise, and the error report "
                    "gains each layer's output error. Without it every method is calibration-free.")
flags.DEFINE_integer("calibration_tokens", 512, "Tokens of --calibration_text to run.", lower_bound=2)
flags.DEFINE_enum("calibration_inputs", "float", ["float", "quantized"], "What each layer sees while "
                  "--calibration_text is run: 'float', the outputs of the unquantized layers before it; 'quantized', "
                  "the outputs of the layers before it as the recipe quantizes them (the sequential form of GPTQ: "
                  "each layer is quantized as soon as its statistics are measured, and the text goes on through the "
                  "quantized layer).")
flags.DEFINE_float("budget_bits_per_weight", None, "Choose per matrix among 3/4/5/6/8-bit integer formats "
                   "(--backend=gguf: its block types Q2_K .. Q8_0; rows not a multiple of 256 take Q4_0 .. Q8_0) so the "
                   "matrices the recipe quantizes fit this many bits per weight as --backend writes them (scales and biases "
                   "included: the bundle's float32 pair, an MLX folder's 16-bit pair) with the "
                   "smallest (importance-weighted) error; the choice is written to <out>/budget_recipe.json, an "
                   "ordinary recipe (--recipe=that file reproduces it).", lower_bound=1.0)
flags.DEFINE_enum("budget_method", "hqq", ["minmax", "search", "hqq", "gptq"], "Rounding method of the "
                  "--budget_bits_per_weight candidates.")
flags.DEFINE_boolean("requantize_gguf", False, "GGUF input: dequantize the GGUF's quantized tensors exactly and "
                     "quantize them with --recipe (default: keep them as the GGUF stores them, losslessly; only "
                     "its float tensors meet the recipe).")
flags.DEFINE_boolean("progress", None, "Show progress bars (default: when stderr is a terminal).")
for _name in ("verify_min_cosine", "budget_bits_per_weight"):  # absl's bounds let NaN through
    flags.register_validator(_name, lambda value: value is None or math.isfinite(value),
                             message="expected a finite number")


def main_for(arch: Architecture) -> None:
    """absl entry point of a model's quantize_and_save binary; a checkpoint of another architecture
    registered in the process (models/architectures.py) is told which target to use."""
    _main_with(lambda checkpoint: arch, arch)


def main_model_free() -> None:
    """absl entry point of //models:quantize: any checkpoint, its architecture read off it
    (models/pipeline/generic.py); --list_recipes without --checkpoint lists llmq's generic presets."""
    from models.pipeline.generic import LISTING, model_free_architecture

    _usage[0] = MODEL_FREE_USAGE
    _main_with(lambda checkpoint: model_free_architecture(checkpoint, FLAGS.backend), LISTING)


def _main_with(resolve, listing: Architecture) -> None:
    """The command line over `resolve(checkpoint) -> Architecture` (UsageError: one line)."""

    def _main(argv):
        if len(argv) > 1:
            print(f"error: unexpected arguments {argv[1:]} (flags are --name=value)", file=sys.stderr)
            return 2
        if FLAGS.list_recipes:
            try:
                arch = resolve(_user_path(FLAGS.checkpoint)) if FLAGS.checkpoint else listing
                print(list_recipes(arch, FLAGS.backend))
            except UsageError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            return 0
        progress = sys.stderr.isatty() if FLAGS.progress is None else FLAGS.progress
        try:
            recipe = FLAGS.recipe
            if recipe and os.path.sep in recipe:
                recipe = _user_path(recipe)
            arch = resolve(_user_path(FLAGS.checkpoint))
            run(arch, checkpoint=_user_path(FLAGS.checkpoint), recipe=recipe, backend=FLAGS.backend,
                out=_user_path(FLAGS.out),
                resume=FLAGS.resume, max_shard_size=FLAGS.max_shard_size, verify=FLAGS.verify, seed=FLAGS.seed,
                use_moe_op=FLAGS.use_moe_quantized_op, verify_min_cosine=FLAGS.verify_min_cosine,
                verify_warn_only=FLAGS.verify_warn_only, progress=progress,
                error_report=_error_report_wanted(), calibration_text=_user_path(FLAGS.calibration_text),
                calibration_tokens=FLAGS.calibration_tokens, budget_bits_per_weight=FLAGS.budget_bits_per_weight,
                budget_method=FLAGS.budget_method, requantize_gguf=FLAGS.requantize_gguf, dry_run=FLAGS.dry_run,
                calibration_inputs=FLAGS.calibration_inputs)
        except (UsageError, CheckpointError, FileExistsError) as e:
            print(f"error: {cli_wording(str(e))}", file=sys.stderr)
            return 2
        except OSError as e:  # the output's place: read-only, full, under /proc, a parent that is a file
            where = e.filename if e.filename is not None else "--out"
            print(f"error: {where}: {e.strerror or e}", file=sys.stderr)
            return 2
        return 0

    app.run(lambda argv: sys.exit(_main(argv)), flags_parser=parse_flags_or_exit)


def _error_report_wanted() -> bool:
    if FLAGS.error_report is not None:
        return FLAGS.error_report
    return FLAGS.calibration_text is not None or FLAGS.budget_bits_per_weight is not None


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


NOMINAL_SHAPE = (256, 4096)  # --list_recipes states bits per weight for a matrix of this shape


def written_bits_per_weight(storage, config) -> float:
    """Bits per weight `storage` (a backend's, llmq.quant.storage) writes for a NOMINAL_SHAPE matrix
    quantized with `config`, scales and per-tensor extras included."""
    import dataclasses

    import torch

    from llmq.quant import quantize_weight

    stored = storage(config)
    if config.format == "int":
        config = dataclasses.replace(config, scale_dtype=stored.scale_dtype, method="minmax")
    return stored.bits(NOMINAL_SHAPE, quantize_weight(torch.zeros(NOMINAL_SHAPE), config)) / math.prod(NOMINAL_SHAPE)


def list_recipes(arch: Architecture, backend: str = "bundle") -> str:
    """--list_recipes: every preset name with what it does (the recipe file's description, or a
    summary of the rules for llmq's generic presets) and the bits per weight each of its formats
    takes as `backend` writes it (scales included; for a NOMINAL_SHAPE matrix)."""
    from llmq.backend import get_backend, storage_of

    try:
        writer = get_backend(backend)
    except ValueError as e:
        raise UsageError(f"--backend: {e}") from None
    storage = storage_of(writer)
    presets = all_presets(arch.presets)
    width = max(len(n) for n in presets)
    lines = []
    for name in sorted(presets):
        about = arch.recipe_descriptions.get(name) if name in arch.presets else None
        if about is None:
            about = "generic llmq preset: " + "; ".join(
                f"{r.pattern}{'' if r.layers is None else f' layers {list(r.layers)}'} -> "
                f"{r.config.describe() if r.config is not None else 'kept'}" for r in presets[name].rules)
        configs = list(dict.fromkeys(r.config for r in presets[name].rules if r.config is not None))
        sizes = []
        for config in configs:
            if config.format in writer.accepts_formats:
                sizes.append(f"{config.describe()} {written_bits_per_weight(storage, config):.2f}")
            else:
                sizes.append(f"{config.describe()} not written by --backend {backend}")
        if sizes:
            about += f" [bits per weight as --backend {backend} writes them: {', '.join(sizes)}]"
        lines.append(f"{name:<{width}}  {about}")
    return "\n".join(lines)


USAGE = """Quantize a checkpoint: read -> recipe -> quantize -> write (--backend) to --out, then (--verify)
reload the output and compare its logits with the unquantized model's. With no --checkpoint a tiny
deterministic model of this architecture is written to a temporary folder and quantized (its output is
deleted at exit unless --out is given). Failures: one line on stderr, exit status 2.
"""

MODEL_FREE_USAGE = """Quantize any checkpoint without model code: read -> recipe rules over tensor names -> quantize ->
write (--backend) to --out, then (--verify) reload the output and compare it with the checkpoint: through
transformers' own model class where transformers knows the architecture, else tensor by tensor.
--checkpoint is required. Failures: one line on stderr, exit status 2.
"""
_usage = [USAGE]

HELP_FLAGS = ("--help", "-help", "-h", "--helpshort", "-helpshort", "-?", "--helpfull", "-helpfull")


def backends_help() -> str:
    """One line per registered backend: name, the formats it takes, what it writes."""
    names = backend_names()
    width = max(len(n) for n in names)
    return "backends (--backend):\n" + "\n".join(
        f"  {n:<{width}}  {get_backend(n).description} [formats: {', '.join(get_backend(n).accepts_formats)}]"
        for n in names)


def parse_flags_or_exit(argv):
    """absl's parser, but --help lists this tool's flags (absl would list only the main module's,
    and this one is not it) and the backends, and exits 0; a bad flag is one line on stderr and exit
    status 2."""
    asked = [a.split("=", 1)[0] for a in argv[1:] if a.split("=", 1)[0] in HELP_FLAGS]
    if asked:
        prog = os.path.basename(argv[0]) if argv else "quantize_and_save"
        print(f"usage: {prog} [--checkpoint=DIR|FILE.gguf] [--recipe=NAME|FILE] [--backend={'|'.join(backend_names())}] "
              "[--out=DIR] [flags]\n")
        print(_usage[0])
        print(backends_help() + "\n")
        if asked[0].endswith("helpfull"):
            print(FLAGS.get_help())
        else:
            print(grouped_help())
        sys.exit(0)
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e}{_enum_suggestion(argv)} (see --help)", file=sys.stderr)
        sys.exit(2)


# --help's sections, by what a person looks for; a flag of this module in none of them is listed under
# "advanced" (so a flag added later is never missing from --help).
HELP_GROUPS = (
    ("input", ("checkpoint", "requantize_gguf", "seed")),
    ("output and backend", ("backend", "out", "max_shard_size", "resume")),
    ("recipe", ("recipe", "list_recipes", "dry_run", "budget_bits_per_weight", "budget_method")),
    ("quality", ("calibration_text", "calibration_tokens", "calibration_inputs", "error_report")),
    ("verification", ("verify", "verify_min_cosine", "verify_warn_only", "use_moe_quantized_op")),
)


def grouped_help() -> str:
    """This tool's flags under HELP_GROUPS' headings (absl's own --helpfull lists every module's)."""
    import textwrap

    mine = {f.name: f for f in FLAGS.flags_by_module_dict().get(__name__, [])}
    listed = {n for _, names in HELP_GROUPS for n in names}
    groups = list(HELP_GROUPS) + [("advanced", tuple(sorted(n for n in mine if n not in listed)))]
    out = []
    for title, names in groups:
        present = [mine[n] for n in names if n in mine]
        if not present:
            continue
        out.append(f"{title}:")
        for flag in present:
            default = flag.default_as_str if flag.default is not None else "unset"
            name = f"--{'[no]' if flag.boolean else ''}{flag.name}"
            out += textwrap.wrap(f"{name}: {flag.help} (default: {default})", width=110, initial_indent="  ",
                                 subsequent_indent="      ")
        out.append("")
    out.append("--helpfull lists every flag of every module (absl's own included).")
    return "\n".join(out)


def _enum_suggestion(argv) -> str:
    """" (did you mean 'x'?)" for a --flag=value whose value is not one of the flag's choices."""
    from llmq.did_you_mean import did_you_mean

    for arg in argv[1:]:
        if not (arg.startswith("-") and "=" in arg):
            continue
        name, value = arg.lstrip("-").split("=", 1)
        if name in FLAGS:
            choices = getattr(FLAGS[name].parser, "enum_values", None)
            if choices and value not in choices:
                return did_you_mean(value, choices)
    return ""
