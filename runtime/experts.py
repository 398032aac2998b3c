"""Expert parallelism at run time: the expert side of a routing region, on experts cut
over a mesh axis.

Inside a routing region (``passes/rules/routing.py``) each rank holds its own token-expert
rows, sorted by expert, and the offsets of each expert's run. With
``compile(expert_axes=(axis,))`` the experts' stacked weights ``[E, ...]`` are cut on their
expert dim over ``axis``: the rank at coordinate ``c`` holds experts ``c*E/G .. (c+1)*E/G``.
The lowering cuts out of the region the *segment* that runs on the experts: from the rows
entering the first grouped GEMM to the rows leaving the last (the activation, the gate,
an expert's bias looked up by its key, in between). ``shardc::expert_region`` runs it:

1. the ranks of ``axis`` exchange how many rows each sends each expert (an all-to-all of
   the E counts; over two axes, ``expert_axes=("z", "data")``, steps 1-2 are a leg per
   axis, the outer first, each with the counts of the experts still reachable, and step 4
   goes back the same legs);
2. each rank sends every row to the rank of its expert (one all-to-all per row input of the
   segment, split sizes from the counts: the rows are sorted by expert, so each
   destination's rows are one run);
3. the receiver orders what came by local expert (one run per expert, each source's rows
   in source order) and runs the segment, the model's own ops, on its own experts;
4. the outputs go back by the reverse all-to-all, each row to its place in the sender's
   sorted order.

So a token travels once to its expert and once back, whatever the experts compute.
Dropless: every row reaches its expert, so the result equals one device's row for row.
The backward mirrors it (the output gradients travel to the experts, the input gradients
back) and is autograd's over the segment's ops; the local experts' weight gradient is
whole over ``axis``, since every row that met an expert, from any rank, met it there.

With a capacity factor ``f`` (``compile(expert_capacity=f)``) each rank sends each expert
at most ``C = ceil(f * N / E)`` of its ``N`` rows, the first ``C`` of that expert's run in
the sorted order, and pads every run to exactly ``C`` rows (zero rows; an integer row
input, the sorted keys, takes the run's expert number): every all-to-all then moves
``E * C`` rows whatever the routing, so no counts are exchanged, and a rank's experts
compute ``E * C`` rows. A row past the capacity is dropped: its output is zero (the token
keeps its other experts' outputs and its residual) and no gradient reaches it through the
experts. ``ExpertLoad.dropped_per_expert`` counts the drops.

Dropless, how many rows a rank receives depends on the routing, so nothing of steps 2-4
has a shape a trace can know. The op is therefore one opaque ``torch.library`` custom op whose outputs
have the sender's rows, and what its backward needs (the segment's autograd graph, the
split sizes, the order) waits on the rank in ``STASH`` under the node's key, as autograd's
saved tensors would. Its backward is a second custom op, so the traced step program and
plain autograd call the same code.

Every all-to-all is counted by the runtime (``Runtime.count``) as the program's other
collectives are. Those that carry the received rows (the outputs going back, and in
backward the input gradients going back) move a number of rows that depends on the
routing: the rows each node received at each leg in its last call are kept in ``Runtime.routed``, from
which ``shardc.comm_report`` reports them exactly once a step has run (before, from uniform
routing, and says so).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from shardc.runtime.collectives import get_runtime, guarded


class _Stash(threading.local):
    """Per thread: a threaded world runs each rank as a thread."""

    def __init__(self) -> None:
        self.saved: dict[tuple[str, str], "_Saved"] = {}
        # the same, for autograd's context to take (``_setup``): several calls of one
        # segment can await their backward at once (a pipeline's micro-batches in
        # flight), and each must get its own
        self.last: dict[tuple[str, str], "_Saved"] = {}


STASH = _Stash()


@dataclass
class Segment:
    """What the expert side of a routing region computes, made by the lowering: ``fn``
    takes the received rows (one tensor per row input, ordered by local expert), the
    local experts' offsets, then ``others`` (the local experts' weights, tables, ...), and
    returns the rows to send back. The specs give the traced shapes their fakes need."""
    fn: Callable[..., Any]
    rows: list[tuple[tuple[int, ...], torch.dtype]]  # each row input: (shape past dim 0, dtype)
    outs: list[tuple[tuple[int, ...], torch.dtype]]  # each output: the same
    others: list[tuple[tuple[int, ...], torch.dtype]]  # each other input: (local shape, dtype)
    # each other input's strides on the rank (an expert weight comes as the transposed view
    # the model made of it; its gradient goes back in that layout)
    other_strides: list[tuple[int, ...]]


# by the program node's key (``runtime key:node``): each process makes its own at compile
SEGMENTS: dict[str, Segment] = {}


@dataclass
class ExpertLoad:
    """How one expert segment's rows were spread in its last call, on this rank
    (``ShardedModule.expert_load``): imbalance is what makes expert parallelism slow, the
    rank with the most rows setting everyone's pace."""
    axis: str  # the axes the experts are cut over, comma-separated, outermost first
    sent_per_expert: list[int]  # this rank's token-expert rows bound for each expert (all E)
    received_per_rank: list[int]  # rows this rank's experts got from each rank of the last axis
    received_per_expert: list[int]  # rows each of this rank's experts got, from every rank
    # with a capacity factor: this rank's rows for each expert past its capacity, dropped
    # (all zero dropless); the received rows then include the padding, which is computed
    dropped_per_expert: list[int] = dataclasses.field(default_factory=list)

    def plus(self, other: "ExpertLoad") -> "ExpertLoad":
        """Both calls' rows (a pipeline step's micro-batches)."""
        def add(a: list[int], b: list[int]) -> list[int]:
            return [x + y for x, y in zip(a, b)]
        return ExpertLoad(self.axis, add(self.sent_per_expert, other.sent_per_expert),
                          add(self.received_per_rank, other.received_per_rank),
                          add(self.received_per_expert, other.received_per_expert),
                          add(self.dropped_per_expert, other.dropped_per_expert))


