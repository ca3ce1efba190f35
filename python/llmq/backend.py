"""Backends: where a quantized stream goes. One base class (`Backend`), one registry.

A backend turns the pipeline's stream of model-layout tensors into a folder some consumer
loads (the portable llmq bundle, tinygemm tiles, an mlx-lm folder, a quantized Hugging Face
folder), and reads that folder back for verification. Each backend registers itself once::

    class MyBackend(Backend): ...          # every member declared on Backend, with its default
    register_backend(MyBackend())          # at import of its module

and the pipeline looks it up by name (``get_backend(flag_value)``); nothing else names it.
The portable bundle is registered here, by the core itself. See docs/backends.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from llmq.did_you_mean import did_you_mean
from llmq.quant.storage import CANONICAL, Storage

Stream = Iterable[Tuple[str, Any]]
Rows = List[Tuple[str, str]]


def _same_name(name: str, value: Any) -> Dict[str, Any]:
    return {name: value}


def _unchanged(tensors: Dict[str, Any]) -> Dict[str, Any]:
    return tensors


@dataclasses.dataclass(frozen=True)
class WriteJob:
    """What a writer needs, fixed before any tensor flows (the pipeline fills it from the model's
    Architecture and the input, so a backend never imports a model).

    out: the output folder. recipe / recipe_name: the QuantRecipe and the name it was asked by.
    architecture: the model's name. hf_config: its config.json dict; model_config: the parsed
    config object (attributes as the model reads them). num_layers: for recipes that count layers
    from the end. to_hf(name, value) -> {hf_name: value}: a model-layout tensor as the HF
    checkpoint stores it; from_hf({hf_name: value}) -> {model name: value}: the inverse, for
    reloading. source_files: files the input carries (config.json, tokenizer) to copy along;
    tokenizer_files: tokenizer files for consumers that need them (Backend.needs_tokenizer_files).
    source_kind: "hf" (a folder), "gguf" (a .gguf file; no config or tokenizer files) or
    "embedded" (the tiny default model); source_path: that folder or file (with source_kind
    "gguf", the file whose metadata, general.* and tokenizer.ggml.*, a GGUF writer may carry over).
    max_shard_bytes / resume: shard size and whether an interrupted run's shards are reused.
    metadata: str -> str pairs the output records (architecture, backend, recipe).
    verify: the run reloads the output afterwards (reload / check_consumer follow write).
    add_files(folder): the run's own files (its error report, a chosen recipe); a writer calls it
    with its work folder once the stream is written, before the one publish, so they are
    published with the output or not at all.

    For writers of GGUF files (all empty where the model has none): gguf_arch, llama.cpp's
    architecture name; to_gguf(name, value) -> {gguf_name: value}, a model-layout tensor as llama.cpp stores it (names and value transforms
    by the table the model's GGUF import reads); gguf_metadata() -> {key: value}, the architecture's
    `<arch>.*` keys for the config (an HF input's; a GGUF input's own keys are in its file);
    from_gguf(path) -> {model name: value}, a GGUF file read back by the model's GGUF import.
    """

    out: str
    recipe: Any
    recipe_name: str
    architecture: str
    hf_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model_config: Any = None
    num_layers: int = 0
    to_hf: Callable[[str, Any], Dict[str, Any]] = _same_name
    from_hf: Callable[[Dict[str, Any]], Dict[str, Any]] = _unchanged
    source_files: Tuple[str, ...] = ()
    tokenizer_files: Tuple[str, ...] = ()
    source_kind: str = "hf"
    source_path: str = ""
    max_shard_bytes: int = 2 << 30
    resume: bool = True
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    verify: bool = False
    add_files: Optional[Callable[[str], None]] = None
    gguf_arch: str = ""
    to_gguf: Optional[Callable[[str, Any], Dict[str, Any]]] = None
    gguf_metadata: Optional[Callable[[], Dict[str, Any]]] = None
    from_gguf: Optional[Callable[[str], Dict[str, Any]]] = None


class BackendError(ValueError):
    """A job a backend cannot write (a refused input, format or output place): one line, shown as is."""


class Backend:
    """A terminal writer of quantized tensors: subclass it, set the four attributes without a
    default, define `write` (and `reload` unless `reloads` is False), and override what else applies.

    Every member, with its default:

    - name: the --backend value; description: one line for --help.
    - accepts_formats: the format names a recipe may use with it (checked before any work).
    - storage(config, job) -> Storage (llmq.quant.storage): required; how it writes a weight quantized
      with `config` (scale dtype, the tensors and their dtypes and shapes): the run quantizes with that
      scale dtype and counts every bits per weight it budgets, reports and prints from it, so they are
      the bytes it writes (job may be None: the declaration must not need more than job.hf_config).
    - takes_float (False): False means write() receives the quantized stream (llmq values: tensors
      and quantized weights, quantized by job.recipe); True means it receives the unquantized
      model-layout stream and quantizes with job.recipe itself.
    - streams_row_blocks (False): True where write() also takes tensors carried as row blocks
      (llmq.quant.row_blocks: RowBlocks, QuantizedRowBlocks); the pipeline then sends large tensors
      that way, so its memory stays one block.
    - needs_tokenizer_files (False): True where the output needs the tokenizer as files
      (tokenizer.json ...): a GGUF input's tokenizer is then written out as files and handed over in
      job.tokenizer_files.
    - reloads (True): whether `reload` can read the output back; a backend that cannot sets False,
      and the pipeline's default verification is then skipped with a line saying why (an explicit
      --verify is refused).
    - checks_consumer (False): True where `check_consumer` loads the folder as its consumer does.
    - needs_model (""): why the backend needs knowledge of the model beyond its tensors and config.json
      (its consumer's names or metadata per architecture); "" where it needs none. Model-free
      quantization (models/pipeline/generic.py) refuses a backend with a reason, quoting it.
    - check(job): refuse a job before any work (BackendError, one line); default: accept.
    - write(stream, job) -> path: required.
    - reload(path, job) -> {name: value}: required where `reloads`.
    - summary(path, job) -> rows: extra summary rows; default none.
    - written_bits(path) -> (bits, weights): a takes_float backend's count, by its `storage`, of what
      it wrote for the weights it quantized (the run's summary); default (0, 0): none counted.
    - check_consumer(path, job, reference, quantized, prompt) -> (rows, dict): where
      `checks_consumer`, load the folder as its consumer does and compare its logits for `prompt`
      [1, T] with our unquantized (`reference`) and reloaded (`quantized`) models; the dict may hold
      "failure" (one line).
    - budget_options() -> configs (llmq.quant.budget.DEFAULT_OPTIONS where it accepts "int", else none): the
      candidates --budget_bits_per_weight chooses among per matrix (each with --budget_method); none: the
      backend takes no budget.
    - recipe_for(recipe) -> recipe (the recipe unchanged): the recipe in the formats this backend
      stores, called first on the recipe as loaded (ValueError for a rule it cannot hold).
    """

    name: str = ""
    description: str = ""
    accepts_formats: Tuple[str, ...] = ()
    takes_float: bool = False
    streams_row_blocks: bool = False
    needs_tokenizer_files: bool = False
    reloads: bool = True
    checks_consumer: bool = False
    needs_model: str = ""

    def recipe_for(self, recipe: Any) -> Any:
        """The recipe in the formats this backend stores (ValueError for a rule it cannot hold)."""
        return recipe

    def budget_options(self) -> Tuple[Any, ...]:
        """The QuantConfigs --budget_bits_per_weight chooses among (method set by --budget_method); () for none."""
        from llmq.quant.budget import DEFAULT_OPTIONS

        return DEFAULT_OPTIONS if "int" in self.accepts_formats else ()

    def check(self, job: WriteJob) -> None:
        """Raise BackendError (one line) for a job this backend cannot write; called before any work."""

    def storage(self, config: Any, job: Optional[WriteJob]) -> Storage:
        """How a weight quantized with `config` is written (llmq.quant.storage.Storage)."""
        raise NotImplementedError(f"{type(self).__name__}.storage")

    def write(self, stream: Stream, job: WriteJob) -> str:
        """Write the stream to job.out; return the output path. Publish only a complete folder, with
        job.add_files called on it first (llmq.checkpoint.workfolder does both)."""
        raise NotImplementedError(f"{type(self).__name__}.write")

    def reload(self, path: str, job: WriteJob) -> Dict[str, Any]:
        """The written tensors as model-layout canonical values (what the model is built from)."""
        raise NotImplementedError(f"--backend {self.name} cannot read its output back (reloads = False)")

    # Whether reload_stream(only=) reads only the tensors asked for (layer-by-layer verification
    # then holds one layer of the output; else it holds what reload gives, whole).
    reloads_selectively: bool = False

    def reload_stream(self, path: str, job: WriteJob, only: Optional[Callable[[str], bool]] = None
                      ) -> Iterator[Tuple[str, Any]]:
        """reload's tensors one by one; with `only`, just the names it accepts."""
        for name, value in self.reload(path, job).items():
            if only is None or only(name):
                yield name, value

    def summary(self, path: str, job: WriteJob) -> Rows:
        """Extra (label, text) rows for the run's summary table."""
        return []

    def written_bits(self, path: str) -> Tuple[int, int]:
        """A takes_float backend's (bits, weights) written for the weights it quantized; (0, 0): none counted."""
        return 0, 0

    def check_consumer(self, path: str, job: WriteJob, reference: Any, quantized: Any,
                       prompt: Any) -> Tuple[Rows, Dict[str, Any]]:
        """Where `checks_consumer`: (summary rows, numbers; "failure": one line where the consumer disagrees)."""
        return [], {}


_REGISTRY: Dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Make `backend` available as get_backend(backend.name); a second backend of one name is refused."""
    if not isinstance(backend, Backend):
        raise TypeError(f"{type(backend).__name__} is not a Backend (subclass llmq.backend.Backend)")
    cls = type(backend)
    missing = [m for m, undefined in (("storage", cls.storage is Backend.storage),
                                      ("write", cls.write is Backend.write),
                                      ("reload", backend.reloads and cls.reload is Backend.reload),
                                      ("check_consumer", backend.checks_consumer
                                       and cls.check_consumer is Backend.check_consumer)) if undefined]
    if missing:
        raise TypeError(f"{cls.__name__} is not a complete Backend: it lacks {', '.join(missing)}")
    if not isinstance(backend.name, str) or not backend.name:
        raise ValueError(f"backend name must be a non-empty string, got {backend.name!r}")
    if backend.name in _REGISTRY:
        raise ValueError(f"backend {backend.name!r} is already registered ({type(_REGISTRY[backend.name]).__name__})")
    _REGISTRY[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    """The backend called `name`; an unknown name is a ValueError listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"backend {name!r} unknown{did_you_mean(name, backend_names())}; expected one of "
                         f"{', '.join(backend_names())}") from None


def storage_of(backend: Backend, job: Optional[WriteJob] = None) -> Callable[[Any], Storage]:
    """config -> Storage of `backend` for `job` (what budgets, reports and summaries count with)."""
    return lambda config: backend.storage(config, job)


def with_scale_dtypes(recipe: Any, storage: Callable[[Any], Storage]) -> Any:
    """`recipe` with every config's scale_dtype set to the one its storage writes, so the methods
    choose scales the backend holds exactly (formats without scales keep theirs)."""
    from llmq.quant import QuantRecipe

    def fitted(config):
        if config is None or config.format != "int":
            return config
        return dataclasses.replace(config, scale_dtype=storage(config).scale_dtype)

    rules = [dataclasses.replace(rule, config=fitted(rule.config)) for rule in recipe.rules]
    return QuantRecipe(rules, num_layers=getattr(recipe, "num_layers", None))


def backend_names() -> List[str]:
    """Registered backend names, the bundle first, then alphabetical."""
    return sorted(_REGISTRY, key=lambda n: (n != BundleBackend.name, n))


class BundleBackend(Backend):
    """The portable llmq bundle (llmq.checkpoint.save_bundle): canonical weights, every format the
    library can quantize, the source files alongside."""

    name = "bundle"
    description = "portable llmq bundle: canonical weights of every format, config and tokenizer files alongside"
    takes_float = False
    streams_row_blocks = True  # save_bundle writes row blocks block by block

    @property
    def accepts_formats(self) -> Tuple[str, ...]:
        from llmq.quant.formats import format_names

        return tuple(format_names(quantizable=True))

    def storage(self, config: Any, job: Optional[WriteJob]) -> Storage:
        """The canonical containers as they are: integer codes with float32 scale and bias per group
        (int4 g32: 6.0 bits per weight), the FP formats' own tensors."""
        return CANONICAL

    def write(self, stream: Stream, job: WriteJob) -> str:
        from llmq.checkpoint import save_bundle

        return save_bundle(stream, job.out, recipe=job.recipe, max_shard_bytes=job.max_shard_bytes, resume=job.resume,
                           metadata=dict(job.metadata), extra_files=job.source_files, add_files=job.add_files)

    def reload(self, path: str, job: WriteJob) -> Dict[str, Any]:
        from llmq.checkpoint import load_bundle

        return load_bundle(path)

    reloads_selectively = True

    def reload_stream(self, path: str, job: WriteJob, only: Optional[Callable[[str], bool]] = None
                      ) -> Iterator[Tuple[str, Any]]:
        from llmq.checkpoint import iter_bundle, read_manifest

        if only is None:
            return iter_bundle(path)
        # a part read by part: the shard checksums (whole-shard hashes) are not recomputed for each part
        return iter_bundle(path, names=[n for n in read_manifest(path)["tensors"] if only(n)], verify=False)


register_backend(BundleBackend())
