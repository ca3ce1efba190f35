"""Recipes: rule matching, layer restriction, files, dict round trip, presets."""

import json
import os

import pytest
import torch

from llmq.quant import PRESETS, QuantConfig, QuantRecipe, QuantRule, get_preset, load_recipe, register_preset
from llmq.quant.recipe import layer_index

INT4 = QuantConfig(bits=4, group_size=32, symmetric=True)
INT8 = QuantConfig(bits=8, group_size=None, symmetric=True)


def test_config_defaults_and_whole_row():
    c = QuantConfig()
    assert (c.format, c.bits, c.group_size, c.symmetric, c.method, c.scale_dtype) == ("int", 4, 32, True, "minmax", torch.float32)
    assert QuantConfig(group_size=-1).group_size is None
    assert QuantConfig(group_size=None).group_size_for(96) == 96
    assert QuantConfig(group_size=-1) == QuantConfig(group_size=None)
    with pytest.raises(dataclasses_frozen_error()):
        c.bits = 8


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bits=1), "bits=1 unsupported"),
        (dict(bits=9), "bits=9 unsupported"),
        (dict(bits=4.0), "bits must be an int"),
        (dict(group_size=0), "group_size"),
        (dict(group_size=-2), "group_size"),
        (dict(group_size=True), "group_size"),
        (dict(symmetric="yes"), "symmetric"),
        (dict(format="int3"), "format='int3' unknown"),
        (dict(method="awq"), "method='awq' unknown"),
        (dict(scale_dtype="float64"), "scale_dtype"),
        (dict(format="mxfp4", bits=4, group_size=16), "group_size=32"),
        (dict(format="nvfp4", bits=8, group_size=16), "4-bit"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


@pytest.mark.parametrize("config,text", [
    (QuantConfig(bits=4, group_size=32), "int4 g32 sym"),
    (QuantConfig(bits=8, group_size=None, symmetric=False), "int8 grow asym"),
    (QuantConfig(format="nvfp4", bits=4, group_size=16), "nvfp4 g16"),
    (QuantConfig(format="mxfp4", bits=4, group_size=32), "mxfp4 g32"),
    (QuantConfig(format="mxfp8", bits=8, group_size=32), "mxfp8 g32"),
    (QuantConfig(format="fp8", granularity="channel"), "fp8 per channel"),
    (QuantConfig(format="fp8", granularity="tensor"), "fp8 per tensor"),
    (QuantConfig(format="fp8", granularity="block128"), "fp8 128x128"),
])
def test_describe_names_each_format_once(config, text):
    """An FP format's name already carries its element size ('fp8', not 'fp88 grow sym')."""
    assert config.describe() == text


def test_config_dict_round_trip_and_unknown_field():
    c = QuantConfig(bits=6, group_size=None, symmetric=False)
    assert QuantConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError, match="groupsize"):
        QuantConfig.from_dict({"bits": 4, "groupsize": 32})


def test_first_match_wins_and_none_keeps():
    r = QuantRecipe([
        QuantRule(r".*\.mlp\.gate", None),
        QuantRule(r".*\.mlp\..*", INT4),
        QuantRule(r".*", INT8),
    ])
    assert r.get_config("model.layers.0.mlp.gate") is None
    assert r.get_config("model.layers.0.mlp.gate_proj") == INT4
    assert r.get_config("model.layers.0.self_attn.q_proj") == INT8


def test_fullmatch_not_search_and_no_match_keeps():
    r = QuantRecipe([QuantRule(r"layers\.\d+\.mlp", INT4)])
    assert r.get_config("layers.3.mlp") == INT4
    assert r.get_config("model.layers.3.mlp") is None  # would match with re.search
    assert r.get_config("layers.3.mlp.down_proj") is None
    assert QuantRecipe([]).get_config("anything") is None


def test_layer_index_parsing():
    assert layer_index("model.layers.12.mlp.experts") == 12
    assert layer_index("layers.0.attn") == 0
    assert layer_index("model.language_model.layers.7") == 7
    assert layer_index("model.embed_tokens") is None
    assert layer_index("model.sublayers.3.x") is None
    assert layer_index("model.layers.x.y") is None


