"""Run a folder's consumer (transformers, mlx-lm, compressed-tensors) as its user would: in a separate Python process in
which nothing of llmq is importable.

The child is this interpreter started with `-I` (isolated: no PYTHONPATH, no user site, no script or
working directory on sys.path), so it sees the interpreter's own site-packages only, and it runs from
an empty temporary directory. Each consumer script (`consumer_scripts/`) imports its consumer and the
standard library only, first checks that `llmq` cannot be imported, and prints one JSON line; logits
travel through a safetensors file. compressed-tensors runs no model: its consumer decompresses the
folder (its model-free dequantizer) and the float32 weights come back in `result.weights`.

    result = run_consumer("transformers", folder, prompt_ids, new_tokens=8)
    result.ok, result.version, result.logits, result.tokens, result.error
    run_consumer("compressed-tensors", folder).weights   # {"model.layers.0.mlp.up_proj.weight": ..., ...}
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "consumer_scripts")
CONSUMERS = {"transformers": "transformers_load.py", "mlx-lm": "mlx_lm_load.py",
             "compressed-tensors": "compressed_tensors_load.py"}
# What a consumer that succeeded did (ConsumerResult.line).
DONE = {"compressed-tensors": "decompressed the folder"}


@dataclasses.dataclass
class ConsumerResult:
    """What a consumer did with a folder: its name and version (None where it is not installed), whether
    it loaded the folder and ran a forward and greedy generation, prefill logits [T, V] (float32), the
    generated token ids (and text where the folder has a tokenizer), and the one-line error otherwise;
    compressed-tensors gives the folder's decompressed weights (float32) instead of logits and tokens."""

    consumer: str
    version: Optional[str] = None
    ok: bool = False
    error: Optional[str] = None
    logits: Any = None
    tokens: List[int] = dataclasses.field(default_factory=list)
    text: Optional[str] = None
    details: Dict[str, Any] = dataclasses.field(default_factory=dict)
    weights: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def line(self) -> str:
        """'transformers 5.24.0: loaded, forward and generate ok' / '... not installed' / '...: failed (...)'."""
        who = f"{self.consumer} {self.version}" if self.version else self.consumer
        if self.version is None and not self.ok:
            return f"{self.consumer}: not tried ({self.error})"
        done = DONE.get(self.consumer, "loaded, forward and generate ok")
        return f"{who}: {done}" if self.ok else f"{who}: failed ({self.error})"


def consumer_version(consumer: str) -> Optional[str]:
    """The installed version of a consumer's package (None: not installed), without importing it."""
    from importlib import metadata

    try:
        return metadata.version(consumer)
    except metadata.PackageNotFoundError:
        return None


def run_consumer(consumer: str, folder: str, prompt_ids: Sequence[int] = (), *, new_tokens: int = 8,
                 prompt_text: Optional[str] = None, new_text_tokens: Optional[int] = None,
                 timeout: float = 1800) -> ConsumerResult:
    """Load `folder` with `consumer` (a key of CONSUMERS) in a clean child process; prefill logits for
    `prompt_ids` and `new_tokens` greedy tokens after them; where `prompt_text` is given, the greedy text
    (`new_text_tokens`, default new_tokens) after it, tokenized by the folder's own tokenizer.
    "compressed-tensors" takes no prompt: the folder decompressed to float32 (result.weights)."""
    result = ConsumerResult(consumer, version=consumer_version(consumer))
    if result.version is None:
        result.error = f"{consumer} is not installed in {sys.executable}"
        return result
    with tempfile.TemporaryDirectory(prefix="llmq-consumer-") as work:
        logits_out = os.path.join(work, "logits.safetensors")
        weights_out = os.path.join(work, "decompressed")
        request = {"folder": os.path.abspath(folder), "prompt_ids": [int(i) for i in prompt_ids],
                   "new_tokens": int(new_tokens), "prompt_text": prompt_text,
                   "new_text_tokens": int(new_text_tokens or new_tokens),
                   "logits_out": logits_out, "weights_out": weights_out}
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        try:
            proc = subprocess.run([sys.executable, "-I", os.path.join(SCRIPTS, CONSUMERS[consumer]),
                                   json.dumps(request)], capture_output=True, text=True, cwd=work, env=env,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            result.error = f"no answer within {timeout:.0f} s"
            return result
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1]
            result.error = tail[:300]
            return result
        answer = json.loads(lines[-1])
        if answer.get("error"):
            result.error = answer["error"]
            return result
        from safetensors.torch import load_file

        result.ok = True
        if consumer == "compressed-tensors":
            for f in sorted(os.listdir(weights_out)):
                if f.endswith(".safetensors"):
                    result.weights.update(load_file(os.path.join(weights_out, f)))
            result.details = {k: v for k, v in answer.items() if k != "error"}
            return result
        result.logits = load_file(logits_out)["logits"]
        result.tokens = list(answer.get("tokens", []))
        result.text = answer.get("text")
        result.details = {k: v for k, v in answer.items() if k not in ("tokens", "text")}
    return result
