"""Expert parallelism at run time: a grouped GEMM whose experts are cut over a mesh axis.

Inside a routing region (``passes/rules/routing.py``) each rank holds its own token-expert
rows, sorted by expert, and the offsets of each expert's run. With
``compile(expert_axes=(axis,))`` the experts' stacked weight ``[E, k, m]`` is cut on its
expert dim over ``axis``: the rank at coordinate ``c`` holds experts ``c*E/G .. (c+1)*E/G``.
``shardc::expert_mm`` is the grouped GEMM over those experts:

1. the ranks of ``axis`` exchange how many rows each sends each expert (an all-to-all of
   the E counts);
2. each rank sends every row to the rank of its expert (an all-to-all with the split sizes
   from the counts: the rows are sorted by expert, so each destination's rows are one run);
3. the receiver orders what came by local expert (one run per expert, each source's rows
   in source order) and runs the same grouped GEMM op the model called, on its own experts;
4. the results go back by the reverse all-to-all, each row to its place in the sender's
   sorted order.

Dropless: every row reaches its expert, so the result equals the one-device grouped GEMM
row for row. The backward mirrors it (the gradient rows travel to the experts and back)
and gives the local experts' weight gradient whole over ``axis``: every row that met an
expert, from any rank, contributed on the expert's rank.

How many rows a rank receives depends on the routing, so nothing of steps 2-4 has a shape
a trace can know. The op is therefore one opaque ``torch.library`` custom op with a fixed
output shape (the sender's rows), and what its backward needs (the received rows, the
split sizes, the order) waits on the rank in ``STASH`` under the program node's name, as
autograd's saved tensors would. Its backward is a second custom op, so both the traced
step program and plain autograd call the same code.

Every all-to-all is counted by the runtime (``Runtime.count``) as the program's other
collectives are. Two of them move a number of rows that depends on the routing (the
results going back, and in backward the rows' gradients going back): the rows each node
received in its last call are kept in ``Runtime.routed``, from which ``shardc.comm_report``
reports those two exactly once a step has run (before, from uniform routing, and says so).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardc.runtime.collectives import get_runtime, guarded


class _Stash(threading.local):
    """Per thread: a threaded world runs each rank as a thread."""

    def __init__(self) -> None:
        self.saved: dict[tuple[str, str], "_Saved"] = {}


STASH = _Stash()


@dataclass
class _Saved:
    x: torch.Tensor  # the received rows, ordered by local expert (the GEMM's input)
    w: torch.Tensor  # the local experts' weight
    offs: torch.Tensor  # the end of each local expert's run of x
    order: torch.Tensor  # received row i (source order) is row order[i] of x
    sent: list[int]  # rows this rank sent each rank
    got: list[int]  # rows this rank got from each rank


def gemm_op(name: str) -> Any:
    """The grouped GEMM op named ``ns.op.overload`` (what ``str(op)`` of an OpOverload gives)."""
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def _a2a(x: torch.Tensor, out_rows: list[int], in_rows: list[int], rt: str, axis: str,
         phase: str) -> torch.Tensor:
    r = get_runtime(rt)
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    r.count("all_to_all", axis, phase, x)
    with guarded(rt, "all_to_all", axis, phase):
        dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=r.group(axis))
    return out


def _route(offs: torch.Tensor, experts: int, rt: str, axis: str, phase: str
           ) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """Exchange the counts: (rows sent each rank, rows got from each rank, the received
    rows' order by local expert, the local experts' offsets)."""
    r = get_runtime(rt)
    g = r.mesh.size(axis)
    local = experts // g
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # rows this rank has per expert
    recv = torch.empty_like(counts)
    r.count("all_to_all", axis, phase, counts)
    with guarded(rt, "all_to_all", axis, phase):
        dist.all_to_all_single(recv, counts, group=r.group(axis))
    sent = counts.view(g, local).sum(1).tolist()
    by_source = recv.view(g, local)  # [source, local expert]: rows that source sends it
    got = by_source.sum(1).tolist()
    # received rows come source-major, each source's rows expert by expert; the GEMM wants
    # them expert-major. A stable sort of the expert numbers gives that order and keeps
    # each expert's rows in source order.
    expert_of = torch.repeat_interleave(torch.arange(local, device=offs.device).repeat(g),
                                        by_source.reshape(-1))
    order = torch.sort(expert_of, stable=True).indices
    local_offs = torch.cumsum(by_source.sum(0), 0).to(offs.dtype)
    return sent, got, order, local_offs


@torch.library.custom_op("shardc::expert_mm", mutates_args=())
def expert_mm(rows: torch.Tensor, offs: torch.Tensor, w: torch.Tensor, experts: int, gemm: str,
              rt: str, axis: str, node: str) -> torch.Tensor:
    """``gemm(rows, W, offs)`` for a ``W`` of ``experts`` experts of which this rank holds
    ``w`` (its share over ``axis``); ``rows`` sorted by expert, ``offs`` their run ends."""
    r = get_runtime(rt)
    phase = "backward" if r.recomputing else "forward"
    sent, got, order, local_offs = _route(offs, experts, rt, axis, phase)
    received = _a2a(rows, got, sent, rt, axis, phase)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    x = received[order]
    out = gemm_op(gemm)(x, w, local_offs)
    back = _a2a(out[inv], sent, got, rt, axis, phase)
    r.routed[node] = sum(got)
    STASH.saved[(rt, node)] = _Saved(x, w, local_offs, order, sent, got)
    return back


@expert_mm.register_fake
def _(rows: torch.Tensor, offs: torch.Tensor, w: torch.Tensor, experts: int, gemm: str,
      rt: str, axis: str, node: str) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], w.shape[-1]))


@torch.library.custom_op("shardc::expert_mm_backward", mutates_args=())
def expert_mm_backward(grad: torch.Tensor, rows: int, k: int, w_shape: list[int], rt: str,
                       axis: str, node: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``expert_mm``'s rows (``rows`` x ``k``) and of this rank's experts
    (``w_shape``)."""
    s = STASH.saved.pop((rt, node))
    received = _a2a(grad, s.got, s.sent, rt, axis, "backward")
    gx, gw = _grouped_mm_backward(s.x, s.w, s.offs, received[s.order])
    back = _a2a(gx[torch.argsort(s.order)], s.sent, s.got, rt, axis, "backward")
    return back, gw


