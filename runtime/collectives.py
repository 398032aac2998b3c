"""Collectives as autograd-aware functions that compiled graphs call.

A compiled program issues and waits every forward collective as two separate graph
nodes (``*_start`` returns a buffer the collective is still filling; ``wait`` blocks on
it), so later passes can move the issue earlier than the wait (prefetching). Each
function's backward issues the adjoint collective:

=====================  ==================  ==============================================
forward                placement change    backward
=====================  ==================  ==============================================
all_gather_start       S(d) -> R           reduce-scatter (gradient is a partial sum) or
                                           the rank's own slice (gradient replicated)
all_reduce_start       P -> R              identity
reduce_scatter_start   P -> S(d)           all-gather of the gradient (each addend's
                                           gradient is the whole gradient)
all_to_all_start       S(i) -> S(j)        the reverse all-to-all
  (stripes=(k, k'))    S(d/k) -> S(d/k')   the reverse exchange (a re-cut of one dim:
                                           each rank sends only what another lacks)
grad_all_reduce        R -> R              all-reduce: the gradient arriving is partial
=====================  ==================  ==============================================

Every byte handed to torch.distributed is counted per (collective, axis, phase) with
the ring model of ``volume.ring_bytes``, so tests can compare it with the compile-time
report byte for byte.

All functions take ``rt``, the key of a :class:`Runtime` (mesh, groups, counters), so
two compiled programs in one process never share state.
"""
from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict
from fractions import Fraction
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from shardc.core.errors import CollectiveError
from shardc.core.mesh import Mesh
from shardc.core.placement import Restripe, restripe, stripe_index

# reduce-scatter, and small all-reduces: gloo's by an all-to-all
from shardc.runtime.algorithms import (
    all_gather_flat,
    all_reduce_flat,
    all_to_all_flat,
    reduce_scatter_flat,
)
from shardc.runtime.groups import axis_groups
from shardc.runtime.volume import ring_bytes

# the reduce-op names of torch's functional collectives, as torch.distributed's enum
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}

_RUNTIMES: dict[str, "Runtime"] = {}
_WORK = "_shardc_work"  # attribute of a buffer whose collective is still in flight
_WHAT = "_shardc_what"  # (runtime key, collective, axis, phase) of that collective
_FROM = "_shardc_from"  # where the buffer's values are once it is done (GatherGroup)
_ids = itertools.count()


