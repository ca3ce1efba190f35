"""The backend registry and the core's bundle backend (write a stream, reload it exactly)."""

import pytest
import torch

from llmq import backend as backend_mod
from llmq.backend import Backend, BundleBackend, WriteJob, backend_names, get_backend, register_backend
from llmq.quant import QuantConfig, QuantRecipe, QuantRule, dequantize, quantize_weight
from llmq.quant.storage import CANONICAL


class _Dummy(Backend):
    name = "dummy-test"
    description = "a test backend"
    accepts_formats = ("int",)
    takes_float = False

    def storage(self, config, job):
        return CANONICAL

    def write(self, stream, job):
        return job.out

    def reload(self, path, job):
        return {}


@pytest.fixture
def clean_registry():
    saved = dict(backend_mod._REGISTRY)
    yield
    backend_mod._REGISTRY.clear()
    backend_mod._REGISTRY.update(saved)


def test_the_core_registers_the_bundle():
    assert "bundle" in backend_names() and backend_names()[0] == "bundle"
    b = get_backend("bundle")
    assert isinstance(b, BundleBackend) and isinstance(b, Backend)
    assert {"int", "fp8", "mxfp8", "mxfp4", "nvfp4"} <= set(b.accepts_formats)


def test_register_refuses_a_duplicate_and_lookup_names_the_known(clean_registry):
    register_backend(_Dummy())
    assert get_backend("dummy-test").description == "a test backend"
    with pytest.raises(ValueError, match="'dummy-test' is already registered"):
        register_backend(_Dummy())
    with pytest.raises(ValueError, match=r"backend 'nope' unknown; expected one of bundle, .*dummy-test"):
        get_backend("nope")


def test_register_refuses_what_is_not_a_backend(clean_registry):
    class Lookalike:  # the members, but not a Backend: nothing declares its defaults
        name, description, accepts_formats, takes_float = "x", "x", (), False

        def write(self, stream, job):
            return ""

        def reload(self, path, job):
            return {}

        def storage(self, config, job):
            return CANONICAL

    class NoReload(Backend):
        name, description = "y", "y"

        def write(self, stream, job):
            return ""

    class NoConsumer(_Dummy):
        name, checks_consumer = "z", True

    with pytest.raises(TypeError, match="Lookalike is not a Backend"):
        register_backend(Lookalike())
    with pytest.raises(TypeError, match="lacks storage, reload"):
        register_backend(NoReload())
    with pytest.raises(TypeError, match="lacks check_consumer"):
        register_backend(NoConsumer())
    assert not {"x", "y", "z"} & set(backend_names())


def test_a_backend_declares_what_it_cannot_do(clean_registry):
    class WriteOnly(Backend):
        name, description, reloads = "write-only", "writes, cannot read back", False

        def storage(self, config, job):
            return CANONICAL

        def write(self, stream, job):
            return job.out

    b = register_backend(WriteOnly())
    job = WriteJob(out="o", recipe=None, recipe_name="r", architecture="toy")
    assert (b.takes_float, b.streams_row_blocks, b.needs_tokenizer_files, b.checks_consumer) == (False,) * 4
    assert b.check(job) is None and b.summary("o", job) == [] and b.written_bits("o") == (0, 0)
    with pytest.raises(NotImplementedError, match="--backend write-only cannot read its output back"):
        b.reload("o", job)


def test_every_registered_backend_is_a_backend():
    for name in backend_names():
        assert isinstance(get_backend(name), Backend), name


@pytest.mark.parametrize("config", [
    QuantConfig(bits=4, group_size=32),
    QuantConfig(bits=8, group_size=None),
    QuantConfig(format="fp8", granularity="channel"),
    QuantConfig(format="mxfp8", bits=8, group_size=32),
    QuantConfig(format="mxfp4", bits=4, group_size=32),
    QuantConfig(format="nvfp4", bits=4, group_size=16),
], ids=lambda c: c.describe())
def test_bundle_backend_write_and_reload_roundtrip(tmp_path, config):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    norm = torch.randn(64, generator=g)
    q = quantize_weight(w, config)
    recipe = QuantRecipe([QuantRule(r".*norm", None), QuantRule(".*", config)])
    job = WriteJob(out=str(tmp_path / "out"), recipe=recipe, recipe_name="test", architecture="toy",
                   max_shard_bytes=1 << 20, metadata={"architecture": "toy", "backend": "bundle"})
    b = get_backend("bundle")
    path = b.write(iter([("layer.weight", q), ("norm.weight", norm)]), job)
    back = b.reload(path, job)
    assert sorted(back) == ["layer.weight", "norm.weight"]
    assert torch.equal(back["norm.weight"], norm)
    assert torch.equal(dequantize(back["layer.weight"], torch.float32), dequantize(q, torch.float32))
    assert type(back["layer.weight"]) is type(q)
