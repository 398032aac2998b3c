"""The communication report: every collective of one training step, from the program.

Built from the compiled graph alone (no communication, works under the "fake" backend
and on meta tensors). ``bytes`` is what one rank sends under the ring algorithm
(``runtime.volume``); the runtime counts the same quantity on the tensors it really hands
to torch.distributed, so a test can hold the two equal byte for byte.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from typing import Any, Iterable, cast

import sympy
import torch
import torch.fx as fx
from rich.console import Console
from rich.table import Table

from shardc.core.context import (
    GLOBAL_VAL,
    KIND,
    PARAM,
    PLACEMENT,
    REQUIRES_GRAD,
    SOURCE,
)
from shardc.core.mesh import ALL_AXES, CUT_AXES, Mesh
from shardc.core.placement import Layout
from shardc.core.precision import Precision, reduce_dtype
from shardc.passes.step_nodes import collective_nodes
from shardc.runtime import collectives as C
from shardc.runtime.experts import EXPERT_REGION, capacity_rows
from shardc.runtime.ring import RING_ATTENTION
from shardc.runtime.volume import as_number, ring_bytes

PHASES = ("forward", "backward", "step")
SYMBOLS = {a: sympy.Symbol(f"G_{a}", positive=True, integer=True) for a in ALL_AXES}


@dataclass
class CommRow:
    node: str
    op: str
    module: str
    param: str | None
    collective: str
    axis: str
    phase: str
    bytes: int | float
    # bytes = ring(collective, G_axis) * numerator * (G_axis if times_axis) / prod(G_d, divs):
    # the same number for any mesh whose program has this structure
    numerator: int = field(default=0, compare=False, repr=False)
    divs: tuple[str, ...] = field(default=(), compare=False, repr=False)
    times_axis: bool = field(default=False, compare=False, repr=False)

    @property
    def formula(self) -> Any:
        """The volume as a sympy expression in the axis sizes G_x, G_y, G_z, G_data."""
        n = sympy.Integer(self.numerator) * (SYMBOLS[self.axis] if self.times_axis else 1)
        for d in self.divs:
            n /= SYMBOLS[d]
        return ring_bytes(self.collective, SYMBOLS[self.axis], n)

    def bytes_for(self, sizes: dict[str, int]) -> Fraction:
        """This row's bytes on another mesh of the same structure (no sympy: fast)."""
        n = Fraction(self.numerator * (sizes[self.axis] if self.times_axis else 1))
        for d in self.divs:
            n /= sizes[d]
        return ring_bytes(self.collective, sizes[self.axis], 1) * n

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["divs"] = list(self.divs)
        d["formula"] = str(self.formula) if self.numerator else None
        return d


def _elsize(val: Any) -> int:
    return torch.empty((), dtype=val.dtype).element_size() if isinstance(val, torch.Tensor) else 4


def _dtype_size(dtype: Any) -> int:
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 0


def _local_numel(n: fx.Node, mesh: Mesh) -> int:
    val, lay = n.meta.get(GLOBAL_VAL), n.meta.get(PLACEMENT)
    if not isinstance(val, torch.Tensor):
        raise AssertionError(f"no global value for {n.format_node()}")
    shape = list(val.shape)
    if lay is None:
        return math.prod(shape)
    return math.prod(lay.local_shape(shape, mesh))


def _terms(n: fx.Node) -> tuple[int, tuple[str, ...]]:
    """(global bytes, axes that divide them) of a node's local value."""
    val, lay = n.meta[GLOBAL_VAL], n.meta.get(PLACEMENT)
    num = math.prod(val.shape) * _elsize(val)
    divs = tuple(a for axes in lay.dims for a in axes) if lay is not None else ()
    return num, divs


