"""Backends: where a quantized stream goes. One protocol, one registry.

A backend turns the pipeline's stream of model-layout tensors into a folder some consumer
loads (the portable llmq bundle, tinygemm tiles, an mlx-lm folder, a quantized Hugging Face
folder), and reads that folder back for verification. Each backend registers itself once::

    register_backend(MyBackend())          # at import of its module

and the pipeline looks it up by name (``get_backend(flag_value)``); nothing else names it.
The portable bundle is registered here, by the core itself. See docs/backends.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Mapping, Protocol, Tuple, runtime_checkable

Stream = Iterable[Tuple[str, Any]]
Rows = List[Tuple[str, str]]


def _same_name(name: str, value: Any) -> Dict[str, Any]:
    return {name: value}


def _unchanged(tensors: Dict[str, Any]) -> Dict[str, Any]:
    return tensors


@dataclasses.dataclass(frozen=True)
class WriteJob:
    """What a writer needs, fixed before any tensor flows.

    out: the output folder. recipe / recipe_name: the QuantRecipe and the name it was asked by.
    architecture: the model's name. hf_config: its config.json dict; model_config: the parsed
    config object (attributes as the model reads them). num_layers: for recipes that count layers
    from the end. to_hf(name, value) -> {hf_name: value}: a model-layout tensor as the HF
    checkpoint stores it; from_hf({hf_name: value}) -> {model name: value}: the inverse, for
    reloading. source_files: files the input carries (config.json, tokenizer) to copy along;
    tokenizer_files: tokenizer files for consumers that need them. source_kind: "hf" (a folder),
    "gguf" (a .gguf file; no config or tokenizer files) or "embedded" (the tiny default model).
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
    max_shard_bytes: int = 2 << 30
    resume: bool = True
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    verify: bool = False  # the run reloads the output afterwards (reload / check_consumer follow write)


class BackendError(ValueError):
    """A job a backend cannot write (a refused input, format or output place): one line, shown as is."""


@runtime_checkable
class Backend(Protocol):
    """A terminal writer of quantized tensors.

    name: the --backend value; description: one line for --help. accepts_formats: the format
    names a recipe may use with it (checked before any work). takes_float: False (the usual
    case) means write() receives the quantized stream (llmq values: tensors and quantized
    weights, quantized by job.recipe); True means it receives the unquantized model-layout
    stream and quantizes with job.recipe itself.

    Optional attribute ``streams_row_blocks`` (default False): True where write() also takes
    tensors carried as row blocks (llmq.quant.chunked: RowBlocks, QuantizedRowBlocks), which
    the pipeline then sends for large tensors so its memory stays one block.
    Optional methods, looked up with getattr: ``check(job)`` refuses a job before any work
    (BackendError, one line); ``summary(path, job) -> rows`` extra summary rows;
    ``check_consumer(path, job, reference, quantized, prompt) -> (rows, dict)`` loads the folder
    as its consumer does and compares its logits for `prompt` [1, T] with our unquantized
    (`reference`) and reloaded (`quantized`) models.
    """

    name: str
    description: str
    accepts_formats: Tuple[str, ...]
    takes_float: bool

    def write(self, stream: Stream, job: WriteJob) -> str:
        """Write the stream to job.out; return the output path. Publish only a complete folder."""

    def reload(self, path: str, job: WriteJob) -> Dict[str, Any]:
        """The written tensors as model-layout canonical values (what the model is built from)."""


_REGISTRY: Dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Make `backend` available as get_backend(backend.name); a second backend of one name is refused."""
    missing = [a for a in ("name", "description", "accepts_formats", "takes_float", "write", "reload")
               if not hasattr(backend, a)]
    if missing:
        raise TypeError(f"{type(backend).__name__} is not a Backend: it lacks {', '.join(missing)}")
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
        raise ValueError(f"backend {name!r} unknown; expected one of {', '.join(backend_names())}") from None


def backend_names() -> List[str]:
    """Registered backend names, the bundle first, then alphabetical."""
    return sorted(_REGISTRY, key=lambda n: (n != BundleBackend.name, n))


class BundleBackend:
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

    def write(self, stream: Stream, job: WriteJob) -> str:
        from llmq.checkpoint import save_bundle

        return save_bundle(stream, job.out, recipe=job.recipe, max_shard_bytes=job.max_shard_bytes, resume=job.resume,
                           metadata=dict(job.metadata), extra_files=job.source_files)

    def reload(self, path: str, job: WriteJob) -> Dict[str, Any]:
        from llmq.checkpoint import load_bundle

        return load_bundle(path)


register_backend(BundleBackend())
