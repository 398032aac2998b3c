"""Routing regions: a sort of the batch's rows whose order is undone before anything
reads it.

A mixture of experts (transformers' ``grouped_mm`` kernel) sorts every token-expert pair
by expert, gathers the tokens in that order, runs one GEMM per expert over contiguous
runs of rows (offsets from a histogram of the sorted keys), scales, and puts the rows
back in their first order with the inverse permutation. No single op of that is
row-local (the sort needs the whole dim; the histogram counts over it), so op by op the
lowering would gather the batch onto every rank. The region as a whole is row-local: each
output row is ``f(row, key)``, whatever order the rows were visited in. So when the sorted
keys are cut over the batch axes, every rank sorts its own rows and runs the region on
them; the indices the local sort returns point at the rank's own rows, and the inverse
permutation restores the rank's own order.

The analysis (``find_regions``) is structural: starting from the sort, every use of a
value whose row order is the sort's order must be one of

- a row-wise op (pointwise with other operands broadcast over the rows, a view, split,
  reduction or normalisation that leaves dim 0 alone, a GEMM with the rows on the left),
- a lookup by the permutation (``x[perm // k]``, ``x[perm]``) of a tensor whose rows are
  the batch's, or by the sorted keys (``bias[keys]``) of a tensor that is not,
- the histogram of the sorted keys over a range that holds every key (the keys are the
  indices of a ``topk``/``argmax`` over a dim that fits the range), its ``cumsum``, and
  a grouped GEMM of the sorted rows at those offsets (row ``i`` meets its own key's
  expert, since the rows are sorted and no key falls outside the bins),
- the inverse permutation (``inv[perm] = arange(n)``) and the lookup by it, where the
  region ends.

Any other use (the counts read by a load-balancing loss, the sorted rows returned)
rejects the region, and its ops keep their ordinary rules. At lowering the region is
taken only when the sorted keys arrive cut on dim 0 alone, evenly; otherwise the sort
gathers as any sort does.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from shardc.core.ir import Val
from shardc.core.placement import Layout
from shardc.passes.rules.common import existing_ops
from shardc.runtime.grouped_gemm import GROUPED_MM

if TYPE_CHECKING:  # the lowering calls the rules; they only name its type
    from shardc.passes.lower import Lowering

aten = torch.ops.aten

# value kinds inside a region
ROWS = "rows"  # dim 0: the sorted rows of this rank, in the local sort's order
IDX = "idx"  # the permutation (local row numbers), divided by ``ratio``
EMPTY = "empty"  # ``empty_like(perm)``: the inverse permutation's storage
COUNTS = "counts"  # rows a key per bin, of this rank's rows
OFFS = "offs"  # their running sum: the grouped GEMM's offsets
INV = "inv"  # the inverse permutation

_SORTS = {aten.sort.default, aten.sort.stable}
# ops whose indices (output 1, or the output itself) lie in [0, size of their dim)
_INDEX_MAKERS = {aten.topk.default: 2, aten.sort.default: 1, aten.max.dim: 1, aten.min.dim: 1}
_ARG_MAKERS = {aten.argmax.default, aten.argmin.default}
# ops that carry values through unchanged (dtype aside)
# (``to`` as export writes a cast, ``_to_copy`` as a re-trace decomposes it)
_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout}
_SAME_VALUES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                aten.clone.default, aten.alias.default, *_CASTS,
                aten.contiguous.default, aten.detach.default, aten.flatten.using_ints}
IGNORED = {aten._assert_tensor_metadata.default}
_ROW_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_ROW_COPIES = {aten.clone.default, aten.alias.default, *_CASTS,
               aten.contiguous.default, aten.detach.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
_DIM_ARG1 = {aten.unsqueeze.default, aten.squeeze.dim, aten.select.int, aten.slice.Tensor, aten.narrow.default,
             aten._softmax.default, aten._log_softmax.default, aten.softmax.int,
             aten.log_softmax.int}
_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default}
_NORMS = set(existing_ops("layer_norm.default", "native_layer_norm.default", "rms_norm.default"))
_GEMMS_LEFT = {aten.linear.default, aten.mm.default, aten.matmul.default}


def grouped_gemms() -> dict[Any, tuple[int, int, int | str]]:
    """Grouped GEMM ops: op -> (rows arg, weight arg, offsets arg or kwarg name)."""
    out: dict[Any, tuple[int, int, int | str]] = {}
    if hasattr(aten, "_grouped_mm"):
        out[aten._grouped_mm.default] = (0, 1, "offs")
    op = transformers_grouped_mm()
    if op is not None:
        out[op] = (0, 1, 2)
    # shardc's own (passes/picked_weights.py makes picked-weight GEMMs into it)
    out[GROUPED_MM] = (0, 1, 2)
    return out


def transformers_grouped_mm() -> Any:
    """transformers' own grouped GEMM (``transformers::grouped_mm_fallback``), for dtypes
    torch's kernel refuses (float64, and any dtype under tracing); None until transformers
    is imported, which registers it."""
    ns = getattr(torch.ops, "transformers", None)
    op = getattr(ns, "grouped_mm_fallback", None) if ns is not None else None
    return getattr(op, "default", None) if op is not None else None


@dataclass
class Region:
    sort: fx.Node
    n: int  # rows sorted
    kinds: dict[fx.Node, tuple[str, int]] = field(default_factory=dict)  # node -> (kind, ratio)
    row_sources: dict[fx.Node, int] = field(default_factory=dict)  # x of x[perm // k] -> k
    exits: list[fx.Node] = field(default_factory=list)
    aranges: list[fx.Node] = field(default_factory=list)  # arange(n) of the inverse alone
    axes: tuple[str, ...] | None = None  # set at lowering when taken
    # the grouped GEMM ops torch and transformers have (``grouped_gemms``), looked up once
    gemms: dict[Any, tuple[int, int, int | str]] = field(default_factory=dict)


def _arg(node: fx.Node, i: int, name: str, default: Any) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def index_bound(n: Any) -> int | None:
    """An exclusive upper bound on the values of ``n`` (and 0 the lower) when ``n`` is
    made of the indices of a topk, sort or arg-max over one dim; None when unknown."""
    while isinstance(n, fx.Node) and n.target in _SAME_VALUES:
        if n.target in _CASTS and not _integral(n):
            return None  # a cast to a float keeps integers exact only below 2**24
        n = n.args[0]
    if not isinstance(n, fx.Node):
        return None
    if n.target in _ARG_MAKERS:
        x = n.args[0].meta["val"]
        dim = _arg(n, 1, "dim", None)
        return int(x.numel()) if dim is None else int(x.shape[dim])
    if n.target is operator.getitem and n.args[1] == 1 and isinstance(n.args[0], fx.Node) \
            and n.args[0].target in _INDEX_MAKERS:
        src = n.args[0]
        x = src.args[0].meta["val"]
        dim = _arg(src, _INDEX_MAKERS[src.target], "dim", -1)
        return int(x.shape[dim]) if x.dim() else 1
    return None


def _integral(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and not v.dtype.is_floating_point and not v.dtype.is_complex


def ndim_of(n: Any) -> int:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else 0


def _rows_of(n: Any) -> int | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return int(v.shape[0]) if isinstance(v, torch.Tensor) and v.dim() else None


class _Reject(Exception):
    pass


def _classify(region: Region, user: fx.Node, src: fx.Node, kind: str, ratio: int,
              bounds: dict[fx.Node, int]) -> list[tuple[fx.Node, str, int]]:
    """What ``user`` makes of ``src`` (of ``kind``): the new region values it defines, or
    [] when it ends the region there; raises _Reject when it reads the order."""
    t = user.target
    kinds = region.kinds
    if t in IGNORED:
        return []
    if kind == IDX:
        if t in (aten.div.Tensor_mode, aten.floor_divide.default) and user.args[0] is src:
            k = user.args[1]
            mode = _arg(user, 2, "rounding_mode", "floor") if t is aten.div.Tensor_mode else "floor"
            if isinstance(k, int) and k > 0 and mode == "floor":
                return [(user, IDX, ratio * k)]
        if t is aten.index.Tensor and list(user.args[1]) == [src] and user.args[0] not in kinds:
            x = user.args[0]
            if _rows_of(x) is not None and _rows_of(x) * ratio == region.n:
                region.row_sources[x] = ratio
                return [(user, ROWS, 1)]
        if t is aten.empty_like.default and ratio == 1:
            return [(user, EMPTY, 1)]
        if t is aten.index_put.default and ratio == 1 and list(user.args[1]) == [src] \
                and kinds.get(user.args[0], (None,))[0] == EMPTY \
                and not _arg(user, 3, "accumulate", False):
            ar = user.args[2]
            if isinstance(ar, fx.Node) and ar.target is aten.arange.default \
                    and list(ar.args) == [region.n]:
                if len(ar.users) == 1:  # made for this alone: the rank makes its own instead
                    region.aranges.append(ar)
                return [(user, INV, 1)]
        raise _Reject(f"{user.format_node()} reads the sorted order")
    if kind == EMPTY:
        if t is aten.index_put.default and user.args[0] is src:
            return []  # classified from its index argument
        raise _Reject(f"{user.format_node()} reads the permutation's storage")
    if kind == INV:
        if t is aten.index.Tensor and list(user.args[1]) == [src] \
                and kinds.get(user.args[0], (None,))[0] == ROWS:
            region.exits.append(user)
            return []
        raise _Reject(f"{user.format_node()} reads the inverse permutation")
    if kind == COUNTS:
        if t is aten.cumsum.default and user.args[0] is src and _arg(user, 1, "dim", 0) in (0, -1):
            return [(user, OFFS, 1)]
        raise _Reject(f"{user.format_node()} reads the rank's own counts")
    if kind == OFFS:
        return _grouped(region, user)
    # ROWS
    if t in region.gemms:
        return _grouped(region, user)
    if t is aten.histc.default and user.args[0] is src and src in bounds:
        bins = _arg(user, 1, "bins", 100)
        lo, hi = _arg(user, 2, "min", 0), _arg(user, 3, "max", 0)
        # every key lands in a bin (none is dropped), and bins rise with keys: the rows
        # of bin b are a contiguous run of the sorted rows, as the offsets assume
        sort = region.sort
        descending = _arg(sort, 2, "descending", False) if sort.target is aten.sort.default \
            else sort.kwargs.get("descending", False)
        if lo != hi and lo <= 0 and bounds[src] - 1 <= hi and bins >= 1 and not descending:
            return [(user, COUNTS, 1)]
        raise _Reject(f"{user.format_node()} may drop keys outside its range")
    if t is aten.index.Tensor and list(user.args[1]) == [src] and user.args[0] not in kinds \
            and _integral(src):
        return [(user, ROWS, 1)]  # a lookup by the sorted keys (an expert's bias)
    if t is aten.index.Tensor and user.args[0] is src:
        # by the inverse permutation it is classified from its index (_grow picks it)
        raise _Reject(f"{user.format_node()} indexes the sorted rows")
    if _row_wise(user, src, kinds):
        out = [(user, ROWS, 1)]
        if isinstance(user.meta.get("val"), (list, tuple)):  # a split, layer norm's statistics
            out += [(g, ROWS, 1) for g in user.users if g.target is operator.getitem]
        return out
    raise _Reject(f"{user.format_node()} is not row-wise")


def _grouped(region: Region, user: fx.Node) -> list:
    spec = region.gemms.get(user.target)
    if spec is None:
        raise _Reject(f"{user.format_node()} reads the offsets")
    x, w, off = gemm_operands(region, user)
    extra = [a for a in user.all_input_nodes if a not in (x, w, off)]
    if region.kinds.get(x, (None,))[0] != ROWS or region.kinds.get(off, (None,))[0] != OFFS \
            or w in region.kinds or any(a in region.kinds for a in extra):
        raise _Reject(f"{user.format_node()} mixes the sorted rows with others")
    return [(user, ROWS, 1)]


def _row_wise(user: fx.Node, src: fx.Node, kinds: dict) -> bool:
    """Does ``user`` compute each of its output rows from the same row of ``src`` (and of
    the region's other row values) alone, keeping dim 0 first?"""
    t = user.target
    nd = ndim_of(src)
    out_rows = _rows_of(user) if isinstance(user.meta.get("val"), torch.Tensor) else None
    if t in _ROW_COPIES:
        return user.args[0] is src
    if t in _ROW_VIEWS:
        return user.args[0] is src and out_rows == _rows_of(src)
    if t in _SPLITS:
        dim = _arg(user, 2, "dim", 0)
        return user.args[0] is src and dim % max(nd, 1) != 0
    if t in _DIM_ARG1:
        dim = int(user.args[1]) if len(user.args) > 1 else 0
        ndim = ndim_of(user) if t is aten.unsqueeze.default else nd
        return user.args[0] is src and dim % max(ndim, 1) != 0
    if t is aten.transpose.int:
        a, b = (int(d) for d in user.args[1:3])
        return user.args[0] is src and a % nd != 0 and b % nd != 0
    if t is aten.permute.default:
        first = int(user.args[1][0])
        return user.args[0] is src and first % nd == 0
    if t in _REDUCTIONS:
        dims = _arg(user, 1, "dim", None)
        return user.args[0] is src and bool(dims) and all(d % nd != 0 for d in dims)
    if t in _NORMS:
        return user.args[0] is src and len(user.args[1]) < nd and \
            not any(a in kinds for a in user.all_input_nodes if a is not src)
    if t in _GEMMS_LEFT:  # rows @ W, W not batched (a batched W would lead the output)
        return user.args[0] is src and nd >= 2 and ndim_of(user) == nd and \
            _rows_of(user) == _rows_of(src) and \
            not any(a in kinds for a in user.all_input_nodes if a is not src)
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
        if _rows_of(user) != _rows_of(src) or ndim_of(user) != nd:
            return False
        for a in user.all_input_nodes:
            if a in kinds:
                if kinds[a][0] != ROWS or ndim_of(a) != nd:
                    return False
            elif ndim_of(a) == nd and _rows_of(a) != 1:
                return False  # a whole tensor of rows in the batch's order, mixed in
        return True
    return False


def find_regions(graph: fx.Graph) -> list[Region]:
    regions = (region_at(n) for n in graph.nodes if n.target in _SORTS)
    return [r for r in regions if r is not None]


def region_at(sort: fx.Node) -> Region | None:
    """The routing region the sort ``sort`` begins, or None where its order is read."""
    x = sort.args[0]
    if ndim_of(x) != 1 or not isinstance(x.meta["val"].shape[0], int):
        return None  # a size known only at run time: no even cut to check
    region = Region(sort, int(x.meta["val"].shape[0]), gemms=grouped_gemms())
    try:
        _grow(region)
    except _Reject:
        return None
    return region if region.exits else None


def _grow(region: Region) -> None:
    sort = region.sort
    bound = index_bound(sort.args[0])
    bounds: dict[fx.Node, int] = {}
    for g in sort.users:
        if g.target is not operator.getitem:
            raise _Reject("sort's result used whole")
        kind = ROWS if g.args[1] == 0 else IDX
        region.kinds[g] = (kind, 1)
        if kind == ROWS and bound is not None:
            bounds[g] = bound
    # in the graph's order, so that every input of a node is classified before it
    after = False
    for user in sort.graph.nodes:
        after = after or user is sort
        if not after or user is sort or user in region.kinds:
            continue
        tainted = [a for a in user.all_input_nodes if a in region.kinds]
        if not tainted:
            continue
        if user.op == "output":
            raise _Reject("a region value is returned")
        src = tainted[0]
        if user.target in (aten.index.Tensor, aten.index_put.default):
            idx = [a for a in user.args[1] if isinstance(a, fx.Node)]
            src = next((a for a in idx if a in region.kinds), src)
        kind, ratio = region.kinds[src]
        for new, k, r in _classify(region, user, src, kind, ratio, bounds):
            region.kinds[new] = (k, r)
            if src in bounds and user.target in _ROW_COPIES:
                bounds[new] = bounds[src]
    # every ROWS value has the sorted rows' count on dim 0
    for n, (k, _) in region.kinds.items():
        if k == ROWS and isinstance(n.meta.get("val"), torch.Tensor) and _rows_of(n) != region.n:
            raise _Reject(f"{n.name} has {_rows_of(n)} rows, not {region.n}")


# ---------------------------------------------------------------------------- lowering
def region_rules(L: Lowering, graph: fx.Graph
                 ) -> tuple[dict[fx.Node, Callable[[Lowering, fx.Node], Any]], list[Region]]:
    """The rule of each node in a routing region of ``graph`` (the rest keep the table's),
    and the regions."""
    out: dict[fx.Node, Callable[[Lowering, fx.Node], Any]] = {}
    regions = find_regions(graph)
    for region in regions:
        out[region.sort] = _sort_rule(region)
        for n, (kind, _) in region.kinds.items():
            out[n] = _member_rule(region, kind)
        for n in region.exits:
            out[n] = _exit_rule(region)
        for n in region.aranges:
            out[n] = _arange_rule(region)
    return out, regions


def rows_layout(axes: tuple[str, ...], ndim: int) -> Layout:
    return Layout(ndim, (axes,) + tuple(() for _ in range(ndim - 1)))


def _ordinary(L: Lowering, node: fx.Node) -> Any:
    return L.rule_for(node)(L, node)


def _sort_rule(region: Region) -> Callable[[Lowering, fx.Node], Any]:
    def rule(L: Lowering, node: fx.Node) -> Any:
        x = L.env[node.args[0]]
        lay = x.layout.clean(L.mesh) if x.layout is not None else None
        axes = lay.dims[0] if lay is not None else ()
        n = math.prod(L.mesh.size(a) for a in axes)
        even = axes and region.n % n == 0 and all(rows % n == 0 for rows in
                                                  (_rows_of(s) for s in region.row_sources))
        if not even or lay.interleave[0] != 1:
            return _ordinary(L, node)
        region.axes = tuple(axes)
        xn = L.to_layout(x, rows_layout(region.axes, 1))
        vals = node.meta["val"]
        out = rows_layout(region.axes, 1)
        sn = L.emit(node.target, (xn, *node.args[1:]), dict(node.kwargs), layout=None, val=vals)
        L.decisions.append(
            f"{node.name} ({L.src.module}:{L.src.line}): each rank sorts its own rows over "
            f"{' and '.join(region.axes)}; the order is undone at "
            f"{', '.join(e.name for e in region.exits)} before anything reads it, so the "
            f"{region.n} rows are not gathered")
        return [Val(L.emit(operator.getitem, (sn, i), layout=out, val=v), out.clean(L.mesh), v)
                for i, v in enumerate(vals)]
    return rule


def local_value(L: Lowering, region: Region, a: Any) -> Any:
    """``a``'s node on this rank, its rows cut over the region's axes, the rest whole."""
    v = L.env[a] if isinstance(a, fx.Node) else a
    if not isinstance(v, Val):
        return v
    if a in region.kinds and region.kinds[a][0] in (COUNTS, OFFS):
        return v.node  # the rank's own counts: local by construction
    return L.to_layout(v, rows_layout(region.axes or (), v.ndim))


def _emit_local(L: Lowering, node: fx.Node, args: tuple, kwargs: dict, lay: Layout) -> Val:
    val = node.meta.get("val")
    n = L.emit(node.target, args, kwargs, layout=lay, val=val)
    return Val(n, lay.clean(L.mesh), val)


def _member_rule(region: Region, kind: str) -> Callable[[Lowering, fx.Node], Any]:
    """Inside a taken region a row value stands for the rows of every rank, each rank's in
    its own sorted order, one after another in rank order (what an all-gather over the
    region's axes would assemble). A row-wise op computes that tensor's rows as one
    device would, whatever its rule does with the layout (a rule that gathers and
    runs whole, then cuts, still hands each rank its own rows back), so row-wise ops
    keep their ordinary rules. The ops that read the order (lookups by the
    permutation, the histogram and the grouped GEMM) run on the rank's own rows."""
    def rule(L: Lowering, node: fx.Node) -> Any:
        if region.axes is None:
            return _ordinary(L, node)
        t = node.target
        if kind == ROWS and t is not aten.index.Tensor and t not in region.gemms:
            return _ordinary(L, node)  # row-wise (and the sort's getitems)
        if kind == IDX and t is not aten.index.Tensor:
            return _ordinary(L, node)  # perm // k, and the sort's getitem
        rows = rows_layout(region.axes, ndim_of(node))
        if t is aten.index.Tensor:
            x, idx = node.args[0], node.args[1][0]
            if region.kinds[idx][0] == IDX:  # x[perm // k]: x's own rows on this rank
                xn = local_value(L, region, x)
            else:  # table[keys]: every rank holds the whole table
                xv = L.env[x]
                xn = L.to_layout(xv, Layout.replicate(xv.ndim))
            return _emit_local(L, node, (xn, [local_value(L, region, idx)]), {}, rows)
        if t in region.gemms:
            wi = region.gemms[t][1]
            args, kwargs = _locals(L, region, node, skip=node.args[wi])
            wv = L.env[node.args[wi]]
            args = args[:wi] + (L.to_layout(wv, Layout.replicate(wv.ndim)),) + args[wi + 1:]
            return _emit_local(L, node, args, kwargs, rows)
        if kind == EMPTY:
            return _emit_local(L, node, (local_value(L, region, node.args[0]),), dict(node.kwargs), rows)
        if kind == INV:  # inv[perm] = arange(n), with n the rank's own rows
            ar = node.args[2]
            assert isinstance(ar, fx.Node)
            local_n = region.n // math.prod(L.mesh.size(a) for a in region.axes)
            arn = L.emit(aten.arange.default, (local_n,), dict(ar.kwargs), layout=rows,
                         val=ar.meta.get("val"))
            return _emit_local(L, node, (local_value(L, region, node.args[0]),
                                         [local_value(L, region, node.args[1][0])], arn), {}, rows)
        if kind in (COUNTS, OFFS):
            args, kwargs = _locals(L, region, node)
            return _emit_local(L, node, args, kwargs, Layout.replicate(ndim_of(node)))
        raise AssertionError(f"no routing rule for a {kind} value: {node.format_node()}")
    return rule


def gemm_operands(region: Region, node: fx.Node) -> tuple[Any, Any, Any]:
    """A grouped GEMM's (rows, weight, offsets) arguments."""
    xi, wi, oi = region.gemms[node.target]
    off = node.kwargs.get(oi) if isinstance(oi, str) else (node.args[oi] if len(node.args) > oi else None)
    if isinstance(oi, str) and off is None and len(node.args) > 2:
        off = node.args[2]
    return node.args[xi], node.args[wi], off


def _locals(L: Lowering, region: Region, node: fx.Node, skip: Any = None) -> tuple[tuple, dict]:
    def sub(a: fx.Node) -> Any:
        return a if a is skip else local_value(L, region, a)
    return fx.node.map_arg(node.args, sub), fx.node.map_arg(node.kwargs, sub)


def _arange_rule(region: Region) -> Callable[[Lowering, fx.Node], Any]:
    def rule(L: Lowering, node: fx.Node) -> Any:
        if region.axes is None:
            return _ordinary(L, node)
        return None  # the inverse permutation's rule makes the rank's own
    return rule


def _exit_rule(region: Region) -> Callable[[Lowering, fx.Node], Any]:
    def rule(L: Lowering, node: fx.Node) -> Any:
        if region.axes is None:
            return _ordinary(L, node)
        x, inv = node.args[0], node.args[1][0]
        return _emit_local(L, node, (local_value(L, region, x), [local_value(L, region, inv)]), {},
                           rows_layout(region.axes, ndim_of(node)))
    return rule
