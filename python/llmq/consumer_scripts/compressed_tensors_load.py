"""A compressed-tensors user's decompression of a folder (run by llmq.consumer_run in `python -I`: llmq
not importable).

Argument: one JSON request {"folder", "weights_out", ...}. compressed-tensors' own model-free entry point,
`convert_checkpoint(folder, weights_out, CompressedTensorsDequantizer(folder, dtype=torch.float32))`:
the folder's quantization_config decides which modules are decompressed and how (each module by its
scheme's registered compressor), every weight is written to `weights_out` as float32 safetensors, and the
dequantizer's own check refuses leftover quantization parameters. Prints one JSON line (its
version, or the error). Imports the standard library, torch and compressed-tensors only.
"""

import importlib.util
import json
import sys


def main() -> int:
    request = json.loads(sys.argv[1])
    if importlib.util.find_spec("llmq") is not None:
        print(json.dumps({"error": "llmq is importable in the consumer's process"}))
        return 1
    import compressed_tensors
    import torch
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer, convert_checkpoint

    answer = {"compressed_tensors": compressed_tensors.__version__}
    try:
        dequantizer = CompressedTensorsDequantizer(request["folder"], dtype=torch.float32)
        convert_checkpoint(request["folder"], request["weights_out"], dequantizer, max_workers=1, device="cpu")
    except Exception as e:  # noqa: BLE001 -- the consumer's refusal is the answer
        answer["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
