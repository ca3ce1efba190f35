"""The GGUF backend (--backend=gguf): the quantized stream -> `<out>/model.gguf`, one file llama.cpp runs.

Integer weights are written as the GGUF block type whose arithmetic they are, exactly
(llmq.quant.formats.gguf_quant.encode_blocks): the recipe's formats q4_0 .. q8_0 and q2_k .. q6_k,
and -- through `recipe_for` -- llmq's "int" configs that have a block type (4- and 5-bit groups of 32:
q4_0 / q5_0 symmetric, q4_1 / q5_1 asymmetric; 8-bit symmetric groups of 32: q8_0; 6-bit and 3-bit
symmetric groups of 16: q6_k, q3_k; 2-bit asymmetric groups of 16: q2_k), quantized under its
constraints (float16 d and m), by any of the block formats' methods (minmax, search, hqq, gptq; a rule's
options are kept). --budget_bits_per_weight chooses per matrix among all these block types
(`budget_options`). A GGUF input's weights, imported exactly, go back to a block type holding the same
values. Tensors kept in high precision are written in the dtype they arrive in (F32 / F16 / BF16; 1-D
tensors F32, as llama.cpp's converter writes them).

Names and llama.cpp's value transforms come from the model through the WriteJob (job.to_gguf; the
table the model's GGUF import reads). Metadata: a GGUF input's keys are all carried over
(general.file_type updated); an HF input gets the architecture's keys (job.gguf_metadata) and its
tokenizer from gguf-py's vocabulary helpers (gguf.vocab). The container is gguf-py's GGUFWriter.
The file is written inside `<out>.partial-<pid>/` and that folder renamed to `<out>` when complete.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from llmq.backend import Backend, BackendError, WriteJob, register_backend
from llmq.checkpoint.workfolder import WorkFolder
from llmq.quant import GroupQuantizedWeight, QuantConfig, QuantRecipe, QuantRule
from llmq.quant.formats.gguf_quant import BLOCK_TYPES, GGUFQuantFormat, NotExact, encode_blocks

FILE_NAME = "model.gguf"
# llmq "int" config (bits, group size, symmetric) -> the block format of the same arithmetic
_INT_AS_BLOCK = {(4, 32, True): "q4_0", (4, 32, False): "q4_1", (5, 32, True): "q5_0", (5, 32, False): "q5_1",
                 (8, 32, True): "q8_0", (6, 16, True): "q6_k", (3, 16, True): "q3_k", (2, 16, False): "q2_k"}
# (bits, group size) of a canonical weight -> the block types that may hold it, smallest file first
_CANDIDATES = {(4, 32): ("q4_0", "q4_k", "q4_1"), (5, 32): ("q5_0", "q5_k", "q5_1"), (8, 32): ("q8_0",),
               (6, 16): ("q6_k",), (2, 16): ("q2_k",), (3, 16): ("q3_k",)}
_FILE_TYPE = {"q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1",
              "q8_0": "MOSTLY_Q8_0", "q2_k": "MOSTLY_Q2_K", "q3_k": "MOSTLY_Q3_K_M", "q4_k": "MOSTLY_Q4_K_M",
              "q5_k": "MOSTLY_Q5_K_M", "q6_k": "MOSTLY_Q6_K"}
_HOLDS = ("4- or 5-bit groups of 32 (q4_0/q5_0 symmetric, q4_1/q5_1 asymmetric), 8-bit symmetric groups of 32 "
          "(q8_0), 6-bit symmetric (q6_k), 3-bit symmetric (q3_k) and 2-bit asymmetric (q2_k) groups of 16, or the "
          "formats q4_0 .. q8_0, q2_k .. q6_k")


def recipe_as_blocks(recipe: QuantRecipe) -> QuantRecipe:
    """`recipe` with each "int" config replaced by the block format of the same arithmetic; BackendError
    (one line, naming the rule) for an int config no GGUF block type holds."""
    rules = []
    for rule in recipe.rules:
        c = rule.config
        if c is not None and c.format == "int":
            kind = _INT_AS_BLOCK.get((c.bits, c.group_size, c.symmetric))
            if kind is None:
                raise BackendError(f"--backend gguf: recipe rule {rule.pattern!r}: {c.describe()} has no GGUF block "
                                   f"type; GGUF holds {_HOLDS}")
            t = BLOCK_TYPES[kind]
            if c.method not in GGUFQuantFormat.methods:
                raise BackendError(f"--backend gguf: recipe rule {rule.pattern!r}: method {c.method!r} does not "
                                   f"choose {t.ggml}'s block scales; use one of {', '.join(GGUFQuantFormat.methods)}")
            c = QuantConfig(format=kind, bits=t.bits, group_size=t.group, symmetric=t.symmetric, method=c.method,
                            options=c.options)
        rules.append(QuantRule(rule.pattern, c, layers=rule.layers))
    return QuantRecipe(rules, num_layers=recipe.num_layers)


def _value_type(value: Any):
    import gguf

    V = gguf.GGUFValueType
    if isinstance(value, bool):
        return V.BOOL, None
    if isinstance(value, int):
        return (V.UINT32 if 0 <= value < 1 << 32 else V.INT64), None
    if isinstance(value, float):
        return V.FLOAT32, None
    if isinstance(value, str):
        return V.STRING, None
    if isinstance(value, (list, tuple)):
        return V.ARRAY, (_value_type(value[0])[0] if value else V.INT32)
    raise BackendError(f"--backend gguf: metadata value {value!r} has no GGUF type")


def _copy_metadata(source: str, writer) -> None:
    """Every key of the GGUF file `source` into `writer`, with its own value type (but the header's
    own fields, the architecture the writer writes itself, and general.file_type, set after the tensors)."""
    import gguf

    reader = gguf.GGUFReader(source)
    skip = ("general.architecture", "general.file_type", "general.alignment")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in skip:
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), main, sub_type=sub)


def _add_tokenizer(folder: str, writer) -> Optional[str]:
    """The tokenizer in `folder` (tokenizer.model: SentencePiece, "llama"; tokenizer.json: BPE, "gpt2")
    written with gguf-py's vocabulary helpers; None if written, else why not."""
    from pathlib import Path

    import gguf

    path = Path(folder)
    vocab = None
    for kind in (gguf.vocab.SentencePieceVocab, gguf.vocab.BpeVocab):
        try:
            vocab = kind(path)
            break
        except (FileNotFoundError, ValueError, TypeError, KeyError, ImportError):
            continue
    if vocab is None:
        return f"no tokenizer gguf-py reads in {folder} (tokenizer.model or a BPE tokenizer.json)"
    tokens, scores, types = [], [], []
    for text, score, toktype in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(int(toktype))
    writer.add_tokenizer_model(vocab.tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.vocab.SpecialVocab(path, load_merges=vocab.tokenizer_model == "gpt2",
                            n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    return None


def _float_tensor(t: torch.Tensor) -> Tuple[np.ndarray, Optional[Any]]:
    """(array, raw dtype) GGUFWriter.add_tensor takes for a float tensor: F32 / F16 as they are, BF16 as raw
    bytes, 1-D tensors and other dtypes F32."""
    import gguf

    t = t.detach().cpu().contiguous()
    if t.dim() <= 1 or t.dtype not in (torch.float16, torch.bfloat16):
        return t.float().numpy(), None
    if t.dtype == torch.float16:
        return t.numpy(), None
    return t.view(torch.uint8).numpy(), gguf.GGMLQuantizationType.BF16


class GGUFBackend(Backend):
    """--backend=gguf (see the module docstring)."""

    name = "gguf"
    description = ("one .gguf file llama.cpp runs: GGUF block types (Q4_0..Q8_0, Q2_K..Q6_K) holding "
                   "llmq's integer weights exactly, kept tensors F32/F16/BF16")
    accepts_formats = tuple(BLOCK_TYPES)
    takes_float = False
    needs_model = ("llama.cpp's tensor names, value transforms (e.g. Llama's q/k row order) and <arch>.* metadata "
                   "come from llmq's model code (models/<m>/gguf_checkpoint.py)")

    def __init__(self):
        self._counts: Dict[str, collections.Counter] = {}

    def recipe_for(self, recipe: QuantRecipe) -> QuantRecipe:
        return recipe_as_blocks(recipe)

    def budget_options(self) -> Tuple[QuantConfig, ...]:
        """Every block type, q2_k .. q8_0, each counted at its blocks' bytes (`storage`); a matrix whose rows are
        not a multiple of 256 takes only the blocks of 32 (q4_0 .. q8_0), the K-quants' shape check says so."""
        return tuple(QuantConfig(format=k, bits=t.bits, group_size=t.group, symmetric=t.symmetric)
                     for k, t in BLOCK_TYPES.items())

    def storage(self, config: Any, job: Optional[WriteJob]):
        """One uint8 tensor of blocks (gguf.GGML_QUANT_SIZES: scales and mins included) per weight, of the block
        type `config` names (an int config: the type of the same arithmetic; other int widths as Q4_1's
        5 bits per weight would misstate them, so they count as their smallest candidate)."""
        import gguf

        from llmq.quant.storage import Storage

        kind = config.format if config.format in BLOCK_TYPES else _INT_AS_BLOCK.get(
            (config.bits, config.group_size, config.symmetric)) or _CANDIDATES.get(
            (config.bits, config.group_size), ("q8_0",))[0]
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[BLOCK_TYPES[kind].ggml]]

        def tensors(scale_dtype, shape):
            return {"blocks": (torch.uint8, (int(np.prod(shape)) // block * nbytes,))}

        return Storage(scale_dtype=torch.float32, tensors=tensors)

    def check(self, job: WriteJob) -> None:
        if job.to_gguf is None or not job.gguf_arch:
            raise BackendError(f"--backend gguf: no GGUF export for {job.architecture} (its GGUF import module has "
                               "no gguf_metadata / GGUFConverter.to_gguf)")
        if os.path.exists(job.out):
            raise BackendError(f"--out {job.out} already exists; a GGUF folder is written whole: remove it or pick "
                               "another --out")
        if job.source_kind != "gguf":
            try:
                job.gguf_metadata()
            except ValueError as e:
                raise BackendError(f"--backend gguf: {job.architecture} config: {e}") from None

    def write(self, stream: Iterable[Tuple[str, Any]], job: WriteJob) -> str:
        import gguf

        self.check(job)
        # <out>.partial, locked until published (llmq.checkpoint.workfolder), like every writer: a second
        # run into the same --out is refused at once; what a killed run left there is cleared (no resume).
        work = WorkFolder(job.out, writer="gguf", overwrite=False)
        try:
            work.clear()
            work.write_journal({})
            counts = self._write_file(os.path.join(work.path, FILE_NAME), stream, job, gguf)
            if job.add_files is not None:
                job.add_files(work.path)
            out = work.publish(synced=(FILE_NAME,))
        except BaseException:
            work.discard()
            raise
        self._counts[out] = counts
        return out

    def _write_file(self, path: str, stream, job: WriteJob, gguf) -> collections.Counter:
        writer = gguf.GGUFWriter(path, job.gguf_arch, use_temp_file=True)
        notes: List[str] = []
        if job.source_kind == "gguf":
            _copy_metadata(job.source_path, writer)
        else:
            for key, value in job.gguf_metadata().items():
                vtype, sub = _value_type(value)
                writer.add_key_value(key, value, vtype, sub_type=sub)
            folders = {os.path.dirname(f) for f in job.tokenizer_files}
            why = _add_tokenizer(folders.pop(), writer) if len(folders) == 1 else "the input has no tokenizer files"
            if why:
                notes.append(f"no tokenizer written ({why}); llama.cpp needs one to run the file")
        bound = job.recipe.bind(job.num_layers)
        counts: collections.Counter = collections.Counter()
        for name, value in stream:
            module = name[: -len(".weight")] if name.endswith(".weight") else name
            config = bound.get_config(module) if isinstance(value, GroupQuantizedWeight) else None
            try:
                converted = job.to_gguf(name, value)
            except ValueError as e:
                raise BackendError(f"--backend gguf: {e}") from None
            for gguf_name, gguf_value in converted.items():
                if isinstance(gguf_value, GroupQuantizedWeight):
                    kind, blocks = self._blocks(gguf_name, gguf_value, config)
                    writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType[BLOCK_TYPES[kind].ggml])
                    counts[kind] += int(np.prod(gguf_value.shape))
                elif isinstance(gguf_value, torch.Tensor):
                    array, raw = _float_tensor(gguf_value)
                    writer.add_tensor(gguf_name, array, raw_dtype=raw)
                    counts["float"] += gguf_value.numel()
                else:
                    raise BackendError(f"--backend gguf: {name}: a {type(gguf_value).__name__} has no GGUF type "
                                       f"(integer block weights and float tensors only)")
        quantized = {k: n for k, n in counts.items() if k != "float"}
        file_type = _FILE_TYPE[max(quantized, key=quantized.get)] if quantized else "ALL_F32"
        writer.add_file_type(int(gguf.LlamaFileType[file_type]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        for note in notes:
            print(f"note: --backend gguf: {note}")
        return counts

    @staticmethod
    def _blocks(name: str, value: GroupQuantizedWeight, config: Optional[QuantConfig]) -> Tuple[str, np.ndarray]:
        """(block type, blocks) of the first type holding `value` exactly: the recipe's, else by bits and group."""
        tried = []
        if config is not None and config.format in BLOCK_TYPES:
            tried.append(config.format)
        tried += [k for k in _CANDIDATES.get((value.bits, value.group_size), ()) if k not in tried]
        for kind in tried:
            try:
                return kind, encode_blocks(kind, value, name=name)
            except NotExact:
                continue
        raise BackendError(f"--backend gguf: {name}: {value.bits}-bit groups of {value.group_size} are exactly none "
                           f"of the GGUF block types {', '.join(tried) or '(none for this width)'}; GGUF holds {_HOLDS}")

    def summary(self, path: str, job: WriteJob) -> List[Tuple[str, str]]:
        counts = self._counts.pop(path, collections.Counter())
        size = os.path.getsize(os.path.join(path, FILE_NAME))
        quantized = {k: n for k, n in counts.items() if k != "float"}
        return [("GGUF file", f"{os.path.join(path, FILE_NAME)} ({size:,} bytes)"),
                ("GGUF block types", ", ".join(f"{BLOCK_TYPES[k].ggml}: {n:,} weights" for k, n in
                                              sorted(quantized.items())) or "none (all float)")]

    def reload(self, path: str, job: WriteJob) -> Dict[str, Any]:
        """The file read back by llmq's own GGUF import (exact), in model layout (job.from_gguf)."""
        if job.from_gguf is None:
            raise ValueError(f"{path}: reloading a GGUF needs the model's GGUF import (job.from_gguf)")
        return job.from_gguf(os.path.join(path, FILE_NAME))


register_backend(GGUFBackend())
