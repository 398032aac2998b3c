"""Expert parallelism in a routing region (``compile(expert_axes=(axis,))``).

A routing region (``routing.py``) keeps each rank's token-expert rows on the rank. With
the experts cut over ``axis`` (each rank stores E/G of every stacked expert weight, on its
expert dim), the part of the region that computes on the experts moves to them instead:
the *segment*, from the rows that enter the first grouped GEMM to the rows that leave the
last, with everything between (the activation, the gate, a bias looked up by the sorted
keys). The lowering emits it as one ``shardc::expert_region`` op (``runtime/experts.py``)
that sends the segment's row inputs to their experts' ranks, runs the segment's own ops
there, and sends its outputs back: one trip there and one back for a token, whatever the
experts compute.

The segment is the region's row values that lie on a path from one grouped GEMM to
another (a GEMM with its following GEMM's input), the GEMMs, and the lookups by the sorted
keys they read (so that the keys travel, one integer a row, not the looked-up rows). Its
outputs must be read only after its last node; otherwise (or when the GEMMs do not share
their offsets) each grouped GEMM is a segment of its own, which moves its own input and
output.

Each expert weight's storage is fixed before the lowering meets its first use (a
parameter is otherwise stored as its first use wants it: transformers transposes its
expert weights on their way to the GEMM, and a transpose of a parameter would keep it
whole); the views between it and its GEMM keep that layout (``Lowering.pinned``).
"""
from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from shardc.core.context import COMM
from shardc.core.errors import ShardcError
from shardc.core.ir import Val, source_of
from shardc.core.placement import Layout
from shardc.passes.rules.routing import (
    IGNORED,
    OFFS,
    ROWS,
    Region,
    gemm_operands,
    local_value,
    ndim_of,
    rows_layout,
    transformers_grouped_mm,
)
from shardc.runtime.experts import EXPERT_REGION, SEGMENTS, Segment
from shardc.runtime.grouped_gemm import GROUPED_MM

if TYPE_CHECKING:
    from shardc.passes.lower import Lowering

aten = torch.ops.aten

_ROW_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# ops between a stacked expert weight and its grouped GEMM that keep the expert dim first
_WEIGHT_VIEWS = {aten.transpose.int, aten.permute.default, aten._to_copy.default, aten.alias.default,
                 aten.detach.default, aten.contiguous.default, aten.clone.default}


class _Segment:
    """The nodes of one segment, in graph order, and what crosses its boundary."""

    def __init__(self, region: Region, nodes: list[fx.Node]) -> None:
        inside = set(nodes)
        self.nodes = nodes
        self.gemms = [n for n in nodes if n.target in region.gemms]
        # a metadata assert reads a value without using it (the lowering drops it)
        self.outputs = [n for n in nodes if any(u not in inside and u.target not in IGNORED
                                                for u in n.users)]
        self.rows: list[fx.Node] = []  # row values made outside: they travel
        self.offs: list[fx.Node] = []  # the offsets the GEMMs read: the experts' own made there
        self.others: list[fx.Node] = []  # the rest (weights, tables): this rank's copy
        for n in nodes:
            for a in n.all_input_nodes:
                if a in inside or a in self.rows or a in self.offs or a in self.others:
                    continue
                kind = region.kinds.get(a, (None,))[0]
                (self.rows if kind == ROWS else self.offs if kind == OFFS else self.others).append(a)
        self.weights = [gemm_operands(region, g)[1] for g in self.gemms]


