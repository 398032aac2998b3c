"""Rule sweep, GEMMs: linear/mm/matmul/addmm with the weight an ``nn.Parameter`` of the
tiny module (Algorithm 1's layouts, normal and transposed), and products of two
activations (bmm, matmul, mm). See ``rules_sweep.py``."""
from __future__ import annotations

import pytest
import rules_sweep as S
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.sweep  # and slow, but for the fast tier's slice (rules_sweep)

_SPECS: list[S.OpSpec] | None = None
MESHES = ("x2", "y2", "x2y2", "z2", "d2")


def specs() -> list[S.OpSpec]:
    global _SPECS
    if _SPECS is not None:
        return _SPECS
    g = S.gen(5)
    x = lambda *s: S._t(s, g)  # noqa: E731

    def Mx(name, fn, *inputs, params=None, meshes=MESHES):
        return S.OpSpec("matrix", name, fn, tuple(inputs), params=params or {}, meshes=meshes)

    LA = ("d2", "x2", "z2d2")

    def spd(a):
        return a @ a.transpose(-1, -2) + 3 * torch.eye(a.shape[-1], dtype=a.dtype)

    W = {"weight": S._t((8, 8), g), "bias": S._t((8,), g)}
    Wkn = {"weight": S._t((8, 4), g)}
    Wkn_b = {"weight": S._t((8, 4), g), "bias": S._t((4,), g)}
    _SPECS = [
        Mx("linear", lambda m, a: F.linear(a, m.weight, m.bias), x(4, 8), params=W),
        Mx("linear.nobias", lambda m, a: F.linear(a, m.weight), x(4, 8), params={"weight": W["weight"]}),
        Mx("linear.3d", lambda m, a: F.linear(a, m.weight, m.bias), x(4, 2, 8), params=W,
           meshes=("x2", "y2", "x2y2", "z2d2")),
        Mx("mm", lambda m, a: torch.mm(a, m.weight), x(4, 8), params=Wkn),
        Mx("matmul", lambda m, a: torch.matmul(a, m.weight), x(4, 2, 8), params=Wkn,
           meshes=("x2", "y2", "x2y2", "d2")),
        Mx("addmm", lambda m, a: torch.addmm(m.bias, a, m.weight), x(4, 8), params=Wkn_b),
        Mx("bmm", lambda m, a, b: torch.bmm(a, b), x(2, 4, 6), x(2, 6, 4),
           meshes=("x2", "y2", "z2", "x2y2")),
        Mx("matmul.act", lambda m, a, b: torch.matmul(a, b), x(2, 2, 4, 6), x(2, 2, 6, 4),
           meshes=("x2", "d2", "x2y2")),
        Mx("mm.act", lambda m, a, b: torch.mm(a, b), x(4, 6), x(6, 4), meshes=("y2", "z2")),
        # a solve, factorisation or decomposition per sample (spd(a): a well-conditioned
        # symmetric positive definite stack made from the input)
        Mx("linalg.solve", lambda m, a, b: torch.linalg.solve(spd(a), b), x(4, 3, 3), x(4, 3, 2),
           meshes=LA),
        Mx("linalg.cholesky", lambda m, a: torch.linalg.cholesky(spd(a)), x(4, 3, 3), meshes=LA),
        Mx("linalg.inverse", lambda m, a: torch.inverse(spd(a)), x(4, 3, 3), meshes=LA),
        Mx("linalg.slogdet", lambda m, a: torch.linalg.slogdet(spd(a))[1], x(4, 3, 3), meshes=LA),
        Mx("linalg.det", lambda m, a: torch.linalg.det(spd(a)), x(4, 3, 3), meshes=LA),
        Mx("linalg.eigvalsh", lambda m, a: torch.linalg.eigvalsh(spd(a)), x(4, 3, 3), meshes=LA),
        Mx("linalg.svdvals", lambda m, a: torch.linalg.svdvals(a), x(4, 3, 3), meshes=LA),
        Mx("linalg.solve_triangular", lambda m, a, b: torch.linalg.solve_triangular(
            torch.linalg.cholesky(spd(a)), b, upper=False), x(4, 3, 3), x(4, 3, 2), meshes=LA),
        Mx("linalg.matrix_exp", lambda m, a: torch.linalg.matrix_exp(a * 0.3), x(4, 3, 3), meshes=LA),
        # a weight computed in forward (weight_norm, a packed projection's piece, a
        # hypernetwork's output): used whole, each rank multiplies its own rows
        Mx("linear.weight_norm", lambda m, a: F.linear(a, m.weight / m.weight.norm(dim=1, keepdim=True),
                                                       m.bias), x(4, 2, 8), params=W, meshes=LA + ("x2y2",)),
        Mx("linear.weight_piece", lambda m, a: F.linear(a, m.weight.split([3, 5])[1]), x(4, 8),
           params={"weight": W["weight"]}, meshes=LA),
        Mx("linear.weight_input", lambda m, a, w_: F.linear(a, w_), x(4, 8), x(3, 8), meshes=LA),
        Mx("addmm.weight_input", lambda m, a, w_, b_: torch.addmm(b_, a, w_), x(4, 8), x(8, 3), x(3),
           meshes=LA),
        # pairwise distances: the batch and a's rows keep their cuts, b whole
        Mx("cdist", lambda m, a, b: torch.cdist(a, b), x(4, 3, 5), x(4, 2, 5), meshes=LA + ("x2y2",)),
        Mx("cdist.2d_p1", lambda m, a, b: torch.cdist(a, b, p=1.0), x(4, 5), x(3, 5), meshes=LA),
        # one matrix (a parameter's): whole on every rank
        Mx("linalg.inverse_one", lambda m, a: a @ torch.inverse(spd(m.weight[None]))[0], x(4, 3),
           params={"weight": x(3, 3)}, meshes=("d2", "x2")),
    ]
    return _SPECS


CASES, sweep_world, test_rule = S.threaded_family("matrix", specs)
