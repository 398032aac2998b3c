"""Rows the data picks (``x[mask]``, ``torch.where(mask)``, ``nonzero``), computed at a
fixed size. Not a pass: ``trace.py`` runs it on the export, so that every reader of the
trace sees sizes it can lay out.

Why: a mixture of experts written as a loop over its experts (``for e, expert in
enumerate(self.experts): rows = torch.where(idx == e)[0]; out.index_add_(0, rows,
expert(x[rows]))``, Switch Transformers' ``next[mask] = expert(h[mask])``, transformers'
4.x Mixtral) runs each expert on as many rows as the router sent it, a number known only
when the step runs. The lowering lays out every tensor when it compiles, so it cannot
take such a size. But the region those rows flow through is row-local: every row is
picked from a tensor of the batch, computed on alone, and written back where it came
from. So it is computed here at its bound instead: ``nonzero_static(mask, size=N,
fill_value=-1)`` (N the mask's elements), the N - n padding rows read the last row (a
real, finite one), and every write of the region lands them in one scratch slot added to
the written tensor and cut off after it. Exact: the real rows' values are the ones the
model computes, the padding changes no output, and its gradients are exact zeros (a
zero row through GEMMs, activations and norms stays zero), so the parameters' gradients
gain only zeros. The cost is the padding's FLOPs: an expert computes every token's row.

What a region may do with its rows (``_follow``): pointwise ops, GEMMs with the rows on
the left, views, reductions and normalisations that leave the row dim alone, lookups of
other tensors by the same indices, and writes by those indices (``index_put``, which
``index_add_`` and ``y[mask] = v`` trace to) into a tensor that is not the region's. Anything that reads the rows as a
set (a sum or mean over them, their count, a sort, a random draw, whose draws would not be
one device's) leaves the region as it is, and the lowering's refusal names it.
"""
from __future__ import annotations

import math
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from shardc.core.ir import source_of, where

aten = torch.ops.aten

# the meta key of a ``nonzero`` whose rows could not be padded: why not
WHY_NOT = "shardc_picked_rows_kept"
# the meta key of a padded region's ``nonzero_static``: its ``Picked``
PICKED = "shardc_picked_rows"


@dataclass
class Picked:
    """A padded region as the lowering needs it to run on each rank's own rows
    (``passes/rules/picked.py``)."""
    nonzero: fx.Node  # nonzero_static(mask, size=bound, fill_value=-1)
    cols: dict[fx.Node, int]  # the nodes that hold one index column -> the mask dim it is
    splits: list[fx.Node]  # unbind(nonzero, 1), whose getitems are columns
    sources: list[fx.Node]  # x[..., cols, ...] of an x outside the region
    writes: list[tuple[fx.Node, fx.Node, fx.Node, int]]  # (pad, write, slice back, dim)


class _Reject(Exception):
    pass


# values carried unchanged, the row dim where it was
_COPIES = {aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default,
           aten.contiguous.default, aten.lift_fresh_copy.default}
# ops that only move or repeat dims: legal wherever their dim arguments spare the row dim
_LAYOUT = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
           aten.unsqueeze.default, aten.transpose.int, aten.permute.default, aten.expand.default,
           aten.t.default, aten.squeeze.dim, aten.squeeze.dims, aten.flatten.using_ints,
           aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.split.Tensor,
           aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}
# ops whose dim argument (position 1) must not be the row dim
_DIM_ARG1 = {aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor, aten.select.int,
             aten.narrow.default, aten.unbind.int, aten._softmax.default,
             aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int,
             aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
             aten.max.dim, aten.min.dim, aten.var.correction, aten.std.correction,
             aten.cumsum.default, aten.logsumexp.default, aten.argmax.default,
             aten.argmin.default}
_DIM_ARG2 = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.topk.default}
_DIM_0 = {aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.unbind.int}  # dim=0 default
_NORMS = {getattr(aten, n).default for n in ("native_layer_norm", "layer_norm", "rms_norm",
                                               "_fused_rms_norm") if hasattr(aten, n)}
_GEMMS = {aten.linear.default, aten.mm.default, aten.matmul.default, aten.addmm.default}
_SIZES = {aten.sym_size.int}
_METADATA_CHECK = getattr(getattr(aten, "_assert_tensor_metadata", None), "default", None)


