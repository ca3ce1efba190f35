"""bazel run //models/gemma3:quantize_and_save -- [--checkpoint=DIR|FILE.gguf] [--recipe=int4] [--out=DIR]"""

import models.architectures  # noqa: F401  every model registered: another model's checkpoint names its target
from models.gemma3.architecture import ARCHITECTURE
from models.pipeline.quantize_and_save import main_for

if __name__ == "__main__":
    main_for(ARCHITECTURE)
