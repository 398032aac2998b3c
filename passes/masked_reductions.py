"""A sum or a mean over values computed element by element from the elements a boolean mask
picks (``d = log(t[valid]) - log(p[valid]); (d ** 2).mean()``, ``F.mse_loss(p[m], t[m])``),
computed over every element with the unpicked ones zeroed out of the sum. Not a pass:
``trace.py`` runs it on the export, before the decompositions.

Why: a depth or regression loss over the valid pixels (GLPN's and DPT's scale-invariant
log loss, a masked mean squared error) picks as many elements as the mask holds, a number
known only when the step runs. The compiled program could only run such a set read whole,
on the gathered batch, on every rank.

The reduction does not need the elements picked. For a mask ``m`` over ``x``'s leading
dims, each pick ``x[m]`` becomes ``x' = where(m, x, fill)`` of ``x``'s own shape, the
element-wise ops run on ``x'`` unchanged, and a sum over the picked elements becomes the
sum over every element with the unpicked ones zeroed (a mean: divided by the picked
count). The values are the model's. So are the gradients: an unpicked element's gradient
is zero, and the ops' derivatives there are taken at ``fill``, the mean of the picked
elements (1 where none is picked), a value in their range, so finite wherever the
model's are for a function whose domain is an interval (log, sqrt, a power): an unpicked
element may hold what the mask was written to keep out (a zero depth under a log), which
would make a zero gradient times an infinite derivative a NaN. Every size is then fixed,
and the elements keep the batch's layout: each rank sums its own, and the sums are
all-reduced, as for any mean.

Taken: the picks ``x[m]`` with one boolean mask over the leading dims (several picks with
masks equal as expressions), element-wise ops between them and values that broadcast
without the picked dim (numbers, parameters), ``broadcast_tensors``, and at the end
``sum``/``mean`` over every dim or over the picked dim, or a loss that reduces
element-wise differences (``mse_loss``, ``l1_loss``, ``smooth_l1_loss``, ``huber_loss``)
with a mean or a sum. Anything else that reads the picked elements leaves them as they
were.
"""
from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from shardc.passes.data_sized import asserts_only, erase_tree, expr_key, fake_val

aten = torch.ops.aten

# element-wise losses: (the reduction's position in the args, its default)
_LOSSES = {aten.mse_loss.default: 2, aten.l1_loss.default: 2, aten.smooth_l1_loss.default: 2,
           aten.huber_loss.default: 2}
_REDUCTIONS = {aten.sum.default, aten.mean.default, aten.sum.dim_IntList, aten.mean.dim}
_COPIES = {aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
           aten.alias.default, aten.to.dtype_layout}


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _arg(n: fx.Node, pos: int, name: str, default: Any) -> Any:
    if len(n.args) > pos:
        return n.args[pos]
    return n.kwargs.get(name, default)


def _pick(n: fx.Node) -> fx.Node | None:
    """The mask of ``n`` if it is ``x[m]``, a boolean mask over ``x``'s leading dims."""
    if n.target is not aten.index.Tensor:
        return None
    idx = list(_arg(n, 1, "indices", []))
    if len(idx) != 1 or not isinstance(idx[0], fx.Node):
        return None
    m, x, v = _val(idx[0]), _val(n.args[0]), _val(n)
    if not (isinstance(m, torch.Tensor) and isinstance(x, torch.Tensor) and m.dtype == torch.bool):
        return None
    if m.dim() > x.dim() or tuple(m.shape) != tuple(x.shape[:m.dim()]) \
            or not all(isinstance(s, int) for s in x.shape) or isinstance(v.shape[0], int):
        return None
    return idx[0]


def _pointwise(n: fx.Node) -> bool:
    t = n.target
    if t in _COPIES or t is aten.broadcast_tensors.default:
        return True
    if n.op == "call_function" and t is operator.getitem:
        return isinstance(n.args[0], fx.Node) and n.args[0].target is aten.broadcast_tensors.default
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags \
        and torch.Tag.nondeterministic_seeded not in t.tags and not t._schema.is_mutable


def _broadcasts_alone(a: Any, rows: Any) -> bool:
    """Does ``a`` broadcast against a value of ``rows`` picked rows without the picked dim?"""
    v = _val(a)
    if not isinstance(v, torch.Tensor):
        return not isinstance(a, fx.Node)  # a number
    r = _val(rows)
    if not all(isinstance(d, int) for d in v.shape):
        return False  # a size the data decides: rows of another selection
    return v.dim() < r.dim() or (v.dim() == r.dim() and v.shape[0] == 1)


class _Reject(Exception):
    pass


