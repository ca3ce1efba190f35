"""What the mlx-lm namings share."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Union

import torch

from llmq.quant.formats import GroupQuantizedWeight
from llmq.quant.formats.mx import MXWeight
from llmq.quant.formats.nvfp4 import NVFP4Weight

Value = Union[torch.Tensor, GroupQuantizedWeight]


def split_rows(value: Value, start: int, stop: int) -> Value:
    """Rows [start, stop) of a (possibly stacked) weight, along the output axis (-2); exact."""
    if isinstance(value, MXWeight):
        return dataclasses.replace(value, codes=value.codes[..., start:stop, :].contiguous(),
                                   scale_e8m0=value.scale_e8m0[..., start:stop, :].contiguous(),
                                   shape=tuple(value.shape[:-2]) + (stop - start, value.shape[-1]))
    if isinstance(value, NVFP4Weight):  # the global scale (one per expert) covers every row: kept
        return dataclasses.replace(value, codes=value.codes[..., start:stop, :].contiguous(),
                                   block_scale=value.block_scale[..., start:stop, :].contiguous(),
                                   shape=tuple(value.shape[:-2]) + (stop - start, value.shape[-1]))
    if isinstance(value, GroupQuantizedWeight):
        shape = tuple(value.shape[:-2]) + (stop - start, value.shape[-1])
        return GroupQuantizedWeight(
            qdata=value.qdata[..., start:stop, :].contiguous(),
            scale=value.scale[..., start:stop, :].contiguous(),
            bias=value.bias[..., start:stop, :].contiguous(),
            bits=value.bits, group_size=value.group_size, shape=shape, dtype=value.dtype,
        )
    return value[..., start:stop, :].contiguous()


def text_section(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's part of a config.json: its ``text_config`` where it has one, else all of it."""
    return hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else hf_config


def copied(c: Any, *names: str) -> Dict[str, Any]:
    """The model config's attributes `names` as config.json entries of the same names, in this order."""
    return {name: getattr(c, name) for name in names}


def special_token_ids(hf_config: Mapping[str, Any], text: Mapping[str, Any]) -> Dict[str, Any]:
    """eos/bos/pad token ids for mlx-lm's config.json: the top-level config's, else its text config's."""
    out = {}
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = hf_config.get(key, text.get(key))
        if value is not None:
            out[key] = value
    return out
