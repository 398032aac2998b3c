"""The collectives of ``runtime.collectives`` again, written so that ``make_fx`` records
them: forward and backward of a training step become one graph whose every collective
is a node.

``runtime.collectives`` runs a collective inside an autograd Function that calls
``torch.distributed`` directly and carries the async ``Work`` on the buffer; that cannot
be traced, and its backward collectives happen inside autograd where no pass reaches
them. Here the same operations issue torch's functional collectives
(``_c10d_functional.*``, which return a tensor and are waited by ``wait_tensor``), and
each autograd Function's backward issues the adjoint with functional collectives too.
Tracing ``forward + autograd.grad`` through them with ``make_fx`` gives the step program
(``passes/joint.py``); nothing here runs at training time.

Each function has the signature of its counterpart in ``runtime.collectives``, so the
joint tracer swaps a node's target and nothing else. While tracing, every collective
appends what it is (collective, axis, phase) to ``STATE.log`` in issue order: the traced
graph holds the collective nodes in the same order, and the joint builder reads the axis
and phase of each from there.

The training-time implementations, which count bytes like ``runtime.collectives`` does,
are the ``run_*`` functions at the end: the joint builder points each collective node at
one of them.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Iterator

import torch
import torch.distributed as dist

from shardc.runtime.collectives import (
    REDUCE_OPS,
    all_gather_flat,
    all_reduce_flat,
    all_to_all_flat,
    get_runtime,
    guarded,
    reduce_scatter_flat,
    runs_of,
    stripe_plan,
    unrun,
)

_fc = torch.ops._c10d_functional

class _TraceState(threading.local):
    """Per thread: torch's threaded process group runs every rank as a thread of one
    process, and each traces its own program at the same time."""

    def __init__(self) -> None:
        # (collective, axis, phase, origin) of each functional collective issued while
        # tracing; origin: the forward program's node that issued it, or "grad:<param>"
        self.log: list[tuple[str, str, str, str]] = []
        # buffers whose wait must reshape the flat result a functional collective returns
        self.shapes: dict[int, tuple[int, ...]] = {}
        self.phase = "forward"
        # at run time: id of a collective's result -> (its number under torch.profiler
        # or None, runtime key, collective, axis, phase, Work, result, input), for its wait
        self.flight: dict[int, tuple] = {}
        # the forward program's node being traced (a backward collective is logged with
        # the node whose autograd function issued it)
        self.node = ""
        # tracing for a report, without process groups: collectives get placeholder names
        self.offline = False
        # positions in ``log`` of the all-to-alls that are re-cuts (``_Restripe``): their
        # nodes run ``run_restripe``
        self.restripes: set[int] = set()

    def clear(self) -> None:
        self.log.clear()
        self.shapes.clear()
        self.restripes.clear()


STATE = _TraceState()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Collectives issued inside are recorded as belonging to phase ``name``
    (autograd runs backward functions while ``phase("backward")`` is active)."""
    old = STATE.phase
    STATE.phase = name
    try:
        yield
    finally:
        STATE.phase = old


def _gname(rt: str, axis: str) -> str:
    if STATE.offline:
        return f"shardc-offline-{axis}"
    return get_runtime(rt).group(axis).group_name


def _log(collective: str, axis: str, ph: str | None = None, node: str | None = None,
         restripe: bool = False) -> None:
    if restripe:
        STATE.restripes.add(len(STATE.log))
    STATE.log.append((collective, axis, ph or STATE.phase, node or STATE.node))


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _fc.wait_tensor(t)


def _gather(x: torch.Tensor, rt: str, axis: str, node: str) -> torch.Tensor:
    """(G * d0, ...) of ``x`` (made contiguous, at least 1-d) from every rank of ``axis``."""
    g = get_runtime(rt).mesh.size(axis)
    flat = x.contiguous()
    flat = flat.reshape(1) if flat.dim() == 0 else flat
    _log("all_gather", axis, node=node)
    return _wait(_fc.all_gather_into_tensor(flat, g, _gname(rt, axis)))


