"""Smoke test of the installed llmq-quant wheel, run by .ci/run outside the source tree (python -I).

It asserts that `llmq` and both C++ kernels come from the installed wheel (llmq/_kernels/, not a fallback,
not the checkout), quantizes a small safetensors checkpoint that it writes itself into a bundle and reads it
back, checking every element against round-to-nearest's bound (|w - dequantized| <= step/2 per group), and
runs the MoE op against its float64 reference with the tolerance of python/llmq/ops/moe_op_test.py.
Prints one line per check and "smoke: N checks passed" last; exits non-zero at the first failure.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from safetensors.torch import save_file

import llmq
from llmq.checkpoint import iter_checkpoint, load_bundle, save_bundle
from llmq.ops import kernel_route, load_kernel, moe_reference, pack_moe_experts, quantized_moe_ffn
from llmq.ops.moe_testing import random_moe
from llmq.quant import _native, dequantize, get_preset, quantize_stream
from llmq.quant.formats import GroupQuantizedWeight

EPS32 = torch.finfo(torch.float32).eps
passed = 0


def check(ok: bool, what: str) -> None:
    global passed
    if not ok:
        print(f"FAILED: {what}", flush=True)
        sys.exit(f"smoke: failed after {passed} checks passed")
    passed += 1
    print(f"ok: {what}", flush=True)


def kernels_from_the_wheel() -> None:
    package = os.path.dirname(os.path.abspath(llmq.__file__))
    check("site-packages" in package, f"llmq imported from the installed wheel ({package})")
    kernels = os.path.join(package, "_kernels")
    check(_native.native_kernel_available(), f"quant kernel loaded (error: {_native.native_kernel_error()})")
    quant_file = os.path.realpath(_native._load().__file__)
    check(quant_file.startswith(kernels), f"quant kernel from the wheel ({quant_file})")
    moe_file = os.path.realpath(load_kernel().__file__)
    check(moe_file.startswith(kernels), f"MoE kernel from the wheel ({moe_file})")
    check(bool(torch.ops.llmq.quantized_moe_ffn_available()), "MoE op's C++ CPU kernel registered with torch")


def quantize_a_checkpoint(workdir: str) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 512, generator=gen).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(128, 256, generator=gen),
        "model.layers.0.input_layernorm.weight": torch.ones(256),
    }
    src = os.path.join(workdir, "model.safetensors")
    save_file(tensors, src)
    recipe = get_preset("int4")
    out = os.path.join(workdir, "bundle")
    save_bundle(quantize_stream(iter_checkpoint(src), recipe), out, recipe=recipe)
    back = load_bundle(out)
    check(set(back) == set(tensors), f"bundle holds every tensor ({sorted(back)})")
    for name, w in tensors.items():
        got = back[name]
        if w.dim() == 1:
            check(torch.equal(got, w), f"{name}: kept as written")
            continue
        check(isinstance(got, GroupQuantizedWeight) and got.bits == 4, f"{name}: quantized to int4 groups")
        deq = dequantize(got, torch.float32)
        step = got.scale.float().repeat_interleave(got.group_size, dim=-1).abs()
        err = (w.float() - deq).abs()
        check(bool((err <= step / 2 * (1 + 1e-5) + 1e-12).all()),
              f"{name}: every element within half a step (max err/step {float((err / step).max()):.3f})")


def moe_op() -> None:
    e, d, f, top_k, bits, gs = 8, 128, 64, 2, 4, 32
    router, w13, w2, _ = random_moe(e, d, f, bits, gs, seed=3)
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(4))
    packed = pack_moe_experts(w13, w2)
    out = quantized_moe_ffn(x, router, None, packed.w13_qdata, packed.w13_sb, packed.w2_qdata, packed.w2_sb,
                            top_k, bits, gs, num_threads=2)
    idx, _ = kernel_route(x, router, None, packed, top_k)  # the reference takes the kernel's expert choice
    ref, mag, flip = moe_reference(x, router, None, w13, w2, top_k, selected=idx, return_bounds=True)
    groups = d // gs + f // gs
    tol = 4 * (groups + top_k + 8) * EPS32 * mag + 2 * flip + 1e-30
    err = (out.double() - ref).abs()
    check(bool(torch.isfinite(out).all() and (err <= tol).all()),
          f"MoE op equals its float64 reference within the arithmetic's bound (worst err/tol {float((err / tol).max()):.3g})")


def main() -> None:
    kernels_from_the_wheel()
    with tempfile.TemporaryDirectory(prefix="llmq-wheel-smoke-") as workdir:
        quantize_a_checkpoint(workdir)
    moe_op()
    print(f"smoke: {passed} checks passed")


if __name__ == "__main__":
    main()
