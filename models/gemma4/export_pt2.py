"""bazel run //models/gemma4:export_pt2 -- [--bundle=DIR --checkpoint=DIR] [--recipe=int4] [--max_seq_len=128] [--out=DIR]

torch.export of the quantized Gemma 4's prefill and decode steps (models/pipeline/export_pt2.py).
The cache is export_pt2's `AttentionKVCacheLayout`: keys/values [1, H_kv, max_seq_len, head_dim] per
layer, indexed by absolute position. The prefill takes a dynamic prompt length.
"""

from models.gemma4.architecture import ARCHITECTURE
from models.pipeline import export_pt2
from models.pipeline.export_pt2 import AttentionKVCacheLayout

DYNAMIC_PROMPT = True
cache_layout = AttentionKVCacheLayout

if __name__ == "__main__":
    export_pt2.main_for(ARCHITECTURE, cache_layout, dynamic_prompt=DYNAMIC_PROMPT)
