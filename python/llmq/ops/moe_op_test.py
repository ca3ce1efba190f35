"""quantized_moe_ffn against the float64 reference of the same quantized math.

Tolerance (from the arithmetic): the kernel sums, per output, G2 group terms per expert,
top_k experts and the shared expert in fp32, and the w13 stage's fp32 error can move the
int8 scale of h by a few ulps: |err| <= 4 * (G13 + G2 + top_k + 8) * eps32 * sum|terms|.
h is requantized to int8, so an fp32-vs-float64 difference in h can flip one rounding: the
reference reports the size of one such flip per output and two are allowed.
"""

import os

import pytest
import torch

from llmq.ops import kernel_route, moe_reference, pack_moe_experts, quantized_moe_ffn, route_reference, set_kernel_isa
from llmq.ops.moe_op import set_kernel_schedule
from llmq.ops.moe_testing import random_group_quantized, random_moe
from llmq.ops.packing import pack_matrix_tiles, pack_with_kernel, unpack_matrix_tiles
from llmq.quant.formats import unpack_bits

EPS32 = torch.finfo(torch.float32).eps


def single_threaded_torch(fn):
    """Run the eager reference with one torch thread: it is hundreds of tiny ops, and on a
    shared 2-core machine torch's OpenMP barriers stall when the other core is busy."""

    def wrapped(*args, **kwargs):
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(old)

    return wrapped


moe_reference = single_threaded_torch(moe_reference)
route_reference = single_threaded_torch(route_reference)


def op_args(x, router, bias, packed, top_k, score="softmax", route_scale=1.0, shared=None, gate=None, **kw):
    args = dict(x=x, router_weight=router, expert_bias=bias, w13_qdata=packed.w13_qdata, w13_sb=packed.w13_sb,
                w2_qdata=packed.w2_qdata, w2_sb=packed.w2_sb, top_k=top_k, bits=packed.bits,
                group_size=packed.group_size, score_func=score, route_scale=route_scale)
    if shared is not None:
        args.update(shared_w13_qdata=shared.w13_qdata, shared_w13_sb=shared.w13_sb, shared_w2_qdata=shared.w2_qdata,
                    shared_w2_sb=shared.w2_sb, shared_gate_weight=gate, shared_bits=shared.bits,
                    shared_group_size=shared.group_size)
    args.update(kw)
    return args


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 64), (8, 32), (8, 128)])
def test_packing_matches_written_spec(bits, gs):
    gen = torch.Generator().manual_seed(1)
    w = random_group_quantized((2, 32, 256), bits, gs, gen)
    qd, sb = pack_matrix_tiles(w)
    q = unpack_bits(w.qdata, bits, 256)
    steps, per = (gs // 8, 8) if bits == 4 else (gs // 4, 4)
    qd = qd.reshape(2, -1)
    for e, n, k in [(0, 0, 0), (1, 17, 5), (0, 31, 255), (1, 5, gs + 6), (0, 16, 3 * gs // 2 + 3)]:
        t, r, g = n // 16, n % 16, k // gs
        s, j = (k % gs) // per, (k % gs) % per
        if bits == 4:
            off = t * 16 * 256 // 2 + (g * steps + s) * 64 + r * 4 + (j % 4)
            got = (qd[e, off] >> 4) if j >= 4 else (qd[e, off] & 0xF)
        else:
            off = t * 16 * 256 + (g * steps + s) * 64 + r * 4 + j
            got = qd[e, off]
        assert got == q[e, n, k]
        assert sb[e, t, g * 32 + r] == w.scale[e, n, g] and sb[e, t, g * 32 + 16 + r] == w.bias[e, n, g]


@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 128), (8, 64)])
def test_cpp_packer_equals_torch_packer(bits, gs):
    w = random_group_quantized((3, 48, 256), bits, gs, torch.Generator().manual_seed(2))
    q1, sb1 = pack_matrix_tiles(w)
    q2, sb2 = pack_with_kernel(w)
    assert torch.equal(q1, q2) and torch.equal(sb1, sb2)