def _op(n: fx.Node) -> str:
    return f"{n.target} {where(source_of(n))}"


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _row_dim(v: Any) -> int | None:
    """The one dim of ``v`` whose size the data decides; None when every size is fixed.
    Raises _Reject for two such dims, or a tuple of values."""
    if not isinstance(v, torch.Tensor):
        raise _Reject("not a tensor")
    dims = [d for d, s in enumerate(v.shape) if type(s) is not int]
    if len(dims) > 1:
        raise _Reject("two sizes the data decides")
    return dims[0] if dims else None


def _static(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_static(x) for x in v)
    return not isinstance(v, torch.Tensor) or all(type(s) is int for s in v.shape)


@dataclass
class _Region:
    nonzero: fx.Node
    rows: dict[fx.Node, int] = field(default_factory=dict)  # value -> its row dim
    cols: dict[fx.Node, int] = field(default_factory=dict)  # index column [n] -> the mask dim
    writes: list[tuple[fx.Node, int]] = field(default_factory=list)  # exit, dim it pads
    sizes: list[fx.Node] = field(default_factory=list)  # sym_size of the row dim
    tuples: set[fx.Node] = field(default_factory=set)  # ops of several outputs (getitems follow)


def _all_dims(node: fx.Node, ndim: int) -> list[int]:
    """The dims an op of _DIM_ARG1/_DIM_ARG2 names, normalised; [] for all of them."""
    i = 2 if node.target in _DIM_ARG2 else 1
    default = -1 if node.target is aten.topk.default else 0 if i == 2 or node.target in _DIM_0 else None
    arg = node.args[i] if len(node.args) > i else node.kwargs.get("dim", default)
    if arg is None:
        return list(range(ndim))
    arg = list(arg) if isinstance(arg, (list, tuple)) else [arg]
    return [int(d) % max(ndim, 1) for d in arg] if arg else list(range(ndim))


def _index_rows(node: fx.Node, region: _Region) -> int | None:
    """For ``x[..., c0, c1, ...]`` with every index tensor one of the region's columns,
    the output's row dim (torch's order: the indices' dim where the indexed dims are
    adjacent, else first); None when some index is not the region's."""
    idx = list(node.args[1])
    at = [d for d, i in enumerate(idx) if i is not None]
    if not at or any(idx[d] not in region.cols for d in at):
        return None
    return at[0] if at == list(range(at[0], at[0] + len(at))) else 0


