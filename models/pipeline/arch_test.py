"""The architecture registry (a checkpoint's model_type / GGUF architecture -> its model) and the
checks of a model package's conventional parts, one message each."""

import types

import pytest

from models.pipeline import arch as arch_mod
from models.pipeline.arch import (
    ModelPackageError,
    architecture_for_gguf,
    architecture_for_model_type,
    package_architecture,
    register_architecture,
    registered_architectures,
)


class _Config:
    @staticmethod
    def from_hf_dict(d):
        return d


def _parts(**drop):
    """A toy package's config, model, keymap and gguf modules; `drop` names attributes to leave out."""
    def module(name, **attrs):
        m = types.ModuleType(name)
        for k, v in attrs.items():
            if k not in drop:
                setattr(m, k, v)
        return m

    return dict(
        config=module("config", ModelConfig=_Config, TEXT_MODEL_TYPES=("toy_text",), MULTIMODAL_MODEL_TYPES=("toy",)),
        model=module("model", build_model=lambda config, **kw: None),
        keymap=module("keymap", hf_to_llmq_key=lambda n: n),
        gguf_import=module("gguf_checkpoint", GGUF_ARCH="toy", hf_config_from_gguf=lambda m, t: {},
                           GGUFConverter=object),
    )


@pytest.fixture
def toy_package(tmp_path):
    (tmp_path / "toy" / "recipes").mkdir(parents=True)
    return str(tmp_path / "toy" / "architecture.py")


@pytest.fixture
def empty_registry(monkeypatch):
    monkeypatch.setattr(arch_mod, "_REGISTRY", {})


def test_a_complete_package_is_read(toy_package):
    arch = package_architecture("toy", toy_package, tiny_hf_config=dict, **_parts())
    assert arch.hf_model_types == ("toy_text", "toy") and arch.target == "//models/toy:quantize_and_save"
    assert arch.gguf_architecture == "toy"


@pytest.mark.parametrize("drop,words", [
    ("MULTIMODAL_MODEL_TYPES", ["models/toy/config.py", "MULTIMODAL_MODEL_TYPES", "() where none"]),
    ("TEXT_MODEL_TYPES", ["models/toy/config.py", "TEXT_MODEL_TYPES"]),
    ("ModelConfig", ["models/toy/config.py", "ModelConfig"]),
    ("build_model", ["models/toy/model.py", "build_model"]),
    ("hf_to_llmq_key", ["models/toy/keymap.py", "hf_to_llmq_key"]),
    ("GGUF_ARCH", ["models/toy/gguf_checkpoint.py", "GGUF_ARCH"]),
    ("GGUFConverter", ["models/toy/gguf_checkpoint.py", "GGUFConverter"]),
])
def test_a_missing_part_is_one_line_naming_it(toy_package, drop, words):
    with pytest.raises(ModelPackageError) as info:
        package_architecture("toy", toy_package, tiny_hf_config=dict, **_parts(**{drop: True}))
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_model_types_must_be_a_tuple(toy_package):
    parts = _parts()
    parts["config"].MULTIMODAL_MODEL_TYPES = "toy"
    with pytest.raises(ModelPackageError, match="MULTIMODAL_MODEL_TYPES must be a tuple of model_type strings"):
        package_architecture("toy", toy_package, tiny_hf_config=dict, **parts)


def test_a_package_without_recipes_is_named(tmp_path):
    (tmp_path / "bare").mkdir()
    with pytest.raises(ModelPackageError, match=r"models/bare: no recipes/ folder"):
        package_architecture("bare", str(tmp_path / "bare" / "architecture.py"), tiny_hf_config=dict, **_parts())


def test_the_registry_finds_a_checkpoint_by_model_type_and_gguf_architecture(toy_package, empty_registry):
    arch = register_architecture(package_architecture("toy", toy_package, tiny_hf_config=dict, **_parts()))
    assert architecture_for_model_type("toy") is arch and architecture_for_model_type("toy_text") is arch
    assert architecture_for_gguf("toy") is arch
    assert architecture_for_model_type("llama") is None and architecture_for_gguf("llama") is None
    assert registered_architectures() == (arch,)


def test_the_registry_refuses_two_readers_of_one_checkpoint_kind(toy_package, empty_registry):
    register_architecture(package_architecture("toy", toy_package, tiny_hf_config=dict, **_parts()))
    with pytest.raises(ModelPackageError, match="already registered"):
        register_architecture(package_architecture("toy", toy_package, tiny_hf_config=dict, **_parts()))
    with pytest.raises(ModelPackageError, match="model_type 'toy' is already read by //models/toy"):
        register_architecture(package_architecture("toy2", toy_package, tiny_hf_config=dict, **_parts()))
    parts = _parts()
    parts["config"].TEXT_MODEL_TYPES, parts["config"].MULTIMODAL_MODEL_TYPES = ("other",), ()
    with pytest.raises(ModelPackageError, match="GGUF architecture 'toy' is already read"):
        register_architecture(package_architecture("toy3", toy_package, tiny_hf_config=dict, **parts))


def test_every_model_of_the_repository_is_registered_once():
    from models.architectures import ARCHITECTURES

    names = {a.name for a in ARCHITECTURES}
    assert {"gemma3", "gemma4", "qwen3.5-moe"} <= names
    for a in ARCHITECTURES:
        for model_type in a.hf_model_types:
            assert architecture_for_model_type(model_type) is a, model_type
        assert architecture_for_gguf(a.gguf_architecture) is a, a.gguf_architecture


def test_the_write_job_carries_the_models_gguf_export():
    """WriteJob gives a writer in llama.cpp's naming the model's GGUF export (names, value transforms,
    metadata, read-back), so a backend never imports a model."""
    from models.architectures import ARCHITECTURES
    from models.pipeline.run import _write_job

    for a in ARCHITECTURES:
        source = types.SimpleNamespace(hf_config=a.tiny_hf_config(), config=a.config_from_hf(a.tiny_hf_config()),
                                       source_files=(), tokenizer_files=(), kind="hf", path="/in")
        job = _write_job(a, source, "bundle", "/out", None, "int4", 1 << 20, False, False)
        assert job.gguf_arch == a.gguf_import.GGUF_ARCH and job.source_path == "/in", a.name
        assert callable(job.to_gguf) and callable(job.from_gguf), a.name
        metadata = job.gguf_metadata()
        assert any(k.startswith(job.gguf_arch + ".") for k in metadata), a.name
