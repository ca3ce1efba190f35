"""models.common.tokenizer on a tiny GGUF vocabulary, against SentencePiece itself and transformers.

A small SentencePiece BPE model (byte fallback, no dummy prefix, Gemma's settings) is trained on a
few sentences; gguf-py's SentencePieceVocab reads its pieces, scores and types and GGUFWriter writes
them as tokenizer.ggml.* metadata (user-defined pieces typed USER_DEFINED, as llama.cpp's converter
does). The tokenizer llmq builds from that file must encode like SentencePiece (plus the BOS the
file asks for) and like transformers' own GGUF loader, decode back to the text, and survive
write_tokenizer_files -> AutoTokenizer / tokenizers / mlx_lm.
"""

import os

import gguf
import pytest

from llmq.checkpoint import gguf_header
from models.common import tokenizer as tk

spm = pytest.importorskip("sentencepiece")

CORPUS = ["The capital of France is Paris.", "The quick brown fox jumps over the lazy dog.",
          "In 1999, the   weather was nice; it rained twice.", "Hello, world! How are you today?",
          "<start_of_turn>user\nWhat is the capital?<end_of_turn>"] * 20
TEXTS = ["The capital of France is", "Hello,  world!\nNew line 12345 \u00fcn\u00efc\u00f6d\u00e9 \u65e5\u672c",
         " leading space", "<start_of_turn>user hi<end_of_turn>", "zzz qqq", ""]
PAD, EOS, BOS, UNK = 0, 1, 2, 3
USER_DEFINED = ["<start_of_turn>", "<end_of_turn>"]


# Gemma's special-token spellings, and SentencePiece's defaults (which GemmaTokenizer does not assume).
SPELLINGS = {"gemma": ("<pad>", "<eos>", "<bos>", "<unk>"), "spm": ("<pad>", "</s>", "<s>", "<unk>")}


@pytest.fixture(scope="module", params=sorted(SPELLINGS))
def files(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("spm")
    pad_piece, eos_piece, bos_piece, unk_piece = SPELLINGS[request.param]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(folder / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, add_dummy_prefix=False, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, pad_id=PAD, eos_id=EOS, bos_id=BOS, unk_id=UNK,
        pad_piece=pad_piece, eos_piece=eos_piece, bos_piece=bos_piece, unk_piece=unk_piece,
        user_defined_symbols=USER_DEFINED, minloglevel=2)
    processor = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    tokens, scores, types = zip(*gguf.vocab.SentencePieceVocab(folder).all_tokens())
    user_defined = {processor.piece_to_id(s) for s in USER_DEFINED}
    types = [gguf.TokenType.USER_DEFINED if i in user_defined else t for i, t in enumerate(types)]
    path = folder / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(UNK)
    writer.add_pad_token_id(PAD)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    old = os.stat(path).st_mtime - 60
    os.utime(path, (old, old))  # older than gguf_header.RACY_NS: its header may be cached
    return path, processor


def test_gguf_encode_decode_equal_sentencepiece_and_transformers(files):
    path, processor = files
    from transformers import AutoTokenizer

    tok = tk.load_tokenizer(str(path))
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tok.bos_token_id == BOS and tok.eos_token_id == EOS and len(tok) == len(reference)
    assert (tok.hf.bos_token, tok.hf.eos_token) == (processor.id_to_piece(BOS), processor.id_to_piece(EOS))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [BOS] + processor.encode(text), text
        assert ids == reference(text).input_ids, text
        assert tok.decode(ids) == processor.decode(ids[1:]) == text
    assert tok.decode([BOS, 4, EOS, PAD]) == "<start_of_turn>"  # control tokens dropped, user-defined kept


def test_built_once_per_file(files):
    path, _ = files
    assert tk.load_tokenizer(str(path)) is tk.load_tokenizer(str(path))


def test_header_arrays_stay_lazy_until_the_tokenizer_is_built(files, monkeypatch):
    path, _ = files
    monkeypatch.setattr(gguf_header, "EAGER_ARRAY_LIMIT", 16)  # make the 400-entry vocabulary a lazy array
    gguf_header.clear_cache()
    monkeypatch.setattr(tk, "_cache", {})
    header = gguf_header.parse_header_cached(str(path))
    tokens = header.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, gguf_header.GGUFArray) and not tokens.loaded
    assert tk.has_tokenizer(str(path)) and not tokens.loaded  # the check does not decode the vocabulary
    tok = tk.load_tokenizer(str(path))
    assert tokens.loaded and gguf_header.parse_header_cached(str(path)) is not None
    assert tok.encode("The capital") == [BOS] + files[1].encode("The capital")
    gguf_header.clear_cache()


def test_written_files_load_in_transformers_tokenizers_and_mlx_lm(files, tmp_path):
    path, processor = files
    out = tmp_path / "mlx_folder"
    written = tk.write_tokenizer_files(str(path), str(out))
    assert set(tk.WRITTEN_FILES) <= set(written) and all(os.path.isfile(out / f) for f in written)
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(str(out))
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    again = tk.load_tokenizer(str(out))  # the written folder is itself a source
    for text in TEXTS:
        expected = [BOS] + processor.encode(text)
        assert reloaded(text).input_ids == expected and again.encode(text) == expected, text
        assert raw.encode(text).ids == expected, text
        assert again.decode(expected) == text
    try:
        from mlx_lm.tokenizer_utils import load as mlx_load
    except ImportError:  # mlx-lm runs on macOS and on Linux with mlx[cpu]
        return
    wrapper = mlx_load(out)
    assert wrapper.encode(TEXTS[0]) == [BOS] + processor.encode(TEXTS[0])
    assert wrapper.decode(wrapper.encode(TEXTS[0]), skip_special_tokens=True) == TEXTS[0]


def test_sources_without_a_tokenizer_say_so(tmp_path):
    path = tmp_path / "no_vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert not tk.has_tokenizer(str(path)) and not tk.has_tokenizer(str(tmp_path)) and not tk.has_tokenizer(None)
    with pytest.raises(ValueError, match="no_vocab.gguf: no tokenizer.ggml.tokens"):
        tk.load_tokenizer(str(path))
    with pytest.raises(ValueError, match="no tokenizer"):
        tk.load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="expected an HF checkpoint folder or a .gguf file"):
        tk.load_tokenizer(str(tmp_path / "missing.gguf"))