def _follow(region: _Region, user: fx.Node, src: fx.Node) -> None:
    """Classify ``user``, which reads ``src`` (a region value): adds what it makes to the
    region, or raises _Reject."""
    t = user.target
    if src is region.nonzero:
        # the dim the op reads; unbind's and squeeze's may be left at their default (0: a
        # loop over the picked positions, which torch 2.8's draft_export traces)
        dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
        if t in _SIZES and dim == 0:
            region.sizes.append(user)
            return
        if t is aten.unbind.int and dim in (1, -1) \
                and all(g.target is operator.getitem for g in user.users):
            region.cols.update({g: int(g.args[1]) for g in user.users})
            region.tuples.add(user)
            return
        if (t is aten.select.int or t is aten.squeeze.dim and _val(src).shape[1] == 1) \
                and dim in (1, -1):
            # ``nz[:, j]``, and ``nz.squeeze(1)`` of a 1-d mask's
            region.cols[user] = int(user.args[2]) if t is aten.select.int else 0
            return
        raise _Reject(f"{_op(user)} reads the picked positions")
    if src in region.cols and t not in (aten.index.Tensor, aten.index_put.default,
                                        aten.index_add.default):
        if t in _COPIES and _val(user).dim() == 1:
            region.cols[user] = region.cols[src]
            return
        raise _Reject(f"{_op(user)} computes with the picked positions")
    if t is aten.index.Tensor:
        if src not in region.cols or _node_in(region, user.args[0]):
            raise _Reject(f"{_op(user)} indexes the picked rows")
        r = _index_rows(user, region)
        if r is None:
            raise _Reject(f"{_op(user)} mixes other indices in")
        region.rows[user] = r
        return
    if t in (aten.index_put.default, aten.index_add.default):
        # checked once the region is whole (``_check_write``): its values may come later
        # in the graph than the indices it was reached from
        if all(w is not user for w, _ in region.writes):
            region.writes.append((user, -1))
        return
    out = _val(user)
    if t is operator.getitem:
        r = _row_dim(out)
        if r is None:
            raise _Reject(f"{_op(user)} drops the rows")
        region.rows[user] = r
        return
    if t in _SIZES:
        if user.args[1] % _val(src).dim() != region.rows[src]:
            raise _Reject(f"{_op(user)} reads a size")  # a fixed one: exported as an int
        region.sizes.append(user)
        return
    if torch.Tag.nondeterministic_seeded in getattr(t, "tags", ()):
        raise _Reject(f"{_op(user)} draws random numbers for each picked row, which "
                      "would not be one device's draws at another row count")
    r_src = region.rows[src]
    nd = _val(src).dim()
    if t in _DIM_ARG1 or t in _DIM_ARG2:
        if r_src in _all_dims(user, nd):
            raise _Reject(f"{_op(user)} works along the picked rows")
    if t in _NORMS:
        shape = user.args[1]
        if user.args[0] is not src or r_src >= nd - len(shape):
            raise _Reject(f"{_op(user)} normalises across the picked rows")
    elif t in _GEMMS:
        a, b = (user.args[1], user.args[2]) if t is aten.addmm.default else user.args[:2]
        if src is a and r_src < nd - 1 and not _node_in(region, b):
            pass
        elif src is b and r_src == nd - 1 and not _node_in(region, a) and t is not aten.linear.default:
            pass
        else:
            raise _Reject(f"{_op(user)} contracts over the picked rows")
    elif t in _COPIES or t in _LAYOUT or t in _DIM_ARG1 or t in _DIM_ARG2:
        if user.args[0] is not src:
            raise _Reject(f"{_op(user)} takes the picked rows as an argument")
    elif isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
        pass
    else:
        raise _Reject(f"{_op(user)} is not known to treat each picked row alone")
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    for o in outs:
        if not isinstance(o, torch.Tensor):
            raise _Reject(f"{_op(user)} makes a number")
    for a in user.all_input_nodes:  # any other input: fixed sizes, or this region's rows
        if a is not src and not _node_in(region, a) and not _static(_val(a)):
            raise _Reject(f"{_op(user)} mixes in rows another selection picked")
    if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.flatten.using_ints):
        # the elements before and after the row dim the same: each row stays whole
        r = _row_dim(out)
        if r is None or math.prod(_val(src).shape[:r_src]) != math.prod(out.shape[:r]) or \
                math.prod(_val(src).shape[r_src + 1:]) != math.prod(out.shape[r + 1:]):
            raise _Reject(f"{_op(user)} reshapes across the picked rows")
    if isinstance(out, torch.Tensor):
        r = _row_dim(out)
        if r is None:
            raise _Reject(f"{_op(user)} drops the rows")
        region.rows[user] = r
    else:  # a tuple (a split, a norm's statistics): its getitems are classified as its users
        region.tuples.add(user)


def _check_write(region: _Region, user: fx.Node) -> int:
    """The dim a write by the region's indices pads (its scratch slot's, which the
    padding's index -1 reaches), or _Reject."""
    dest = user.args[0]
    if _node_in(region, dest) or not _static(_val(dest)):
        raise _Reject(f"{_op(user)} writes into the picked rows")
    if user.target is aten.index_put.default:
        vals = user.args[2]
        r = _index_rows(user, region)
        at = [d for d, i in enumerate(user.args[1]) if i is not None]
        fixed = not _node_in(region, vals) and _static(_val(vals))  # ``out[rows] = 0``
        if r is None or not (fixed or region.rows.get(vals) == r):
            raise _Reject(f"{_op(user)} writes other values or by other indices")
        return at[0]
    # ``index_add`` itself (torch's export decomposes it into the ``index_put`` above
    # where shardc has no rule for it) takes no index -1, the padding's
    raise _Reject(f"{_op(user)} adds by the picked positions whole")


def _node_in(region: _Region, n: Any) -> bool:
    return n is region.nonzero or n in region.rows or n in region.cols