def capacity_rows(factor: float, rows: int, experts: int) -> int:
    """The rows a rank sends each expert under capacity factor ``factor``, of its ``rows``
    token-expert rows (GShard's and Megatron's rule: the factor times an even share)."""
    return max(1, math.ceil(factor * rows / experts))


@dataclass
class _Saved:
    leaves: list[torch.Tensor]  # the segment's inputs (received rows, then others), as leaves
    outs: list[torch.Tensor]  # its outputs, attached to the leaves by autograd
    hops: list["_Hop"]  # the way the rows came
    pad: "_Pad | None" = None  # with a capacity: where the kept rows sit among the slots
    recomputed: bool = False  # made by a block's recompute, for the backward that follows


@contextlib.contextmanager
def _autograd_inside() -> Iterator[None]:
    """Record autograd inside a custom op: its autograd kernel runs the op below the
    autograd dispatch keys (and a step program runs without grad), but the segment's
    backward is autograd's over the same ops, so they are recorded here."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "AutogradCPU",
                "AutogradCUDA", "ADInplaceOrView"):
        k = getattr(torch._C.DispatchKey, key, None)
        if k is not None:
            exclude = exclude.remove(k)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad():
        yield


def _a2a(x: torch.Tensor, out_rows: list[int], in_rows: list[int], rt: str, axis: str,
         phase: str) -> torch.Tensor:
    r = get_runtime(rt)
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    r.count("all_to_all", axis, phase, x)
    with guarded(rt, "all_to_all", axis, phase):
        dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=r.group(axis))
    return out


@dataclass
class _Hop:
    """One all-to-all leg of the way to the experts, over one axis, and how to undo it."""
    axis: str
    order: torch.Tensor  # row j sorted by expert is received (source-major) row order[j]
    sent: list[int]  # rows this rank sent each rank of the axis
    got: list[int]  # rows it got from each


def _hop(rows: list[torch.Tensor], counts: torch.Tensor, base: int, span: int, rt: str,
         axis: str, phase: str, static: bool = False
         ) -> tuple[list[torch.Tensor], torch.Tensor, int, int, _Hop]:
    """Move ``rows`` (sorted by expert; ``counts[e]`` of expert e, nonzero only for the
    experts ``base .. base+span`` this rank's position so far leads to) one axis closer to
    their experts: each row goes to the rank of the axis whose coordinate is its expert's
    along that axis. Returns the rows received, sorted by expert again, their counts, and
    the experts they can still reach (the range of this rank's coordinate). ``static``:
    every rank holds the same counts (padded to a capacity), so none are exchanged."""
    r = get_runtime(rt)
    g = r.mesh.size(axis)
    sub = span // g
    mine = counts[base:base + span].contiguous()
    if static:
        recv = mine.clone()
    else:
        recv = torch.empty_like(mine)
        r.count("all_to_all", axis, phase, mine)
        with guarded(rt, "all_to_all", axis, phase):
            dist.all_to_all_single(recv, mine, group=r.group(axis))
    by_source = recv.view(g, sub)  # [source, expert of this rank's range]: its rows
    sent, got = mine.view(g, sub).sum(1).tolist(), by_source.sum(1).tolist()
    received = [_a2a(x, got, sent, rt, axis, phase) for x in rows]
    # received rows come source-major, each source's expert by expert; the experts want
    # them expert-major: a stable sort of the expert numbers keeps each expert's rows in
    # source order
    expert_of = torch.repeat_interleave(torch.arange(sub, device=counts.device).repeat(g),
                                        by_source.reshape(-1))
    order = torch.sort(expert_of, stable=True).indices
    new_base = base + r.coord(axis) * sub
    new_counts = torch.zeros_like(counts)
    new_counts[new_base:new_base + sub] = by_source.sum(0)
    return [x[order] for x in received], new_counts, new_base, sub, _Hop(axis, order, sent, got)


@dataclass
class _Pad:
    """Under a capacity: the rank's sorted rows ``src`` sit at slots ``dst`` of the padded
    runs (expert e's run is slots e*C .. e*C+C-1); its other rows were dropped."""
    src: torch.Tensor
    dst: torch.Tensor
    rows: int  # the rank's rows, kept or not
    slots: int  # E * C


def _padded(rows: list[torch.Tensor], counts: torch.Tensor, cap: int
            ) -> tuple[list[torch.Tensor], _Pad, list[int]]:
    """``rows`` (sorted by expert, ``counts[e]`` of expert e) as runs of exactly ``cap``
    rows an expert: the first ``cap`` of each run, then padding (zero rows; an integer
    input, the sorted keys, holds the run's expert, so what it looks up is in range).
    Returns the padded rows, where the kept rows went, and the rows dropped per expert."""
    experts = counts.numel()
    dev = counts.device
    expert_of = torch.repeat_interleave(torch.arange(experts, device=dev), counts)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(expert_of.numel(), device=dev) - starts[expert_of]
    src = (pos < cap).nonzero().squeeze(1)
    dst = expert_of[src] * cap + pos[src]
    slots = experts * cap
    slot_expert = torch.arange(experts, device=dev).repeat_interleave(cap)
    out = []
    for x in rows:
        if x.is_floating_point():
            z = x.new_zeros((slots, *x.shape[1:]))
        else:
            z = slot_expert.to(x.dtype).view(-1, *([1] * (x.dim() - 1))).expand(slots, *x.shape[1:]).clone()
        z[dst] = x[src]
        out.append(z)
    pad = _Pad(src, dst, rows[0].shape[0], slots)
    return out, pad, (counts - cap).clamp(min=0).tolist()


def _scatter_rows(xs: list[torch.Tensor], n: int, put: torch.Tensor, take: torch.Tensor
                  ) -> list[torch.Tensor]:
    """Each x's rows ``take`` at rows ``put`` of ``n`` zero rows."""
    out = []
    for x in xs:
        z = x.new_zeros((n, *x.shape[1:]))
        z[put] = x[take]
        out.append(z)
    return out


def _pad(xs: list[torch.Tensor], pad: _Pad | None) -> list[torch.Tensor]:
    """Rows in the rank's sorted order to the padded slots (what the dropped rows held is
    not sent)."""
    return xs if pad is None else _scatter_rows(xs, pad.slots, pad.dst, pad.src)


def _unpad(xs: list[torch.Tensor], pad: _Pad | None) -> list[torch.Tensor]:
    """The padded slots back to the rank's sorted rows; a dropped row gets zeros."""
    return xs if pad is None else _scatter_rows(xs, pad.rows, pad.src, pad.dst)


def _back(xs: list[torch.Tensor], hops: list[_Hop], rt: str, phase: str) -> list[torch.Tensor]:
    """Undo ``hops``, the last first: each row back to where it came from."""
    for h in reversed(hops):
        inv = torch.argsort(h.order)
        xs = [_a2a(x[inv], h.sent, h.got, rt, h.axis, phase) for x in xs]
    return xs


def _there(xs: list[torch.Tensor], hops: list[_Hop], rt: str, phase: str) -> list[torch.Tensor]:
    """Send ``xs`` the way ``hops`` went (the gradients of what came back)."""
    for h in hops:
        xs = [_a2a(x, h.got, h.sent, rt, h.axis, phase)[h.order] for x in xs]
    return xs


# the schemas spelled out: torch 2.6's schema inference takes no ``list[Tensor]``
@torch.library.custom_op("shardc::expert_region", mutates_args=(), schema=(
    "(Tensor[] rows, Tensor offs, Tensor[] others, int experts, str rt, str axis, str key, "
    "float capacity) -> Tensor[]"))
def expert_region(rows: list[torch.Tensor], offs: torch.Tensor, others: list[torch.Tensor],
                  experts: int, rt: str, axis: str, key: str, capacity: float) -> list[torch.Tensor]:
    """The expert side of a routing region over ``experts`` experts cut over ``axis``:
    ``rows`` (each sorted by expert, ``offs`` their runs' ends) go to their experts' ranks,
    ``SEGMENTS[key]`` runs there on this rank's experts, and its outputs come back, each
    row to its place. ``capacity``: a capacity factor (0: dropless)."""
    seg = SEGMENTS[key]
    r = get_runtime(rt)
    phase = "backward" if r.recomputing else "forward"
    ends = offs.to(torch.int64)
    counts = first = torch.diff(ends, prepend=ends.new_zeros(1))  # rows per expert, this rank's
    pad, dropped = None, [0] * experts
    if capacity > 0:
        cap = capacity_rows(capacity, rows[0].shape[0], experts)
        rows, pad, dropped = _padded(rows, counts, cap)
        counts = torch.full_like(counts, cap)
    base, span, hops = 0, experts, []
    for a in axis.split(","):  # outer axis first: the rows stay grouped by destination
        rows, counts, base, span, hop = _hop(rows, counts, base, span, rt, a, phase, pad is not None)
        hops.append(hop)
    local = counts[base:base + span]
    load = ExpertLoad(axis, first.tolist(), hops[-1].got, local.tolist(), dropped)
    routed = [sum(h.got) for h in hops]
    if r.routed_adds and key in r.routed:
        if not r.recomputing:  # a recomputed block routes its rows again: the same ones
            r.expert_load[key] = r.expert_load[key].plus(load)
            r.routed[key] = [a + b for a, b in zip(r.routed[key], routed)]
    else:
        r.expert_load[key] = load
        r.routed[key] = routed
    with _autograd_inside():
        # an expert weight stays the view the model made of it (transformers transposes it
        # for the GEMM): shardc's grouped GEMM reads it, and writes its gradient, in place
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in [*rows, *others]]
        outs = list(seg.fn(*leaves[:len(rows)], torch.cumsum(local, 0).to(offs.dtype),
                           *leaves[len(rows):]))
    STASH.saved[(rt, key)] = STASH.last[(rt, key)] = _Saved(leaves, outs, hops, pad, r.recomputing)
    return _unpad(_back([o.detach() for o in outs], hops, rt, phase), pad)


@expert_region.register_fake
def _(rows: list[torch.Tensor], offs: torch.Tensor, others: list[torch.Tensor], experts: int,
      rt: str, axis: str, key: str, capacity: float) -> list[torch.Tensor]:
    n = rows[0].shape[0]
    return [rows[0].new_empty((n, *shape), dtype=dtype) for shape, dtype in SEGMENTS[key].outs]


@torch.library.custom_op("shardc::expert_region_backward", mutates_args=(), schema=(
    "(Tensor[] grads, str rt, str axis, str key) -> Tensor[]"))
def expert_region_backward(grads: list[torch.Tensor], rt: str, axis: str, key: str
                           ) -> list[torch.Tensor]:
    """The gradients of ``expert_region``'s floating inputs: its rows (sent back to their
    ranks) and its others (this rank's experts', whole over ``axis``; a table's, this
    rank's part of the sum)."""
    s = STASH.saved.pop((rt, key))
    received = _there(_pad(list(grads), s.pad), s.hops, rt, "backward")
    wants = [t for t in s.leaves if t.requires_grad]
    with _autograd_inside():
        found = torch.autograd.grad(s.outs, wants, received, allow_unused=True)
    by_leaf = {id(t): g for t, g in zip(wants, found)}
    n_rows = len(SEGMENTS[key].rows)
    rows: list[torch.Tensor] = []
    others: list[torch.Tensor] = []
    for i, t in enumerate(s.leaves):
        if not t.requires_grad:
            continue
        g = by_leaf[id(t)]
        if i < n_rows:
            g = torch.zeros(t.shape, dtype=t.dtype, device=t.device) if g is None else g.contiguous()
            rows.append(g)
        else:  # in the input's own layout, which the fake below gives the trace
            others.append(_laid_out_as(t, g))
    return _unpad(_back(rows, s.hops, rt, "backward"), s.pad) + others


def _laid_out_as(t: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """``g`` (or zeros for None) laid out as ``t`` (``empty_like``: its dims' order in
    memory, what the lowering's ``_local_strides`` tells the trace)."""
    if g is not None and g.stride() == t.stride():
        return g
    out = torch.empty_like(t)
    return out.zero_() if g is None else out.copy_(g)


@expert_region_backward.register_fake
def _(grads: list[torch.Tensor], rt: str, axis: str, key: str) -> list[torch.Tensor]:
    seg = SEGMENTS[key]
    n = grads[0].shape[0]
    g0 = grads[0]
    return [g0.new_empty((n, *shape), dtype=dtype) for shape, dtype in seg.rows if dtype.is_floating_point] + \
        [g0.new_empty_strided(shape, stride, dtype=dtype)
         for (shape, dtype), stride in zip(seg.others, seg.other_strides) if dtype.is_floating_point]


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    rows, _offs, others, _experts, rt, axis, key, _capacity = inputs
    ctx.info = (rt, axis, key)
    ctx.saved = STASH.last.pop((rt, key), None)  # None while a trace runs the fake op
    ctx.outs = [(o.shape, o.dtype, o.device) for o in output]
    ctx.floating = ([t.is_floating_point() for t in rows], [t.is_floating_point() for t in others])


def _backward(ctx: Any, grads: list[torch.Tensor]) -> tuple:
    rt, axis, key = ctx.info
    seg = SEGMENTS[key]
    grads = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
             for g, (shape, dtype, device) in zip(grads, ctx.outs)]
    held = STASH.saved.get((rt, key))
    # this call's, not the segment's latest call's; but a block's recompute ran the call
    # again just now, and autograd's saved tensors of the first run are the recompute's
    if ctx.saved is not None and not (held is not None and held.recomputed):
        STASH.saved[(rt, key)] = ctx.saved
    found = iter(expert_region_backward(list(grads), rt, axis, key))
    rows_f, others_f = ctx.floating
    g_rows = [next(found) if f else None for f in rows_f]
    g_others = [next(found) if f else None for f in others_f]
    assert len(seg.rows) == len(g_rows)
    return g_rows, None, g_others, None, None, None, None, None


expert_region.register_autograd(_backward, setup_context=_setup)

# the ops as graph nodes' targets (a CustomOpDef is not one)
EXPERT_REGION = torch.ops.shardc.expert_region.default
EXPERT_REGION_BACKWARD = torch.ops.shardc.expert_region_backward.default
