"""How the flat collectives are carried out on each backend: all-gather as torch.distributed
does it; reduce-scatter, and all-reduce of small tensors, on gloo, by an all-to-all.

gloo's own reduce-scatter is slow on CPU ranks, slower than its all-reduce of the same
buffer: 8 ranks, 13 MiB, 77.7 ms (17.7 ms of CPU a rank) against 68.2 ms for the
all-reduce, where an all-to-all of the buffer followed by each rank summing the eight
blocks it received took 38.1 ms (8.8 ms) (``python benchmarks/collectives.py --world 8
--mb 13 --rounds 7``). Measured faster in every case tried: 2.0-3.4x on 8 ranks from 0.25
to 13.6 MiB, 1.7-2.1x on groups of 4, 1.2x on pairs. Both send the same bytes, (G-1)/G of
the input a rank, the ring model's figure, so the comm report and the runtime's counters
are unchanged: only gloo's algorithm is replaced. On every other backend (NCCL's
reduce-scatter is already one fused ring) torch.distributed's own call runs.

The received blocks are reduced in rank order 0..G-1 on the rank that keeps them, so the
result is the same on every run and does not depend on which rank reduces what; it
differs from gloo's own (a ring's order) only in rounding.

``GLOO_REDUCE_SCATTER`` picks the algorithm: ``"all_to_all"`` (the default) or
``"native"`` (gloo's own, e.g. to measure the difference).

A small all-reduce on gloo (16 B to ``GLOO_EXCHANGE_BYTES``) is an exchange: every rank
sends its whole tensor to every other in one all-to-all and reduces the G copies it holds,
in rank order. gloo's own all-reduce of a few dozen bytes or more passes pieces around the
group in steps that each wait for the next rank, so on ranks that share cores each step
waits for a process to be scheduled. 8 ranks, 256 B: 17.5 ms (3.2 ms of CPU a rank)
against 3.9 ms (0.7 ms) for the exchange; 64 KiB: 18.4 against 4.8 ms; groups of 4 and
pairs gain less; at 256 KiB pairs already lose, and at 1 MiB the exchange loses on every
group size (``python benchmarks/collectives.py --world 8 --small [--group G]``). One or two
values (the loss, its token count) are as cheap or cheaper by gloo's own, and stay there.
What reaches the window: vocabulary-parallel cross-entropy's per-token sums, the NaN
guard's per-parameter sums of squares, small activations under tensor parallelism. The
exchange sends (G-1) times the tensor a rank where the ring model counts 2(G-1)/G times (at
most 7 x 64 KiB more on 8 ranks); the comm report and the runtime's counters keep the ring
model's figure for every all-reduce, as they do on NCCL, which also picks its algorithm by
size. ``GLOO_EXCHANGE_BYTES = 0`` gives gloo's own at every size.

A re-cut of one dim into other stripes (the contiguous cut of a sequence into the
head-tail cut: at most two peers a rank, ``placement.restripe``) is an all-to-all with
split sizes that leave most peers out; on gloo it goes as point-to-point messages to the
peers that have rows (``all_to_all_flat(..., point_to_point=True)``): gloo's all-to-all
with split sizes visits every peer in turn, each step waiting for that rank to be
scheduled. 8 ranks, a 64 KiB re-cut: 3.9-4.7 ms by gloo's all-to-all, 0.9-1.3 ms point to
point, 9-12.6 ms as an all-gather (what the re-cut was before; scratch timings on two
shared cores). With rows for every peer it is the other way round: the experts'
all-to-alls of an 8-rank Mixtral step sent point to point made the step 1.17-1.22x
(``benchmarks/experts.py`` beside a copy of itself), so every other all-to-all is gloo's.
The caller chooses, never the splits: a rank knows only its own, and every rank of the
group must take the same path. The bytes are the same, so the report and the counters
keep their figure. ``GLOO_ALL_TO_ALL = "native"`` gives gloo's own for re-cuts too.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older releases
# have only the old ones. Same semantics, so use whichever this torch has.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_native_reduce_scatter = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)

GLOO_REDUCE_SCATTER = "all_to_all"  # or "native"
GLOO_ALL_TO_ALL = "point_to_point"  # or "native": how a re-cut's all-to-all goes
GLOO_EXCHANGE_BYTES = 64 * 1024  # the largest all-reduce on gloo done as an exchange
_EXCHANGE_FROM = 16  # bytes: below, gloo's own is as fast (module docstring)

_LOCAL: dict[Any, Callable[..., torch.Tensor]] = {
    dist.ReduceOp.SUM: torch.sum, dist.ReduceOp.MAX: torch.amax,
    dist.ReduceOp.MIN: torch.amin, dist.ReduceOp.PRODUCT: torch.prod}


class _ReduceOnWait:
    """The all-to-all in flight; waiting on it reduces the received blocks into ``out``.
    Stands for the reduce-scatter's or all-reduce's Work wherever the runtime keeps one
    (it only waits)."""

    __slots__ = ("_work", "_blocks", "_out", "_op")

    def __init__(self, work: Any, blocks: torch.Tensor, out: torch.Tensor, op: Any) -> None:
        self._work: Any = work
        self._blocks: torch.Tensor | None = blocks
        self._out, self._op = out, op

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._work is not None:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
            blocks, reduce = self._blocks, _LOCAL[self._op]
            assert blocks is not None
            with torch.no_grad():
                if self._out.is_contiguous():
                    reduce(blocks, 0, out=self._out.view(blocks.shape[1:]))
                else:
                    self._out.copy_(reduce(blocks, 0).view(self._out.shape))
            self._work = self._blocks = None
        return True


def _on_gloo(x: torch.Tensor, op: Any, group: Any) -> bool:
    if x.device.type != "cpu" or op not in _LOCAL:
        return False
    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):  # a group this process is not part of, etc.
        return False


def _by_all_to_all(x: torch.Tensor, op: Any, group: Any) -> bool:
    return GLOO_REDUCE_SCATTER == "all_to_all" and _on_gloo(x, op, group)


def all_reduce_flat(x: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                    async_op: bool = False) -> Any:
    """``torch.distributed.all_reduce`` of ``x`` in place; on gloo, a contiguous tensor of
    16 B to ``GLOO_EXCHANGE_BYTES`` by an exchange (module docstring)."""
    nbytes = x.numel() * x.element_size()
    if (not _EXCHANGE_FROM <= nbytes <= GLOO_EXCHANGE_BYTES or not x.is_contiguous()
            or not _on_gloo(x, op, group)):
        return dist.all_reduce(x, op=op, group=group, async_op=async_op)
    g = dist.get_world_size(group)
    copies = x.reshape(1, -1).expand(g, -1).contiguous()
    received = torch.empty_like(copies)
    work = dist.all_to_all_single(received, copies, group=group, async_op=True)
    pending = _ReduceOnWait(work, received, x, op)
    if async_op:
        return pending
    pending.wait()
    return None


# the tag of the point-to-point messages of an all-to-all (gloo matches a receive to a
# send by peer and tag): apart from the ring's and the pipeline's, which use the default
ALL_TO_ALL_TAG = 17


class _AllWorks:
    """Several Works waited as one (an all-to-all sent point to point)."""

    __slots__ = ("_works", "_hold")

    def __init__(self, works: list[Any], hold: Any) -> None:
        self._works, self._hold = works, hold

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self._works:
            w.wait() if timeout is None else w.wait(timeout)
        self._works, self._hold = [], None
        return True


def all_to_all_flat(out: torch.Tensor, x: torch.Tensor, out_splits: list[int],
                    in_splits: list[int], group: Any = None, async_op: bool = False,
                    point_to_point: bool = False) -> Any:
    """``torch.distributed.all_to_all_single`` with split sizes; ``point_to_point`` (the
    same on every rank of the group: a re-cut's), on gloo, as messages to the peers that
    have rows either way (module docstring)."""
    if (not point_to_point or GLOO_ALL_TO_ALL != "point_to_point"
            or not _on_gloo(x, dist.ReduceOp.SUM, group)):
        return dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=async_op)
    g = dist.get_world_size(group)
    me = dist.get_rank(group)
    peers = [r for r in range(g) if r != me]
    group = group if group is not None else dist.group.WORLD
    x = x.contiguous()
    sends = x.split(list(in_splits))
    recvs = out.split(list(out_splits))
    ops = []
    for r in peers:
        if in_splits[r]:
            ops.append(dist.P2POp(dist.isend, sends[r], dist.get_global_rank(group, r), group,
                                  ALL_TO_ALL_TAG))
        if out_splits[r]:
            ops.append(dist.P2POp(dist.irecv, recvs[r], dist.get_global_rank(group, r), group,
                                  ALL_TO_ALL_TAG))
    with torch.no_grad():
        recvs[me].copy_(sends[me])
    pending = _AllWorks(dist.batch_isend_irecv(ops) if ops else [], (x, out))
    if async_op:
        return pending
    pending.wait()
    return None


def reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                        group: Any = None, async_op: bool = False) -> Any:
    """``torch.distributed``'s flat reduce-scatter (``x`` is G blocks along dim 0, ``out``
    receives this rank's block reduced over the group), by an all-to-all on gloo."""
    if not _by_all_to_all(x, op, group):
        return _native_reduce_scatter(out, x, op=op, group=group, async_op=async_op)
    g = dist.get_world_size(group)
    x = x.contiguous()
    received = torch.empty_like(x)
    work = dist.all_to_all_single(received, x, group=group, async_op=True)
    pending = _ReduceOnWait(work, received.view(g, -1), out, op)
    if async_op:
        return pending
    pending.wait()
    return None
