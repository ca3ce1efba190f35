"""Decompositions applied before ExecuTorch lowering, for ops that are not core ATen.

`aten.linalg_solve_triangular` (the gated delta rule's chunk solve, models/qwen/delta_rule.py) has no
ExecuTorch kernel and no core-ATen decomposition in torch 2.13, so `to_edge` rejects the Qwen3.5-MoE
program. `solve_triangular` below replaces it by substitution over the rows (forward for lower
triangular systems, backward for upper), built only from slicing, multiplication, subtraction and
division: the textbook algorithm, exact up to float rounding (each x_i is b_i minus a sum of products,
as in LAPACK's trsm, in a different summation order). It unrolls one step per row of A (n slices, n
multiply-subtracts), so it suits the small fixed chunk sizes the delta rule uses (64).
"""

from __future__ import annotations

from typing import Dict

import torch


def solve_triangular(a: torch.Tensor, b: torch.Tensor, *, upper: bool, left: bool = True,
                     unitriangular: bool = False) -> torch.Tensor:
    """torch.linalg.solve_triangular(a, b, upper=..., left=..., unitriangular=...) by substitution.

    a: [..., n, n]; b: [..., n, k] (left) or [..., k, n] (right). Batch dimensions broadcast."""
    if not left:  # X A = B  <=>  A^T X^T = B^T, and A^T is triangular the other way
        return solve_triangular(a.transpose(-1, -2), b.transpose(-1, -2), upper=not upper,
                                unitriangular=unitriangular).transpose(-1, -2)
    n = a.shape[-1]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = a.expand(*batch, n, n)
    residual = b.expand(*batch, *b.shape[-2:])
    order = range(n - 1, -1, -1) if upper else range(n)
    rows = [None] * n
    # Column-oriented substitution: once x_j is final, remove its contribution from every later row.
    for step, j in enumerate(order):
        x_j = residual[..., j:j + 1, :]
        if not unitriangular:
            x_j = x_j / a[..., j:j + 1, j:j + 1]
        rows[j] = x_j
        if step == n - 1:
            break
        if upper:  # rows above j
            residual = torch.cat([residual[..., :j, :] - a[..., :j, j:j + 1] * x_j, residual[..., j:, :]], dim=-2)
        else:      # rows below j
            residual = torch.cat([residual[..., :j + 1, :], residual[..., j + 1:, :] - a[..., j + 1:, j:j + 1] * x_j],
                                 dim=-2)
    return torch.cat(rows, dim=-2)


def _solve_triangular_decomposition(a, b, *, upper, left=True, unitriangular=False):
    return solve_triangular(a, b, upper=upper, left=left, unitriangular=unitriangular)


def pte_decompositions() -> Dict:
    """The decomposition table applied to a program before ExecuTorch lowering (ExportedProgram.run_decompositions)."""
    return {torch.ops.aten.linalg_solve_triangular.default: _solve_triangular_decomposition}


def decompose_for_pte(program: "torch.export.ExportedProgram") -> "torch.export.ExportedProgram":
    """`program` with the ops above decomposed; programs without them come back unchanged (same object)."""
    targets = set(pte_decompositions())
    if not any(node.op == "call_function" and node.target in targets for node in program.graph.nodes):
        return program
    return program.run_decompositions(pte_decompositions())
