"""bazel run //models/gemma4:export_pte -- [--bundle=DIR --checkpoint=DIR] [--recipe=NAME] [--max_seq_len=128] [--out=FILE.pte]

ExecuTorch .pte of the quantized Gemma 4 (prefill and decode methods, XNNPACK): models/pipeline/export_pte.py.
The cache layout is the .pt2 export's (models/gemma4/export_pt2.py).
"""

from models.gemma4.architecture import ARCHITECTURE
from models.gemma4.export_pt2 import DYNAMIC_PROMPT, cache_layout
from models.pipeline import export_pte

if __name__ == "__main__":
    export_pte.main_for(ARCHITECTURE, cache_layout, dynamic_prompt=DYNAMIC_PROMPT)
