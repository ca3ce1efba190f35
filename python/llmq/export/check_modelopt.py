"""Compare our FP quantizers with nvidia-modelopt's own, on the same weights (a manual check).

nvidia-modelopt pulls a CUDA torch, so it is not installed in the project's .venv. Run it from
a separate environment that sees the project's packages, e.g.:

    python -m venv --system-site-packages /tmp/modelopt-venv
    echo /work/main/.venv/lib/python3.11/site-packages > /tmp/modelopt-venv/lib/python3.11/site-packages/llmq.pth
    /tmp/modelopt-venv/bin/pip install --no-deps nvidia-modelopt omegaconf nvidia-ml-py pulp
    PYTHONPATH=python /tmp/modelopt-venv/bin/python python/llmq/export/check_modelopt.py

It prints, per format, whether scale bytes are identical and how many element codes differ
(ignoring the sign of zero). Expected: NVFP4, MXFP8 and FP8 identical (FP8: see the note on ModelOpt's bf16 quotient in
main); MXFP4 differs only
where an element lies exactly half-way between two E2M1 values, because ModelOpt's MXFP4
cast rounds those ties down while the OCP spec (and ModelOpt's own NVFP4 cast, and we)
round them to even.
"""

from __future__ import annotations

import sys

import torch

from llmq.quant.codecs import e8m0_decode, unpack_fp4
from llmq.quant.formats.fp8 import quantize_fp8
from llmq.quant.formats.mx import quantize_mx
from llmq.quant.formats.nvfp4 import quantize_nvfp4


def _tie_mask(x: torch.Tensor, block: int, scale: torch.Tensor) -> torch.Tensor:
    """Elements whose scaled magnitude is exactly an E2M1 midpoint (where rounding rules differ)."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    v = (x.float().reshape(*x.shape[:-1], -1, block) / scale.unsqueeze(-1)).abs()
    return (v.unsqueeze(-1) == mids).any(-1).reshape(x.shape)


def _differing_codes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mask of differing 4-bit codes, treating codes 0 and 8 (+0 / -0) as equal."""
    ua, ub = unpack_fp4(a), unpack_fp4(b)
    ua = torch.where(ua == 8, torch.zeros_like(ua), ua)
    ub = torch.where(ub == 8, torch.zeros_like(ub), ub)
    return ua != ub


def main() -> int:
    try:
        import modelopt
        from modelopt.torch.quantization.qtensor import FP8QTensor, MXFP4QTensor, MXFP8QTensor, NVFP4QTensor
    except ImportError as e:  # pragma: no cover - a manual tool
        print(f"nvidia-modelopt is not importable here ({e}); see this file's docstring")
        return 2
    print(f"nvidia-modelopt {modelopt.__version__}, torch {torch.__version__}")
    g = torch.Generator().manual_seed(0)
    ok = True
    for shape in [(256, 512), (3, 64, 256), (1024, 2048)]:
        w = (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g))).to(torch.bfloat16)
        w.view(-1)[:64] = 0  # all-zero blocks
        w2 = w.reshape(-1, shape[-1])

        # NVFP4 (per-tensor global scale over the whole 2-D view)
        theirs, s_theirs, s2_theirs = NVFP4QTensor.quantize(w2.clone(), 16)
        ours = quantize_nvfp4(w2)
        same_scale = torch.equal(ours.block_scale.view(torch.uint8), s_theirs.view(torch.uint8)) and ours.global_scale.item() == s2_theirs.float().item()
        diff = int(_differing_codes(ours.codes, theirs._quantized_data).sum())
        print(f"NVFP4 {list(w2.shape)}: scales identical={same_scale}"
              f", weight_scale_2 ours={ours.global_scale.item():.9g} theirs={s2_theirs.float().item():.9g}, differing codes={diff}")
        ok &= same_scale and diff == 0

        # MXFP4
        theirs, e_theirs = MXFP4QTensor.quantize(w2.clone(), 32)
        ours = quantize_mx(w2, "mxfp4")
        same_scale = torch.equal(ours.scale_e8m0.reshape(-1), e_theirs.reshape(-1))
        differ = _differing_codes(ours.codes, theirs._quantized_data.reshape(ours.codes.shape))
        ties = _tie_mask(w2, 32, e8m0_decode(ours.scale_e8m0))
        off_tie = int((differ & ~ties).sum())
        print(f"MXFP4 {list(w2.shape)}: scales identical={same_scale}, differing codes={int(differ.sum())}, "
              f"of which not at an E2M1 midpoint: {off_tie} (midpoint elements: {int(ties.sum())})")
        ok &= same_scale and off_tie == 0

        # MXFP8
        theirs, e_theirs = MXFP8QTensor.quantize(w2.clone())
        ours = quantize_mx(w2, "mxfp8")
        same_scale = torch.equal(ours.scale_e8m0.reshape(-1), e_theirs.reshape(-1))
        diff = int((ours.codes != theirs._quantized_data.view(torch.uint8).reshape(ours.codes.shape)).sum())
        print(f"MXFP8 {list(w2.shape)}: scales identical={same_scale}, differing bytes={diff}")
        ok &= same_scale and diff == 0

        # FP8 per tensor, with the scale ModelOpt's HF export uses (amax.float() / 448). ModelOpt
        # then divides the bf16 weight by that 0-dim float32 scale, which PyTorch evaluates in
        # bf16, so the quotient is rounded to bf16 before e4m3 (a double rounding); we round the
        # float32 quotient once. On a float32 copy of the weight the two must agree exactly.
        scale = w2.float().abs().amax() / 448.0
        ours = quantize_fp8(w2, "tensor")
        t32, s32 = FP8QTensor.quantize(w2.float(), scales=scale)
        t16, _ = FP8QTensor.quantize(w2.clone(), scales=scale)
        same_scale = ours.scale.item() == s32.float().item()
        diff32 = int((ours.data.view(torch.uint8) != t32._quantized_data.view(torch.uint8)).sum())
        v16 = t16._quantized_data.float()
        diff16 = int((ours.data.float() != v16).sum())
        # How far apart are the bf16-path codes? Count those more than one e4m3 step away.
        step = (ours.data.view(torch.uint8).to(torch.int16) - t16._quantized_data.view(torch.uint8).to(torch.int16)).abs()
        far = int((step > 1).sum())
        print(f"FP8 {list(w2.shape)}: scale identical={same_scale}, differing bytes on float32 input={diff32}; "
              f"with ModelOpt's bf16 quotient: {diff16} differ, {far} by more than one e4m3 step")
        ok &= same_scale and diff32 == 0 and far == 0
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