def test_layers_restrict_rules():
    r = QuantRecipe([
        QuantRule(r".*", INT8, layers=range(0, 2)),
        QuantRule(r".*", INT4, layers={5}),
    ])
    assert r.get_config("model.layers.0.mlp.up_proj") == INT8
    assert r.get_config("model.layers.1.mlp.up_proj") == INT8
    assert r.get_config("model.layers.5.mlp.up_proj") == INT4
    assert r.get_config("model.layers.3.mlp.up_proj") is None
    assert r.get_config("lm_head") is None  # a rule with layers never matches an fqn without one


def test_negative_layers_need_binding():
    r = QuantRecipe([QuantRule(r".*", INT8, layers=[0, -1]), QuantRule(r".*", INT4)])
    assert r.needs_num_layers
    assert r.get_config("lm_head") == INT4  # no layer index: the rule with layers is skipped
    with pytest.raises(ValueError, match="bind"):
        r.get_config("model.layers.3.mlp.up_proj")
    b = r.bind(4)
    assert not b.needs_num_layers
    assert b.get_config("model.layers.3.mlp.up_proj") == INT8
    assert b.get_config("model.layers.0.mlp.up_proj") == INT8
    assert b.get_config("model.layers.2.mlp.up_proj") == INT4


@pytest.mark.parametrize(
    "args,match",
    [
        (("(unclosed", INT4), "not a valid regular expression"),
        ((".*", "int4"), "config must be"),
        ((".*", INT4, "0,1"), "layers must be"),
        ((".*", INT4, [0.5]), "layers must hold ints"),
    ],
)
def test_rule_validation(args, match):
    with pytest.raises(ValueError, match=match):
        QuantRule(*args)


def test_recipe_dict_round_trip():
    r = QuantRecipe([
        QuantRule(r".*norm.*", None),
        QuantRule(r".*\.self_attn\..*", QuantConfig(bits=8, group_size=64), layers=[0, 1, -1]),
        QuantRule(r".*", QuantConfig(bits=3, group_size=None, symmetric=False)),
    ], num_layers=6)
    d = json.loads(json.dumps(r.to_dict()))
    assert QuantRecipe.from_dict(d) == r
    assert d["rules"][1]["layers"] == [-1, 0, 1]


RECIPE = {
    "rules": [
        {"pattern": r".*\.mlp\.gate", "config": None},
        {"pattern": ".*", "config": {"bits": 8, "group_size": -1}, "layers": [0, 1]},
        {"pattern": ".*", "config": {"bits": 4, "group_size": 32, "symmetric": False}},
    ]
}


def check_loaded(r):
    assert r.get_config("model.layers.2.mlp.gate") is None
    assert r.get_config("model.layers.1.mlp.up_proj") == QuantConfig(bits=8, group_size=None)
    assert r.get_config("model.layers.2.mlp.up_proj") == QuantConfig(bits=4, group_size=32, symmetric=False)


def test_from_json_and_yaml_files(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(RECIPE))
    check_loaded(QuantRecipe.from_file(p))
    y = tmp_path / "r.yaml"
    y.write_text(
        "rules:\n"
        "  - pattern: '.*\\.mlp\\.gate'\n"
        "    config: null\n"
        "  - pattern: '.*'\n"
        "    config: {bits: 8, group_size: -1}\n"
        "    layers: [0, 1]\n"
        "  - pattern: '.*'\n"
        "    config: {bits: 4, group_size: 32, symmetric: false}\n"
    )
    check_loaded(QuantRecipe.from_file(y))
    check_loaded(load_recipe(str(y)))


@pytest.mark.parametrize(
    "text,match",
    [
        ("{not json", "not valid JSON/YAML"),
        ('{"rules": "x"}', "'rules' list"),
        ('{"rules": [{"config": null}]}', "pattern"),
        ('{"rules": [{"pattern": ".*", "config": {"bits": 99}}]}', "bits=99"),
        ('{"rules": [], "extra": 1}', "extra"),
    ],
)
def test_bad_files_name_the_file(tmp_path, text, match):
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        QuantRecipe.from_file(p)
    assert "bad.json" in str(e.value)


