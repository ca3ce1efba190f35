"""GGUF <-> HF names checked against gguf-py's own tensor-name mapping (an independent reference)."""

import gguf

from models.gemma4.keymap import GGUF_TO_HF


def test_gguf_names_agree_with_gguf_py():
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, 8)
    for gguf_name, hf_name in GGUF_TO_HF.items():
        hf = hf_name.format(L=5)
        expected = table.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert expected is not None, hf
        mine = gguf_name.format(L=5)
        assert mine == expected or mine == expected + ".weight", (hf, mine, expected)