def expert_rules(L: Lowering, region: Region) -> dict[fx.Node, Callable[[Lowering, fx.Node], Any]]:
    """The rules of the region's segments' nodes (each but the last emits nothing; the
    last emits the segment), and each expert weight's storage, fixed now."""
    axes = cut_axes(L.ctx.options.expert_axes, L.mesh)
    capacity = L.ctx.options.expert_capacity
    if not axes:
        if capacity is not None and region.gemms:
            raise ShardcError(
                f"shardc.compile: expert_capacity={capacity!r}, but on {L.mesh} expert_axes="
                f"{L.ctx.options.expert_axes!r} has one rank, so the experts are not cut and no rows "
                "travel: a capacity would not apply and the step would silently be dropless. Leave "
                "expert_capacity=None on this mesh, or cut the experts over an axis of more than one rank.")
        return {}
    out: dict[fx.Node, Callable[[Lowering, fx.Node], Any]] = {}
    segments = _segments(region)
    if capacity is not None and len(segments) > 1:
        g = segments[0].gemms[0]
        src = source_of(g)
        raise ShardcError(
            f"shardc.compile: expert_capacity={capacity!r}: the experts of {g.target} "
            f"({src.module}:{src.line}) run as {len(segments)} segments (a value between their "
            "grouped GEMMs is read outside the experts' path, or the GEMMs read different offsets), "
            "and a row dropped by one segment would still reach the next and what reads it between: "
            "a capacity is applied only where a layer's experts are one segment (docs/experts.md). "
            "Leave expert_capacity=None (dropless) for this model.")
    for seg in segments:
        for n in seg.nodes:
            out[n] = _segment_rule(region, seg)
        for w in seg.weights:
            _pin(L, w, axes)
    return out


def _segments(region: Region) -> list[_Segment]:
    graph = region.sort.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    rows = {n for n, (k, _) in region.kinds.items() if k == ROWS and n not in region.exits}
    gemms = sorted((n for n in region.kinds if n.target in region.gemms), key=order.__getitem__)
    if not gemms:
        return []
    down = _reach(gemms, lambda n: n.users, rows)
    up = _reach(gemms, lambda n: n.all_input_nodes, rows)
    inside = set(gemms) | (down & up)
    # lookups by the sorted keys (an expert's bias): made on the experts' side from the keys
    keyed = _made_from_keys(region, rows, order)
    grew = True
    while grew:
        grew = False
        for n in list(inside):
            for a in n.all_input_nodes:
                if a in keyed and a not in inside and not _is_keys(region, a):
                    inside.add(a)
                    grew = True
    nodes = sorted(inside, key=order.__getitem__)
    seg = _Segment(region, nodes)
    last = order[nodes[-1]]
    early = any(order[u] < last for o in seg.outputs for u in o.users
                if u not in inside and u.target not in IGNORED)
    # a region value other than rows and offsets (the permutation, the rank's own counts)
    # means this rank's order, which the experts' ranks do not have
    foreign = any(a in region.kinds for a in seg.others)
    if early or foreign or len(seg.offs) != 1:
        return [_Segment(region, [g]) for g in gemms]
    return [seg]