class Runtime:
    """What one compiled program needs at run time on this rank."""

    def __init__(self, mesh: Mesh, rank: int) -> None:
        self.mesh = mesh
        # the rank compiled for: what an offline trace (no process group) reads
        self.compiled_rank = rank
        self.key = f"rt{next(_ids)}"
        # bytes handed to torch.distributed per (collective, axis, phase): plain integers,
        # turned into the ring model's figures only when read (``measured``); a Fraction
        # per call cost ~20 us, on every collective of every step
        self.sent: dict[tuple[str, str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str, str], int] = defaultdict(int)
        # expert parallelism (runtime/experts.py): the rows each expert segment (by its
        # key) received at each hop of its last call; they depend on routing, so the comm
        # report reads them here once a step has run
        self.routed: dict[str, list[int]] = {}
        # and how they were spread over the experts and ranks (runtime.experts.ExpertLoad)
        self.expert_load: dict[str, Any] = {}
        # a pipeline stage runs its expert segments once a micro-batch: while True, each
        # call adds its rows to the step's (the pipeline clears them when a step starts)
        self.routed_adds = False
        # gradient accumulation (``ShardedModule.no_sync``): while ``sync`` is False the
        # backward skips every gradient reduction. A weight's full, unreduced gradient
        # waits in ``deferred`` (keyed by its all-gather node) for the next synced
        # reduce-scatter; a parameter whose step-phase reduction was skipped is in
        # ``unreduced`` (its ``.grad`` holds local sums, reduced after the next synced
        # accumulation). Both are summed exactly once: every reduction is linear.
        self.sync = True
        self.deferred: dict[str, torch.Tensor] = {}
        self.unreduced: set[str] = set()
        # activation checkpointing: a forward collective re-issued by a block's recompute
        # runs in backward, and is counted there
        self.recomputing = False
        # the module's gradient buckets (runtime/grad_buckets.py): weights whose
        # all-gather's backward puts the gradient in a bucket instead of reducing it
        self.grad_buckets: Any = None
        # weight all-gathers that go out together, one collective a block (GatherGroup),
        # by the gather's key
        self.gather_groups: dict[str, GatherGroup] = {}
        # gemm_modes="auto": GEMM key -> the form the ranks agreed on (runtime/gemm.py).
        # The compiled module's first batch decides; its later step programs (another
        # input shape) reuse each choice, and another compiled module makes its own
        self.gemm_forms: dict[tuple, str] = {}
        # draw number -> the whole tensor that draw would make, when another drew it (a
        # pipeline stage: its micro-batch's rows of one device's mask); None: draw here
        self.draws: Callable[[int], torch.Tensor] | None = None
        # while a step program is traced (shardc/program/share.py): the axes whose
        # coordinate it read ("*": the rank), which the ranks it is shared with must agree on
        self.reads: set[str] | None = None
        _RUNTIMES[self.key] = self

    @property
    def rank(self) -> int:
        if self.reads is not None:
            self.reads.add("*")
        return self._rank()

    def _rank(self) -> int:
        # offline (shardc.program.offline, the planner) there is no process group; the program
        # is the compiled rank's
        return dist.get_rank() if dist.is_initialized() else self.compiled_rank

    def coord(self, axis: str) -> int:
        if self.reads is not None:
            self.reads.add(axis)
        return self.mesh.coords(self._rank())[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        g = axis_groups(self.mesh)[axis]
        assert g is not None, f"no group for axis {axis} of size 1"
        return g

    def count(self, collective: str, axis: str, phase: str, t: torch.Tensor) -> None:
        if self.recomputing and phase == "forward":
            phase = "backward"
        self.sent[(collective, axis, phase)] += t.numel() * t.element_size()
        self.calls[(collective, axis, phase)] += 1

    @property
    def measured(self) -> dict[tuple[str, str, str], Fraction]:
        """Bytes this rank sent per (collective, axis, phase), by the ring model
        (``volume.ring_bytes``: linear in the input's bytes, so summing the inputs first is
        exact)."""
        return {k: ring_bytes(k[0], self.mesh.size(k[1]), n) for k, n in self.sent.items()}

    def reset_counters(self) -> None:
        self.sent.clear()
        self.calls.clear()


def get_runtime(key: str) -> Runtime:
    return _RUNTIMES[key]


@contextlib.contextmanager
def guarded(rt: str | None, collective: str, axis: str | None, phase: str) -> Iterator[None]:
    """The one place a failed collective becomes a ``CollectiveError`` that names it:
    gloo says "Connection closed by peer" or "Timed out waiting 5000ms for recv", not
    which of the program's collectives, axis and ranks were involved. ``axis=None``: a
    collective over every rank (``rt`` may then be None)."""
    try:
        yield
    except RuntimeError as e:  # torch.distributed's DistError is a RuntimeError
        if isinstance(e, CollectiveError):
            raise
        rank = dist.get_rank()
        if axis is None or rt is None:
            where = f"over all {dist.get_world_size()} ranks ({phase}; rank {rank})"
        else:
            mesh = get_runtime(rt).mesh
            where = (f"over mesh axis '{axis}' ({phase}; rank {rank} with ranks "
                     f"{mesh.group_of(rank, axis)} of {mesh})")
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CollectiveError(
            f"shardc: {collective} {where} failed: {type(e).__name__}: {cause}\n"
            "A rank of that group died, stopped issuing collectives, or issued a different "
            "one (every rank must run the same program on same-shaped inputs). Collectives give "
            "up after the process group's timeout: init_process_group(..., "
            "timeout=datetime.timedelta(seconds=...)) sets it (torch's default: 30 minutes on "
            "gloo, 10 on NCCL).") from e


def _issue(buf: torch.Tensor, rt: str, collective: str, axis: str, phase: str, fn: Any,
           *args: Any, **kwargs: Any) -> torch.Tensor:
    """Issue an async collective filling ``buf``; ``wait`` finishes it."""
    with guarded(rt, collective, axis, phase):
        work = fn(*args, async_op=True, **kwargs)
    setattr(buf, _WORK, work)
    setattr(buf, _WHAT, (rt, collective, axis, phase))
    return buf


class GatherGroup:
    """A block's weights, gathered by one all-gather under the forward program.

    The forward program (what runs under autograd's backward: ``step_graph=False``,
    recompute) gathers each weight on its own; on an FSDP mesh that is one collective a
    weight, each paying the collective's fixed cost (45 a forward for the peers' 4-layer
    GPT on ``z8``, and 40 more when block recompute gathers again). FSDP2 gathers a
    block's parameters together for that reason, as the step program does
    (``passes/coalesce.py``). Here the program keeps one all-gather node a weight, each
    its own autograd node (its backward is the weight's reduce-scatter, bucketed or not),
    and the grouping is done at run time: the first member the program gathers sends every
    member's shard in one buffer; the others are then served from that buffer, waited
    where the program waits for them. A member asked for again before the others were
    served (recompute gathers a block again) sends the whole group again. Every rank runs
    the same program, so every rank issues the same collectives. The members are
    parameters: ``new_step`` (before each forward) and a changed ``_version`` keep a
    buffer from serving weights the optimizer has stepped since.

    Numerics: an all-gather copies, so each weight is bitwise what its own gather gave.
    Bytes: a ring all-gather's volume is linear in the size, so one of the group moves
    exactly the sum of its members' (measured == reported)."""

    def __init__(self, rt: str, axis: str, members: list[tuple[str, torch.Tensor]],
                 dtype: torch.dtype | None, label: str = "") -> None:
        self.rt, self.axis, self.dtype, self.label = rt, axis, dtype, label
        self.members = members  # (gather key, parameter) in the program's order
        self._params = dict(members)
        self.offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for key, p in members:
            self.offsets[key] = (off, p.numel())
            off += p.numel()
        self.numel = off
        self._buf: torch.Tensor | None = None  # (G, numel) of the collective in flight
        self._work: Any = None
        self._versions: list[int] = []
        self._pending: set[str] = set()

    def new_step(self) -> None:
        self._buf, self._work, self._pending = None, None, set()

    def rebind(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """The user replaced member parameter ``old`` by ``new`` (same shape and dtype):
        send ``new``'s shard from now on."""
        for i, (key, p) in enumerate(self.members):
            if p is old:
                self.members[i] = (key, new)
                self._params[key] = new
                self.new_step()

    def holds(self, key: str, x: torch.Tensor) -> bool:
        """Whether ``x``, what the program gathers as ``key``, is the tensor this group
        sends for it (a parameter object replaced after compile is gathered alone)."""
        return self._params[key] is x

    def take(self, key: str, phase: str) -> torch.Tensor:
        """This member's (G, *shard) buffer, with the group's collective attached for
        ``wait``; sends the group's gather when this member was served already."""
        if key not in self._pending or \
                [p._version for _, p in self.members] != self._versions:
            self._send(phase)
        self._pending.discard(key)
        buf = self._buf
        assert buf is not None
        if not self._pending:
            # every member holds what it needs (its piece, until its wait): the block's
            # buffer goes when the last of them is waited, as one weight's would
            self._buf = None
        off, n = self.offsets[key]
        param = self._params[key]
        # its own tensor, filled from the group's buffer at the wait (FSDP2 copies out
        # the same way): a view of the buffer would be an output of this autograd
        # function whose base the collective writes, which autograd forbids, and each
        # member's gathered blocks are strided in the buffer (rank-major)
        out = buf.new_empty((buf.shape[0], *param.shape))
        setattr(out, _WORK, self._work)
        setattr(out, _WHAT, (self.rt, "all_gather", self.axis, phase))
        setattr(out, _FROM, buf[:, off:off + n])
        return out

    def _send(self, phase: str) -> None:
        r = get_runtime(self.rt)
        g = r.mesh.size(self.axis)
        with torch.no_grad():
            flat = torch.cat([(p if self.dtype is None else p.to(self.dtype)).reshape(-1)
                              for _, p in self.members])
        buf = flat.new_empty((g, self.numel))
        r.count("all_gather", self.axis, phase, flat)
        with guarded(self.rt, "all_gather", self.axis, phase):
            self._work = all_gather_flat(buf.view(-1), flat, group=r.group(self.axis),
                                         async_op=True)
        self._buf = buf
        self._versions = [p._version for _, p in self.members]
        self._pending = {k for k, _ in self.members}


# ---------------------------------------------------------------------------- forward
class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: str, axis: str, grad: str, key: str | None = None,
                dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None
                ) -> torch.Tensor:
        r = get_runtime(rt)
        g = r.mesh.size(axis)
        ctx.rt, ctx.axis, ctx.grad, ctx.key = rt, axis, grad, key
        ctx.in_dtype, ctx.reduce_dtype = x.dtype, reduce_dtype or x.dtype
        if key is not None and key in r.gather_groups:
            group = r.gather_groups[key]
            if group.holds(key, x):  # (else a parameter was replaced since compile)
                return group.take(key, "forward")
        x = x.contiguous() if dtype is None else x.to(dtype).contiguous()
        flat = x.reshape((-1, *x.shape[1:])) if x.dim() else x.reshape(1)
        buf = x.new_empty((g, *x.shape))
        # gloo wants the output as (G*d0, ...): hand it a view, return the base
        out = buf.view((g * flat.shape[0], *flat.shape[1:]))
        r.count("all_gather", axis, "forward", x)
        return _issue(buf, rt, "all_gather", axis, "forward", all_gather_flat, out, flat,
                      group=r.group(axis))

    @staticmethod
    def backward(ctx: Any, g_buf: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        r = get_runtime(ctx.rt)
        if ctx.grad == "reduce_scatter":
            # The gathered tensor fed computations that differ across the axis (other
            # tokens), so each rank's gradient is a partial sum: reduce and keep our shard.
            shape = g_buf.shape[1:]
            # a gather that cast (precision): the gradient comes back in the input's dtype,
            # held across no_sync in it, and reduced in the policy's reduce dtype
            g_flat = g_buf.to(ctx.in_dtype).contiguous().reshape(
                (-1, *shape[1:]) if len(shape) else (-1,))
            if not r.sync and ctx.key is not None:
                # no_sync and x is a weight: keep the whole unreduced gradient; the shard
                # gets nothing now. (Without a key x is an activation, whose gradient the
                # rest of backward needs now: reduced every time, which is exact too.)
                held = r.deferred.get(ctx.key)
                r.deferred[ctx.key] = g_flat.clone() if held is None else held.add_(g_flat)
                return None, None, None, None, None, None, None
            held = r.deferred.pop(ctx.key, None) if ctx.key is not None else None
            if held is not None:
                # reduce-scatter is linear: reducing the sum of the micro-batches'
                # gradients once equals reducing each and summing the shards
                g_flat = held.add_(g_flat)
            buckets = r.grad_buckets
            if buckets is not None and ctx.key in buckets.by_key:
                # into a bucket (cast to the reduce dtype on the way), reduced with others
                # (runtime/grad_buckets.py)
                return buckets.scattered(ctx.key, g_flat), None, None, None, None, None, None
            g_flat = g_flat.to(ctx.reduce_dtype)
            out = g_flat.new_empty((g_flat.shape[0] // g_buf.shape[0], *g_flat.shape[1:]))
            r.count("reduce_scatter", ctx.axis, "backward", g_flat)
            with guarded(ctx.rt, "reduce_scatter", ctx.axis, "backward"):
                reduce_scatter_flat(out, g_flat, group=r.group(ctx.axis))
            return out.view(shape).to(ctx.in_dtype), None, None, None, None, None, None
        # The gradient is already the same on every rank of the axis: keep our piece.
        return g_buf[r.coord(ctx.axis)].to(ctx.in_dtype), None, None, None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: str, axis: str, op: str) -> torch.Tensor:
        r = get_runtime(rt)
        # Out of place: the producer of x may have saved it for its own backward.
        buf = x.detach().clone(memory_format=torch.contiguous_format)
        r.count("all_reduce", axis, "forward", buf)
        red = REDUCE_OPS.get(op, dist.ReduceOp.SUM)
        return _issue(buf, rt, "all_reduce", axis, "forward", all_reduce_flat, buf, op=red,
                      group=r.group(axis))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # d(sum_r x_r)/dx_r = 1: every partial contribution receives the whole gradient.
        # (A max all-reduce only ever sees detached inputs: it is a shift constant.)
        return g, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Sum a partial tensor over ``axis`` and keep this rank's block of dim ``dim``. The
    buffer it returns holds that block with ``dim`` moved to the front (the layout the
    flat collective writes); ``unmove`` puts it back after the wait."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: str, axis: str, dim: int) -> torch.Tensor:
        r = get_runtime(rt)
        g = r.mesh.size(axis)
        ctx.rt, ctx.axis, ctx.dim = rt, axis, dim
        front = x.movedim(dim, 0).contiguous()
        out = front.new_empty((front.shape[0] // g, *front.shape[1:]))
        r.count("reduce_scatter", axis, "forward", front)
        return _issue(out, rt, "reduce_scatter", axis, "forward", reduce_scatter_flat, out, front,
                      group=r.group(axis))

    @staticmethod
    def backward(ctx: Any, g_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # d(sum_r x_r)/dx_r = 1: every addend receives the whole gradient, which is the
        # gathered blocks
        r = get_runtime(ctx.rt)
        g = r.mesh.size(ctx.axis)
        g_out = g_out.contiguous()
        full = g_out.new_empty((g * g_out.shape[0], *g_out.shape[1:]))
        r.count("all_gather", ctx.axis, "backward", g_out)
        with guarded(ctx.rt, "all_gather", ctx.axis, "backward"):
            all_gather_flat(full, g_out, group=r.group(ctx.axis))
        return full.movedim(0, ctx.dim), None, None, None


class _AllToAll(torch.autograd.Function):
    """Move the cut of ``axis`` from dim ``src`` to dim ``dst``: each rank sends rank r
    the r-th block of its piece along ``dst`` and receives blocks of ``src``. The buffer
    is (G, *piece with dst cut) in the order of the sending ranks; ``concat_received``
    lays the blocks side by side along ``src`` after the wait."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: str, axis: str, src: int, dst: int) -> torch.Tensor:
        r = get_runtime(rt)
        g = r.mesh.size(axis)
        ctx.rt, ctx.axis, ctx.src, ctx.dst = rt, axis, src, dst
        n = x.shape[dst]
        # (G, *x with dst cut): block i goes to rank i
        send = x.unflatten(dst, (g, n // g)).movedim(dst, 0).contiguous()
        buf = torch.empty_like(send)
        r.count("all_to_all", axis, "forward", send)
        return _issue(buf, rt, "all_to_all", axis, "forward", dist.all_to_all_single, buf, send,
                      group=r.group(axis))

    @staticmethod
    def backward(ctx: Any, g_buf: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        r = get_runtime(ctx.rt)
        g_buf = g_buf.contiguous()
        back = torch.empty_like(g_buf)
        r.count("all_to_all", ctx.axis, "backward", g_buf)
        with guarded(ctx.rt, "all_to_all", ctx.axis, "backward"):
            dist.all_to_all_single(back, g_buf, group=r.group(ctx.axis))
        # back[i] is the gradient of the block this rank sent to rank i (a block of dst)
        return back.movedim(0, ctx.dst).flatten(ctx.dst, ctx.dst + 1), None, None, None, None


def stripe_plan(rt: str, axis: str, size: int, stripes: tuple[int, int]) -> Restripe:
    """This rank's part in re-cutting a dim whose pieces are ``size`` long over ``axis``
    from interleave ``stripes[0]`` to ``stripes[1]`` (``placement.restripe``)."""
    r = get_runtime(rt)
    g = r.mesh.size(axis)
    return restripe(size * g, stripes[0], stripes[1], r.coord(axis), g)


def runs_of(x: torch.Tensor, runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The (offset, length) runs of ``x``'s dim 0, one after another (``x`` itself when
    the runs are all of it, in order)."""
    if len(runs) == 1 and runs[0] == (0, x.shape[0]):
        return x
    return torch.cat([x.narrow(0, o, m) for o, m in runs])


def unrun(x: torch.Tensor, runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The inverse of ``runs_of`` when the runs cover dim 0 once: ``x`` holds them one
    after another; each goes back to its offset."""
    order = sorted(range(len(runs)), key=lambda i: runs[i][0])
    at = [0]
    for _o, m in runs:
        at.append(at[-1] + m)
    if order == list(range(len(runs))):
        return x
    return torch.cat([x.narrow(0, at[i], runs[i][1]) for i in order])


class _Restripe(torch.autograd.Function):
    """Re-cut dim ``dim`` of a tensor cut over ``axis`` from one interleave to another
    (the contiguous cut of a sequence to the head-tail cut, and back): each rank sends
    the runs of its piece that other ranks hold after (``placement.restripe``). The buffer
    holds dim ``dim`` first, the runs in the order they arrive; ``restriped`` puts them in
    the new local order after the wait."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: str, axis: str, dim: int,
                stripes: tuple[int, int]) -> torch.Tensor:
        r = get_runtime(rt)
        plan = stripe_plan(rt, axis, x.shape[dim], stripes)
        ctx.rt, ctx.axis, ctx.dim, ctx.plan = rt, axis, dim, plan
        send = runs_of(x.movedim(dim, 0), plan.send).contiguous()
        buf = send.new_empty((sum(plan.recv_splits), *send.shape[1:]))
        r.count("all_to_all", axis, "forward", send)
        return _issue(buf, rt, "all_to_all", axis, "forward", all_to_all_flat, buf, send,
                      list(plan.recv_splits), list(plan.send_splits), group=r.group(axis),
                      point_to_point=True)

    @staticmethod
    def backward(ctx: Any, g_buf: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        r = get_runtime(ctx.rt)
        plan = ctx.plan
        g_buf = g_buf.contiguous()
        back = g_buf.new_empty((sum(plan.send_splits), *g_buf.shape[1:]))
        r.count("all_to_all", ctx.axis, "backward", g_buf)
        with guarded(ctx.rt, "all_to_all", ctx.axis, "backward"):
            all_to_all_flat(back, g_buf, list(plan.send_splits), list(plan.recv_splits),
                            group=r.group(ctx.axis), point_to_point=True)
        # back holds this rank's runs in the order it sent them
        return unrun(back, plan.send).movedim(0, ctx.dim), None, None, None, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: str, axis: str) -> torch.Tensor:
        ctx.rt, ctx.axis = rt, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        r = get_runtime(ctx.rt)
        g = g.clone(memory_format=torch.contiguous_format)
        r.count("all_reduce", ctx.axis, "backward", g)
        with guarded(ctx.rt, "all_reduce", ctx.axis, "backward"):
            all_reduce_flat(g, group=r.group(ctx.axis))
        return g, None, None


# --------------------------------------------------------------- graph-callable ops
def all_gather_start(x: torch.Tensor, rt: str, axis: str, grad: str, key: str | None = None,
                     dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None
                     ) -> torch.Tensor:
    """Issue an all-gather over ``axis``; returns a (G, *x.shape) buffer being filled.
    ``grad`` is "reduce_scatter" or "slice", decided by the gradient analysis pass;
    ``key`` names the gather (its node) so that ``no_sync`` can hold its unreduced
    gradient across backward calls. ``dtype`` casts ``x`` before sending (a weight under
    a mixed-precision policy); its gradient is then reduce-scattered in ``reduce_dtype``
    (default: x's own dtype) and returned in x's dtype. The cast belongs to the gather
    because a separate cast node would round the reduced gradient to the narrow dtype
    on its way back."""
    return _AllGather.apply(x, rt, axis, grad, key, dtype, reduce_dtype)


def all_reduce_start(x: torch.Tensor, rt: str, axis: str, op: str = "sum") -> torch.Tensor:
    """Issue an all-reduce ("sum", "max" or "min") over ``axis`` (partial -> replicate); returns
    the buffer being filled."""
    return _AllReduce.apply(x, rt, axis, op)


def reduce_scatter_start(x: torch.Tensor, rt: str, axis: str, dim: int) -> torch.Tensor:
    """Issue a reduce-scatter over ``axis`` of a partial sum, cut along ``dim``
    (partial -> shard); returns the buffer being filled (``dim`` first)."""
    return _ReduceScatter.apply(x, rt, axis, dim)


def unmove(buf: torch.Tensor, dim: int) -> torch.Tensor:
    """A reduce-scatter's buffer (``dim`` first) back in the tensor's own dim order."""
    return buf.movedim(0, dim)


def all_to_all_start(x: torch.Tensor, rt: str, axis: str, src: int, dst: int,
                     stripes: tuple[int, int] | None = None) -> torch.Tensor:
    """Issue an all-to-all over ``axis`` that moves its cut from dim ``src`` to dim
    ``dst`` (shard -> shard); returns the (G, ...) buffer being filled. With ``stripes``
    (``src == dst``): the cut stays on that dim and goes from interleave ``stripes[0]``
    to ``stripes[1]``; the buffer (the dim first) is read by ``restriped``."""
    if stripes is not None:
        assert src == dst, (src, dst)
        return _Restripe.apply(x, rt, axis, src, (stripes[0], stripes[1]))
    return _AllToAll.apply(x, rt, axis, src, dst)


def restriped(buf: torch.Tensor, rt: str, axis: str, dim: int, stripes: tuple[int, int]) -> torch.Tensor:
    """A re-cut's buffer (``all_to_all_start`` with ``stripes``), waited, in the new local
    order, the dim back in its place."""
    plan = stripe_plan(rt, axis, buf.shape[0], (stripes[0], stripes[1]))
    return runs_of(buf, plan.place).movedim(0, dim)


def concat_received(buf: torch.Tensor, src: int) -> torch.Tensor:
    """An all-to-all's (G, ...) buffer -> one tensor, the blocks from ranks 0..G-1 side by
    side along ``src`` (the dim that was cut and is now whole)."""
    return buf.movedim(0, src).flatten(src, src + 1)


def wait(buf: torch.Tensor) -> torch.Tensor:
    """Block until the collective filling ``buf`` is done; returns ``buf``."""
    work = buf.__dict__.pop(_WORK, None)
    if work is not None:
        # some backends finish by copying the result into ``buf`` (gloo's reduce-scatter
        # does): outside autograd, or that copy would cut the gradient's path to ``buf``
        with torch.no_grad(), guarded(*buf.__dict__.pop(_WHAT)):
            work.wait()
    src = buf.__dict__.pop(_FROM, None)
    if src is not None:  # a member of a GatherGroup (its collective may be waited already)
        with torch.no_grad():
            buf.copy_(src.view(buf.shape))
    return buf


def concat_gathered(buf: torch.Tensor, dim: int) -> torch.Tensor:
    """(G, *shape) gathered blocks -> one tensor, blocks concatenated along ``dim``."""
    g = buf.shape[0]
    if dim == 0:
        return buf.reshape((g * buf.shape[1], *buf.shape[2:]))
    moved = buf.movedim(0, dim)  # (*shape[:dim], G, shape[dim], ...)
    shape = list(buf.shape[1:])
    shape[dim] *= g
    return moved.reshape(shape)


def concat_gathered_interleaved(buf: torch.Tensor, dim: int, k: int) -> torch.Tensor:
    """Like ``concat_gathered`` for a dim read as (|k|, size/|k|) with the inner part split
    (mirrored in odd stripes when k < 0: core/placement.py)."""
    g = buf.shape[0]
    shape = list(buf.shape[1:])
    n = shape[dim]
    if k < 0:  # the ranks' pieces side by side, then each position taken from where it is
        held = torch.cat([stripe_index(n * g, k, r, g, buf.device) for r in range(g)])
        take = torch.empty_like(held)
        take[held] = torch.arange(held.numel(), device=buf.device)
        return buf.movedim(0, dim).flatten(dim, dim + 1).index_select(dim, take)
    parts = buf.reshape([g] + shape[:dim] + [k, n // k] + shape[dim + 1:])
    parts = parts.movedim(0, dim + 1)  # (..., k, G, n/k, ...)
    shape[dim] = n * g
    return parts.reshape(shape)


def grad_all_reduce(x: torch.Tensor, rt: str, axis: str) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over ``axis`` in backward (Megatron's
    "f"): ``x`` is replicated on the axis but fed computations that differ across it."""
    return _GradAllReduce.apply(x, rt, axis)


def local_chunk(x: torch.Tensor, rt: str, axis: str, dim: int, k: int = 1) -> torch.Tensor:
    """This rank's block of a tensor replicated on ``axis`` (no communication). With
    ``k > 1`` the dim is read as (k, size/k) and each of the k parts is cut; k < 0: the
    same with the odd parts cut in mirrored order (core/placement.py)."""
    r = get_runtime(rt)
    g, i = r.mesh.size(axis), r.coord(axis)
    n = x.shape[dim]
    if k == 1:
        return x.narrow(dim, i * (n // g), n // g)
    shape = list(x.shape)
    if k < 0:  # mirrored stripes (core/placement.py)
        return x.index_select(dim, stripe_index(n, k, i, g, x.device))
    v = x.reshape(shape[:dim] + [k, n // k] + shape[dim + 1:])
    v = v.narrow(dim + 1, i * (n // k // g), n // k // g)
    return v.reshape(shape[:dim] + [n // g] + shape[dim + 1:])


def grad_reduce_hook(rt: str, axis: str, name: str | None = None, dtype: torch.dtype | None = None):
    """A leaf-tensor hook that sums a parameter's gradient over ``axis`` (the "step"
    phase: data-parallel reduction, or any axis whose ranks saw different tokens).

    Under ``no_sync`` it passes the local gradient through (``.grad`` accumulates local
    sums) and marks parameter ``name`` unreduced; the next synced backward leaves that
    parameter to ``grad_reduce_after_accumulate``, which reduces ``.grad`` as a whole.
    ``dtype``: the precision policy's reduce dtype, when narrower than the gradient."""
    r = get_runtime(rt)

    def hook(g: torch.Tensor) -> torch.Tensor:
        if not r.sync:
            if name is not None:
                r.unreduced.add(name)
            return g
        if name is not None and name in r.unreduced:
            return g
        own = g.dtype
        g = g.clone(memory_format=torch.contiguous_format) if dtype is None else g.to(dtype)
        r.count("all_reduce", axis, "step", g)
        with guarded(rt, "all_reduce", axis, "step"):
            all_reduce_flat(g, group=r.group(axis))
        return g.to(own)

    return hook


def grad_reduce_after_accumulate(rt: str, axes: list[str], name: str,
                                 dtype: torch.dtype | None = None):
    """A post-accumulate-grad hook: in the first synced backward after ``no_sync``, sum
    the parameter's accumulated ``.grad`` (earlier micro-batches' local gradients plus
    this one's) over ``axes``, in place: one reduction for all the micro-batches."""
    r = get_runtime(rt)

    def hook(p: torch.Tensor) -> None:
        if not r.sync or name not in r.unreduced:
            return
        r.unreduced.discard(name)
        assert p.grad is not None
        for axis in axes:
            g = p.grad if dtype is None else p.grad.to(dtype)
            r.count("all_reduce", axis, "step", g)
            all_reduce_flat(g, group=r.group(axis))
            if dtype is not None:
                p.grad.copy_(g)

    return hook