def test_pack_rejects_bad_layouts():
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match="INT4 or INT8"):
        pack_matrix_tiles(random_group_quantized((32, 64), 2, 32, gen))
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_matrix_tiles(random_group_quantized((32, 64), 4, 16, gen))
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_matrix_tiles(random_group_quantized((24, 64), 4, 32, gen))
    w13 = random_group_quantized((2, 64, 64), 4, 32, gen)
    with pytest.raises(ValueError, match="w2 must be"):
        pack_moe_experts(w13, random_group_quantized((2, 64, 64), 4, 32, gen))


# ---------------------------------------------------------------- correctness

CASES = [
    # score,    bias,  shared, T,   top_k, E,   D,   F,   bits, gs
    ("softmax", False, True, 1, 8, 256, 64, 32, 4, 32),
    ("softmax", False, False, 513, 8, 256, 64, 32, 4, 32),
    ("softmax", False, True, 513, 1, 4, 128, 64, 8, 64),
    ("sigmoid", True, True, 1, 8, 256, 64, 32, 8, 32),
    ("sigmoid", True, False, 513, 8, 256, 64, 32, 4, 32),
    ("sigmoid", False, True, 37, 4, 4, 256, 128, 4, 128),
    ("sigmoid", True, True, 9, 1, 4, 256, 128, 8, 128),
    ("softmax", False, True, 64, 3, 16, 128, 64, 4, 64),
]


def check_against_reference(out, x, router, bias, w13, w2, top_k, score, route_scale, shared, idx):
    s13, s2, gate = shared if shared else (None, None, None)
    ref, mag, flip = moe_reference(x, router, bias, w13, w2, top_k, score, route_scale, s13, s2, gate,
                                   selected=idx, return_bounds=True)
    g_total = w13.shape[-1] // w13.group_size + w2.shape[-1] // w2.group_size
    tol = 4 * (g_total + top_k + 8) * EPS32 * mag + 2 * flip + 1e-30
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all()
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} outputs off; worst err {err.max():.3g}, ratio {(err / tol).max():.3g}"
    return ref


def check_routing_is_a_valid_topk(x, router, bias, top_k, score, idx, wts, route_scale):
    """Kernel's selection == float64 top-k except where keys agree within fp32 rounding."""
    ref_idx, _, logits = route_reference(x, router, bias, top_k, score, route_scale)
    keys = logits if score == "softmax" else torch.sigmoid(logits) + (bias.double() if bias is not None else 0)
    chosen = torch.gather(keys, 1, idx.long())
    kth = torch.sort(keys, -1, descending=True).values[:, top_k - 1 : top_k]
    slack = 64 * EPS32 * (x.double().abs() @ router.double().abs().T).amax(-1, keepdim=True)
    assert (chosen >= kth - slack).all()
    assert (idx.long().sort(-1).values.unique_consecutive(dim=-1).shape[-1] == top_k) or top_k == 1
    assert torch.allclose(wts.double().sum(-1), torch.full((x.shape[0],), route_scale, dtype=torch.float64),
                          rtol=1e-5)


