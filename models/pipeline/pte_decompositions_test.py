"""models/pipeline/pte_decompositions.py: triangular solves by block-doubling inversion, vs torch.linalg.solve_triangular.

Needs no executorch: the decomposition is plain torch, applied to a program before lowering.

Bound, componentwise, to first order in u (the unit roundoff; gamma_m = m u / (1 - m u)): each of the
L = ceil(log2 n) doubling steps I <- I - I C I adds two inner products of length <= n, so the computed inverse
has |I - A^-1| <= gamma_{2nL} |A^-1||A||A^-1|; the product with B adds gamma_n |A^-1||B|; rounding A and B to
float32 adds u |A^-1| (|A||X| + |B|). Checked in float32 against the float64 solution.
"""

import pytest
import torch

from models.pipeline.pte_decompositions import decompose_for_pte, doubling_steps, solve_triangular


def _system(n, upper, unit, batch=(2, 3), seed=0, dtype=torch.float64):
    """A triangular system like the delta rule's: I + a strictly triangular part of entries ~ b (k_i . k_j) decay,
    unit-norm keys in 128 dimensions and b, decay in (0, 1): about 0.1 in size."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, n, n, generator=g, dtype=torch.float64) * 0.1
    a = a.triu(1) if upper else a.tril(-1)
    diag = torch.ones(*batch, n, dtype=torch.float64) if unit else 1 + torch.rand(*batch, n, generator=g, dtype=torch.float64)
    a = a + torch.diag_embed(diag)
    return a.to(dtype)


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("unit", [True, False])
@pytest.mark.parametrize("n", [24, 64])  # a short last block; the delta rule's chunk
def test_matches_torch_solve_triangular(upper, left, unit, n):
    k = 5
    a = _system(n, upper, unit)
    if unit:  # the diagonal must be ignored, as torch does: put garbage there
        a = a + torch.diag_embed(torch.full(a.shape[:-1], 7.0, dtype=a.dtype))
    g = torch.Generator().manual_seed(1)
    b = torch.randn(2, 3, n, k, generator=g, dtype=torch.float64) if left else torch.randn(2, 3, k, n, generator=g, dtype=torch.float64)
    ref = torch.linalg.solve_triangular(a, b, upper=upper, left=left, unitriangular=unit)
    got = solve_triangular(a, b, upper=upper, left=left, unitriangular=unit)
    # float64 both ways: the same solution up to a few roundings of float64
    assert (got - ref).abs().max() <= 1e-12 * ref.abs().max()

    # float32 substitution within Higham's componentwise bound around the float64 solution
    got32 = solve_triangular(a.float(), b.float(), upper=upper, left=left, unitriangular=unit).double()
    a_eff = a.clone()
    if unit:
        a_eff.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    u = 2.0**-24
    gamma = lambda m: m * u / (1 - m * u)  # noqa: E731
    inv = torch.linalg.inv(a_eff).abs()
    inv_a_inv = inv @ a_eff.abs() @ inv
    steps = doubling_steps(n)
    if left:
        computed = gamma(2 * n * steps) * (inv_a_inv @ b.abs()) + gamma(n) * (inv @ b.abs())
        inputs = u * (inv @ (a_eff.abs() @ ref.abs() + b.abs()))  # A and B rounded to float32
    else:  # X = B A^-1
        computed = gamma(2 * n * steps) * (b.abs() @ inv_a_inv) + gamma(n) * (b.abs() @ inv)
        inputs = u * ((ref.abs() @ a_eff.abs() + b.abs()) @ inv)
    bound = (computed + inputs) * (1 + 1e-3)  # + second-order terms
    assert bool(((got32 - ref).abs() <= bound).all()), ((got32 - ref).abs() / bound).max()
    assert bound.max() < 1e-2 * ref.abs().max()


def test_batch_broadcasts_like_torch():
    a = _system(8, upper=False, unit=True, batch=(3,))
    b = torch.randn(2, 1, 8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref = torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)
    got = solve_triangular(a, b, upper=False, unitriangular=True)
    assert got.shape == ref.shape == (2, 3, 8, 4)
    assert (got - ref).abs().max() <= 1e-12 * ref.abs().max()


class _DeltaRuleSolve(torch.nn.Module):
    def forward(self, a, b):
        return torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True) + 1


def test_decompose_for_pte_removes_the_op_and_keeps_the_function():
    a, b = _system(16, upper=False, unit=True, dtype=torch.float32), torch.randn(2, 3, 16, 4)
    program = torch.export.export(_DeltaRuleSolve(), (a, b), strict=False)
    targets = lambda p: {n.target for n in p.graph.nodes if n.op == "call_function"}  # noqa: E731
    assert torch.ops.aten.linalg_solve_triangular.default in targets(program)
    # torch's own core-ATen decomposition (what to_edge runs) keeps the op, for which ExecuTorch has no kernel
    assert torch.ops.aten.linalg_solve_triangular.default in targets(program.run_decompositions())
    decomposed = decompose_for_pte(program)
    assert torch.ops.aten.linalg_solve_triangular.default not in targets(decomposed)
    # after it, only core-ATen ops remain (what ExecuTorch's kernels and XNNPACK run)
    core = targets(decomposed.run_decompositions())
    assert all(torch.Tag.core in t.tags for t in core if isinstance(t, torch._ops.OpOverload)), core
    ref = torch.linalg.solve_triangular(a.double(), b.double(), upper=False, unitriangular=True) + 1
    got = decomposed.module()(a, b).double()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_programs_without_the_op_are_left_alone():
    program = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),), strict=False)
    assert decompose_for_pte(program) is program
