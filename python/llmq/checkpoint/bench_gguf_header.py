"""Benchmark: opening a GGUF file with a large vocabulary (header parse time and peak memory).

Writes a synthetic GGUF with gguf-py's GGUFWriter: a SentencePiece-style tokenizer of
``--vocab`` entries (tokenizer.ggml.tokens / scores / token_type, as Gemma 3's 262,144-entry
vocabulary) and a few small tensors, then measures, each in a fresh state:

* gguf-py ``GGUFReader`` + ``contents()`` of every field: how llmq read headers before it had
  its own parser (quantize_and_save did this 4 times per run);
* ``gguf_header.parse_header``: llmq's parser (large arrays left on disk);
* the same, then decoding ``tokenizer.ggml.tokens`` (what a caller that wants the tokens pays);
* ``GGUFFile`` opened 4 times, as one quantize_and_save run does (one parse, three cache hits).

Times are from an untraced run; peak memory from a second run under tracemalloc (Python
objects and numpy buffers; the header's read-only mmap is not counted). Not run by tests:

    bazel run //python/llmq/checkpoint:bench_gguf_header -- --vocab=262144
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import tracemalloc

import numpy as np


def write_synthetic(path: str, vocab: int) -> None:
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_block_count(1)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"\u2581tok{i}{'x' * int(rng.integers(0, 8))}" for i in range(vocab)])
    w.add_token_scores(rng.standard_normal(vocab).astype(np.float32).tolist())
    w.add_token_types([1] * vocab)
    w.add_tensor("token_embd.weight", rng.standard_normal((64, 32)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def measure(fn):
    """(seconds, peak bytes): timed without tracing (tracemalloc slows allocation-heavy code
    several times over), then run again under tracemalloc for the peak."""
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return seconds, peak


def gguf_py_open(path: str) -> None:
    import gguf

    reader = gguf.GGUFReader(path, "r")
    {k: f.contents() for k, f in reader.fields.items()}
    [(t.name, t.tensor_type, t.shape, t.data_offset) for t in reader.tensors]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--skip-gguf-py", action="store_true", help="do not time gguf-py's reader (slow)")
    args = parser.parse_args()

    from llmq.checkpoint import gguf_header
    from llmq.checkpoint.gguf_import import GGUFFile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vocab.gguf")
        write_synthetic(path, args.vocab)
        old = time.time() - 3600
        os.utime(path, (old, old))  # old enough for the header cache to trust its times
        size = os.path.getsize(path)

        def ours_and_tokens():
            len(gguf_header.parse_header(path).metadata["tokenizer.ggml.tokens"].tolist())

        def pipeline_opens():
            gguf_header.clear_cache()
            for _ in range(4):
                GGUFFile(path).close()

        rows = []
        if not args.skip_gguf_py:
            rows.append(("gguf-py GGUFReader + contents() (before)", measure(lambda: gguf_py_open(path))))
        rows.append(("llmq parse_header (arrays left on disk)", measure(lambda: gguf_header.parse_header(path))))
        rows.append(("llmq parse_header + decode the tokens", measure(ours_and_tokens)))
        rows.append(("llmq GGUFFile opened 4x (one quantize_and_save run)", measure(pipeline_opens)))

    print(f"GGUF with a {args.vocab:,}-entry vocabulary (tokens, scores, token_type): {size / 2 ** 20:.1f} MiB")
    print(f"{'what':<52} {'seconds':>9} {'peak MiB':>9}")
    for what, (seconds, peak) in rows:
        print(f"{what:<52} {seconds:>9.3f} {peak / 2 ** 20:>9.1f}")


if __name__ == "__main__":
    main()
