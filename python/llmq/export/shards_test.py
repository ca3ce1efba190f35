"""ShardWriter (streaming shards for the HF export): shards are on disk while the writer runs,
read back with safetensors.safe_open, carry an index, and a resumed run gives the same bytes."""

import json
import os

import torch
from safetensors import safe_open

from llmq.export.shards import ShardWriter


def _read(path):
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_shard_writer_streams_shards_index_and_resume(tmp_path):
    want = {f"l{i}.w": torch.full((256,), float(i)) for i in range(6)}  # 1 KiB each
    w = ShardWriter(str(tmp_path), max_shard_bytes=2048)
    for k, t in want.items():
        w.add(k, t)
        if k == "l2.w":  # two full shards are on disk before the writer closes
            assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".tmp.safetensors")) == [
                "shard-00000.tmp.safetensors"]
    names = w.close()
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert index["metadata"]["total_size"] == 6 * 1024
    for k, t in want.items():
        got, meta = _read(str(tmp_path / index["weight_map"][k]))
        assert torch.equal(got[k], t)
        assert meta == {"format": "pt"}
    # resume: an interrupted run's completed shards are kept, its open one rewritten
    out = tmp_path / "r"
    out.mkdir()
    w = ShardWriter(str(out), max_shard_bytes=2048)
    for k in list(want)[:5]:
        w.add(k, want[k])  # shards 0 and 1 complete, shard 2 open (.part) when "killed"
    w.abort()
    w2 = ShardWriter.resume(str(out), 2048)
    assert [w2.has(k) for k in want] == [True] * 4 + [False] * 2
    for k, t in want.items():
        w2.add(k, t)
    assert w2.close() == names
    for name in names:
        assert open(out / name, "rb").read() == open(tmp_path / name, "rb").read()
