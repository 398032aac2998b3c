"""shardc's grouped GEMM (runtime/grouped_gemm.py), which expert segments run in place of
transformers' fallback: the same products and gradients, in float64 against transformers'
own kernel, on weights as transformers hands them (a transposed view of [E, out, in]) and
contiguous, with an expert that gets no rows and rows past the last expert's end; and the
weight's gradient comes back in the weight's own layout."""
from __future__ import annotations

import pytest
import torch

from shardc.runtime.grouped_gemm import GROUPED_MM

pytestmark: list = []  # one process, fast: the fast tier

# float64: both kernels sum the same products, a weight gradient's perhaps in another order
# (BLAS's for the transposed product): a few roundings of values of size ~10 (1e-14); any
# wrong row, expert or transpose is ~1
TOL = 1e-12


def _fallback():
    moe = pytest.importorskip("transformers.integrations.moe")
    assert hasattr(moe, "_grouped_mm_fallback")
    return torch.ops.transformers.grouped_mm_fallback.default


@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
@pytest.mark.parametrize("ends", [[3, 3, 7, 9], [0, 4, 4, 6], [2, 5, 8, 12]],
                         ids=["empty-expert", "tail-rows", "all-rows"])
def test_same_products_and_gradients_as_transformers(layout: str, ends: list[int]) -> None:
    fallback = _fallback()
    g = torch.Generator().manual_seed(0)
    E, S, K, N = 4, 12, 5, 6
    x = torch.randn(S, K, dtype=torch.float64, generator=g)
    param = torch.randn(E, N, K, dtype=torch.float64, generator=g)
    dy = torch.randn(S, N, dtype=torch.float64, generator=g)
    offs = torch.tensor(ends, dtype=torch.int32)
    results = []
    for op in (GROUPED_MM, fallback):
        xl = x.clone().requires_grad_()
        # a view of a parameter, as the expert segment's leaf is (runtime/experts.py)
        w = param.transpose(-2, -1) if layout == "transposed" else param.transpose(-2, -1).contiguous()
        w.requires_grad_()
        out = op(xl, w, offs)
        results.append((out, *torch.autograd.grad(out, [xl, w], dy)))
    (out, dx, dw), (ref, ref_dx, ref_dw) = results
    assert out.shape == ref.shape
    for got, want in ((out, ref), (dx, ref_dx), (dw, ref_dw)):
        assert (got - want).abs().max() < TOL
    assert (out[ends[-1]:] == 0).all() and (dx[ends[-1]:] == 0).all()
    empty = [e for e in range(E) if ends[e] == (ends[e - 1] if e else 0)]
    assert all((dw[e] == 0).all() for e in empty)
    # the weight's gradient in the weight's layout: nothing for the segment to copy
    assert dw.stride() == w.stride()
