"""Side files (config, tokenizer, generation config...) are regular files inside the checkpoint
folder: a link out of it, a FIFO, a folder or a dangling link is refused in one line naming it."""

import os

import pytest

from llmq.checkpoint import (
    SOURCE_FILES,
    TOKENIZER_FILES,
    UnsupportedCheckpointError,
    side_file,
    side_files,
    source_files,
)


@pytest.fixture
def folder(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "tokenizer.json").write_text("{}")
    (tmp_path / "secret.txt").write_text("TOKEN=hunter2")
    return ckpt


def test_regular_files_and_links_inside_are_taken_missing_ones_skipped(folder):
    os.symlink("tokenizer.json", folder / "merges.txt")  # inside the folder: allowed
    assert side_files(folder, TOKENIZER_FILES) == [str(folder / "tokenizer.json"), str(folder / "merges.txt")]
    assert source_files(folder) == [str(folder / "config.json"), str(folder / "tokenizer.json")]
    assert side_file(folder, "vocab.json") is None


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "special_tokens_map.json",
                                  "chat_template.jinja", "merges.txt"])
@pytest.mark.parametrize("target", ["secret", "environ"])
def test_links_out_of_the_folder_are_refused_in_one_line(folder, name, target):
    path = folder / name
    if path.exists():
        path.unlink()
    os.symlink(folder.parent / "secret.txt" if target == "secret" else "/proc/self/environ", path)
    for gather in (lambda: side_files(folder, TOKENIZER_FILES + ("config.json",)),
                   lambda: source_files(folder) if name in SOURCE_FILES else side_file(folder, name)):
        with pytest.raises(UnsupportedCheckpointError) as info:
            gather()
        message = str(info.value)
        assert message.startswith(f"{path}: is a link to ") and "outside the checkpoint folder" in message
        assert "\n" not in message and "hunter2" not in message


@pytest.mark.parametrize("kind", ["fifo", "folder", "dangling"])
def test_what_is_not_a_regular_file_is_refused(folder, kind):
    path = folder / "tokenizer_config.json"
    if kind == "fifo":
        os.mkfifo(path)  # reading it would block the run
    elif kind == "folder":
        path.mkdir()
    else:
        os.symlink("missing.json", path)
    with pytest.raises(UnsupportedCheckpointError, match="tokenizer_config.json: (is not a regular file|cannot be read)"):
        side_files(folder, TOKENIZER_FILES)


def test_a_hub_cache_snapshot_may_link_into_its_blobs(tmp_path):
    cache = tmp_path / "models--org--name"
    (cache / "blobs").mkdir(parents=True)
    (cache / "blobs" / "abc").write_text("{}")
    snapshot = cache / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    os.symlink(cache / "blobs" / "abc", snapshot / "tokenizer.json")
    assert side_files(snapshot, TOKENIZER_FILES) == [str(snapshot / "tokenizer.json")]
