"""A transformers user's load of a folder (run by llmq.consumer_run in `python -I`: llmq not importable).

Argument: one JSON request {"folder", "prompt_ids", "new_tokens", "prompt_text", "new_text_tokens", "logits_out"}.
`AutoModelForCausalLM.from_pretrained(folder)` with transformers' defaults, prefill logits for
prompt_ids (written to logits_out as float32 [T, V]), then greedy `generate`. Prints one JSON line.
Imports the standard library, torch, transformers and safetensors only.
"""

import importlib.util
import json
import sys


def main() -> int:
    request = json.loads(sys.argv[1])
    if importlib.util.find_spec("llmq") is not None:
        print(json.dumps({"error": "llmq is importable in the consumer's process"}))
        return 1
    import torch
    import transformers
    from safetensors.torch import save_file

    transformers.logging.set_verbosity_error()
    answer = {"transformers": transformers.__version__}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(request["folder"])
        model.eval()
        answer.update(model_class=type(model).__name__, dtype=str(next(model.parameters()).dtype).replace("torch.", ""))
        ids = torch.tensor([request["prompt_ids"]], dtype=torch.long)
        with torch.no_grad():
            logits = model(ids).logits[0].float()
            out = model.generate(ids, max_new_tokens=request["new_tokens"], do_sample=False)
        answer["tokens"] = out[0, ids.shape[1]:].tolist()
        save_file({"logits": logits.contiguous()}, request["logits_out"])
        if request.get("prompt_text"):
            tokenizer = transformers.AutoTokenizer.from_pretrained(request["folder"])
            text_ids = tokenizer(request["prompt_text"], return_tensors="pt").input_ids
            with torch.no_grad():
                gen = model.generate(text_ids, max_new_tokens=request["new_text_tokens"], do_sample=False)
            answer["text"] = str(tokenizer.decode(gen[0, text_ids.shape[1]:], skip_special_tokens=True))
    except Exception as e:  # noqa: BLE001 -- the consumer's refusal is the answer
        answer["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
