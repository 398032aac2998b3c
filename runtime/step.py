"""Running a step program (``passes/joint.py``) as one autograd node.

Calling the compiled module runs the program's forward graph; ``backward()`` runs its
backward graph, in which every backward collective (and every post-backward gradient
reduction) is a node the passes have placed, instead of autograd's own walk over the
forward program. To autograd the whole step is one function of the parameters and the
inputs, so ``loss.backward()``, gradient accumulation into ``.grad`` and
``torch.autograd.grad`` work as with any module.

Backward frees each saved value once it has read it for the last time: autograd's
references go first (``maybe_clear_saved_tensors``, unless the graph is retained) and the
part takes the rest as one list that it empties (``call_boxed``), as AOTAutograd's
compiled backward does. Holding them all to the end put shardc's peak 9-14% above FSDP2's
(docs/memory.md).
"""
from __future__ import annotations

from typing import Any

import torch

from shardc.core.ir import DEFERRED, Deferred, StepProgram
from shardc.runtime import functional as F
from shardc.runtime.experts import STASH
from shardc.runtime.pending import Cell, PendingOutput


class StepRunner(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, jp: StepProgram, *primals: Any) -> Any:
        before = dict(STASH.saved)
        res = list(jp.runners()[0](*primals))
        # An expert region leaves what its backward needs on the rank (runtime/experts.py),
        # under its node's key: this call's go with this call's backward. Left there, a
        # second call before the backward (a loss over two batches) replaced the first's
        # and its backward found nothing; and CUDA runs backward on another thread, whose
        # stash (per thread) is its own
        ctx.stashed = {k: v for k, v in STASH.saved.items() if before.get(k) is not v}
        for k in ctx.stashed:
            STASH.saved.pop(k)
            STASH.last.pop(k, None)  # autograd's copy, which no custom-op context takes here
        deferred: list[Deferred] = jp.forward.meta.get(DEFERRED, [])
        extra = sum(d.n_inputs for d in deferred)
        outs, saved = res[:jp.n_outputs], res[jp.n_outputs:len(res) - extra]
        ctx.pending = []
        at = len(res) - extra
        for d in deferred:
            outs[d.index] = _pending(d, res[at:at + d.n_inputs])
            ctx.pending.append(outs[d.index].cell)
            at += d.n_inputs
        ctx.jp = jp
        # saved values (activations, gathered weights) go through save_for_backward, so
        # autograd frees them after backward and refuses a second backward without
        # retain_graph, as it does for any module
        # (a size the data decided, an index read off a tensor, is a number, kept aside)
        ctx.numbers = {i: v for i, v in enumerate(saved) if not isinstance(v, torch.Tensor)}
        ctx.save_for_backward(*[v for v in saved if isinstance(v, torch.Tensor)])
        ctx.n_primals = len(primals)
        nondiff = [o for i, o in enumerate(outs)
                   if isinstance(o, torch.Tensor) and i not in jp.diff_outputs]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *gouts: Any) -> Any:
        jp: StepProgram = ctx.jp
        STASH.saved.update(ctx.stashed)
        ctx.stashed = {}
        tangents = [gouts[i].contiguous() for i in jp.diff_outputs]
        run = jp.runners()[1]
        tensors = iter(ctx.saved_tensors)
        n_saved = len(ctx.numbers) + len(ctx.saved_tensors)
        args = [ctx.numbers[i] if i in ctx.numbers else next(tensors) for i in range(n_saved)]
        args += tangents
        del tensors
        del tangents, gouts
        call_boxed = getattr(run, "call_boxed", None)
        if call_boxed is not None and not torch._C._autograd._get_current_graph_task_keep_graph():
            # the part empties ``args`` and frees each saved value after its last read,
            # so autograd's own references go first (as AOTAutograd's backward does);
            # with retain_graph they stay, for the next backward
            ctx.maybe_clear_saved_tensors()
            grads = call_boxed(args)
        else:
            grads = run(*args)
        out: list[Any] = [None] * ctx.n_primals
        for i, g in zip(jp.grad_of, grads):
            out[i] = g
        # the step's deferred outputs overlapped backward; settle them before it returns
        # (a no-op for those the loop already read)
        for cell in ctx.pending:
            cell.get()
        return (None, *out)


def _pending(d: Deferred, inputs: list[Any]) -> PendingOutput:
    """The deferred output ``d`` as a tensor that runs its tail on first read. The tail
    waits on collectives this thread issued; the read may come on another thread (CUDA
    runs backward on a device thread), so their records go with the tail."""
    flights = {id(t): F.STATE.flight.pop(id(t)) for t in inputs
               if isinstance(t, torch.Tensor) and id(t) in F.STATE.flight}

    def compute() -> torch.Tensor:
        F.STATE.flight.update(flights)
        return d.tail(*inputs)

    device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
    return PendingOutput(d.like, device, Cell(compute))