def test_missing_file():
    with pytest.raises(ValueError, match="recipe file /nonexistent/recipe.json: No such file"):
        QuantRecipe.from_file("/nonexistent/recipe.json")


def test_presets_exist_and_skip_the_right_modules():
    for name in ("int4", "int8", "int4-asym", "int4-mixed"):
        assert name in PRESETS
    r = get_preset("int4")
    kept = ["model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate",
            "model.layers.0.input_layernorm", "model.norm", "model.layers.0.linear_attn.conv1d", "model.layers.0.mlp.router"]
    for fqn in kept:
        assert r.get_config(fqn) is None, fqn
    for fqn in ("model.embed_tokens", "lm_head", "transformer.wte"):  # 8-bit, not float (their size)
        assert r.get_config(fqn) == QuantConfig(bits=8, group_size=32, symmetric=True), fqn
    assert get_preset("nvfp4").get_config("model.embed_tokens").format == "fp8"
    assert get_preset("mxfp4").get_config("lm_head").format == "mxfp8"
    for fqn in ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_proj",
                "model.layers.0.mlp.experts.3.down_proj", "model.layers.0.linear_attn.in_proj_qkvz"]:
        assert r.get_config(fqn) == QuantConfig(bits=4, group_size=32, symmetric=True), fqn
    assert get_preset("int8").get_config("model.layers.0.mlp.up_proj") == QuantConfig(bits=8, group_size=None)
    assert get_preset("int4-asym").get_config("model.layers.0.mlp.up_proj").symmetric is False


def test_int4_mixed_preset():
    r = get_preset("int4-mixed").bind(4)
    assert r.get_config("model.layers.1.self_attn.k_proj").bits == 8
    assert r.get_config("model.layers.0.mlp.down_proj").bits == 8
    assert r.get_config("model.layers.3.mlp.down_proj").bits == 8
    assert r.get_config("model.layers.2.mlp.down_proj").bits == 4
    assert r.get_config("model.layers.2.mlp.gate") is None


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError, match="int4-mixed") as e:
        get_preset("int5")
    assert "int5" in str(e.value)
    with pytest.raises(ValueError, match="neither a known preset"):
        load_recipe("int5")


def test_register_preset():
    r = QuantRecipe([QuantRule(".*", INT8)])
    register_preset("test-only-int8", r)
    try:
        assert get_preset("test-only-int8") is r
        with pytest.raises(ValueError, match="already exists"):
            register_preset("test-only-int8", r)
        register_preset("test-only-int8", r, overwrite=True)
        with pytest.raises(ValueError, match="QuantRecipe"):
            register_preset("test-bad", {"rules": []})
    finally:
        PRESETS.pop("test-only-int8", None)


def test_fp8_granularity_and_old_group_size_files():
    assert QuantConfig(format="fp8", granularity="tensor").group_size is None  # fp8 has no group size
    for group_size, granularity in ((0, "tensor"), (None, "channel"), (-1, "channel"), (128, "block128")):
        old = QuantConfig.from_dict({"format": "fp8", "bits": 8, "group_size": group_size})
        assert old == QuantConfig(format="fp8", granularity=granularity)
    with pytest.raises(ValueError, match="FP8 group_size=32 unsupported"):
        QuantConfig.from_dict({"format": "fp8", "bits": 8, "group_size": 32})
    with pytest.raises(ValueError, match=r"\['group_size'\] do not apply to format 'fp8'"):
        QuantConfig(format="fp8", group_size=128)
    with pytest.raises(ValueError, match="positive int"):
        QuantConfig(group_size=0)


