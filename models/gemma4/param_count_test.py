"""The Gemma 4 31B config builds on the meta device and its parameter count equals transformers'."""

import json

from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from models.common.parity import hf_parameter_count
from models.gemma4 import param_count
from models.gemma4.config import ModelConfig


def test_counts_match_transformers_meta_model():
    raw = json.load(open(param_count.DEFAULT_CONFIG))
    counts = param_count.parameter_counts(ModelConfig.from_hf_dict(raw))
    assert counts["total"] == hf_parameter_count(Gemma4ForCausalLM, Gemma4TextConfig(**raw["text_config"]))
    assert 30.5e9 < counts["total"] < 31e9  # "30.7B" on the model card
