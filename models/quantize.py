"""bazel run //models:quantize -- --checkpoint=<HF folder or .gguf> [--recipe=NAME|FILE] [--backend=...] [--out=DIR]

Model-free quantization of any checkpoint (models/pipeline/generic.py); --help lists the flags by topic.
"""

import models.architectures  # noqa: F401  every model registered: GGUF input and the "llmq has model code" note
from models.pipeline.cli import main_model_free

if __name__ == "__main__":
    main_model_free()