def test_load_recipe_takes_a_callers_presets_without_changing_the_global_ones():
    generic = PRESETS["int4"]
    mine = QuantRecipe([QuantRule(".*", QuantConfig(bits=8, group_size=None))])
    assert load_recipe("int4", presets={"int4": mine}) is mine
    assert load_recipe("int4") is generic and PRESETS["int4"] is generic
    assert load_recipe("nvfp4").get_config("model.layers.0.mlp.down_proj").format == "nvfp4"
    with pytest.raises(ValueError, match="known preset .*only-mine"):
        load_recipe("nope", presets={"only-mine": mine})


def test_to_file_writes_one_rule_per_line_and_reads_back_equal(tmp_path):
    recipe = QuantRecipe([QuantRule(r"model\.layers\.0\.mlp\.up_proj", QuantConfig(bits=3, group_size=32, symmetric=False,
                                                                                  method="hqq")),
                          QuantRule(r".*norm.*", None),
                          QuantRule(r".*", QuantConfig(bits=4, group_size=128))], num_layers=4)
    path = tmp_path / "chosen.json"
    recipe.to_file(path, description="written by a test")
    lines = path.read_text().splitlines()
    assert len(lines) == 2 + len(recipe.rules) and '"description": "written by a test"' in lines[0]
    assert QuantRecipe.from_file(path) == recipe


def test_catastrophic_pattern_matches_in_linear_time():
    """`(.+)+!` takes Python's backtracking re exponential time on a name without '!' (a 30-character
    name: minutes); the rule's matcher (RE2) answers at once."""
    import time

    recipe = QuantRecipe([QuantRule(r"(.+)+!", QuantConfig()), QuantRule(r"(a|aa)*b", None),
                          QuantRule(r".*down_proj", QuantConfig(bits=8))])
    name = "model.layers.3.mlp.experts.down_proj" * 20
    start = time.perf_counter()
    assert recipe.get_config(name) == QuantConfig(bits=8)
    assert recipe.get_config("a" * 5000) is None
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("pattern,match", [
    (r"(?!lm_head).*", "backtracking construct"),  # lookahead
    (r"(a)\1", "backtracking construct"),  # backreference
    (r"(", "not a valid regular expression"),
    ("a" * 5000, "characters"),
])
def test_patterns_re2_cannot_match_are_refused_in_one_line(pattern, match, capfd):
    with pytest.raises(ValueError, match=match) as e:
        QuantRule(pattern, QuantConfig())
    assert "\n" not in str(e.value)
    assert capfd.readouterr().err == ""  # RE2's own error log stays quiet


def test_rule_patterns_keep_fullmatch_semantics():
    rule = QuantRule(r"(.*\.)?embed_tokens", None)
    assert rule.regex.fullmatch("model.embed_tokens") and rule.regex.fullmatch("embed_tokens")
    assert not rule.regex.fullmatch("model.embed_tokensx") and not rule.regex.fullmatch("xembed_tokens")


def test_fp_formats_refuse_asymmetric():
    """FP formats have no zero point: symmetric=False is refused when the recipe loads, not mid-export."""
    for fmt, extra in (("mxfp8", {"group_size": 32, "bits": 8}), ("nvfp4", {"group_size": 16}),
                       ("fp8", {"group_size": None, "bits": 8})):
        with pytest.raises(ValueError, match="symmetric"):
            QuantConfig(format=fmt, symmetric=False, **extra)


def test_yaml_error_is_one_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("rules:\n  - pattern: 'x'\n    config: {bits: 4\n  - oops: [\n")
    with pytest.raises(ValueError, match="bad.yaml is not valid JSON/YAML") as e:
        QuantRecipe.from_file(p)
    assert "\n" not in str(e.value) and "line" in str(e.value)


def test_recipe_fifo_and_device_are_refused(tmp_path):
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="FIFO"):
        QuantRecipe.from_file(fifo)  # would block forever in open() before the fix
    with pytest.raises(ValueError, match="character device"):
        QuantRecipe.from_file("/dev/zero")
    big = tmp_path / "big.json"
    big.write_bytes(b" " * ((1 << 20) + 1))
    with pytest.raises(ValueError, match="larger than"):
        QuantRecipe.from_file(big)