@pytest.mark.parametrize("score,use_bias,use_shared,T,top_k,E,D,F,bits,gs", CASES)
def test_matches_float64_reference(score, use_bias, use_shared, T, top_k, E, D, F, bits, gs):
    seed = hash((score, T, E, bits, gs)) % 1000
    router, w13, w2, shared = random_moe(E, D, F, bits, gs, seed=seed, shared_inter=F if use_shared else 0)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, D, generator=gen)
    bias = 0.3 * torch.randn(E, generator=gen) if use_bias else None
    route_scale = 2.5 if score == "sigmoid" else 1.0
    packed = pack_moe_experts(w13, w2)
    sp = pack_moe_experts(shared[0], shared[1]) if shared else None
    # two kernel threads whatever torch's setting: the multi-threaded schedule is what runs
    args = op_args(x, router, bias, packed, top_k, score, route_scale, sp, shared[2] if shared else None,
                   num_threads=2)
    out = quantized_moe_ffn(**args)
    old = set_kernel_schedule("by_columns" if T * top_k * D <= (1 << 21) else "by_expert")
    try:  # the other w2 schedule sums in the same order: identical bits
        assert torch.equal(out, quantized_moe_ffn(**args))
    finally:
        set_kernel_schedule(old)
    idx, wts = kernel_route(x, router, bias, packed, top_k, score, route_scale)
    check_routing_is_a_valid_topk(x, router, bias, top_k, score, idx, wts, route_scale)
    ref = check_against_reference(out, x, router, bias, w13, w2, top_k, score, route_scale, shared, idx)
    # the int8-activation contract stays close to weight-only quantized math (not a bound; a sanity check)
    plain = moe_reference(x, router, bias, w13, w2, top_k, score, route_scale,
                          *(shared if shared else (None, None, None)), act_quant=False, selected=idx)
    rel = (ref - plain).norm() / plain.norm()
    assert rel < 0.03


def _rounded_to_bf16(w):
    """The canonical weight whose scale and bias are the bfloat16-rounded ones (float32)."""
    from llmq.quant.formats import GroupQuantizedWeight

    return GroupQuantizedWeight(w.qdata, w.scale.to(torch.bfloat16).float(), w.bias.to(torch.bfloat16).float(),
                                w.bits, w.group_size, w.shape, w.dtype)


@pytest.mark.parametrize("bits,gs,T", [(4, 32, 1), (4, 128, 37), (8, 64, 513)])
def test_bf16_scale_bias_is_exactly_the_rounded_weights(bits, gs, T):
    """Compact bfloat16 scale/bias (pack_moe_experts(scale_dtype=torch.bfloat16)): bit for bit the
    op on float32-packed weights whose scales/biases were rounded to bfloat16 first, on every
    ISA path, and within the float64 reference bound of those rounded weights; half the sb bytes."""
    router, w13, w2, shared = random_moe(16, 256, 128, bits, gs, seed=21, shared_inter=128)
    x = torch.randn(T, 256, generator=torch.Generator().manual_seed(22))
    compact = pack_moe_experts(w13, w2, torch.bfloat16)
    compact_s = pack_moe_experts(shared[0], shared[1], torch.bfloat16)
    assert compact.w13_sb.dtype == torch.bfloat16 and compact_s.w2_sb.dtype == torch.bfloat16
    r13, r2, rs13, rs2 = (_rounded_to_bf16(w) for w in (w13, w2, shared[0], shared[1]))
    exact = pack_moe_experts(r13, r2)
    exact_s = pack_moe_experts(rs13, rs2)
    assert compact.nbytes < exact.nbytes
    assert compact.w13_sb.nbytes * 2 == exact.w13_sb.nbytes and compact.w2_sb.nbytes * 2 == exact.w2_sb.nbytes
    out = quantized_moe_ffn(**op_args(x, router, None, compact, 4, shared=compact_s, gate=shared[2], num_threads=2))
    want = quantized_moe_ffn(**op_args(x, router, None, exact, 4, shared=exact_s, gate=shared[2], num_threads=2))
    assert torch.equal(out, want)
    from llmq.ops.kernel_loader import load_kernel

    best = load_kernel().best_isa()
    for isa in ["scalar"] + (["avx2"] if best == "avx512_vnni" else []):
        old = set_kernel_isa(isa)
        try:
            assert torch.equal(out, quantized_moe_ffn(**op_args(x, router, None, compact, 4, shared=compact_s,
                                                                gate=shared[2])))
        finally:
            set_kernel_isa(old)
    idx, _ = kernel_route(x, router, None, compact, 4)
    check_against_reference(out, x, router, None, r13, r2, 4, "softmax", 1.0, (rs13, rs2, shared[2]), idx)
    # unpacking gives the rounded canonical weights back
    back = unpack_matrix_tiles(compact.w2_qdata, compact.w2_sb, bits, gs, tuple(w2.shape))
    assert torch.equal(back.scale, r2.scale) and torch.equal(back.bias, r2.bias)


