"""Fuzzing the GGUF fields the model packages read: hyper-parameters and tokenizer metadata.

llmq/checkpoint/fuzz_test.py fuzzes the GGUF container (counts, lengths, offsets); this file
fuzzes the values inside a well-formed container. Each example takes a valid tiny metadata set
(Gemma 3, Gemma 4, Qwen3.5-MoE hyper-parameters; a byte-level BPE / SentencePiece tokenizer) and
replaces one to three fields by hostile values of any GGUF type (0, 2^40, 2^63, NaN, negative,
strings, booleans, arrays). The reader must then either build a config (and the model's
parameter list on the meta device) / a working tokenizer, or raise the one-line error the CLI
reports -- never another exception, a hang (20 s alarm: the machine may be loaded) or unbounded
memory. Deterministic and
bounded: about 1,500 examples.
"""

import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from llmq.checkpoint.testing_util import time_limit
from models.gemma3.architecture import ARCHITECTURE as GEMMA3
from models.gemma4.architecture import ARCHITECTURE as GEMMA4
from models.pipeline.checks import expected_tensors
from models.pipeline.gguf_input import GGUFTensors
from models.qwen.architecture import ARCHITECTURE as QWEN

ALARM_S = 20.0
_FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                 suppress_health_check=list(HealthCheck))

_COMMON = {"block_count": 1, "context_length": 64, "embedding_length": 8, "attention.head_count": 2,
           "attention.head_count_kv": 1, "attention.key_length": 4, "attention.value_length": 4,
           "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0}
BASES = {
    "gemma3": dict(_COMMON, **{"feed_forward_length": 16, "attention.sliding_window": 4}),
    "gemma4": dict(_COMMON, **{"feed_forward_length": 16, "attention.sliding_window": 4,
                             "attention.sliding_window_pattern": [True], "attention.key_length_swa": 4}),
    "qwen35moe": dict(_COMMON, **{"full_attention_interval": 1, "ssm.time_step_rank": 2, "ssm.inner_size": 8,
                           "ssm.group_count": 1, "ssm.conv_kernel": 4, "ssm.state_size": 4,
                           "expert_feed_forward_length": 8, "expert_shared_feed_forward_length": 8,
                           "expert_count": 2, "expert_used_count": 1}),
}
# Keys a file may add (read with defaults).
OPTIONAL = ["attention.sliding_window_pattern", "rope.scaling.type", "rope.scaling.factor", "rope.freq_base_swa",
            "final_logit_softcapping", "attn_logit_softcapping", "nextn_predict_layers", "rope.dimension_count",
            "rope.dimension_count_swa", "expert_count", "vocab_size", "attention.shared_kv_layers",
            "embedding_length_per_layer_input"]
SHAPES = {"token_embd.weight": (16, 8), "blk.0.attn_q.weight": (8, 8)}

_SCALARS = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4, 8, 16, 17, -1, 2 ** 31, 2 ** 40, 2 ** 63, 2 ** 64 - 1]),
    st.sampled_from([0.0, -1.0, 0.5, 1e-6, 1e30, math.inf, -math.inf, math.nan]),
    st.booleans(), st.sampled_from(["", "linear", "none", "yarn", "1", "x" * 100]))
_VALUES = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=4))


def _tensors():
    return GGUFTensors(shapes=dict(SHAPES), read=lambda name: (_ for _ in ()).throw(ValueError("no data")))


@settings(_FUZZ, max_examples=900)
@given(arch=st.sampled_from([GEMMA3, GEMMA4, QWEN]), data=st.data())
def test_hostile_hyper_parameters_give_a_config_or_one_line(arch, data):
    prefix = arch.gguf_import.GGUF_ARCH
    base = BASES[prefix]
    keys = data.draw(st.lists(st.sampled_from(sorted(base) + OPTIONAL), min_size=1, max_size=3, unique=True))
    metadata = {"general.architecture": prefix, **{f"{prefix}.{k}": v for k, v in base.items()}}
    for key in keys:
        metadata[f"{prefix}.{key}"] = data.draw(_VALUES)
    with time_limit(ALARM_S):
        try:
            hf = arch.gguf_import.hf_config_from_gguf(metadata, _tensors())
        except ValueError as e:
            assert "\n" not in str(e)
            return
        try:  # what inputs.open_input reports in one line
            config = arch.config_from_hf(hf)
        except (ValueError, KeyError, NotImplementedError) as e:
            assert "\n" not in str(e)
            return
        expected_tensors(arch, config)  # the parameter list the checkpoint is checked against


_TOKENS = st.one_of(st.text(alphabet="abĠ▁<>", min_size=0, max_size=3), st.integers(-1, 300), st.booleans(),
                    st.floats(allow_nan=True))


@st.composite
def tokenizer_metadata(draw):
    kind = draw(st.sampled_from(["gpt2", "llama", "t5", "gemma4", "bert", "", 7]))
    tokens = draw(st.one_of(st.lists(st.text(alphabet="abcĠ▁", min_size=1, max_size=3), min_size=1, max_size=12,
                                     unique=True), st.lists(_TOKENS, max_size=6)))
    md = {"general.architecture": draw(st.sampled_from(["qwen35moe", "gemma3", 5])), "tokenizer.ggml.model": kind,
          "tokenizer.ggml.tokens": tokens}
    n = len(tokens)
    optional = {
        "tokenizer.ggml.merges": st.lists(st.one_of(st.sampled_from(["a b", "Ġ a", "ab", "a b c", " a", "a "]),
                                                    _TOKENS), max_size=4),
        "tokenizer.ggml.scores": st.one_of(st.lists(st.floats(allow_nan=True), min_size=n, max_size=n),
                                           st.lists(_TOKENS, max_size=4)),
        "tokenizer.ggml.token_type": st.one_of(st.lists(st.integers(0, 6), min_size=n, max_size=n),
                                               st.lists(_TOKENS, max_size=4)),
        "tokenizer.ggml.bos_token_id": st.one_of(st.integers(-2, n + 2), st.sampled_from([2 ** 40, "1", 1.0])),
        "tokenizer.ggml.eos_token_id": st.integers(-1, n + 1),
        "tokenizer.ggml.unknown_token_id": st.integers(-1, n + 1),
        "tokenizer.ggml.add_bos_token": st.one_of(st.booleans(), st.integers(0, 2)),
        "tokenizer.ggml.pre": st.one_of(st.sampled_from(["default", "qwen2", "gpt-4o", "zzz"]), st.integers()),
        "tokenizer.chat_template": st.one_of(st.just("{{ messages }}"), st.integers()),
    }
    for key in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)):
        md[key] = draw(optional[key])
    return md


@pytest.fixture(scope="module")
def warm_transformers():
    """Import transformers' GGUF tokenizer builders once, outside the per-example alarm."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping  # noqa: F401


@settings(_FUZZ, max_examples=600)
@given(metadata=tokenizer_metadata())
def test_hostile_tokenizer_metadata_builds_or_is_one_line(warm_transformers, metadata):
    from models.common.tokenizer import Tokenizer, tokenizer_from_gguf_metadata

    with time_limit(ALARM_S):
        try:
            hf = tokenizer_from_gguf_metadata(metadata, "t.gguf")
        except ValueError as e:
            assert "\n" not in str(e) and "t.gguf" in str(e)
            return
        tokenizer = Tokenizer(hf, "t.gguf")  # what is accepted works
        tokenizer.decode(tokenizer.encode("ab cab"))
