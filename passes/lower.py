"""Lower the traced global graph into this rank's program.

Reads:  the exported graph (ATen ops on global shapes, ``node.meta["val"]``), the
        parameter/input roles of its placeholders, the op rules of ``passes/rules/``
Writes: a new graph of local ops on shards, with every collective as a start node and a
        wait node; each node's ``meta[PLACEMENT]`` (its Layout) and ``meta[GLOBAL_VAL]``;
        ``meta[FALLBACK]`` where an op had no rule and ran replicated
Keeps:  every rank builds the same graph, so every rank issues the same collectives in
        the same order

Why a new graph rather than an in-place rewrite: each op's rule decides the placements
it needs from the placements its inputs already have, and a redistribution (all-reduce,
all-gather, local slice) is inserted in front of it when they differ. Walking the old
graph once in topological order and emitting into a new one keeps that a single pass.

Parameters have no placement until their first use asks for one (lazily): the weight of
a GEMM gets Algorithm 1's layout from the GEMM, a layer norm's weight the placement of
the hidden dim it scales. The stored shard is that layout further cut over z (the
FSDP/ZeRO-3 part), and the first use all-gathers it over z.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental import symbolic_shapes

from shardc.core.context import (
    COMM,
    FALLBACK,
    GLOBAL_VAL,
    KIND,
    PARAM,
    PLACEMENT,
    PROGRAM,
    SOURCE,
    CompileContext,
)
from shardc.core.errors import ShardcError
from shardc.core.ir import Fallback, SourceInfo, Val, source_of, where
from shardc.core.mesh import BATCH_AXES, CONTEXT, SEQUENCE_DIM, Mesh
from shardc.core.placement import Layout
from shardc.core.precision import reduce_dtype
from shardc.passes.data_sized import WHY_NOT
from shardc.passes.rules import RULES, fallback_rule
from shardc.passes.rules.experts import cut_axes, expert_rules
from shardc.passes.rules.picked import picked_rules
from shardc.passes.rules.routing import region_rules
from shardc.passes.rules.sequence import cut_inputs, token_wise
from shardc.runtime import collectives as C
from shardc.runtime import ops as R
from shardc.runtime.experts import EXPERT_REGION
from shardc.runtime.ring import balanced_interleave

aten = torch.ops.aten


# torch's error for a decision on a size known only at run time (a rule asking whether an
# unbacked symbol equals something); torch 2.6 already has it under this name
_DATA_DEPENDENT: tuple[type[Exception], ...] = tuple(
    t for t in (getattr(symbolic_shapes, "GuardOnDataDependentSymNode", None),) if t is not None)


def _unbacked(n: fx.Node) -> bool:
    v = n.meta.get("val")
    try:
        return bool(symbolic_shapes.free_unbacked_symbols(v))
    except Exception:  # noqa: BLE001 - a value free_unbacked_symbols cannot walk
        return False


# why a size known only at run time cannot be laid out, and the rewrite that avoids one
FIXED_SIZE = ("shardc lays out every tensor when it compiles, so a size known only when the "
              "step runs (boolean-mask indexing `h[mask]`, `nonzero`, `masked_select`, "
              "`unique`) cannot be sharded, unless the rows picked are only written back "
              "where they came from (`out.index_add_(0, rows, f(x[rows]))`, `y[mask] = "
              "f(x[mask])`), which shardc computes at their bound, or a classification loss "
              "reads them (`F.cross_entropy(logits[mask], labels[mask])`, a mean or a sum), "
              "which shardc computes over every row with the others ignored. Give it a fixed "
              "size instead: pick the rows by "
              "index (`h[torch.arange(B), idx]` with `idx` from `argmax` or a count), or keep "
              "every row and zero the others (`torch.where`).")


def data_sized_origin(graph: fx.Graph) -> fx.Node | None:
    """The first node that makes a size depending on the data from none (the nonzero or
    boolean index behind a ``view(B, -1, H)`` of ``h[mask]``)."""
    return next((n for n in graph.nodes
                 if _unbacked(n) and not any(_unbacked(a) for a in n.all_input_nodes)), None)


def _data_dependent_error(node: fx.Node, src: SourceInfo, cause: Exception) -> ShardcError:
    """What to tell the user when a rule meets a size that depends on the data. The node
    that made the size is named: the rule that failed is often a few ops later (a
    ``view(B, -1, H)`` of ``h[mask]``), and the fix belongs at the former."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    origin, seen, stack = None, set(), [node]
    while stack:  # up through data-dependent values to the earliest that none made
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        ins = [a for a in n.all_input_nodes if _unbacked(a)]
        if ins:
            stack.extend(ins)
        elif n is not node and (origin is None or order[n] < order[origin]):
            origin = n
    made = f", made by {origin.target} {where(source_of(origin))}" if origin is not None else ""
    why = origin.meta.get(WHY_NOT) if origin is not None else None
    if why:
        made += (f" (rows picked so are computed at their bound when they are only written back "
                 f"where they came from; here {why})")
    return ShardcError(
        f"shardc.compile: {node.target} {where(src)} works on a size that depends on the "
        f"data{made}. {FIXED_SIZE} ({type(cause).__name__}: {str(cause).splitlines()[0]})")