def test_isa_paths_are_bitwise_identical():
    from llmq.ops.kernel_loader import load_kernel

    best = load_kernel().best_isa()  # on a CPU without AVX2 this compares the portable path with itself
    router, w13, w2, shared = random_moe(32, 256, 64, 4, 32, seed=5, shared_inter=64)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(6))
    packed, sp = pack_moe_experts(w13, w2), pack_moe_experts(shared[0], shared[1])
    args = op_args(x, router, None, packed, 4, "softmax", 1.0, sp, shared[2])
    fast = quantized_moe_ffn(**args)
    others = ["scalar"] + (["avx2"] if best == "avx512_vnni" else [])
    for isa in others:
        old = set_kernel_isa(isa)
        try:
            assert torch.equal(fast, quantized_moe_ffn(**args)), isa
        finally:
            set_kernel_isa(old)
    assert torch.equal(fast, quantized_moe_ffn(**args, num_threads=1))  # thread count changes nothing
    for schedule in ("by_expert", "by_columns"):  # both w2 work splits sum in the same order
        old = set_kernel_schedule(schedule)
        try:
            assert torch.equal(fast, quantized_moe_ffn(**args))
        finally:
            set_kernel_schedule(old)


def test_ties_choose_lower_index_and_nan_is_never_chosen():
    E, D, F = 8, 64, 32
    router, w13, w2, _ = random_moe(E, D, F, 4, 32, seed=7)
    router[5] = router[2]  # experts 2 and 5 always tie
    router[6] = router[3]
    router[1] = float("nan")  # NaN logits rank as -inf
    x = torch.randn(16, D, generator=torch.Generator().manual_seed(8))
    packed = pack_moe_experts(w13, w2)
    for score in ("softmax", "sigmoid"):
        idx, _ = kernel_route(x, router, None, packed, 4, score)
        ref_idx, _, _ = route_reference(x, router, None, 4, score)
        assert torch.equal(idx.long(), ref_idx)
        assert not (idx == 1).any()
        assert not ((idx == 5).any(-1) & ~(idx == 2).any(-1)).any()  # 5 only ever together with 2
    idx, _ = kernel_route(x, router, None, packed, E, "softmax")  # k = E: NaN expert comes last
    assert (idx[:, -1] == 1).all()


