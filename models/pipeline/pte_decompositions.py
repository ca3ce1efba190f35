"""Decompositions applied before ExecuTorch lowering, for ops that are not core ATen.

`aten.linalg_solve_triangular` (the gated delta rule's chunk solve, models/qwen/delta_rule.py) has no
ExecuTorch kernel and no core-ATen decomposition in torch 2.13, so `to_edge` rejects the Qwen3.5-MoE
program. `solve_triangular` below replaces it by the inverse of A built by block doubling, then one
matmul with B, using only multiplication, subtraction, matmul and constant masks:

    A's diagonal blocks of size s, inverted: I_1 = diag(1/a_ii) (the identity when unitriangular);
    I_2s = I_s - I_s C_s I_s, with C_s the part of A in a diagonal 2s-block but outside the s-blocks.

For a 2s-block [[P, 0], [Q, R]] (or [[P, Q], [0, R]]) that is exactly its inverse [[P^-1, 0],
[-R^-1 Q P^-1, R^-1]], so after ceil(log2 n) steps I_s is A^-1 (any n: the last block may be short).
Exact in exact arithmetic; in floating point each step adds two inner products of length <= n, so
|I - A^-1| <= gamma_{2n ceil(log2 n)} |A^-1||A||A^-1| to first order (the test checks that bound).
Why not row-by-row substitution: its n unrolled steps made lowering the tiny Qwen take minutes (one
64-row solve: 52 s of CPU in to_edge + XNNPACK); this is 4 nodes per doubling, 6 for the delta rule's 64.
"""

from __future__ import annotations

import math
from typing import Dict

import torch


def _constants(n: int, upper: bool, dtype, device) -> tuple:
    """(identity, [mask of C_s for s = 1, 2, 4, ... < n]): C_s inside one 2s-block, outside the s-blocks, in A's
    triangle. Built from arange, floor division and comparisons (core ATen, so they lower as they are)."""
    i = torch.arange(n, device=device)
    row, col = i[:, None], i[None, :]
    triangle = col > row if upper else col < row
    masks, s = [], 1
    while s < n:
        same_2s = torch.div(row, 2 * s, rounding_mode="floor") == torch.div(col, 2 * s, rounding_mode="floor")
        same_s = torch.div(row, s, rounding_mode="floor") == torch.div(col, s, rounding_mode="floor")
        masks.append((same_2s & (~same_s) & triangle).to(dtype))
        s *= 2
    return (row == col).to(dtype), masks


def triangular_inverse(a: torch.Tensor, *, upper: bool, unitriangular: bool = False) -> torch.Tensor:
    """A^-1 of the triangle of a [..., n, n] (the other triangle ignored; the diagonal too when unitriangular)."""
    n = a.shape[-1]
    eye, masks = _constants(n, upper, a.dtype, a.device)
    if unitriangular:
        inv = eye.expand(a.shape)
    else:
        inv = eye / (a * eye).sum(-1, keepdim=True)  # diag(1 / a_ii)
    for mask in masks:
        inv = inv - inv @ (a * mask) @ inv
    return inv


def solve_triangular(a: torch.Tensor, b: torch.Tensor, *, upper: bool, left: bool = True,
                     unitriangular: bool = False) -> torch.Tensor:
    """torch.linalg.solve_triangular(a, b, upper=..., left=..., unitriangular=...) as A^-1 B (left) or B A^-1.

    a: [..., n, n]; b: [..., n, k] (left) or [..., k, n] (right). Batch dimensions broadcast."""
    inv = triangular_inverse(a, upper=upper, unitriangular=unitriangular)
    return inv @ b if left else b @ inv


def doubling_steps(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def _solve_triangular_decomposition(a, b, *, upper, left=True, unitriangular=False):
    return solve_triangular(a, b, upper=upper, left=left, unitriangular=unitriangular)


def pte_decompositions() -> Dict:
    """The decomposition table applied to a program before ExecuTorch lowering (ExportedProgram.run_decompositions)."""
    return {torch.ops.aten.linalg_solve_triangular.default: _solve_triangular_decomposition}


def decompose_for_pte(program: "torch.export.ExportedProgram") -> "torch.export.ExportedProgram":
    """`program` with the ops above decomposed; programs without them come back unchanged (same object)."""
    targets = set(pte_decompositions())
    if not any(n.op == "call_function" and n.target in targets for n in program.graph.nodes):
        return program
    return program.run_decompositions(pte_decompositions())