@dataclass
class LowerResult:
    graph_module: fx.GraphModule
    storage: dict[str, Layout]  # parameter name -> layout of the stored shard
    fallbacks: list[Fallback] = field(default_factory=list)
    reduce_params: dict[str, list[str]] = field(default_factory=dict)  # set by grad_sync
    decisions: list[str] = field(default_factory=list)  # human-readable choices, for explain


class Lowering:
    """State of one lowering: the new graph, the value of every old node, the choices."""

    def __init__(self, gm: fx.GraphModule, ctx: CompileContext) -> None:
        self.old = gm
        self.ctx = ctx
        self.mesh: Mesh = ctx.mesh
        self.rt = ctx.rt
        self.roles = ctx.role_map  # placeholder name -> (role, target)
        self.g = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.storage: dict[str, Layout] = {}
        # parameters whose storage was decided before their first use (experts cut by
        # expert_axes, passes/rules/experts.py): views of them keep the stored layout
        self.pinned: set[str] = set()
        self.param_ph: dict[str, fx.Node] = {}
        self.param_val: dict[str, Any] = {}
        self.cache: dict[tuple, fx.Node] = {}
        self.fallbacks: list[Fallback] = []
        self.decisions: list[str] = []
        # inputs whose sequence the program re-cuts (Options.balanced_context)
        self.recut: list[tuple[fx.Node, Layout]] = []
        self.src = SourceInfo("", "", "")
        self.cur: fx.Node | None = None
        # the dtype the next collective of a parameter's redistribution sends in (pcast)
        self._send: torch.dtype | None = None
        self._token_wise: set[fx.Node] | None = None
        # the program's draws from the default generator, numbered in program order: a
        # pipeline stage is handed, by that number, the piece of the mask one device drew
        # for the whole batch (runtime/ops.py, shardc/program/pipeline.py)
        self.draws = 0

    def draw_site(self) -> dict[str, int]:
        """The keyword argument that numbers the next draw of the program."""
        self.draws += 1
        return {"site": self.draws - 1}

    def token_wise(self) -> set[fx.Node]:
        """The global graph's nodes whose value may be cut along tokens up to the next
        GEMMs (rules/sequence.py), found on first use."""
        if self._token_wise is None:
            self._token_wise = token_wise(
                self.old.graph, lambda n: self.roles.get(n.name, ("input",))[0] == "param",
                lambda n: self.rule_for(n) is RULES["pointwise"])
        return self._token_wise

    # ------------------------------------------------------------------ emission
    def emit(self, target: Callable, args: Sequence[Any], kwargs: dict | None = None, *,
             layout: Layout | None, val: Any, kind: str = "local") -> fx.Node:
        n = self.g.call_function(target, tuple(args), dict(kwargs or {}))
        n.meta[PLACEMENT] = layout.clean(self.mesh) if layout is not None else None
        n.meta[GLOBAL_VAL] = val
        n.meta[KIND] = kind
        n.meta[SOURCE] = self.src
        return n

    def val_of(self, a: Any) -> Any:
        if isinstance(a, fx.Node):
            return self.env[a]
        return a

    # ------------------------------------------------------------ redistribution
    def to_layout(self, v: Val, target: Layout) -> fx.Node:
        """A node holding ``v`` laid out as ``target`` (inserting collectives as needed)."""
        target = target.clean(self.mesh)
        if v.layout is None:
            return self._param_at(v, target)
        assert v.node is not None
        return self._redistribute(v.node, v.layout.clean(self.mesh), target, v.val)

    def _redistribute(self, node: fx.Node, cur: Layout, target: Layout, gval: Any) -> fx.Node:
        if cur == target and self._send is None:
            return node
        key: tuple = (node, target, self._send)
        if key in self.cache:
            return self.cache[key]
        lay = cur
        # 1. partial values -> replicated (all-reduce), except a sum or mean the target
        #    cuts along a dim: that one is reduce-scattered once the shards are settled
        scatter: list[tuple[str, str, int]] = []
        for axis, op in cur.partial:
            if dict(target.partial).get(axis) == op:
                continue
            d = target.shard_dim(axis)
            if d is not None and op in ("sum", "avg"):
                scatter.append((axis, op, d))
                continue
            node, lay = self._reduce(node, lay, axis, op, gval)
        # 2. shards that the target does not keep, innermost first: to the dim the target
        #    cuts over that axis (all-to-all) or whole (all-gather)
        for d in range(lay.ndim):
            have, want = lay.dims[d], target.dims[d]
            if len(have) == 1 and have == want and lay.interleave[d] != target.interleave[d]:
                # the same axis cuts the dim into other stripes: each rank sends only the
                # runs another holds after, where a gather would send every rank all
                node, lay = self._restripe(node, lay, have[0], d, target.interleave[d], gval)
                continue
            keep = 0
            if lay.interleave[d] == target.interleave[d] or not have:
                while keep < min(len(have), len(want)) and have[keep] == want[keep]:
                    keep += 1
            for axis in reversed(have[keep:]):
                j = target.shard_dim(axis)
                if j is not None and j != d and lay.interleave[d] == 1 and \
                        self._next_cut(lay, target, j, axis, gval):
                    node, lay = self._all_to_all(node, lay, axis, d, j, gval)
                else:
                    node = self._all_gather(node, lay, axis, d, gval)
                    lay = lay.with_replicated(axis)
        for axis, op, d in scatter:
            if self._next_cut(lay, target, d, axis, gval):
                with self._at_origin(node, axis):
                    node, lay = self._reduce_scatter(node, lay, axis, op, d, gval)
            else:
                node, lay = self._reduce(node, lay, axis, op, gval)
        # 3. shards the target has and we lack -> local slice (no communication)
        for d in range(lay.ndim):
            have, want = lay.dims[d], target.dims[d]
            for axis in want[len(have):]:
                k = target.interleave[d]
                new = lay.with_shard(axis, d).with_interleave(d, k)
                node = self.emit(C.local_chunk, (node, self.rt, axis, d, k), layout=new, val=gval,
                                 kind="slice")
                lay = new
        for axis, op in target.partial:
            assert dict(lay.partial).get(axis) == op, (cur, target)
        assert lay == target, (cur, target, lay)
        node = self._cast_pending(node, lay, gval)
        self.cache[key] = node
        return node

    @contextlib.contextmanager
    def _at_origin(self, node: fx.Node, axis: str) -> Iterator[None]:
        """Emit as the op that made ``node``'s partial value over ``axis``: the reduction
        completes that op, so the report and explain attribute it there."""
        here, self.src = self.src, self._partial_origin(node, axis).meta.get(SOURCE, self.src)
        try:
            yield
        finally:
            self.src = here

    def _cast_pending(self, node: fx.Node, lay: Layout, gval: Any) -> fx.Node:
        """A parameter's narrowing cast that no all-gather took on: done here, locally."""
        if self._send is None:
            return node
        dtype, self._send = self._send, None
        return self.emit(aten._to_copy.default, (node,), {"dtype": dtype}, layout=lay, val=gval)

    def _reduce(self, node: fx.Node, lay: Layout, axis: str, op: str, gval: Any
                ) -> tuple[fx.Node, Layout]:
        node = self._cast_pending(node, lay, gval)
        with self._at_origin(node, axis):
            node = self._all_reduce(node, lay, axis, op, gval)
        return node, lay.with_replicated(axis)

    def _next_cut(self, lay: Layout, target: Layout, d: int, axis: str, gval: Any) -> bool:
        """Is ``axis`` the next cut the target makes of dim ``d`` (plain blocks, and this
        rank's piece of the dim divides evenly)?"""
        have, want = lay.dims[d], target.dims[d]
        if want[:len(have)] != have or len(want) <= len(have) or want[len(have)] != axis:
            return False
        if target.interleave[d] != 1 or lay.interleave[d] != 1:
            return False
        return lay.local_shape(list(gval.shape), self.mesh)[d] % self.mesh.size(axis) == 0

    def _reduce_scatter(self, node: fx.Node, lay: Layout, axis: str, op: str, d: int, gval: Any
                        ) -> tuple[fx.Node, Layout]:
        """Partial -> cut along ``d``: one reduce-scatter moves (G-1)/G of the tensor,
        where all-reducing and then slicing would move twice that."""
        out = lay.with_shard(axis, d)
        moved = [d] + [i for i in range(lay.ndim) if i != d]
        buf = Layout(lay.ndim, tuple(out.dims[i] for i in moved), out.partial,
                     tuple(out.interleave[i] for i in moved))
        start = self.emit(C.reduce_scatter_start, (node, self.rt, axis, d), layout=buf, val=None,
                          kind="collective")
        start.meta[COMM] = {"collective": "reduce_scatter", "axis": axis, "dim": d, "op": op}
        done = self.emit(C.wait, (start,), layout=buf, val=None, kind="wait")
        node = self.emit(C.unmove, (done, d), layout=out, val=gval)
        if op == "avg":
            node = self.emit(aten.mul.Tensor, (node, 1.0 / self.mesh.size(axis)), layout=out, val=gval)
        return node, out

    def _all_to_all(self, node: fx.Node, lay: Layout, axis: str, src: int, dst: int, gval: Any
                    ) -> tuple[fx.Node, Layout]:
        """Cut over ``axis`` along ``src`` -> along ``dst``: an all-to-all moves (G-1)/G of
        the piece, where gathering and slicing would move (G-1) times it."""
        node = self._cast_pending(node, lay, gval)
        out = lay.with_replicated(axis).with_shard(axis, dst)
        done = self._stacked(C.all_to_all_start, (node, self.rt, axis, src, dst), out,
                             {"collective": "all_to_all", "axis": axis, "src": src, "dst": dst})
        return self.emit(C.concat_received, (done, src), layout=out, val=gval), out

    def _restripe(self, node: fx.Node, lay: Layout, axis: str, d: int, k: int, gval: Any
                  ) -> tuple[fx.Node, Layout]:
        """Cut over ``axis`` along ``d`` in one interleave -> another (the contiguous cut of
        a sequence -> the head-tail cut): an exchange of at most the rank's piece, where
        gathering and slicing would move (G-1) times it."""
        node = self._cast_pending(node, lay, gval)
        out = lay.with_interleave(d, k)
        moved = [d] + [i for i in range(lay.ndim) if i != d]
        buf = Layout(lay.ndim, tuple(out.dims[i] for i in moved), out.partial,
                     tuple(out.interleave[i] for i in moved))
        stripes = (lay.interleave[d], k)
        start = self.emit(C.all_to_all_start, (node, self.rt, axis, d, d), {"stripes": stripes},
                          layout=buf, val=None, kind="collective")
        start.meta[COMM] = {"collective": "all_to_all", "axis": axis, "src": d, "dst": d,
                            "stripes": stripes}
        done = self.emit(C.wait, (start,), layout=buf, val=None, kind="wait")
        return self.emit(C.restriped, (done, self.rt, axis, d, stripes), layout=out, val=gval), out

    @staticmethod
    def _partial_origin(node: fx.Node, axis: str) -> fx.Node:
        """The node that made ``node``'s partial sum over ``axis``: walk up through ops
        that only carried it (views, casts, dropout, bias-free adds of partials)."""
        while True:
            ins = [a for a in node.all_input_nodes
                   if isinstance(a.meta.get(PLACEMENT), Layout) and axis in dict(a.meta[PLACEMENT].partial)]
            if not ins:
                return node
            node = ins[0]

    def _all_reduce(self, node: fx.Node, lay: Layout, axis: str, op: str, gval: Any) -> fx.Node:
        out = lay.with_replicated(axis)
        if op in ("max", "min") and _may_carry_grad(node):
            return self._gather_reduce(node, lay, axis, op, gval)
        buf_lay = out
        start = self.emit(C.all_reduce_start, (node, self.rt, axis, op if op in ("max", "min") else "sum"),
                          layout=buf_lay, val=gval, kind="collective")
        start.meta[COMM] = {"collective": "all_reduce", "axis": axis, "op": op}
        done = self.emit(C.wait, (start,), layout=buf_lay, val=gval, kind="wait")
        if op == "avg":
            done = self.emit(aten.mul.Tensor, (done, 1.0 / self.mesh.size(axis)), layout=out, val=gval)
        return done

    def _gather_reduce(self, node: fx.Node, lay: Layout, axis: str, op: str, gval: Any) -> fx.Node:
        """A partial max/min whose value carries a gradient: gather the ranks' pieces and
        reduce them locally. An all-reduce MAX has no derivative to offer; amax over the
        gathered pieces sends the gradient to the rank that holds the maximum (ties split
        as torch.amax splits them), and the all-gather's backward returns each rank its
        piece's gradient."""
        out = lay.with_replicated(axis)
        done = self._stacked(C.all_gather_start, (node, self.rt, axis, "slice"), out,
                             {"collective": "all_gather", "axis": axis, "dim": 0})
        red = aten.amax.default if op == "max" else aten.amin.default
        return self.emit(red, (done, [0]), layout=out, val=gval)

    def _stacked(self, target: Callable, args: tuple, out: Layout, comm: dict,
                 kwargs: dict | None = None) -> fx.Node:
        """Issue a collective that fills a (G, *piece) buffer and wait for it; the buffer's
        dims are ``out``'s shifted by one (dim 0 indexes the ranks of the axis)."""
        buf = Layout(out.ndim + 1, ((),) + out.dims, out.partial, (1,) + out.interleave)
        start = self.emit(target, args, kwargs, layout=buf, val=None, kind="collective")
        start.meta[COMM] = comm
        return self.emit(C.wait, (start,), layout=buf, val=None, kind="wait")

    def _all_gather(self, node: fx.Node, lay: Layout, axis: str, dim: int, gval: Any) -> fx.Node:
        out = lay.with_replicated(axis)
        kwargs = {}
        if self._send is not None:
            # the parameter's narrowing cast, fused into its first gather: sent narrow, and
            # the gradient reduce-scattered in the policy's reduce dtype (runtime.collectives)
            kwargs = {"dtype": self._send,
                      "reduce_dtype": reduce_dtype(node.meta[GLOBAL_VAL].dtype, self.ctx.options.precision)}
            self._send = None
        done = self._stacked(C.all_gather_start, (node, self.rt, axis, "slice"), out,
                             {"collective": "all_gather", "axis": axis, "dim": dim}, kwargs)
        k = lay.interleave[dim]
        if k == 1:
            return self.emit(C.concat_gathered, (done, dim), layout=out, val=gval)
        return self.emit(C.concat_gathered_interleaved, (done, dim, k), layout=out, val=gval)

    # ---------------------------------------------------------------- parameters
    def _param_at(self, v: Val, want: Layout) -> fx.Node:
        """Materialise parameter-derived ``v`` at ``want`` (in v's own dims)."""
        assert v.param is not None
        name = v.param
        pwant = want
        if v.ptrans:
            pwant = Layout(want.ndim, tuple(reversed(want.dims)), want.partial,
                           tuple(reversed(want.interleave)))
        if name not in self.storage:
            self.storage[name] = self._storage_for(pwant, list(self.param_val[name].shape))
        if v.pcast is not None:
            self._send = v.pcast
            node = self._redistribute(self.param_ph[name], self.storage[name], pwant,
                                      _cast_val(self.param_val[name], v.pcast))
            self._send = None  # consumed, or the cached redistribution already casts
        else:
            node = self._redistribute(self.param_ph[name], self.storage[name], pwant,
                                      self.param_val[name])
        if v.ptrans:
            key: tuple = (node, "t")
            if key not in self.cache:
                self.cache[key] = self.emit(aten.t.default, (node,), layout=want, val=v.val)
            node = self.cache[key]
        for target, extra in v.pchain:
            key = (node, target, extra)
            if key not in self.cache:
                self.cache[key] = self.emit(target, (node, *extra), layout=want, val=v.val)
            node = self.cache[key]
        return node

    def _storage_for(self, want: Layout, shape: list[int]) -> Layout:
        """The stored shard: the layout of the first use, cut further over z on the first
        dim it divides, z innermost (so the all-gather over z yields that use's block)."""
        want = Layout(want.ndim, want.dims, (), want.interleave)  # a parameter is never partial
        gz = self.mesh.size("z")
        if gz == 1 or want.shard_dim("z") is not None or want.ndim == 0:
            return want.clean(self.mesh)
        local = want.local_shape(shape, self.mesh)
        for d in range(want.ndim):
            k = abs(want.interleave[d]) if want.dims[d] else 1
            if local[d] % (gz * k) == 0:
                return want.with_shard("z", d).clean(self.mesh)
        return want.clean(self.mesh)

    # --------------------------------------------------------------------- driver
    def rule_for(self, node: fx.Node) -> Callable[["Lowering", fx.Node], Any]:
        """The table's rule for ``node``'s op (``fallback_rule`` when it has none)."""

        rule = RULES.get(node.target)
        if rule is None and isinstance(node.target, torch._ops.OpOverload):
            rule = RULES.get(node.target.overloadpacket)
            if rule is None and torch.Tag.pointwise in node.target.tags:
                rule = RULES["pointwise"]
        return rule or fallback_rule

    def run(self) -> LowerResult:

        # ops whose rule depends on a region around them, not on the op alone
        regions, found = region_rules(self, self.old.graph)
        # rows the data picks (padded at the trace): each rank its own
        regions.update(picked_rules(self.old.graph))
        for region in found:
            # experts cut over an axis (expert_axes): the segments that run on the
            # experts' ranks take over their nodes' rules
            regions.update(expert_rules(self, region))
        outputs: list[Any] = []
        for node in self.old.graph.nodes:
            self.cur = node
            self.src = source_of(node)
            if node.op == "placeholder":
                self.env[node] = self._placeholder(node)
                continue
            if self.recut:
                self._recut_inputs()
            if node.op == "get_attr":
                t = getattr(self.old, node.target)
                n = self.g.get_attr(node.target)
                n.meta[PLACEMENT] = Layout.replicate(t.dim()) if isinstance(t, torch.Tensor) else None
                n.meta[GLOBAL_VAL] = t
                n.meta[KIND] = "constant"
                self.env[node] = Val(n, n.meta[PLACEMENT], t)
            elif node.op == "call_function":
                rule = regions.get(node) or self.rule_for(node)
                if self.ctx.options.sequence_parallel and node not in regions:
                    cut_inputs(self, node)
                try:
                    self.env[node] = rule(self, node)
                except _DATA_DEPENDENT as e:
                    raise _data_dependent_error(node, self.src, e) from e
            elif node.op == "output":
                outputs = list(node.args[0])
            else:
                raise NotImplementedError(f"shardc: cannot lower a {node.op} node ({node.format_node()})")
        if self.recut:  # a program of inputs alone
            self._recut_inputs()
        out_nodes = [self._output(o) for o in outputs]
        self.g.output(tuple(out_nodes))
        # lazy: the Python code is generated on the first call (planning never calls it)
        gm = _LazyGraphModule(self.old, self.g)
        for name, ph in self.param_ph.items():
            if name not in self.storage:  # unused parameter: keep it whole (cut over z)
                v = self.param_val[name]
                self.storage[name] = self._storage_for(Layout.replicate(v.dim()), list(v.shape))
            ph.meta[PLACEMENT] = self.storage[name]
        # in the model's order, whatever order the storages were decided in (an expert
        # weight's before the lowering began): the module's parameters, and so an
        # optimizer's groups, must not depend on the mesh or the options
        self.storage = {name: self.storage[name] for name in self.param_ph}
        return LowerResult(gm, self.storage, fallbacks=self.fallbacks, decisions=self.decisions)

    def _placeholder(self, node: fx.Node) -> Any:
        role, target = self.roles.get(node.name, ("input", node.name))
        gval = node.meta.get("val")
        if role == "param":
            if target in self.param_ph:  # a tied weight: one parameter, one placeholder
                return Val(None, None, gval, param=target)
            ph = self.g.placeholder(f"p_{target.replace('.', '_')}")
            ph.meta.update({KIND: "param", PARAM: target, GLOBAL_VAL: gval})
            self.param_ph[target] = ph
            self.param_val[target] = gval
            return Val(None, None, gval, param=target)
        ph = self.g.placeholder(node.name)
        ph.meta[GLOBAL_VAL] = gval
        ph.meta[KIND] = role
        override = dict(self.ctx.input_layouts).get(node.name)
        if role == "input" and override is not None:
            lay = override
        elif role == "input" and isinstance(gval, torch.Tensor) and gval.dim() > 0:
            lay = Layout.of(gval.dim(), {a: 0 for a in BATCH_AXES}, order=("data", "z"))
            if gval.dim() > SEQUENCE_DIM and self.mesh.size(CONTEXT) > 1:
                # the sequence dim, as shard_batch cuts it
                lay = lay.with_shard(CONTEXT, SEQUENCE_DIM)
        elif isinstance(gval, torch.Tensor):
            lay = Layout.replicate(gval.dim())
        else:  # a non-tensor input: a constant of the traced program
            ph.meta[PLACEMENT] = None
            return gval
        lay = lay.clean(self.mesh)
        ph.meta[PLACEMENT] = lay
        v = Val(ph, lay, gval)
        if lay.dims[SEQUENCE_DIM:SEQUENCE_DIM + 1] == ((CONTEXT,),) and override is None:
            assert isinstance(gval, torch.Tensor)
            g = self.mesh.size(CONTEXT)
            seq = gval.shape[SEQUENCE_DIM]
            if seq % g:
                raise ShardcError(
                    f"shardc.compile: input {node.name!r} has a sequence of {seq} (dim {SEQUENCE_DIM}), "
                    f"which context = {g} ranks cannot cut evenly; use a multiple of {g}.")
            k = balanced_interleave(seq, g)
            if not self.ctx.options.balanced_context or k == 1:
                return v
            # re-cut the sequence into k stripes, each rank holding its chunk of every
            # stripe: a causal attention's ring then gives the ranks even work
            # (runtime/ring.py); after every placeholder: the program's inputs come first
            self.recut.append((node, lay.with_interleave(SEQUENCE_DIM, k)))
        return v

    def _recut_inputs(self) -> None:
        """Bring the inputs ``_placeholder`` marked to their balanced sequence cut."""
        for node, want in self.recut:
            v = self.env[node]
            self.src = SourceInfo("input", "", "")
            self.env[node] = Val(self.to_layout(v, want), want.clean(self.mesh), v.val)
        self.recut = []

    def _output(self, o: Any) -> Any:
        if not isinstance(o, fx.Node):
            return o
        v = self.env[o]
        if not isinstance(v, Val):
            return v
        self.src = SourceInfo("output", "", "")
        lay = v.layout.clean(self.mesh) if v.layout is not None else Layout.replicate(v.ndim)
        # What a rank returns: its batch shard (dim 0 over data and z) of a batched output;
        # everything else whole. A partial value (a loss: this rank's mean or sum over its
        # batch shard) is reduced, so every rank gets back exactly what one device
        # computes, whatever reduction the model applied: one scalar all-reduce per axis.
        # Its backward hands each rank's piece the gradient of the reduction (1 for a
        # sum, 1/G for a mean), so parameter gradients are those of the global loss.
        want = Layout.replicate(v.ndim)
        if v.ndim > 0:
            for a in lay.dims[0]:
                if a in BATCH_AXES:
                    want = want.with_shard(a, 0)
        if v.ndim > SEQUENCE_DIM and lay.dims[SEQUENCE_DIM] == (CONTEXT,):
            # a per-token output's sequence stays cut as shard_batch cuts the inputs: this
            # rank's contiguous block (re-cut from the balanced stripes where need be)
            want = want.with_shard(CONTEXT, SEQUENCE_DIM)
        assert lay.ndim == v.ndim, (self.cur, lay, v.val.shape)
        return self.to_layout(v, want)