def _reach(start: list[fx.Node], step: Callable[[fx.Node], Any], within: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(start)
    while stack:
        for m in step(stack.pop()):
            if m in within and m not in seen:
                seen.add(m)
                stack.append(m)
    return seen


def _is_keys(region: Region, n: fx.Node) -> bool:
    return bool(n.target is operator.getitem and n.args[0] is region.sort and n.args[1] == 0)


def _made_from_keys(region: Region, rows: set[fx.Node], order: dict[fx.Node, int]) -> set[fx.Node]:
    """Row values made from the sorted keys alone (and values from outside the region)."""
    keyed: set[fx.Node] = set()
    for n in sorted(rows, key=order.__getitem__):
        if _is_keys(region, n):
            keyed.add(n)
            continue
        ins = [a for a in n.all_input_nodes if a in region.kinds]
        if ins and all(a in keyed for a in ins):
            keyed.add(n)
    return keyed


def cut_axes(axes: tuple[str, ...] | None, mesh: Any) -> tuple[str, ...]:
    """The axes of ``expert_axes`` that have ranks to cut over, in the order given (the
    first outermost)."""
    return tuple(a for a in axes or () if mesh.size(a) > 1)


def _pin(L: Lowering, w: Any, axes: tuple[str, ...]) -> None:
    """Store the parameter behind expert weight ``w`` cut on its expert dim over ``axes``
    (then over z, as any stored shard, if z is not one of them), before its first use
    decides otherwise."""
    while isinstance(w, fx.Node) and w.op == "call_function" and w.target in _WEIGHT_VIEWS:
        nd = ndim_of(w)
        if w.target is aten.permute.default and int(w.args[1][0]) % nd != 0:
            return
        if w.target is aten.transpose.int and 0 in (int(w.args[1]) % nd, int(w.args[2]) % nd):
            return
        w = w.args[0]
    role = L.roles.get(w.name) if isinstance(w, fx.Node) and w.op == "placeholder" else None
    if role is None or role[0] != "param":
        return
    name = role[1]
    shape = list(w.meta["val"].shape)
    if name not in L.storage and shape and shape[0] % math.prod(L.mesh.size(a) for a in axes) == 0:
        L.storage[name] = L._storage_for(_expert_cut(len(shape), axes), shape)
        L.pinned.add(name)


def _expert_cut(ndim: int, axes: tuple[str, ...]) -> Layout:
    return Layout(ndim, (axes,) + tuple(() for _ in range(ndim - 1)))


def _segment_rule(region: Region, seg: _Segment) -> Callable[[Lowering, fx.Node], Any]:
    def rule(L: Lowering, node: fx.Node) -> Any:
        if node is not seg.nodes[-1]:
            return None  # the segment is emitted at its last node, as one op
        return _emit_segment(L, region, seg)
    return rule


def _check(L: Lowering, region: Region, seg: _Segment) -> tuple[tuple[str, ...], int]:
    """(the experts' axes, their number), or a ShardcError saying why they cannot be cut."""
    given = L.ctx.options.expert_axes
    axes = cut_axes(given, L.mesh)
    g = seg.gemms[0]
    where = f"{g.target} ({L.src.module}:{L.src.line})"
    missing = [a for a in axes if region.axes is None or a not in region.axes]
    if missing:
        cut = " and ".join(region.axes) if region.axes else "no batch axis evenly"
        raise ShardcError(
            f"shardc.compile: expert_axes={given!r}, but the token-expert rows reaching the experts "
            f"of {where} are cut over {cut}, so no all-to-all over {missing[0]} can bring them to "
            "their experts' ranks (the tokens must be cut over that axis, evenly).")
    counts = {int(w.meta["val"].shape[0]) for w in seg.weights}
    if len(counts) != 1:
        raise ShardcError(f"shardc.compile: expert_axes={given!r}: the grouped GEMMs of {where} "
                          f"read weights of {sorted(counts)} experts; one number expected.")
    experts = counts.pop()
    ranks = math.prod(L.mesh.size(a) for a in axes)
    if experts % ranks:
        sizes = " x ".join(f"{a}={L.mesh.size(a)}" for a in axes)
        raise ShardcError(
            f"shardc.compile: expert_axes={given!r}: {where} has {experts} experts, which "
            f"{sizes} does not divide; each rank must hold as many.")
    return axes, experts


def _emit_segment(L: Lowering, region: Region, seg: _Segment) -> Any:
    axes, experts = _check(L, region, seg)
    weights = set(seg.weights)
    rows = [local_value(L, region, a) for a in seg.rows]
    offs = local_value(L, region, seg.offs[0])
    others, specs, strides, consts = [], [], [], {}
    for a in seg.others:
        v = L.env[a]
        if not isinstance(v, Val):
            consts[a] = v  # a constant of the traced program
            continue
        lay = _expert_cut(v.ndim, axes) if a in weights else Layout.replicate(v.ndim)
        others.append(L.to_layout(v, lay))
        specs.append((tuple(lay.clean(L.mesh).local_shape(list(v.val.shape), L.mesh)), v.val.dtype))
        strides.append(_local_strides(v.val, specs[-1][0]))
    key = f"{L.rt}:{seg.nodes[-1].name}"
    SEGMENTS[key] = Segment(_segment_fn(seg, consts),
                            [(tuple(a.meta["val"].shape[1:]), a.meta["val"].dtype) for a in seg.rows],
                            [(tuple(o.meta["val"].shape[1:]), o.meta["val"].dtype) for o in seg.outputs],
                            specs, strides)
    vals = tuple(o.meta["val"] for o in seg.outputs)
    capacity = float(L.ctx.options.expert_capacity or 0.0)
    op = L.emit(EXPERT_REGION, (rows, offs, others, experts, L.rt, ",".join(axes), key, capacity),
                layout=None, val=vals)
    op.meta[COMM] = {"collective": "all_to_all", "axis": axes[-1]}
    for i, o in enumerate(seg.outputs):
        lay = rows_layout(region.axes or (), ndim_of(o))
        n = L.emit(operator.getitem, (op, i), layout=lay, val=vals[i])
        L.env[o] = Val(n, lay.clean(L.mesh), vals[i])
    per = experts // math.prod(L.mesh.size(a) for a in axes)
    over = " x ".join(axes)
    where = (f"{axes[0]} coordinate c" if len(axes) == 1 else
             f"coordinates ({', '.join(axes)}), read as one number c with {axes[0]} outermost,")
    L.decisions.append(
        f"{seg.gemms[0].name} ({L.src.module}:{L.src.line}): the {experts} experts are cut over "
        f"{over}, {per} a rank (the rank at {where} holds experts {per}c to {per}c+{per - 1}); "
        f"{len(seg.nodes)} ops "
        f"({', '.join(n.name for n in seg.gemms)} and what lies between) run on the experts' "
        f"ranks: {len(seg.rows)} row input(s) go there and {len(seg.outputs)} output(s) come back by "
        f"all-to-all{'' if len(axes) == 1 else ', one axis at a time (' + ', then '.join(axes) + ')'}"
        + ("" if not capacity else
           f"; capacity factor {capacity:g}: each rank sends each expert at most "
           f"ceil({capacity:g} x its rows / {experts}) rows, padded to that many (every all-to-all "
           "the same size whatever the routing), and drops the rest (their expert output is zero; "
           "counted in sm.expert_load())"))
    return L.env[seg.nodes[-1]]


def _local_strides(whole: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a rank's part (``shape``) of a value laid out as ``whole`` is: its
    dims in the same order in memory (an expert weight's transposed view stays one)."""
    order = sorted(range(whole.dim()), key=lambda d: whole.stride(d), reverse=True)
    t = torch.empty([shape[d] for d in order], device="meta")
    return tuple(t.permute(sorted(range(len(order)), key=order.__getitem__)).stride())


def _segment_fn(seg: _Segment, consts: dict[fx.Node, Any]) -> fx.GraphModule:
    """The segment's own ops as a GraphModule: (rows..., offsets, others...) -> outputs.
    transformers' fallback grouped GEMM becomes shardc's (runtime/grouped_gemm.py: the
    same products, without its zero fills and strided copies)."""
    fallback = transformers_grouped_mm()
    g = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for i, a in enumerate(seg.rows):
        env[a] = g.placeholder(f"rows_{i}")
    offs = g.placeholder("offs")
    env[seg.offs[0]] = offs
    for i, a in enumerate(a for a in seg.others if a not in consts):
        env[a] = g.placeholder(f"other_{i}")
    env.update(consts)
    for n in seg.nodes:
        c = env[n] = g.node_copy(n, lambda a: env[a])
        if fallback is not None and n.target is fallback:
            c.target = GROUPED_MM
        if n.target in _ROW_VIEWS:
            # the traced view names the rows the whole region had; the experts' ranks
            # hold as many as were routed to them
            shape = list(c.args[1])
            if -1 in shape[1:]:
                raise ShardcError(f"shardc.compile: cannot run {n.format_node()} on the experts' "
                                  "rows: its shape has -1 past the rows.")
            c.args = (c.args[0], [-1, *shape[1:]], *c.args[2:])
    g.output([env[o] for o in seg.outputs])
    return fx.GraphModule(torch.nn.Module(), g)
