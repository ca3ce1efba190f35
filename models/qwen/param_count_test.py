"""The Qwen3.5-35B-A3B config builds on the meta device and its parameter count equals transformers'."""

import json
import os
import subprocess
import sys

from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from models.common.parity import hf_parameter_count
from models.qwen import param_count
from models.qwen.config import ModelConfig


def test_counts_match_transformers_meta_model():
    raw = json.load(open(param_count.DEFAULT_CONFIG))
    counts = param_count.parameter_counts(ModelConfig.from_hf_dict(raw))
    text = {k: v for k, v in raw["text_config"].items() if k != "full_attention_interval"}
    assert counts["total"] == hf_parameter_count(Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**text))
    # 35B total / 3B active is the model's name; the text stack alone is a little under 35B.
    assert 34e9 < counts["total"] < 35e9 and 3.0e9 < counts["active"] < 3.6e9


def test_command_prints_total_and_active():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "python"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "models.qwen.param_count"], capture_output=True, text=True, env=env, cwd=root)
    assert out.returncode == 0, out.stderr
    assert "total" in out.stdout and "active per token" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "models.qwen.param_count", "--config=/nonexistent.json"],
                         capture_output=True, text=True, env=env, cwd=root)
    assert bad.returncode != 0 and "/nonexistent.json" in bad.stderr
