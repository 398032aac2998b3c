"""The grouped GEMM an expert segment runs on its rank's experts (runtime/experts.py).

A grouped GEMM multiplies each expert's run of rows, sorted by expert, by that expert's
weight: ``out[a:b] = x[a:b] @ w[e]`` for expert e's rows a..b (``offs``, the runs' ends),
rows past the last end zero. transformers' fallback for it
(``transformers::grouped_mm_fallback``: what its default experts kernel runs on CPU in
fp32, and wherever torch's grouped kernel refuses the dtype) computes exactly this, but
zero-fills its output and both gradients before writing every row of them, and writes an
expert's weight gradient into the layout of the weight it is given: the transposed view
[E, in, out] that transformers makes of its [E, out, in] parameter, which BLAS cannot
write in place, so each expert's gradient goes through a temporary and a strided copy. An
expert segment also made every weight contiguous before the GEMMs (a copy of the local
experts each forward) and its gradient contiguous after (another each backward).

``shardc::grouped_mm`` is the same product without them: outputs allocated and written
once (only rows past the last end, and the gradient of an expert with no rows, are
zeroed), and the weight gradient computed as ``dy^T x`` straight into the transpose of a
transposed weight's layout, so the weight stays the view the model made and its gradient
comes back in that view's layout. The expert segment's lowering (passes/rules/experts.py)
puts it in place of transformers' fallback. Same sums as transformers': each output row is
one GEMM's row, each weight gradient one GEMM over the expert's rows; only the order of a
weight gradient's sum over rows may differ (BLAS's, for the transposed product), within
fp32 rounding.
"""
from __future__ import annotations

import torch


def _ends(offs: torch.Tensor) -> list[int]:
    # one device-to-host read for all experts (a sync on CUDA), as transformers' does
    return [int(e) for e in offs.tolist()]


def _into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b``, written in place when ``out`` or its transpose is contiguous."""
    if out.is_contiguous():
        torch.mm(a, b, out=out)
    elif out.t().is_contiguous():
        torch.mm(b.t(), a.t(), out=out.t())
    else:
        out.copy_(a @ b)


@torch.library.custom_op("shardc::grouped_mm", mutates_args=(),
                         schema="(Tensor x, Tensor w, Tensor offs) -> Tensor")
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((x.shape[0], w.shape[2]))
    start = 0
    for e, end in enumerate(_ends(offs)):
        if end > start:
            _into(x[start:end], w[e], out[start:end])
        start = end
    out[start:].zero_()
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("shardc::grouped_mm_backward", mutates_args=(),
                         schema="(Tensor x, Tensor w, Tensor offs, Tensor dy) -> (Tensor, Tensor)")
def grouped_mm_backward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, dy: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw): dw in ``w``'s own layout (``empty_like`` keeps a transposed view's strides)."""
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dw = torch.empty_like(w)
    start = 0
    for e, end in enumerate(_ends(offs)):
        if end > start:
            _into(dy[start:end], w[e].t(), dx[start:end])
            _into(x[start:end].t(), dy[start:end], dw[e])
        else:
            dw[e].zero_()
        start = end
    dx[start:].zero_()
    return dx, dw


@grouped_mm_backward.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, dy: torch.Tensor
      ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(w)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, dy):  # type: ignore[no-untyped-def]
    x, w, offs = ctx.saved_tensors
    dx, dw = grouped_mm_backward(x, w, offs, dy.contiguous())
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_setup)

GROUPED_MM = torch.ops.shardc.grouped_mm.default