def _grouped_mm_backward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, g: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``out[a:b] = x[a:b] @ w[e]`` for each expert's run ``a:b``, one GEMM
    each (as transformers' grouped GEMM fallback computes them). Written out: inside a
    custom op autograd is below the dispatcher and records nothing."""
    # contiguous, as the fake says (the weight may be a transposed view of the parameter)
    gx = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    gw = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(g[start:end], w[e].transpose(0, 1), out=gx[start:end])
            torch.mm(x[start:end].transpose(0, 1), g[start:end], out=gw[e])
        start = end
    return gx, gw


@expert_mm_backward.register_fake
def _(grad: torch.Tensor, rows: int, k: int, w_shape: list[int], rt: str, axis: str, node: str
      ) -> tuple[torch.Tensor, torch.Tensor]:
    return grad.new_empty((rows, k)), grad.new_empty(w_shape)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    rows, _offs, w, _experts, _gemm, rt, axis, node = inputs
    ctx.info = (int(rows.shape[0]), int(rows.shape[1]), [int(d) for d in w.shape], rt, axis, node)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    gx, gw = expert_mm_backward(grad, *ctx.info)
    return gx, None, gw, None, None, None, None, None


expert_mm.register_autograd(_backward, setup_context=_setup)

# the op as a graph node's target (a CustomOpDef is not one)
EXPERT_MM = torch.ops.shardc.expert_mm.default