def _region(graph: fx.Graph, start: fx.Node, keys: dict) -> tuple[set, list, dict, fx.Node]:
    """The picks with ``start``'s mask (equal as expressions), the element-wise nodes that
    read them and the final reductions (each: over every dim, or over the picked one)."""
    mask = _pick(start)
    assert mask is not None
    key = expr_key(mask, keys)
    picks: list[fx.Node] = []
    inner: set = set()
    ends: dict = {}
    for u in graph.nodes:
        m = _pick(u)
        if m is not None and expr_key(m, keys) == key:
            picks.append(u)
            inner.add(u)
            continue
        ins = list(u.args[0]) if u.target is aten.broadcast_tensors.default else u.all_input_nodes
        read = [a for a in ins if a in inner]
        if not read:
            continue
        if u.target is aten.sym_size.int and all(asserts_only(u)):
            continue
        n = read[0]
        if u.target in _REDUCTIONS:
            dims = _arg(u, 1, "dim", None)
            nd = _val(n).dim()
            over = None if dims is None else sorted(d % nd for d in dims)
            if over in (None, list(range(nd)), [0]) and not _arg(u, 2, "keepdim", False):
                ends[u] = "rows" if over == [0] and nd > 1 else "all"
                continue
            raise _Reject
        is_loss = u.target in _LOSSES and _arg(u, _LOSSES[u.target], "reduction", 1) in (1, 2)
        if not (_pointwise(u) or u.target in _LOSSES):
            raise _Reject
        if any(a not in inner and not (u.target is not operator.getitem and _broadcasts_alone(a, n))
               for a in ins):
            raise _Reject
        if is_loss:
            ends[u] = "all"
        else:
            inner.add(u)
    return inner, picks, ends, mask


def unpick_reductions(gm: fx.GraphModule) -> None:
    """Rewrite each sum or mean over element-wise values of picked elements (see the
    module's doc)."""
    graph = gm.graph
    keys: dict = {}
    tried: set = set()  # masks (as expressions) whose picks were taken or left
    changed = False
    for start in [n for n in graph.nodes if _pick(n) is not None]:
        m = _pick(start)  # None for a pick a rewrite before this one erased
        key = expr_key(m, keys)
        if m is None or key in tried:
            continue
        tried.add(key)
        try:
            inner, picks, ends, mask = _region(graph, start, keys)
        except _Reject:
            continue
        if not ends:
            continue
        _rewrite(graph, inner, picks, ends, mask)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()


def _call(graph: fx.Graph, like: fx.Node, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    n = graph.call_function(target, args, kwargs)
    n.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta", "unbacked_bindings")})
    fake_val(n)
    return n


def _rewrite(graph: fx.Graph, inner: set, picks: list, ends: dict, mask: fx.Node) -> None:
    lead = _val(mask).dim()
    first = picks[0]  # _region lists them in graph order

    def spread(like: fx.Node, nd: int) -> fx.Node:
        """The mask shaped to broadcast over a value of ``nd`` dims."""
        return _call(graph, like, aten.reshape.default, mask, list(_val(mask).shape) + [1] * (nd - lead))

    with graph.inserting_before(first):
        count = _call(graph, first, aten.sum.default, mask)
        some = _call(graph, first, aten.gt.Scalar, count, 0)
        denom = _call(graph, first, aten.clamp_min.default, count, 1)
    for p in picks:
        x = p.args[0]
        nd = _val(x).dim()
        with graph.inserting_before(p):
            m = spread(p, nd)
            if _val(x).is_floating_point():
                kept = _call(graph, p, aten.where.ScalarOther, m, x, 0)
                total = _call(graph, p, aten.sum.dim_IntList, kept, list(range(lead)))
                mean = _call(graph, p, aten.div.Tensor, total, denom)
                # where nothing is picked: 1, at which the usual domains (log, sqrt) are finite
                fill = _call(graph, p, aten.where.ScalarOther, some, mean, 1)
                full = _call(graph, p, aten.where.self, m, x, fill)
            else:  # no gradient: any value of the dtype does
                full = _call(graph, p, aten.where.ScalarOther, m, x, False if _val(x).dtype == torch.bool else 0)
        for u in list(p.users):
            if u.target is aten.sym_size.int:
                erase_tree(graph, u)
        p.replace_all_uses_with(full)
        graph.erase_node(p)
    for n in graph.nodes:  # the element-wise values again, at the input's shape
        if n in inner and n.op == "call_function":
            fake_val(n)
    for e, kind in ends.items():
        y = e.args[0]
        with graph.inserting_before(e):
            if e.target in _LOSSES:
                red = _arg(e, _LOSSES[e.target], "reduction", 1)
                args = list(e.args)
                while len(args) <= _LOSSES[e.target]:
                    args.append(1)
                args[_LOSSES[e.target]] = 0
                kw = {k: v for k, v in e.kwargs.items() if k != "reduction"}
                y = _call(graph, e, e.target, *args, **kw)
                averaged = red == 1
            else:
                averaged = e.target in (aten.mean.default, aten.mean.dim)
            nd = _val(y).dim()
            over = list(range(nd)) if kind == "all" else list(range(lead))
            # an integer zero keeps the dtype (a count of picked booleans stays an integer)
            kept = _call(graph, e, aten.where.ScalarOther, spread(e, nd), y,
                         False if _val(y).dtype == torch.bool else 0)
            out = _call(graph, e, aten.sum.dim_IntList, kept, over)
            if averaged:
                per = math.prod(_val(y).shape[lead:]) if kind == "all" else 1
                n = _call(graph, e, aten.mul.Scalar, count, per) if per != 1 else count
                out = _call(graph, e, aten.div.Tensor, out, n)
            dtype = e.kwargs.get("dtype")
            if dtype is not None and _val(out).dtype != dtype:
                out = _call(graph, e, aten._to_copy.default, out, dtype=dtype)
        e.replace_all_uses_with(out)
        graph.erase_node(e)