def test_experts_without_tokens_and_bf16_input():
    E, D, F = 64, 128, 64
    router, w13, w2, _ = random_moe(E, D, F, 4, 64, seed=9)
    bias = torch.zeros(E)
    bias[: E // 2] = -100.0  # the first half is never selected
    x = torch.randn(20, D, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    packed = pack_moe_experts(w13, w2)
    out = quantized_moe_ffn(**op_args(x, router, bias, packed, 2, "sigmoid"))
    assert out.dtype == torch.bfloat16
    idx, _ = kernel_route(x.float(), router, bias, packed, 2, "sigmoid")
    assert (idx >= E // 2).all()
    ref = moe_reference(x.float(), router, bias, w13, w2, 2, "sigmoid", selected=idx)
    # bf16 output: one rounding of relative 2^-8 on top of the fp32 result
    assert ((out.double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-3 * ref.abs().max()).all()


# ---------------------------------------------------------------- errors, fake kernel, export


def small_setup():
    router, w13, w2, shared = random_moe(4, 64, 32, 4, 32, seed=11, shared_inter=32)
    return router, pack_moe_experts(w13, w2), pack_moe_experts(shared[0], shared[1]), shared[2]


BAD = [
    ("top_k", dict(top_k=5), "top_k=5"),
    ("score", dict(score_func="tanh"), "score_func"),
    ("x dtype", dict(x=torch.randn(3, 64, dtype=torch.float64)), "x must be"),
    ("x shape", dict(x=torch.randn(3, 48)), "router_weight must be"),
    ("router dtype", dict(router_weight=torch.randn(4, 64, dtype=torch.bfloat16)), "router_weight"),
    ("group", dict(group_size=16), "multiple of 32"),
    ("group not dividing F", dict(group_size=64), "does not divide"),
    ("bits", dict(bits=8), "w13_qdata must be"),
    ("bias shape", dict(expert_bias=torch.zeros(5), score_func="sigmoid"), "expert_bias"),
    ("bias with softmax", dict(expert_bias=torch.zeros(4)), "sigmoid"),
    ("w2 dtype", dict(w2_sb=torch.zeros(4, 4, 32, dtype=torch.float16)), "w2_sb"),
    ("partial shared", dict(shared_w13_qdata=None), "all four"),
    ("mixed sb dtypes", dict(w2_sb=torch.zeros(4, 4, 32, dtype=torch.bfloat16)), "share a dtype"),
]


def test_tensors_on_different_devices_are_refused():
    """A meta router next to CPU activations dispatches to the fake kernel, which must refuse
    it rather than hand back an uninitialised CPU tensor."""
    router, packed, sp, gate = small_setup()
    args = op_args(torch.randn(3, 64), router.to("meta"), None, packed, 2, shared=sp, gate=gate)
    with pytest.raises(ValueError, match="router_weight is on meta but x on cpu"):
        quantized_moe_ffn(**args)


@pytest.mark.parametrize("name,change,match", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_fail_clearly_in_real_and_fake_kernel(name, change, match):
    router, packed, sp, gate = small_setup()
    args = op_args(torch.randn(3, 64), router, None, packed, 2, shared=sp, gate=gate)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        quantized_moe_ffn(**args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(ValueError, match=match):
            torch.ops.llmq.quantized_moe_ffn(**args)


def test_probe_and_the_cpp_side_checks_its_own_arguments():
    from llmq.ops.kernel_loader import load_kernel

    assert torch.ops.llmq.quantized_moe_ffn_available()
    router, packed, sp, gate = small_setup()
    x = torch.randn(3, 64)
    from llmq.ops.moe_op import _kernel_args

    args = _kernel_args(x, router, None, packed.w13_qdata, packed.w13_sb, packed.w2_qdata, packed.w2_sb, 2, 4, 32,
                        "softmax", 1.0, None, None, None, None, None, 4, 32, 0)
    out = torch.empty(3, 64)
    kernel = load_kernel()
    for key, value, match in [("top_k", 9, "top_k=9"), ("group_size", 48, "multiple of 32"),
                              ("intermediate", 24, "w2: group_size 32 does not divide K=24"), ("isa", "sse9", "unknown isa")]:
        bad = dict(args["dict"], **{key: value})
        with pytest.raises(ValueError, match=match):
            kernel.moe_ffn(bad, out.data_ptr())


def test_cpu_kernel_is_the_compiled_one_and_follows_the_forced_path():
    """The CPU kernel is the C++ one (no Python on the call path), and set_kernel_isa /
    set_kernel_schedule reach it (else the cross-path equality tests would compare a path
    with itself)."""
    from llmq.ops.kernel_loader import load_kernel

    cpu = [line for line in torch._C._dispatch_dump("llmq::quantized_moe_ffn").splitlines() if line.startswith("CPU:")]
    assert len(cpu) == 1 and "moe_torch_op.cc" in cpu[0], cpu
    kernel = load_kernel()
    start = kernel.op_settings()
    old = set_kernel_isa("scalar")
    try:
        assert kernel.op_settings()["isa"] == "scalar"
    finally:
        set_kernel_isa(old)
    old = set_kernel_schedule("by_columns")
    try:
        assert kernel.op_settings()["schedule"] == "by_columns"
    finally:
        set_kernel_schedule(old)
    assert kernel.op_settings() == start


def test_strided_inputs_give_the_contiguous_result():
    router, packed, sp, gate = small_setup()
    x = torch.randn(64, 5).T  # [5, 64], not contiguous
    args = op_args(x, router, None, packed, 2, shared=sp, gate=gate)
    want = quantized_moe_ffn(**dict(args, x=x.contiguous()))
    assert torch.equal(quantized_moe_ffn(**args), want)
    wide = torch.zeros(router.shape[0], 2 * router.shape[1])
    wide[:, ::2] = router  # a strided view of the same router
    assert torch.equal(quantized_moe_ffn(**dict(args, router_weight=wide[:, ::2])), want)


def test_fake_kernel_infers_shape_without_the_extension():
    router, packed, sp, gate = small_setup()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.llmq.quantized_moe_ffn(**op_args(torch.randn(7, 64, dtype=torch.bfloat16), router, None,
                                                         packed, 2, shared=sp, gate=gate))
    assert out.shape == (7, 64) and out.dtype == torch.bfloat16


def test_opcheck():
    router, packed, sp, gate = small_setup()
    for x in (torch.randn(5, 64), torch.randn(1, 64, dtype=torch.bfloat16)):
        args = op_args(x, router, None, packed, 2, shared=sp, gate=gate)
        torch.library.opcheck(torch.ops.llmq.quantized_moe_ffn.default, (), args)


def test_not_differentiable_output_never_requires_grad():
    """Autograd falls through: with grad-requiring inputs the result is the same tensor values,
    does not require grad, and backward fails loudly rather than returning no gradient."""
    router, packed, sp, gate = small_setup()
    x = torch.randn(3, 64, requires_grad=True)
    out = torch.ops.llmq.quantized_moe_ffn(**op_args(x, router.requires_grad_(True), None, packed, 2, shared=sp,
                                                     gate=gate))
    assert not out.requires_grad
    assert torch.equal(out, torch.ops.llmq.quantized_moe_ffn(**op_args(x.detach(), router.detach(), None, packed, 2,
                                                                       shared=sp, gate=gate)))
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()


class _Block(torch.nn.Module):
    def __init__(self, router, packed):
        super().__init__()
        self.router = router
        self.p = packed

    def forward(self, x):
        p = self.p
        return torch.ops.llmq.quantized_moe_ffn(x, self.router, None, p.w13_qdata, p.w13_sb, p.w2_qdata, p.w2_sb,
                                                2, p.bits, p.group_size)


def test_export_keeps_the_op():
    router, packed, _, _ = small_setup()
    t = torch.export.Dim("T", min=1, max=4096)
    ep = torch.export.export(_Block(router, packed), (torch.randn(6, 64),), dynamic_shapes=({0: t},))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.llmq.quantized_moe_ffn.default in targets
    x = torch.randn(9, 64)
    assert torch.equal(ep.module()(x), _Block(router, packed)(x))


def test_without_the_extension_the_schema_works_and_the_call_names_what_is_missing(tmp_path):
    """A fresh interpreter whose LLMQ_MOE_KERNEL names no file: importing llmq.ops still
    defines the op (the fake kernel traces), the probe says False, and a call raises
    MoEKernelUnavailable naming the variable and the path it gave."""
    import subprocess
    import sys

    script = """
import torch, llmq.ops
from torch._subclasses.fake_tensor import FakeTensorMode
from llmq.ops.moe_testing import random_moe
from llmq.ops import pack_moe_experts, MoEKernelUnavailable
router, w13, w2, _ = random_moe(4, 64, 32, 4, 32, seed=1)
p = pack_moe_experts(w13, w2)
args = (torch.randn(3, 64), router, None, p.w13_qdata, p.w13_sb, p.w2_qdata, p.w2_sb, 2, 4, 32)
with FakeTensorMode(allow_non_fake_inputs=True):
    assert torch.ops.llmq.quantized_moe_ffn(*args).shape == (3, 64)
assert not torch.ops.llmq.quantized_moe_ffn_available()
try:
    torch.ops.llmq.quantized_moe_ffn(*args)
except MoEKernelUnavailable as e:
    print("ERROR:", e)
"""
    env = dict(os.environ, LLMQ_MOE_KERNEL=str(tmp_path / "missing.so"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ERROR:" in proc.stdout and "LLMQ_MOE_KERNEL" in proc.stdout and "missing.so" in proc.stdout, proc.stdout
