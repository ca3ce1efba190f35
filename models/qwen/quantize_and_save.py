"""bazel run //models/qwen:quantize_and_save -- [--checkpoint=DIR] [--recipe=int4] [--out=DIR]"""

import models.architectures  # noqa: F401  every model registered: another model's checkpoint names its target
from models.pipeline.quantize_and_save import main_for
from models.qwen.architecture import ARCHITECTURE

if __name__ == "__main__":
    main_for(ARCHITECTURE)
