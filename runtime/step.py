"""Running a joint program (``passes/joint.py``) as one autograd node.

Calling the compiled module runs the program's forward graph; ``backward()`` runs its
backward graph, in which every backward collective (and every post-backward gradient
reduction) is a node the passes have placed, instead of autograd's own walk over the
forward program. To autograd the whole step is one function of the parameters and the
inputs, so ``loss.backward()``, gradient accumulation into ``.grad`` and
``torch.autograd.grad`` work as with any module.
"""
from __future__ import annotations

from typing import Any

import torch

from shardc.passes.joint import JointProgram


class JointStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, jp: JointProgram, *primals: Any) -> Any:
        res = jp.runners()[0](*primals)
        outs, saved = res[:jp.n_outputs], res[jp.n_outputs:]
        ctx.jp = jp
        # saved values (activations, gathered weights) go through save_for_backward, so
        # autograd frees them after backward and refuses a second backward without
        # retain_graph, as it does for any module
        ctx.save_for_backward(*saved)
        ctx.n_primals = len(primals)
        nondiff = [o for i, o in enumerate(outs)
                   if isinstance(o, torch.Tensor) and i not in jp.diff_outputs]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *gouts: Any) -> Any:
        jp: JointProgram = ctx.jp
        tangents = [gouts[i].contiguous() for i in jp.diff_outputs]
        grads = jp.runners()[1](*ctx.saved_tensors, *tangents)
        out: list[Any] = [None] * ctx.n_primals
        for i, g in zip(jp.grad_of, grads):
            out[i] = g
        return (None, *out)
