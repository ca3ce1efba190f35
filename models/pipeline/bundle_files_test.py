"""quantize_and_save copies the checkpoint's config and tokenizer files into the bundle, so the
bundle alone rebuilds the model (nothing is read from the source folder, which is deleted first)."""

import json
import os
import shutil

import torch

from llmq.checkpoint import load_bundle, read_manifest
from models.pipeline.default_model import write_default_checkpoint
from models.pipeline.quantize_and_save import run
from models.pipeline.quantized_model import build_quantized_model
from models.qwen.architecture import ARCHITECTURE as QWEN


def test_the_bundle_carries_config_and_tokenizer_files(tmp_path):
    checkpoint = write_default_checkpoint(QWEN, str(tmp_path / "ckpt"), seed=2)
    extra = {"tokenizer.json": b'{"model": {"type": "WordLevel"}}', "generation_config.json": b'{"do_sample": false}'}
    for name, data in extra.items():
        with open(os.path.join(checkpoint, name), "wb") as f:
            f.write(data)
    sources = {n: open(os.path.join(checkpoint, n), "rb").read() for n in ["config.json", *extra]}
    out = run(QWEN, checkpoint=checkpoint, recipe="int4", backend="bundle", out=str(tmp_path / "out"), resume=True,
              max_shard_size=1 << 20, verify=False, seed=0, progress=False)["bundle"]
    assert sorted(f["file"] for f in read_manifest(out)["files"]) == sorted(sources)
    for name, data in sources.items():
        assert open(os.path.join(out, name), "rb").read() == data, name
    shutil.rmtree(checkpoint)
    with open(os.path.join(out, "config.json")) as f:
        config = QWEN.config_from_hf(json.load(f))
    model = build_quantized_model(QWEN.build_model(config, device="meta"), load_bundle(out, verify=True))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape[-1] == config.vocab_size and torch.isfinite(logits).all()