def _grow(nonzero: fx.Node) -> _Region:
    region = _Region(nonzero)
    order = {n: i for i, n in enumerate(nonzero.graph.nodes)}
    todo = [nonzero]
    seen: set[fx.Node] = set()
    while todo:
        todo.sort(key=order.__getitem__)  # inputs before the ops that read them
        src = todo.pop(0)
        if src in seen:
            continue
        seen.add(src)
        for user in list(src.users):
            if user.target is _METADATA_CHECK or any(w is user for w, _ in region.writes) \
                    or user in region.rows or user in region.cols or user in region.tuples:
                continue
            before = set(region.rows) | set(region.cols) | region.tuples
            _follow(region, user, src)
            todo.extend((set(region.rows) | set(region.cols) | region.tuples) - before)
    for s in region.sizes:  # a row count may only be checked (export's range asserts)
        for u in s.users:
            if u.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                            aten.expand.default) and _node_in(region, u.args[0]):
                continue
            if u.target in _CHECKS or u.op == "call_function" and all(asserts_only(u)):
                continue
            raise _Reject(f"{_op(u)} computes with how many rows were picked")
    if not region.writes:
        raise _Reject("nothing writes the picked rows back")
    region.writes = [(w, _check_write(region, w)) for w, _ in region.writes]
    known = set(region.rows) | set(region.cols) | region.tuples | {w for w, _ in region.writes} | \
        set(region.sizes)
    for v in [nonzero, *region.rows, *region.cols, *region.tuples]:  # every reader classified
        for u in v.users:
            if u not in known and u.target is not _METADATA_CHECK:
                raise _Reject(f"{_op(u)} was not followed")
    return region


# export's checks of a size the data decides (``u0 >= 0``; torch 2.8 also constrains it)
_CHECKS = {getattr(aten, n).default for n in ("_assert_scalar", "sym_constrain_range_for_size",
                                              "sym_constrain_range") if hasattr(aten, n)}


def asserts_only(n: fx.Node) -> list[bool]:
    return [u.target in _CHECKS or
            (u.op == "call_function" and not isinstance(u.target, torch._ops.OpOverload)
             and bool(u.users) and all(asserts_only(u))) for u in n.users] or [False]


def _bool_indices(graph: fx.Graph) -> None:
    """``x[mask]`` and ``x[mask] = v`` with a boolean mask (one ``nonzero`` per mask, so
    that a read and a write of the same mask pick the same rows) become integer indices,
    which the regions follow. A write of a value of fixed shape (``x[mask] = 0``) has no
    size the data decides and stays as it is."""
    made: dict[fx.Node, list[fx.Node]] = {}
    keys: dict[fx.Node, Any] = {}
    firsts: dict[Any, fx.Node] = {}
    for node in list(graph.nodes):
        if node.target not in (aten.index.Tensor, aten.index_put.default):
            continue
        idx = list(node.args[1])
        masks = [i for i in idx if isinstance(i, fx.Node) and isinstance(_val(i), torch.Tensor)
                 and _val(i).dtype in (torch.bool, torch.uint8)]
        if len(masks) != 1 or len([i for i in idx if i is not None]) != 1:
            continue
        if node.target is aten.index_put.default and _static(_val(node.args[2])):
            continue
        m = masks[0]
        m = firsts.setdefault(expr_key(m, keys), m)  # ``flat == i`` written twice: one mask
        if m not in made:
            with graph.inserting_after(m):
                nz = graph.call_function(aten.nonzero.default, (m,))
            with graph.inserting_after(nz):
                ub = graph.call_function(aten.unbind.int, (nz, 1))
            cols: list[fx.Node] = []
            for k in range(_val(m).dim()):
                with graph.inserting_after(cols[-1] if cols else ub):
                    cols.append(graph.call_function(operator.getitem, (ub, k)))
            for n in (nz, ub, *cols):  # where the model wrote the mask's use
                n.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            fake_val(nz)
            fake_val(ub)
            for c in cols:
                fake_val(c)
            made[m] = cols
        d = idx.index(masks[0])
        node.args = (node.args[0], idx[:d] + made[m] + idx[d + 1:], *node.args[2:])


def expr_key(n: Any, keys: dict[fx.Node, Any]) -> Any:
    """What ``n`` computes, as a hashable expression: equal for two nodes that run the same
    pure ops on the same inputs; the node itself where it reads anything else."""
    if not isinstance(n, fx.Node):
        return tuple(expr_key(a, keys) for a in n) if isinstance(n, (list, tuple)) else n
    if n not in keys:
        t = n.target
        pure = n.op == "call_function" and isinstance(t, torch._ops.OpOverload) \
            and not t._schema.is_mutable and torch.Tag.nondeterministic_seeded not in t.tags
        keys[n] = (t, expr_key(n.args, keys), tuple(sorted((k, expr_key(v, keys)) for k, v in n.kwargs.items()))) \
            if pure else n
    return keys[n]