def _scatter(front: torch.Tensor, rt: str, axis: str, node: str) -> torch.Tensor:
    g = get_runtime(rt).mesh.size(axis)
    _log("reduce_scatter", axis, node=node)
    return _wait(_fc.reduce_scatter_tensor(front.contiguous(), "sum", g, _gname(rt, axis)))


def _reduce(x: torch.Tensor, rt: str, axis: str, node: str, op: str = "sum") -> torch.Tensor:
    _log("all_reduce", axis, node=node)
    return _wait(_fc.all_reduce(x.contiguous(), op, _gname(rt, axis)))


def _exchange(x: torch.Tensor, rt: str, axis: str, node: str) -> torch.Tensor:
    g = get_runtime(rt).mesh.size(axis)
    n = x.shape[0] // g
    _log("all_to_all", axis, node=node)
    return _wait(_fc.all_to_all_single(x.contiguous(), [n] * g, [n] * g, _gname(rt, axis)))


def _dense(g: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real zero tensor on the forward's ``device`` for a gradient that autograd hands
    over as an efficient zero tensor (the derivative of ``sgn``, ``sign``, ...). Under
    make_fx the ops on such a tensor trace to device "meta", which the fake-tensor tracer
    refuses (and which no program may run): the step program of ``sgn(amax(gather(x)))``
    could not be built and fell back to autograd's backward."""
    if g._is_zerotensor():
        return torch.zeros(g.shape, dtype=g.dtype, device=device)
    return g


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: str, axis: str, grad: str,
                dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None
                ) -> torch.Tensor:
        ctx.rt, ctx.axis, ctx.grad, ctx.shape = rt, axis, grad, tuple(x.shape)
        ctx.device = x.device
        ctx.in_dtype, ctx.reduce_dtype = x.dtype, reduce_dtype or x.dtype
        ctx.node = STATE.node
        g = get_runtime(rt).mesh.size(axis)
        flat = x.contiguous() if dtype is None else x.to(dtype).contiguous()
        flat = flat.reshape(1) if flat.dim() == 0 else flat
        _log("all_gather", axis)
        buf = _fc.all_gather_into_tensor(flat, g, _gname(rt, axis))
        STATE.shapes[id(buf)] = (g, *x.shape)
        return buf

    @staticmethod
    def backward(ctx: Any, g_flat: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        g_flat = _dense(g_flat, ctx.device)
        r = get_runtime(ctx.rt)
        g = r.mesh.size(ctx.axis)
        if ctx.grad == "reduce_scatter":
            out = _scatter(g_flat.to(ctx.reduce_dtype), ctx.rt, ctx.axis, ctx.node)
            return out.reshape(ctx.shape).to(ctx.in_dtype), None, None, None, None, None
        piece = g_flat.reshape((g, *ctx.shape))[r.coord(ctx.axis)]
        return piece.to(ctx.in_dtype), None, None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: str, axis: str, op: str) -> torch.Tensor:
        _log("all_reduce", axis)
        return _fc.all_reduce(x.contiguous(), op, _gname(rt, axis))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return g, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: str, axis: str, dim: int) -> torch.Tensor:
        ctx.rt, ctx.axis, ctx.dim, ctx.node = rt, axis, dim, STATE.node
        ctx.device = x.device
        g = get_runtime(rt).mesh.size(axis)
        _log("reduce_scatter", axis)
        return _fc.reduce_scatter_tensor(x.movedim(dim, 0).contiguous(), "sum", g, _gname(rt, axis))

    @staticmethod
    def backward(ctx: Any, g_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        full = _gather(_dense(g_out, ctx.device), ctx.rt, ctx.axis, ctx.node)
        return full.movedim(0, ctx.dim), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: str, axis: str, src: int, dst: int) -> torch.Tensor:
        g = get_runtime(rt).mesh.size(axis)
        ctx.rt, ctx.axis, ctx.dst, ctx.node = rt, axis, dst, STATE.node
        ctx.device = x.device
        send = x.unflatten(dst, (g, x.shape[dst] // g)).movedim(dst, 0).contiguous()
        ctx.send_shape = tuple(send.shape)
        n = send.shape[0] // g
        _log("all_to_all", axis)
        buf = _fc.all_to_all_single(send, [n] * g, [n] * g, _gname(rt, axis))
        return buf

    @staticmethod
    def backward(ctx: Any, g_buf: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = _exchange(_dense(g_buf, ctx.device), ctx.rt, ctx.axis, ctx.node)
        return back.movedim(0, ctx.dst).flatten(ctx.dst, ctx.dst + 1), None, None, None, None


class _Restripe(torch.autograd.Function):
    """``collectives._Restripe`` as one functional all-to-all with split sizes each way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: str, axis: str, dim: int,
                stripes: tuple[int, int]) -> torch.Tensor:
        plan = stripe_plan(rt, axis, x.shape[dim], stripes)
        ctx.rt, ctx.axis, ctx.dim, ctx.plan, ctx.node = rt, axis, dim, plan, STATE.node
        ctx.device = x.device
        send = runs_of(x.movedim(dim, 0), plan.send).contiguous()
        _log("all_to_all", axis, restripe=True)
        return _fc.all_to_all_single(send, list(plan.recv_splits), list(plan.send_splits),
                                     _gname(rt, axis))

    @staticmethod
    def backward(ctx: Any, g_buf: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan = ctx.plan
        _log("all_to_all", ctx.axis, node=ctx.node, restripe=True)
        back = _wait(_fc.all_to_all_single(_dense(g_buf, ctx.device).contiguous(),
                                           list(plan.send_splits), list(plan.recv_splits),
                                           _gname(ctx.rt, ctx.axis)))
        return unrun(back, plan.send).movedim(0, ctx.dim), None, None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, buf: torch.Tensor) -> torch.Tensor:
        return _wait(buf)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: str, axis: str) -> torch.Tensor:
        ctx.rt, ctx.axis, ctx.node = rt, axis, STATE.node
        ctx.device = x.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _reduce(_dense(g, ctx.device), ctx.rt, ctx.axis, ctx.node), None, None


# ------------------------------------------------- the counterparts of collectives.*
def all_gather_start(x: torch.Tensor, rt: str, axis: str, grad: str, key: str | None = None,
                     dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None
                     ) -> torch.Tensor:
    # ``key`` names the gather for no_sync's held gradients; the step program does not
    # run under no_sync (the module runs the forward program then), so it is unused here
    return _AllGather.apply(x, rt, axis, grad, dtype, reduce_dtype)


def all_reduce_start(x: torch.Tensor, rt: str, axis: str, op: str = "sum") -> torch.Tensor:
    return _AllReduce.apply(x, rt, axis, op)


def reduce_scatter_start(x: torch.Tensor, rt: str, axis: str, dim: int) -> torch.Tensor:
    return _ReduceScatter.apply(x, rt, axis, dim)


def all_to_all_start(x: torch.Tensor, rt: str, axis: str, src: int, dst: int,
                     stripes: tuple[int, int] | None = None) -> torch.Tensor:
    if stripes is not None:
        return _Restripe.apply(x, rt, axis, src, (stripes[0], stripes[1]))
    return _AllToAll.apply(x, rt, axis, src, dst)


def wait(buf: torch.Tensor) -> torch.Tensor:
    shape = STATE.shapes.pop(id(buf), None)
    out = _Wait.apply(buf)
    return out.view(shape) if shape is not None else out


def grad_all_reduce(x: torch.Tensor, rt: str, axis: str) -> torch.Tensor:
    return _GradAllReduce.apply(x, rt, axis)


def step_all_reduce(g: torch.Tensor, rt: str, axis: str, param: str,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The post-backward sum of a parameter's gradient over ``axis`` (phase "step"),
    in ``dtype`` when the precision policy reduces narrower than the gradient."""
    with phase("step"):
        if dtype is not None:
            return _reduce(g.to(dtype), rt, axis, f"grad:{param}").to(g.dtype)
        return _reduce(g, rt, axis, f"grad:{param}")


# ------------------------------------------------------------ what the program runs
# Each takes the functional collective's own arguments and then (rt, axis, phase): it
# counts the bytes it hands to torch.distributed, as runtime.collectives does, and
# issues the collective. The result is waited by a separate ``run_wait`` node.
#
# They issue through torch.distributed's async calls (``async_op=True``) and keep the
# ``Work`` beside the buffer, as the forward program's runtime does, not through the
# functional ops the program was traced with. On gloo (torch 2.13) the functional
# all-gather, whose CPU path is gloo's coalesced all-gather, corrupted the heap: the
# 8-rank step program aborted in malloc ("unaligned tcache chunk") within a few hundred
# steps, every time, while the same program through torch.distributed's all-gather
# ran clean (benchmarks/soak_step.py). The functional ops stay what the program is
# traced with: make_fx records them as nodes, and their schemas give the passes shapes
# and aliasing.
#
# Under torch.profiler, the issue and the wait each leave a short labelled range
# ("shardc.issue#K all_reduce@x backward 8192B" and "shardc.wait#K"): the two ends of
# collective K's flight, which ``shardc.tools.timeline`` joins into one span beside the compute
# it overlapped.
_ids = itertools.count()


def _issue(rt: str, collective: str, axis: str, ph: str, x: torch.Tensor, out: torch.Tensor,
           call: Any) -> torch.Tensor:
    """Count, then ``call()`` (an async torch.distributed call filling ``out``); its Work,
    with ``out`` and ``x`` held until the wait, goes in ``STATE.flight`` under ``out``.
    Holding ``out`` also keeps its ``id`` from naming another tensor while in flight."""
    nbytes = _count(rt, collective, axis, ph, x)
    k = None
    with guarded(rt, collective, axis, ph):
        if torch.autograd.profiler._is_profiler_enabled:
            k = next(_ids)
            with torch.profiler.record_function(f"shardc.issue#{k} {collective}@{axis} {ph} {nbytes}B"):
                work = call()
        else:
            work = call()
    STATE.flight[id(out)] = (k, rt, collective, axis, ph, work, out, x)
    return out


def run_all_gather(x: torch.Tensor, group_size: int, group_name: str, rt: str, axis: str,
                   ph: str) -> torch.Tensor:
    x = x.reshape(1) if x.dim() == 0 else x
    out = x.new_empty((group_size * x.shape[0], *x.shape[1:]))
    return _issue(rt, "all_gather", axis, ph, x, out, lambda: all_gather_flat(
        out, x, group=get_runtime(rt).group(axis), async_op=True))


def run_reduce_scatter(x: torch.Tensor, op: str, group_size: int, group_name: str, rt: str,
                       axis: str, ph: str) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
    return _issue(rt, "reduce_scatter", axis, ph, x, out, lambda: reduce_scatter_flat(
        out, x, op=REDUCE_OPS[op], group=get_runtime(rt).group(axis), async_op=True))


def run_all_reduce(x: torch.Tensor, op: str, group_name: str, rt: str, axis: str,
                   ph: str, inplace: bool = False) -> torch.Tensor:
    """``inplace``: reduce ``x`` itself instead of a copy (the traced op is out of place);
    for a buffer nothing else reads, such as a bucket the program just packed (a clone of
    a 13 MiB bucket cost more than the reduction's own copy)."""
    out = x if inplace else x.clone(memory_format=torch.contiguous_format)
    return _issue(rt, "all_reduce", axis, ph, x, out, lambda: all_reduce_flat(
        out, op=REDUCE_OPS[op], group=get_runtime(rt).group(axis), async_op=True))


def run_all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   group_name: str, rt: str, axis: str, ph: str) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return _issue(rt, "all_to_all", axis, ph, x, out, lambda: dist.all_to_all_single(
        out, x, list(out_splits), list(in_splits), group=get_runtime(rt).group(axis),
        async_op=True))


def run_restripe(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                 group_name: str, rt: str, axis: str, ph: str) -> torch.Tensor:
    """``run_all_to_all`` for a re-cut (``_Restripe``): point to point on gloo, as every
    rank's re-cut goes (runtime/algorithms.py)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    return _issue(rt, "all_to_all", axis, ph, x, out, lambda: all_to_all_flat(
        out, x, list(out_splits), list(in_splits), group=get_runtime(rt).group(axis),
        async_op=True, point_to_point=True))


def run_wait(t: torch.Tensor) -> torch.Tensor:
    """Block until the collective that returned ``t`` is done; a failure (a dead peer, a
    timeout) becomes a CollectiveError naming the collective, axis and phase."""
    flight = STATE.flight.pop(id(t), None)
    if flight is None:
        # another Python object over the same buffer: no test program reaches this (the
        # gloo step-graph and recompute tests checked), but the functional runtime found
        # its works by storage, and a wait may meet such a wrapper in a program they miss
        ptr = t.untyped_storage().data_ptr()
        key = next((i for i, f in STATE.flight.items()
                    if ptr and f[6].untyped_storage().data_ptr() == ptr), None)
        if key is None:
            raise RuntimeError("shardc: the step program waits on a tensor that none of its "
                               "collectives in flight returned")
        flight = STATE.flight.pop(key)
    k, rt, collective, axis, ph, work = flight[:6]
    with guarded(rt, collective, axis, ph):
        if k is None:
            work.wait()
        else:
            with torch.profiler.record_function(f"shardc.wait#{k}"):
                work.wait()
    return t


def pack_into(buf: torch.Tensor, x: torch.Tensor, offset: int) -> torch.Tensor:
    """Copy ``x`` into ``buf[offset:offset + x.numel()]`` and return ``buf``: one member of
    a gradient bucket (``passes/bucket.py``), copied right after backward makes it, while it
    is still in cache, as DDP copies each gradient into its bucket. Returning ``buf`` chains
    the copies, so the graph's data dependences keep each one before the bucket's
    all-reduce (the passes see the chain; a bare in-place copy would be invisible to them)."""
    buf[offset:offset + x.numel()].view(x.shape).copy_(x)
    return buf


def mm_into(buf: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offset: int,
            shape: list[int]) -> torch.Tensor:
    """``a @ b`` written straight into ``buf[offset:offset + numel]`` (viewed as ``shape``)
    and return ``buf``: a weight gradient made by a GEMM goes into its bucket as it is
    computed, with no copy after it (``passes/into_bucket.py``). Chained through ``buf``
    as ``pack_into`` is."""
    n = shape[0] * shape[1]
    torch.mm(a, b, out=buf[offset:offset + n].view(shape))
    return buf


# What returns an alias of one of its arguments without an op schema to say so: the
# argument's index (shardc.planning.memory's liveness and passes/inplace.py read it).
ALIASES = {pack_into: 0, mm_into: 0}


def _count(rt: str, collective: str, axis: str, ph: str, t: torch.Tensor) -> int:
    r = get_runtime(rt)
    nbytes = t.numel() * t.element_size()
    r.sent[(collective, axis, ph)] += nbytes
    r.calls[(collective, axis, ph)] += 1
    return nbytes


# functional op -> (training-time function, collective name)
RUNNERS = {
    _fc.all_gather_into_tensor.default: (run_all_gather, "all_gather"),
    _fc.reduce_scatter_tensor.default: (run_reduce_scatter, "reduce_scatter"),
    _fc.all_reduce.default: (run_all_reduce, "all_reduce"),
    _fc.all_to_all_single.default: (run_all_to_all, "all_to_all"),
}
# every function a step program's collective node may call (a re-cut's all-to-all runs
# ``run_restripe``, passes/joint.py)
RUN_FUNCTIONS = frozenset({*(fn for fn, _ in RUNNERS.values()), run_restripe})
# what every wait node of a step program calls (the traced ``wait_tensor`` is swapped)
WAIT = run_wait
TRACED_WAIT = _fc.wait_tensor.default
