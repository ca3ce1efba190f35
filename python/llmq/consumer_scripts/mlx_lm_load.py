"""An mlx-lm user's load of a folder (run by llmq.consumer_run in `python -I`: llmq not importable).

Argument: one JSON request {"folder", "prompt_ids", "new_tokens", "prompt_text", "new_text_tokens", "logits_out"}.
`mlx_lm.load(folder)`, prefill logits for prompt_ids (written to logits_out as float32 [T, V]), then
greedy generation (mlx_lm.stream_generate, its default sampler: argmax) after prompt_ids and after
prompt_text. Prints one JSON line. Imports the standard library, mlx and mlx-lm only.
"""

import importlib.util
import json
import sys


def main() -> int:
    request = json.loads(sys.argv[1])
    if importlib.util.find_spec("llmq") is not None:
        print(json.dumps({"error": "llmq is importable in the consumer's process"}))
        return 1
    import mlx.core as mx
    import mlx_lm

    answer = {"mlx_lm": getattr(mlx_lm, "__version__", None)}
    try:
        model, tokenizer = mlx_lm.load(request["folder"])[:2]
        answer["model_class"] = type(model).__module__.rsplit(".", 1)[-1]
        ids = request["prompt_ids"]
        logits = model(mx.array([ids]))[0].astype(mx.float32)
        mx.save_safetensors(request["logits_out"], {"logits": logits})
        n = request["new_tokens"]
        answer["tokens"] = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt=ids, max_tokens=n)]
        if request.get("prompt_text"):
            answer["text"] = "".join(r.text for r in mlx_lm.stream_generate(model, tokenizer, prompt=request["prompt_text"],
                                                                             max_tokens=request["new_text_tokens"]))
    except Exception as e:  # noqa: BLE001 -- the consumer's refusal is the answer
        answer["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