def _cast_val(val: Any, dtype: torch.dtype) -> Any:
    """The global value ``val`` in ``dtype`` (shape and dtype are what the passes read)."""
    return torch.empty(val.shape, dtype=dtype, device="meta")


def _may_carry_grad(node: fx.Node) -> bool:
    """False for values that are detached by construction (the row maxima that only shift
    cross-entropy's exponentials) or not floating point; True otherwise."""

    if node.target is R.row_max:
        return False
    gval = node.meta.get(GLOBAL_VAL)
    return not isinstance(gval, torch.Tensor) or gval.dtype.is_floating_point


def lower_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """The pass entry point: returns this rank's program; what it decided is in
    ``gm.meta[PROGRAM]`` (a LowerResult)."""
    res = Lowering(gm, ctx).run()
    out = res.graph_module
    _check_experts_cut(out, ctx)
    _drop_dead_collectives(out.graph)
    # an op run whole whose result turned out dead is not run: nor reported
    alive = {id(n.meta[FALLBACK]) for n in out.graph.nodes if FALLBACK in n.meta}
    res.fallbacks[:] = [f for f in res.fallbacks if id(f) in alive]
    out.meta[PROGRAM] = res
    out.graph.lint()
    return out


def _check_experts_cut(gm: fx.GraphModule, ctx: CompileContext) -> None:
    """``expert_axes`` asks for experts cut over an axis: a program that cut none would
    hold every expert on every rank while the user plans memory for 1/G of them."""
    axes = cut_axes(ctx.options.expert_axes, ctx.mesh)
    if not axes:
        return
    if not any(n.target is EXPERT_REGION for n in gm.graph.nodes):
        raise ShardcError(
            f"shardc.compile: expert_axes={ctx.options.expert_axes!r}, but no experts were found to cut. Expert "
            "parallelism takes a mixture of experts whose token-expert pairs are sorted by "
            "expert and run by one grouped GEMM per weight (transformers' default "
            "'grouped_mm' experts kernel; passes/rules/routing.py), or whose pairs each look "
            "their expert's weight up by its key (its 'batched_mm' kernel, made the sorted form "
            f"by passes/picked_weights.py), with the tokens cut over {' and '.join(axes)}. "
            "Experts held as a ModuleList, or looped over, are not cut yet; leave "
            "expert_axes=None for them.")


def _drop_dead_collectives(g: fx.Graph) -> None:
    """Collectives whose result nothing reads are not emitted, nor the pure ops between
    them and nothing: the operand of a check the lowering drops (XLM's ``assert
    lengths.max().item() <= slen`` gathered the lengths for nothing). The step
    program's trace drops them anyway, so keeping them made the comm report count bytes
    no step moves. In-place ops, random draws (the generator's position is part of the
    result) and the runtime's own functions stay."""


    issues = {C.all_gather_start, C.all_reduce_start, C.reduce_scatter_start,
              C.all_to_all_start, C.grad_all_reduce, C.wait, C.concat_gathered,
              C.concat_gathered_interleaved, C.local_chunk, C.restriped}

    def pure(n: fx.Node) -> bool:
        t = n.target
        if t in issues or getattr(t, "__module__", None) in (operator.__name__, "_operator"):
            return True
        return (isinstance(t, torch._ops.OpOverload) and not t._schema.is_mutable
                and torch.Tag.nondeterministic_seeded not in t.tags)

    for n in reversed(list(g.nodes)):
        if n.op == "call_function" and not n.users and pure(n):
            g.erase_node(n)
