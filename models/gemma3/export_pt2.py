"""bazel run //models/gemma3:export_pt2 -- [--bundle=DIR --checkpoint=DIR|FILE.gguf] [--recipe=int4] [--max_seq_len=128] [--out=DIR]

torch.export of the quantized Gemma 3 (text)'s prefill and decode steps (models/pipeline/export_pt2.py).
Gemma 3 runs Gemma 4's modules, so its cache is Gemma 4's (models/gemma4/export_pt2.py).
"""

from models.gemma3.architecture import ARCHITECTURE
from models.gemma4.export_pt2 import DYNAMIC_PROMPT, cache_layout
from models.pipeline import export_pt2

if __name__ == "__main__":
    export_pt2.main_for(ARCHITECTURE, cache_layout, dynamic_prompt=DYNAMIC_PROMPT)
