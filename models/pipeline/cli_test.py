"""quantize_and_save's command line over a table of bad inputs: exit status 2, exactly one non-empty
stderr line naming the file / tensor / flag, no traceback, nothing published at --out.

Each case runs the binary's entry point (`main_for`: absl's app.run, flag parsing, the whole run)
in a forked child of this process, so the table costs one torch import, not one per case; one
test runs the real binary file in a fresh interpreter to prove the wiring.
"""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from llmq.backend import BundleBackend, register_backend


class _WriteOnly(BundleBackend):
    """The bundle's writer, declared unable to read its output back (reloads = False); registered before
    the command line's flags are defined, as a backend package's import would."""

    name = "write-only-test"
    reloads = False

    def reload(self, path, job):
        raise AssertionError("reload called on a backend that declares reloads = False")


register_backend(_WriteOnly())

from models.architectures import GEMMA3, GEMMA4, QWEN  # noqa: E402
from models.pipeline.cli_testing import run_main  # noqa: E402
from models.pipeline.default_model import write_default_checkpoint  # noqa: E402

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    good = write_default_checkpoint(QWEN, str(root / "qwen"), seed=1)
    made = {"good": good, "gemma": write_default_checkpoint(GEMMA4, str(root / "gemma"), seed=1),
            "gemma3": write_default_checkpoint(GEMMA3, str(root / "gemma3"), seed=1)}

    def variant(name, change_index=None, change_config=None, change_tensors=None):
        folder = root / name
        folder.mkdir()
        with open(os.path.join(good, INDEX)) as f:
            index = json.load(f)
        with open(os.path.join(good, "config.json")) as f:
            config = json.load(f)
        for shard in sorted(set(index["weight_map"].values())):
            tensors = load_file(os.path.join(good, shard))
            if change_tensors:
                change_tensors(tensors)
            save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        if change_index:
            change_index(index)
        if change_config:
            change_config(config)
        (folder / INDEX).write_text(json.dumps(index))
        (folder / "config.json").write_text(json.dumps(config))
        made[name] = str(folder)

    missing = "model.layers.2.linear_attn.out_proj.weight"
    variant("missing_tensor", change_index=lambda ix: ix["weight_map"].pop(missing))
    variant("missing_expert", change_index=lambda ix: ix["weight_map"].pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    variant("empty_weight_map", change_index=lambda ix: ix["weight_map"].clear())
    variant("wrong_shapes", change_config=lambda c: c.update(vocab_size=1024))

    def poison(tensors):
        if "model.norm.weight" in tensors:
            tensors["model.norm.weight"][3] = float("nan")

    variant("nan_weights", change_tensors=poison)

    def linked(name, file, target):  # a side file that is a link out of the checkpoint folder
        variant(name)
        if os.path.lexists(os.path.join(made[name], file)):
            os.unlink(os.path.join(made[name], file))
        os.symlink(target, os.path.join(made[name], file))

    (root / "secret.json").write_text('{"token": "hunter2"}')
    linked("linked_tokenizer", "tokenizer.json", str(root / "secret.json"))
    linked("linked_config", "config.json", os.path.join(good, "config.json"))
    linked("environ_generation_config", "generation_config.json", "/proc/self/environ")
    (root / "bad.json").write_text("{not json")
    (root / "g48.json").write_text(json.dumps({"rules": [{"pattern": ".*experts.*", "config": {
        "bits": 4, "group_size": 48, "symmetric": True}}]}))
    (root / "a_file").write_text("x")
    made.update(root=str(root), bad_recipe=str(root / "bad.json"), g48=str(root / "g48.json"),
                a_file=str(root / "a_file"))
    return made


# (case id, args given the fixture's paths, words the one stderr line must contain)
CASES = [
    ("missing checkpoint", lambda c: [f"--checkpoint={c['root']}/nope"], ["nope", "no such folder"]),
    ("checkpoint is a file", lambda c: [f"--checkpoint={c['a_file']}"], ["a_file"]),
    ("bad recipe file", lambda c: [f"--checkpoint={c['good']}", f"--recipe={c['bad_recipe']}"], ["bad.json"]),
    ("unknown recipe", lambda c: [f"--checkpoint={c['good']}", "--recipe=int3"], ["int3"]),
    ("recipe group size", lambda c: [f"--checkpoint={c['good']}", f"--recipe={c['g48']}"],
     ["group_size=48", "experts"]),
    ("bad backend", lambda c: [f"--checkpoint={c['good']}", "--backend=tpu"], ["backend", "tpu"]),
    ("bad shard size", lambda c: ["--max_shard_size=abc"], ["max_shard_size"]),
    ("unknown flag", lambda c: ["--bogus=1"], ["bogus"]),
    ("stray argument", lambda c: ["int4"], ["int4"]),
    ("missing tensor", lambda c: [f"--checkpoint={c['missing_tensor']}"],
     ["missing_tensor", "model.layers.2.linear_attn.out_proj.weight"]),
    ("empty weight_map", lambda c: [f"--checkpoint={c['empty_weight_map']}"], ["empty_weight_map", "none of"]),
    ("wrong shapes", lambda c: [f"--checkpoint={c['wrong_shapes']}"],
     ["lm_head.weight", "expected shape [1024, 128]", "found [512, 128]"]),
    ("nan weights", lambda c: [f"--checkpoint={c['nan_weights']}"], ["model.norm.weight", "NaN"]),
    ("out exists", lambda c: [f"--checkpoint={c['good']}", f"--out={c['root']}"], ["--out"]),
    ("other model", lambda c: [f"--checkpoint={c['gemma']}"], ["//models/gemma4:quantize_and_save"]),
    ("out under a file", lambda c: [f"--checkpoint={c['good']}", f"--out={c['a_file']}/sub/out"],
     ["a_file is a file"]),
    ("out is a file", lambda c: [f"--checkpoint={c['good']}", f"--out={c['a_file']}"], ["a_file", "not a folder"]),
    ("missing expert", lambda c: [f"--checkpoint={c['missing_expert']}"], ["missing_expert", "layers.1."]),
    ("side file linked out", lambda c: [f"--checkpoint={c['linked_tokenizer']}"],
     ["linked_tokenizer/tokenizer.json", "outside the checkpoint folder"]),
    ("config linked out", lambda c: [f"--checkpoint={c['linked_config']}"],
     ["linked_config/config.json", "outside the checkpoint folder"]),
    ("side file linked to environ", lambda c: [f"--checkpoint={c['environ_generation_config']}"],
     ["generation_config.json", "/environ, outside the checkpoint folder"]),
]


@pytest.mark.parametrize("case,make_args,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_published(case, make_args, words, checkpoints, tmp_path):
    out = tmp_path / "out"
    args = make_args(checkpoints)
    if not any(a.startswith("--out=") for a in args):
        args.append(f"--out={out}")
    code, stdout, stderr = run_main(QWEN, args + ["--noverify", "--progress=false"], tmp_path)
    lines = stderr.splitlines()
    assert code == 2, (code, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].strip() != "error:", stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "=True" not in lines[0] and "='allow'" not in lines[0] and "=False" not in lines[0], lines[0]
    assert case == "out exists" or not out.exists(), f"{case}: something was published at --out"
    leftovers = {p.name for p in tmp_path.iterdir()} - {"child.stdout", "child.stderr"}
    assert leftovers <= {"out.partial"}, leftovers  # only a resumable .partial may stay


@pytest.mark.parametrize("arch,given,target", [
    (GEMMA4, "good", "//models/qwen:quantize_and_save"),
    (GEMMA4, "gemma3", "//models/gemma3:quantize_and_save"),
    (QWEN, "gemma3", "//models/gemma3:quantize_and_save"),
    (GEMMA3, "gemma", "//models/gemma4:quantize_and_save"),
    (GEMMA3, "good", "//models/qwen:quantize_and_save"),
], ids=lambda v: v if isinstance(v, str) else v.name)
def test_a_binary_names_the_target_of_another_models_checkpoint(arch, given, target, checkpoints, tmp_path):
    """Found by the checkpoint's model_type through models/architectures.py's registry, no per-model list."""
    code, _, stderr = run_main(arch, [f"--checkpoint={checkpoints[given]}", f"--out={tmp_path}/o"], tmp_path)
    assert code == 2 and stderr.count("\n") == 1 and target in stderr, stderr


def test_a_backend_that_cannot_reload_skips_the_default_verification(checkpoints, tmp_path):
    write_only_backend = _WriteOnly.name
    out = tmp_path / "out"
    code, stdout, stderr = run_main(QWEN, [f"--checkpoint={checkpoints['good']}", f"--out={out}",
                                           f"--backend={write_only_backend}", "--progress=false"], tmp_path)
    assert code == 0 and "Traceback" not in stderr, stderr
    assert f"not run (--backend {write_only_backend} cannot read its output back)" in stdout, stdout
    assert (out / "llmq_manifest.json").is_file()
    code, _, stderr = run_main(QWEN, [f"--checkpoint={checkpoints['good']}", f"--out={tmp_path}/o2", "--verify",
                                      f"--backend={write_only_backend}", "--progress=false"], tmp_path)
    assert code == 2 and stderr.count("\n") == 1 and "cannot read its output back" in stderr, stderr
    assert not (tmp_path / "o2").exists()


def test_help_lists_the_tools_flags_and_exits_0(tmp_path):
    code, stdout, stderr = run_main(QWEN, ["--help"], tmp_path)
    assert code == 0, stderr
    for flag in ("--checkpoint:", "--recipe:", "--backend:", "--out:", "--[no]verify:", "--[no]verify_warn_only:",
                 "--verify_min_cosine:", "--[no]list_recipes:"):
        assert flag in stdout, flag


def test_real_binary_help_and_bad_flag():
    """The binary file itself, in a fresh interpreter (import wiring, absl's own parse)."""
    binary = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "qwen", "quantize_and_save.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    help_run = subprocess.run([sys.executable, binary, "--help"], capture_output=True, text=True, env=env,
                              timeout=600)
    assert help_run.returncode == 0, help_run.stderr
    assert "--checkpoint" in help_run.stdout and "--verify_min_cosine" in help_run.stdout
    bad = subprocess.run([sys.executable, binary, "--backend=tpu"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "backend" in bad.stderr, bad.stderr


def test_list_recipes_prints_descriptions(tmp_path):
    code, stdout, _ = run_main(QWEN, ["--list_recipes"], tmp_path)
    assert code == 0
    lines = {line.split()[0]: line for line in stdout.splitlines() if line.strip()}
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "qwen", "recipes",
                           "mixed.json")) as f:
        assert json.load(f)["description"] in lines["mixed"]
    assert "int4-asym" in lines and "->" in lines["int4-asym"]  # generic presets: their rules summarised
    # each format's bits per weight as the backend writes it: the bundle's float32 scale and bias per
    # group of 32 (4 + 2), an MLX folder's 16-bit pair (4 + 1)
    assert "[bits per weight as --backend bundle writes them: int4 g32 sym 6.00]" in lines["int4"]
    code, stdout, _ = run_main(QWEN, ["--list_recipes", "--backend=mlx"], tmp_path)
    lines = {line.split()[0]: line for line in stdout.splitlines() if line.strip()}
    assert code == 0 and "int4 g32 sym 5.00]" in lines["int4"] and "int8 g32 sym 9.00, int4 g32 sym 5.00]" in lines["mixed"]
    assert "fp8 per channel not written by --backend mlx" in lines["nvfp4"]  # its FP8 embedding rule
