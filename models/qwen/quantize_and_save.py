"""bazel run //models/qwen:quantize_and_save -- [--checkpoint=DIR] [--recipe=int4] [--out=DIR]"""

from models.gemma4.spec import ARCHITECTURE as OTHER
from models.pipeline.quantize_and_save import main_for
from models.qwen.spec import ARCHITECTURE

if __name__ == "__main__":
    main_for(ARCHITECTURE, others=[OTHER])  # a checkpoint of the other model names its target
