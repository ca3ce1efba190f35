"""Write a Gemma 3 (model-layout float tensors) as an F32 GGUF the way llama.cpp's converter
writes Gemma 3: gguf-py's GEMMA3 tensor names, RMSNorm weights stored as 1 + w, no output.weight
(tied), and every metadata key (hyper-parameters, tokenizer) copied from a source GGUF of the same
model. Used to hand an off-grid reference to llama.cpp's quantizer (quality_eval.py)."""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch


def write_f32_gguf(path: str, source_gguf: str, tensors: Dict[str, torch.Tensor], config) -> None:
    import gguf

    reader = gguf.GGUFReader(source_gguf)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(path, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    offset = np.float32(getattr(config, "norm_offset", 1.0))
    for name, value in tensors.items():
        if name == "lm_head.weight":
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"{name}: no GGUF name in gguf-py's GEMMA3 table")
        data = value.detach().float().numpy()
        if base.endswith("norm"):
            data = data + offset
        writer.add_tensor(gguf_name + ".weight", np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