def fake_val(node: fx.Node) -> None:
    """The node's meta value, from its inputs' (in the export's fake mode)."""
    def arg(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, fx.Node) else a
    args = fx.node.map_aggregate(node.args, arg)
    kwargs = fx.node.map_aggregate(node.kwargs, arg)
    if node.target is operator.getitem:
        node.meta["val"] = args[0][args[1]]
        return
    mode = detect_fake_mode([a.meta.get("val") for a in node.all_input_nodes])
    if mode is None:
        node.meta["val"] = node.target(*args, **kwargs)
        return
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)


def _rewrite(graph: fx.Graph, region: _Region) -> int:
    """Pad ``region`` to its bound, which it returns."""
    nz = region.nonzero
    mask = nz.args[0]
    bound = math.prod(_val(mask).shape)
    with graph.inserting_after(nz):
        fixed = graph.call_function(aten.nonzero_static.default, (mask,),
                                    {"size": bound, "fill_value": -1})
    fixed.meta.update({k: v for k, v in nz.meta.items() if k != "val"})
    nz.replace_all_uses_with(fixed)
    graph.erase_node(nz)
    region.nonzero = fixed
    for s in region.sizes:
        for u in list(s.users):
            if u.target in _CHECKS:
                graph.erase_node(u)
            elif u.op == "call_function" and not isinstance(u.target, torch._ops.OpOverload) \
                    and all(asserts_only(u)):
                erase_tree(graph, u)
        s.replace_all_uses_with(bound)
        graph.erase_node(s)
    for w, dim in region.writes:
        dest = w.args[0]
        nd = _val(dest).dim()
        size = int(_val(dest).shape[dim])
        with graph.inserting_before(w):
            # one scratch slot past the end: index -1 (the padding's) lands there
            padded = graph.call_function(aten.constant_pad_nd.default,
                                         (dest, [0, 0] * (nd - 1 - dim) + [0, 1], 0.0))
        padded.meta.update({k: v for k, v in w.meta.items() if k != "val"})
        w.replace_input_with(dest, padded)
        with graph.inserting_after(w):
            cut = graph.call_function(aten.slice.Tensor, (w, dim, 0, size))
        cut.meta.update({k: v for k, v in w.meta.items() if k != "val"})
        w.replace_all_uses_with(cut, delete_user_cb=lambda u, cut=cut: u is not cut)
    splits = [u for u in fixed.users if u.target is aten.unbind.int]
    sources = [n for n in region.rows if n.target is aten.index.Tensor]
    writes = [(w.args[0], w, next(iter(w.users)), dim) for w, dim in region.writes]
    fixed.meta[PICKED] = Picked(fixed, dict(region.cols), splits, sources, writes)
    # the region's values again, at the bound (what reads a write's slice keeps its shape)
    redo = set(region.rows) | set(region.cols) | region.tuples | {fixed} | \
        {n for w, _ in region.writes for n in (w, w.args[0], *w.users)}
    for n in graph.nodes:
        if n in redo:
            fake_val(n)
    return bound


def erase_tree(graph: fx.Graph, n: fx.Node) -> None:
    for u in list(n.users):
        erase_tree(graph, u)
    graph.erase_node(n)


def pad_data_sized(gm: fx.GraphModule) -> None:
    """Rewrite every region whose rows a ``nonzero`` (or a boolean mask) picks into its
    fixed-size form, with a warning naming where and at what bound; a region that reads
    its rows as a set is left as it is (the lowering refuses it, naming the op)."""
    graph = gm.graph
    if not any(n.target in (aten.nonzero.default, aten.index.Tensor, aten.index_put.default)
               for n in graph.nodes):
        return
    _bool_indices(graph)
    done = []
    for nz in [n for n in graph.nodes if n.target is aten.nonzero.default]:
        v = _val(nz)
        if not isinstance(v, torch.Tensor) or _static(v):
            continue
        try:
            region = _grow(nz)
        except _Reject as e:
            nz.meta[WHY_NOT] = str(e)  # for the lowering's refusal
            continue
        done.append((source_of(nz), _rewrite(graph, region)))  # the source read before nz goes
    gm.recompile()
    if done:
        places = ", ".join(sorted({f"{where(s)} (up to {b} rows)" for s, b in done}))
        warnings.warn(
            f"shardc.compile: rows picked by the data (a boolean mask or nonzero) {places} "
            "are computed at their bound, padded: exact, but each such region runs every row "
            "it could pick (a mixture of experts looped over, each expert the whole batch; "
            "transformers' grouped_mm experts, its default since 5.0, sort the rows instead).",
            stacklevel=2)
