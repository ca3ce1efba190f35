"""text_agreement on toy bigram language models with a character tokenizer (fast, no checkpoint).

The expected numbers are recomputed here independently: greedy chains by direct argmax over the
bigram table, teacher-forced agreement by comparing the two tables' argmax rows along the
reference's chain, the cosine from the tables' rows for the prompt tokens."""

import pytest
import torch

from models.common.text_check import text_agreement, text_rows

ALPHABET = " abcdefghijklmnopqrstuvwxyz."
EOS = len(ALPHABET)  # one id past the characters


class CharTokenizer:
    eos_token_id = EOS

    def encode(self, text):
        return [ALPHABET.index(c) for c in text]

    def decode(self, ids):
        return "".join(ALPHABET[i] for i in ids if i < len(ALPHABET))


class _Cache:
    pass


class Bigram(torch.nn.Module):
    """logits[t] = table[ids[t]]: next-token scores depend only on the current token."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)

    def new_cache(self, batch_size=1):
        return _Cache()

    def forward(self, input_ids, cache=None):
        return self.table[input_ids]


def _table(seed, vocab=EOS + 1):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, vocab, generator=g)
    table[:, EOS] = -1e9  # never end: every run generates all its tokens
    return table


def _chain(table, start, n):
    out, tok = [], start
    for _ in range(n):
        tok = int(table[tok].argmax())
        out.append(tok)
    return out


def test_identical_models_agree_fully():
    model = Bigram(_table(0))
    result = text_agreement(CharTokenizer(), model, model, prompt="the cat", new_tokens=12)
    assert result["prompt_ids"] == CharTokenizer().encode("the cat")
    assert result["tokens_reference"] == result["tokens_quantized"] == _chain(model.table, result["prompt_ids"][-1], 12)
    assert result["text_reference"] == CharTokenizer().decode(result["tokens_reference"])
    assert result["greedy_equal"] == 12 and result["token_agreement"] == 1.0 and result["tokens_compared"] == 12
    assert result["logits_cosine"] == pytest.approx(1.0, abs=1e-12)
    labels = [label for label, _ in text_rows(result)]
    assert labels[:4] == ["prompt", "greedy text (unquantized)", "greedy text (quantized)", "token agreement"]


def test_a_perturbed_model_matches_independent_counts():
    ref_table = _table(1)
    q_table = ref_table.clone()
    q_table[5:9] = _table(2)[5:9]  # rows of four tokens disagree
    tok = CharTokenizer()
    result = text_agreement(tok, Bigram(ref_table), Bigram(q_table), prompt="a big dog", new_tokens=20)
    ids = tok.encode("a big dog")
    ref_chain = _chain(ref_table, ids[-1], 20)
    q_chain = _chain(q_table, ids[-1], 20)
    assert result["tokens_reference"] == ref_chain and result["tokens_quantized"] == q_chain
    first_diff = next((i for i, (a, b) in enumerate(zip(ref_chain, q_chain)) if a != b), 20)
    assert result["greedy_equal"] == first_diff
    inputs = [ids[-1]] + ref_chain[:-1]  # the token each compared prediction reads
    expected = sum(int(ref_table[t].argmax() == q_table[t].argmax()) for t in inputs) / 20
    assert result["token_agreement"] == pytest.approx(expected)
    assert 0 < result["token_agreement"] < 1  # this seed exercises both outcomes
    r, q = ref_table[ids].double().flatten(), q_table[ids].double().flatten()
    assert result["logits_cosine"] == pytest.approx((r @ q / (r.norm() * q.norm())).item(), rel=1e-9)


def test_bad_arguments_are_refused():
    model = Bigram(_table(0))
    with pytest.raises(ValueError, match="new_tokens must be >= 1"):
        text_agreement(CharTokenizer(), model, model, new_tokens=0)
    with pytest.raises(ValueError, match="no tokens for the prompt"):
        text_agreement(CharTokenizer(), model, model, prompt="")
