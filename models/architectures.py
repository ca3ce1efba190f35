"""Every model architecture of this repository, registered (models.pipeline.arch's registry), so that
any model's quantize_and_save finds the architecture of the checkpoint it is given by its config.json
`model_type` or GGUF `general.architecture`, and names that model's target when it is not its own.

Add a model: one line here (and its :architecture in //models:architectures' deps).
"""

from models.gemma3.architecture import ARCHITECTURE as GEMMA3
from models.gemma4.architecture import ARCHITECTURE as GEMMA4
from models.pipeline.arch import register_architecture
from models.qwen.architecture import ARCHITECTURE as QWEN

ARCHITECTURES = tuple(register_architecture(arch) for arch in (GEMMA3, GEMMA4, QWEN))