def _param_of(n: Any) -> str | None:
    """The parameter a collective moves: follow its input up through slices and gathers."""
    seen = 0
    while n is not None and seen < 12:
        if n.op == "placeholder":
            return n.meta.get(PARAM)
        if n.meta.get(KIND) in ("slice", "collective", "wait") or n.target in (
                C.concat_gathered, C.concat_gathered_interleaved):
            n = n.args[0]
            seen += 1
            continue
        return None
    return None


def build_rows(gm: fx.GraphModule, mesh: Mesh, storage: dict[str, Layout],
               reduce_params: dict[str, list[str]], param_vals: dict[str, Any],
               policy: Precision | None = None, routed: dict[str, list[int]] | None = None
               ) -> list[CommRow]:
    """``policy``: the precision policy (the step reductions run in its reduce dtype
    where that is narrower than the parameter's); ``routed``: the rows each expert segment
    received at each hop in the last step (``Runtime.routed``), where one has run."""
    policy = policy or Precision(torch.float32, torch.float32)
    rows: list[CommRow] = []

    def src(n: fx.Node) -> tuple[str, str]:
        s = n.meta.get(SOURCE)
        return (getattr(s, "op", "") or "", getattr(s, "module", "") or "")

    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        op, module = src(n)
        if n.target is C.all_gather_start:
            inp = n.args[0]
            axis, mode = n.args[2], n.args[3]
            g = mesh.size(axis)
            # a gather that casts (precision) sends its dtype and reduces the gradient in
            # its reduce dtype; else both move the input's dtype
            own = _elsize(inp.meta[GLOBAL_VAL])
            sent = _dtype_size(n.kwargs.get("dtype")) or own
            reduced = _dtype_size(n.kwargs.get("reduce_dtype")) or own
            elems = _local_numel(inp, mesh)
            num, divs = _terms(inp)
            param = _param_of(inp)
            rows.append(CommRow(n.name, op, module, param, "all_gather", axis, "forward",
                                as_number(ring_bytes("all_gather", g, elems * sent)),
                                num // own * sent, divs))
            if mode == "reduce_scatter" and inp.meta.get(REQUIRES_GRAD):
                rows.append(CommRow(n.name, op, module, param, "reduce_scatter", axis, "backward",
                                    as_number(ring_bytes("reduce_scatter", g, g * elems * reduced)),
                                    num // own * reduced, divs, True))
        elif n.target in (C.reduce_scatter_start, C.all_to_all_start):
            # partial -> shard (backward: all-gather of the gradient), or shard(i) ->
            # shard(j) (backward: the reverse all-to-all)
            inp = n.args[0]
            axis = n.args[2]
            g = mesh.size(axis)
            nb = _local_numel(inp, mesh) * _elsize(inp.meta[GLOBAL_VAL])
            num, divs = _terms(inp)
            param = _param_of(inp)
            fwd, bwd = (("reduce_scatter", "all_gather") if n.target is C.reduce_scatter_start
                        else ("all_to_all", "all_to_all"))
            rows.append(CommRow(n.name, op, module, param, fwd, axis, "forward",
                                as_number(ring_bytes(fwd, g, nb)), num, divs))
            if inp.meta.get(REQUIRES_GRAD):
                # the all-gather's input is the gradient of this rank's block: 1/G of nb
                grad_in = Fraction(nb, g) if bwd == "all_gather" else Fraction(nb)
                bdivs = divs + (axis,) if bwd == "all_gather" else divs
                rows.append(CommRow(n.name, op, module, param, bwd, axis, "backward",
                                    as_number(ring_bytes(bwd, g, grad_in)), num, bdivs))
        elif n.target in (C.all_reduce_start, C.grad_all_reduce):
            # all_reduce_start sums a partial forward; grad_all_reduce sums a gradient
            inp = n.args[0]
            axis = n.args[2]
            phase = "forward" if n.target is C.all_reduce_start else "backward"
            nb = _local_numel(inp, mesh) * _elsize(inp.meta[GLOBAL_VAL])
            rows.append(CommRow(n.name, op, module, _param_of(inp), "all_reduce", axis, phase,
                                as_number(ring_bytes("all_reduce", mesh.size(axis), nb)), *_terms(inp)))
        elif n.target is EXPERT_REGION:
            rows += expert_rows(n, mesh, routed)
        elif n.target is RING_ATTENTION:
            rows += ring_rows(n, mesh, op, module)
    for name, axes in reduce_params.items():
        val = param_vals[name]
        lay = storage[name]
        el = _dtype_size(reduce_dtype(val.dtype, policy) or val.dtype)
        nb = math.prod(lay.local_shape(list(val.shape), mesh)) * el
        num = math.prod(val.shape) * el
        divs = tuple(a for d in lay.dims for a in d)
        module = name.rsplit(".", 1)[0] if "." in name else ""
        for axis in axes:
            rows.append(CommRow(f"grad:{name}", "gradient reduction", module, name, "all_reduce",
                                axis, "step", as_number(ring_bytes("all_reduce", mesh.size(axis), nb)),
                                num, divs))
    return rows


# the label of an expert row whose bytes the last step's routing decided
ROUTED = "routed, last step"


def expert_rows(n: fx.Node, mesh: Mesh, routed: dict[str, list[int]] | None) -> list[CommRow]:
    """The all-to-alls of one expert segment (``runtime.experts.expert_region``), one row
    each, in the order it issues them. Its experts are cut over one axis or several; the
    rows go one axis at a time (a hop), outer axis first. Each hop: the counts of the
    experts still reachable; each row input onward (forward). Then each output back, the
    last hop first. In backward: each output's gradient onward, each floating input's
    gradient back. The first hop sends the rank's own rows (a fixed number); any other
    leg carries rows the routing decided: before a step they are taken as uniform (as
    many as the rank's own) and the row says so; after one, they are the last step's."""
    rows_in, _offs, _others, experts, _rt, axes, key, capacity = cast(tuple[Any, ...], n.args)
    module = getattr(n.meta.get(SOURCE), "module", "") or ""
    hops = axes.split(",")
    got = (routed or {}).get(key)
    sent = _local_numel(rows_in[0], mesh) // max(1, math.prod(rows_in[0].meta[GLOBAL_VAL].shape[1:]))
    n_global = int(rows_in[0].meta[GLOBAL_VAL].shape[0])
    divs = tuple(a for a in (n.meta.get(PLACEMENT) or _first_layout(n)).dims[0])
    outs = list(n.meta[GLOBAL_VAL])
    floating_in = [x.meta[GLOBAL_VAL] for x in rows_in if x.meta[GLOBAL_VAL].dtype.is_floating_point]
    label = "uniform-routing estimate" if got is None else ROUTED
    if capacity:
        return _capped_expert_rows(n, mesh, module, hops, experts * capacity_rows(capacity, sent, experts),
                                   outs, floating_in)

    def row(what: str, phase: str, axis: str, t: Any, held: int | None) -> CommRow:
        """``held``: the rows sent, when the routing decided them (None: the rank's own)."""
        per_row = math.prod(t.shape[1:]) * _elsize(t)
        g = mesh.size(axis)
        if held is None or got is None:
            fixed = held is None
            return CommRow(n.name, what if fixed else f"{what} ({label})", module, None, "all_to_all",
                           axis, phase, as_number(ring_bytes("all_to_all", g, sent * per_row)),
                           n_global * per_row, divs)
        nb = held * per_row  # exact: this rank's last step
        return CommRow(n.name, f"{what} ({label})", module, None, "all_to_all", axis, phase,
                       as_number(ring_bytes("all_to_all", g, nb)), nb, ())

    def there(k: int) -> int | None:  # rows held before hop k (None: the rank's own)
        return None if k == 0 else (got[k - 1] if got is not None else -1)

    out = []
    span = experts
    for k, axis in enumerate(hops):
        nb = span * 8  # the counts of the experts still reachable, int64
        out.append(CommRow(n.name, "expert counts", module, None, "all_to_all", axis, "forward",
                           as_number(ring_bytes("all_to_all", mesh.size(axis), nb)), nb, ()))
        span //= mesh.size(axis)
        out += [row("expert dispatch", "forward", axis, x.meta[GLOBAL_VAL], there(k)) for x in rows_in]
    for k in reversed(range(len(hops))):
        out += [row("expert combine", "forward", hops[k], o, got[k] if got else -1) for o in outs]
    if n.meta.get(REQUIRES_GRAD):
        for k, axis in enumerate(hops):
            out += [row("expert dispatch (gradient)", "backward", axis, o, there(k)) for o in outs]
        for k in reversed(range(len(hops))):
            out += [row("expert combine (gradient)", "backward", hops[k], t, got[k] if got else -1)
                    for t in floating_in]
    return out


def _capped_expert_rows(n: fx.Node, mesh: Mesh, module: str, hops: list[str], slots: int,
                        outs: list[Any], floating_in: list[Any]) -> list[CommRow]:
    """An expert segment under a capacity factor: every leg moves the ``slots`` padded rows
    (E x the capacity) whatever the routing, so every row is exact before any step, and
    no counts are exchanged."""
    def row(what: str, phase: str, axis: str, t: Any) -> CommRow:
        nb = slots * math.prod(t.shape[1:]) * _elsize(t)
        return CommRow(n.name, f"{what} (padded to capacity)", module, None, "all_to_all", axis, phase,
                       as_number(ring_bytes("all_to_all", mesh.size(axis), nb)), nb, ())

    rows_in = cast(list[fx.Node], n.args[0])
    out = [row("expert dispatch", "forward", axis, x.meta[GLOBAL_VAL]) for axis in hops for x in rows_in]
    out += [row("expert combine", "forward", axis, o) for axis in reversed(hops) for o in outs]
    if n.meta.get(REQUIRES_GRAD):
        out += [row("expert dispatch (gradient)", "backward", axis, o) for axis in hops for o in outs]
        out += [row("expert combine (gradient)", "backward", axis, t) for axis in reversed(hops)
                for t in floating_in]
    return out


def ring_rows(n: fx.Node, mesh: Mesh, op: str, module: str) -> list[CommRow]:
    """A ring attention's hops (``runtime.ring``): its keys and values make G-1 hops, the
    bytes of an all-gather of them; in backward again, and their gradients (in at least
    float32) G-1 hops back, the bytes of a reduce-scatter."""
    q, k, v = cast(tuple[fx.Node, ...], n.args[:3])
    axis = cast(str, n.args[-1])
    g = mesh.size(axis)
    el = _elsize(k.meta[GLOBAL_VAL])
    grad_el = _dtype_size(torch.promote_types(k.meta[GLOBAL_VAL].dtype, torch.float32))
    numel = _local_numel(k, mesh) + _local_numel(v, mesh)
    whole = math.prod(k.meta[GLOBAL_VAL].shape) + math.prod(v.meta[GLOBAL_VAL].shape)
    divs = tuple(a for axes in k.meta[PLACEMENT].dims for a in axes)
    what = f"{op} (ring: keys and values)"
    rows = [CommRow(n.name, what, module, None, "all_gather", axis, "forward",
                    as_number(ring_bytes("all_gather", g, numel * el)), whole * el, divs)]
    if any(t.meta.get(REQUIRES_GRAD) for t in (q, k, v)):
        rows.append(CommRow(n.name, what, module, None, "all_gather", axis, "backward",
                            as_number(ring_bytes("all_gather", g, numel * el)), whole * el, divs))
        rows.append(CommRow(n.name, f"{op} (ring: key and value gradients)", module, None,
                            "reduce_scatter", axis, "backward",
                            as_number(ring_bytes("reduce_scatter", g, g * numel * grad_el)),
                            whole * grad_el, divs, True))
    return rows


def _first_layout(n: fx.Node) -> Layout:
    """The layout of a tuple-valued node's first element (its ``getitem`` user)."""
    return next(u.meta[PLACEMENT] for u in n.users if isinstance(u.meta.get(PLACEMENT), Layout))


def zero_rows(mesh: Mesh, layouts: dict[str, Layout], zero: dict[str, Any],
              param_vals: dict[str, Any]) -> list[CommRow]:
    """shard_optimizer: per parameter split over data (runtime/zero.py), the reduce-
    scatter of its gradient into the optimizer's slice and the all-gather of the stepped
    slices; together the bytes of the all-reduce they replace."""
    rows: list[CommRow] = []
    g = mesh.size("data")
    for name, zp in zero.items():
        val, lay = param_vals[name], layouts[name]
        elems = math.prod(lay.local_shape(list(val.shape), mesh))
        own = _elsize(val)
        red = _dtype_size(zp.reduce_dtype) or own
        divs = tuple(a for d in lay.dims for a in d)
        module = name.rsplit(".", 1)[0] if "." in name else ""
        numel = math.prod(val.shape)
        rows.append(CommRow(f"grad:{name}", "optimizer slice (gradient)", module, name,
                            "reduce_scatter", "data", "step",
                            as_number(ring_bytes("reduce_scatter", g, elems * red)), numel * red, divs))
        rows.append(CommRow(f"param:{name}", "optimizer slice (parameter)", module, name,
                            "all_gather", "data", "step",
                            as_number(ring_bytes("all_gather", g, Fraction(elems * own, g))),
                            numel * own, divs + ("data",)))
    return rows


class CommReport:
    """Every collective of one training step on one rank (the ring model's bytes)."""

    def __init__(self, rows: Iterable[CommRow], mesh: Mesh | None = None, title: str = "",
                 calls: dict[tuple[str, str, str], int] | None = None) -> None:
        self.rows = list(rows)
        self.mesh = mesh
        self.title = title
        # (collective, axis, phase) -> collectives the step program issues per step,
        # after bucketing and coalescing (the rows count each tensor); None until the
        # module has run a training step (the program is built then)
        self.calls = calls

    # ------------------------------------------------------------------- totals
    def select(self, axis: str | None = None, phase: str | None = None,
               collective: str | None = None, module: str | None = None) -> list[CommRow]:
        return [r for r in self.rows if (axis is None or r.axis == axis)
                and (phase is None or r.phase == phase)
                and (collective is None or r.collective == collective)
                and (module is None or r.module == module or r.module.startswith(module + "."))]

    def total_bytes(self, axis: str | None = None, phase: str | None = None,
                    collective: str | None = None, module: str | None = None) -> int | float:
        return as_number(sum((Fraction(r.bytes) for r in self.select(axis, phase, collective, module)),
                             Fraction(0)))

    def by_key(self) -> dict[tuple[str, str, str], int | float]:
        """(collective, axis, phase) -> bytes: the shape the runtime's counters have."""
        acc: dict[tuple[str, str, str], Fraction] = defaultdict(Fraction)
        for r in self.rows:
            acc[(r.collective, r.axis, r.phase)] += Fraction(r.bytes)
        return {k: as_number(v) for k, v in acc.items() if v}

    def formula(self, axis: str | None = None, phase: str | None = None) -> Any:
        """The sum of the selected rows' volumes as one sympy expression."""
        return sympy.simplify(sum((r.formula for r in self.select(axis, phase)), sympy.Integer(0)))

    # -------------------------------------------------------------------- json
    def to_json(self) -> str:
        return json.dumps({"mesh": self.mesh.spec() if self.mesh else None, "title": self.title,
                           "rows": [r.to_dict() for r in self.rows]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CommReport":
        try:
            d = json.loads(text)
            rows = []
            for r in d["rows"]:
                r.pop("formula", None)
                r["divs"] = tuple(r.get("divs", ()))
                rows.append(CommRow(**r))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"CommReport.from_json: not a shardc comm report ({e}).") from e
        return cls(rows, Mesh.parse(d["mesh"]) if d.get("mesh") else None, d.get("title", ""))

    # -------------------------------------------------------------------- diff
    def grouped(self) -> dict[tuple[str, str, str, str], int | float]:
        """(module, collective, axis, phase) -> bytes."""
        acc: dict[tuple[str, str, str, str], Fraction] = defaultdict(Fraction)
        for r in self.rows:
            acc[(r.module, r.collective, r.axis, r.phase)] += Fraction(r.bytes)
        return {k: as_number(v) for k, v in acc.items()}

    def diff(self, other: "CommReport") -> list[dict[str, Any]]:
        """Rows of (module, collective, axis, phase) whose bytes differ: self is "before",
        other "after"."""
        a, b = self.grouped(), other.grouped()
        out = []
        for key in sorted(set(a) | set(b)):
            before, after = a.get(key, 0), b.get(key, 0)
            if before != after:
                out.append({"module": key[0], "collective": key[1], "axis": key[2], "phase": key[3],
                            "before": before, "after": after})
        return out

    # ---------------------------------------------------------------- printing
    def __rich__(self) -> Any:

        t = Table(title=self.title or (f"communication per step, one rank, {self.mesh}" if self.mesh
                                       else "communication per step, one rank"))
        t.add_column("module")
        t.add_column("op")
        t.add_column("collective")
        t.add_column("axis")
        t.add_column("phase")
        t.add_column("count", justify="right")
        t.add_column("bytes", justify="right")
        groups: dict[tuple, list[CommRow]] = defaultdict(list)
        for r in self.rows:
            groups[(r.module, r.op, r.collective, r.axis, r.phase)].append(r)
        for (module, op, coll, axis, phase), rs in groups.items():
            t.add_row(module or "-", op, coll, axis, phase, str(len(rs)),
                      fmt_bytes(sum(Fraction(r.bytes) for r in rs)))
        t.add_section()
        for axis in CUT_AXES:
            for phase in PHASES:
                tot = self.total_bytes(axis=axis, phase=phase)
                if tot:
                    t.add_row(f"total over {axis}", "", "", axis, phase,
                              str(len(self.select(axis, phase))), fmt_bytes(tot))
        t.add_row("total", "", "", "", "", str(len(self.rows)), fmt_bytes(self.total_bytes()),
                  style="bold")
        if self.calls:
            t.caption = ("collectives issued per step after bucketing and coalescing: " + ", ".join(
                f"{c}@{a} {p} {n}" for (c, a, p), n in sorted(self.calls.items())))
        return t

    def __str__(self) -> str:

        console = Console(width=140, record=True, force_terminal=False, color_system=None)
        with console.capture() as cap:
            console.print(self)
        return cap.get()

    def __repr__(self) -> str:
        return f"CommReport({len(self.rows)} rows, {self.total_bytes()} bytes)"


def fmt_bytes(b: Any) -> str:
    b = float(b)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:,.0f} {unit}" if unit == "B" else f"{b:,.2f} {unit}"
        b /= 1024
    return str(b)


def comm_report(sm: Any) -> CommReport:
    """The report of a compiled module (no communication)."""
    if hasattr(sm, "pipeline_report"):  # a pipeline stage (shardc/program/pipeline.py)
        return cast(CommReport, sm.pipeline_report())
    gm = sm.graph_module
    param_vals = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.meta.get(KIND) == "param":
            param_vals[n.meta[PARAM]] = n.meta[GLOBAL_VAL]
    layouts = getattr(sm, "_program_layouts", sm.param_layouts)
    rows = build_rows(gm, sm.mesh, layouts, sm.grad_reductions, param_vals,
                      sm.ctx.options.precision, sm.runtime.routed)
    rows += zero_rows(sm.mesh, layouts, getattr(sm, "_zero", {}), param_vals)
    # reshard_after_forward: the weights backward gathers again, as the step program does
    regathered = sm.regathered() if hasattr(sm, "regathered") else []
    for node in regathered:
        for r in [r for r in rows if r.node == node and r.collective == "all_gather"
                  and r.phase == "forward"]:
            rows.append(replace(r, phase="backward", op=f"{r.op} (gathered again)"))
    # activation checkpointing re-issues a block's forward collectives in backward
    again = {n.name for n in gm.graph.nodes if n.meta.get("shardc_recompute")}
    rows += [replace(r, phase="backward") for r in rows
             if r.node in again and r.phase == "forward"]
    calls = step_calls(sm)
    if calls is not None:
        # an expert GEMM is one op of the step program that issues each of its rows'
        # all-to-alls itself
        experts = {n.name for n in gm.graph.nodes if n.target is EXPERT_REGION}
        for r in rows:
            if r.node in experts:
                calls[(r.collective, r.axis, r.phase)] = calls.get((r.collective, r.axis, r.phase), 0) + 1
    if calls is None and _autograds_backward(sm):
        calls = eager_calls(sm, rows)
    return CommReport(rows, sm.mesh, calls=calls)


def _autograds_backward(sm: Any) -> bool:
    """Whether a synced training step of ``sm`` runs the forward program and autograd's
    backward (``step_graph=False``, recompute, or a step program that could not be built)."""
    return hasattr(sm, "_grad_buckets") and (
        getattr(sm, "_recompute", None) is not None or not sm.ctx.options.step_graph
        or getattr(sm, "_joint_failed", None) is not None)


def eager_calls(sm: Any, rows: list[CommRow]) -> dict[tuple[str, str, str], int]:
    """Collectives per (collective, axis, phase) that a synced step issues under autograd's
    backward: one a row, except the weight all-gathers a block sends together
    (collectives.GatherGroup), one a block, and the gradient reductions that go into
    buckets (runtime/grad_buckets.py), one a bucket (a bucket reduce-scattered and then
    all-reduced, under HSDP, two), and shard_optimizer's buckets."""
    gb = sm._grad_buckets
    sliced = {f"{k}:{name}" for name in getattr(sm, "_zero", {}) for k in ("grad", "param")}
    together = sm.runtime.gather_groups  # gather key -> its block's GatherGroup
    sent: set[tuple[int, str]] = set()
    out: dict[tuple[str, str, str], int] = defaultdict(int)
    for r in rows:
        if r.collective == "all_gather" and r.node in together:
            # one collective a block's gather (again in backward under recompute)
            if (id(together[r.node]), r.phase) in sent:
                continue
            sent.add((id(together[r.node]), r.phase))
        if r.node not in sliced and not gb.covers(r.collective, r.axis, r.phase, r.param, r.node):
            out[(r.collective, r.axis, r.phase)] += 1
    for b in gb.buckets:
        for key in b.issues():
            out[key] += 1
    _zero_calls(sm, out)
    return dict(out)


def _zero_calls(sm: Any, out: dict[tuple[str, str, str], int]) -> None:
    zero = getattr(sm, "_zero_buckets", None)
    if zero is not None and zero.buckets:
        for c in ("reduce_scatter", "all_gather"):
            out[(c, "data", "step")] += len(zero.buckets)


def step_calls(sm: Any) -> dict[tuple[str, str, str], int] | None:
    """Collectives per (collective, axis, phase) that the built step program issues
    in one step, with shard_optimizer's buckets (one reduce-scatter and one all-gather
    each, runtime/zero.py); None when the program is not built (or off)."""
    built = list(getattr(sm, "_joint", {}).values())
    if not built:
        return None

    out: dict[tuple[str, str, str], int] = defaultdict(int)
    for part in (built[-1].forward, built[-1].backward):
        for n in collective_nodes(part.graph):
            c = n.meta["shardc_comm"]
            out[(c["collective"], c["axis"], c["phase"])] += 1
    _zero_calls(sm, out)
    return dict(out)
