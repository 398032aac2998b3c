"""A classification loss over the rows a boolean mask picks (``F.cross_entropy(logits[mask],
labels[mask])``), computed over every row with the unpicked ones ignored. Not a pass:
``trace.py`` runs it on the export, before the decompositions.

Why: a loss written by hand over the valid tokens (a masked language model's, a token
classifier's ``logits.view(-1, C)[active]``, transformers' older heads) picks as many rows
as the mask holds, a number known only when the step runs. torch's own decomposition of
``cross_entropy_loss`` cannot take that size (it asks whether ``n * C == 0``), so such a
model failed to trace at all, on every mesh, a mesh of one included. And were it
traced, the lowering could not lay the picked rows out over the batch's ranks.

The loss does not need the rows picked. ``cross_entropy(x[m], t[m], w, reduction, ii,
smoothing)`` with reduction mean or sum equals ``cross_entropy(x', t', w, reduction, ii,
smoothing)`` over every row, where ``t'`` is ``t`` with the unpicked rows set to the
ignore index ``ii`` and ``x'`` is ``x`` with the unpicked rows zeroed: an ignored row adds
nothing to the sum, nothing to a mean's count or weight total, and its gradient is an
exact zero (zeroed, not just ignored: a row the mask leaves out may hold infinities or
NaNs, which would reach the gradient through log-softmax's backward). The same holds
for ``nll_loss`` of a ``log_softmax``, and for dtype casts, copies and scalings on the way
to the loss, which treat each row alone. Every size is then fixed, and the rows keep the
batch's layout (each rank its own rows, as for any cross-entropy).

``binary_cross_entropy_with_logits(x[m], y[m])`` (ELECTRA's discriminator over the
attended tokens) is an elementwise loss: it becomes the loss of every element (the
unpicked ones' inputs zeroed), its unpicked elements zeroed, summed, and for a mean
divided by the number of picked elements; ``pos_weight`` is kept, a ``weight`` (one per
picked element) leaves it as it was.

Left as they were (and refused later, naming the index): a loss with ``reduction="none"``
(its size is the rows'), probability targets (no ignore index), a mask over other dims
than the leading ones, and picked rows read by anything else.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from shardc.passes.data_sized import asserts_only, erase_tree, expr_key, fake_val

aten = torch.ops.aten

_LOGITS_LOSS = aten.binary_cross_entropy_with_logits.default
_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default,
           _LOGITS_LOSS}
_METADATA_CHECK = getattr(getattr(aten, "_assert_tensor_metadata", None), "default", None)
# ops that compute each row from that row alone and keep zeros finite
_ROW_WISE = {aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
             aten.alias.default, aten.log_softmax.int, aten._log_softmax.default,
             aten.mul.Scalar, aten.div.Scalar, aten.mul.Tensor, aten.div.Tensor}


def _arg(node: fx.Node, pos: int, name: str, default: Any) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def _picked(n: Any) -> tuple[fx.Node, fx.Node] | None:
    """(the tensor, the mask) of ``x[mask]`` with one boolean mask over x's leading dims."""
    if not (isinstance(n, fx.Node) and n.target is aten.index.Tensor):
        return None
    x, idx = n.args[0], n.args[1]
    if not (isinstance(x, fx.Node) and isinstance(idx, (list, tuple)) and len(idx) == 1
            and isinstance(idx[0], fx.Node)):
        return None
    m = idx[0]
    xv, mv = x.meta.get("val"), m.meta.get("val")
    if not (isinstance(xv, torch.Tensor) and isinstance(mv, torch.Tensor)) or mv.dtype != torch.bool:
        return None
    if tuple(xv.shape[:mv.dim()]) != tuple(mv.shape) or not all(type(s) is int for s in xv.shape):
        return None
    return x, m


def _row_wise(n: fx.Node) -> bool:
    if n.target not in _ROW_WISE:
        return False
    if n.target in (aten.log_softmax.int, aten._log_softmax.default):
        # over a dim of each picked row, never across the picked rows (dim 0)
        dim, ndim = n.args[1], n.meta["val"].dim()
        return isinstance(dim, int) and ndim > 1 and dim % ndim != 0
    if n.target in (aten.mul.Tensor, aten.div.Tensor):  # by a number, not a tensor
        return not isinstance(n.args[1], fx.Node)
    return True


def _chain(loss: fx.Node, start: fx.Node) -> list[fx.Node] | None:
    """The row-wise nodes from a picked ``x[mask]`` to ``start`` (the loss's operand), the
    pick first; None when the path leaves the row-wise ops or a node on it has another
    reader than the next (size checks and metadata asserts aside)."""
    path = [start]
    while _picked(path[-1]) is None:
        n = path[-1]
        if not _row_wise(n) or not isinstance(n.args[0], fx.Node):
            return None
        path.append(n.args[0])
    path.reverse()
    for a, b in zip(path, [*path[1:], loss]):
        others = [u for u in a.users if u is not b and u.target is not _METADATA_CHECK
                  and not (u.target is aten.sym_size.int and all(asserts_only(u)))]
        if others:
            return None
    return path


def _operands(loss: fx.Node, keys: dict[fx.Node, Any]
              ) -> tuple[list[fx.Node], list[fx.Node], fx.Node, fx.Node, fx.Node] | None:
    """(the input's chain, the target's, the input picked from, the target picked from,
    the mask) when both operands are picked by one mask through row-wise ops."""
    x_in, t_in = loss.args[0], loss.args[1]
    if not (isinstance(x_in, fx.Node) and isinstance(t_in, fx.Node)):
        return None
    xs, ts = _chain(loss, x_in), _chain(loss, t_in)
    if xs is None or ts is None:
        return None
    (x, m), (t, tm) = _picked(xs[0]), _picked(ts[0])  # type: ignore[misc]
    if expr_key(m, keys) != expr_key(tm, keys):
        return None
    return xs, ts, x, t, m


def _unpick(graph: fx.Graph, chains: list[list[fx.Node]], reps: list[fx.Node]) -> None:
    """Each chain's pick replaced by ``rep`` (the same rows, every one of them), the
    picked count's checks erased, the chain's shapes computed anew."""
    for chain, rep in zip(chains, reps):
        pick = chain[0]
        for u in list(pick.users):
            if u.target is aten.sym_size.int:  # the picked count and export's checks on it
                erase_tree(graph, u)
        pick.replace_all_uses_with(rep)
        graph.erase_node(pick)
    for chain in chains:
        for n in chain[1:]:
            fake_val(n)


def _new(graph: fx.Graph, where: fx.Node, made: list[fx.Node]) -> None:
    for n in made:  # where the model wrote the pick, for the readouts
        n.meta.update({k: v for k, v in where.meta.items() if k != "val"})
        fake_val(n)


def _rewrite_logits(graph: fx.Graph, loss: fx.Node, keys: dict[fx.Node, Any]) -> bool:
    """``binary_cross_entropy_with_logits(x[m], y[m])`` (ELECTRA's discriminator over the
    attended tokens): the elementwise loss over every element, the unpicked ones zeroed
    (their inputs too, so that what the model leaves out cannot reach a gradient),
    summed, and divided by the picked elements' count for a mean."""
    weight = _arg(loss, 2, "weight", None)
    reduction = _arg(loss, 4, "reduction", 1)
    if reduction not in (1, 2) or weight is not None:  # a weight per picked element: not here
        return False
    found = _operands(loss, keys)
    if found is None:
        return False
    xs, ts, x, t, m = found
    xv, tv, mv = x.meta["val"], t.meta["val"], m.meta["val"]
    if tuple(xv.shape) != tuple(tv.shape):
        return False
    trailing = list(xv.shape[mv.dim():])
    with graph.inserting_before(xs[0]):
        off = graph.call_function(aten.logical_not.default, (m,))
        off_x = graph.call_function(aten.reshape.default, (off, list(mv.shape) + [1] * len(trailing)))
        x0 = graph.call_function(aten.masked_fill.Scalar, (x, off_x, 0))
    with graph.inserting_before(ts[0]):
        t0 = graph.call_function(aten.masked_fill.Scalar, (t, off_x, 0))
    _new(graph, xs[0], [off, off_x, x0, t0])
    _unpick(graph, [xs, ts], [x0, t0])
    with graph.inserting_before(loss.next):  # in order, where the loss was
        each = graph.call_function(_LOGITS_LOSS, (loss.args[0], loss.args[1], None,
                                                 _arg(loss, 3, "pos_weight", None), 0))
        kept = graph.call_function(aten.masked_fill.Scalar, (each, off_x, 0))
        out = graph.call_function(aten.sum.default, (kept,))
        made = [each, kept, out]
        if reduction == 1:
            count = graph.call_function(aten.sum.default, (m,))
            per = graph.call_function(aten.mul.Tensor, (count, math.prod(trailing)))
            out = graph.call_function(aten.div.Tensor, (out, per))
            made += [count, per, out]
    _new(graph, loss, made)
    loss.replace_all_uses_with(out)
    graph.erase_node(loss)
    return True


def _rewrite(graph: fx.Graph, loss: fx.Node, keys: dict[fx.Node, Any]) -> bool:
    if loss.target is _LOGITS_LOSS:
        return _rewrite_logits(graph, loss, keys)
    reduction = _arg(loss, 3, "reduction", 1)
    ignore = _arg(loss, 4, "ignore_index", -100)
    if reduction not in (1, 2):  # "none": a value per picked row
        return False
    found = _operands(loss, keys)
    if found is None:
        return False
    xs, ts, x, t, m = found
    tv, mv = t.meta["val"], m.meta["val"]
    if tv.dim() != mv.dim() or tv.dtype.is_floating_point or x.meta["val"].dim() != mv.dim() + 1:
        return False
    rows = math.prod(mv.shape)
    classes = x.meta["val"].shape[-1]
    new: list[fx.Node] = []
    with graph.inserting_before(xs[0]):
        off = graph.call_function(aten.logical_not.default, (m,))
        off_x = graph.call_function(aten.unsqueeze.default, (off, -1))
        kept = graph.call_function(aten.masked_fill.Scalar, (x, off_x, 0))
        flat = graph.call_function(aten.reshape.default, (kept, [rows, classes]))
        new += [off, off_x, kept, flat]
    with graph.inserting_before(ts[0]):
        labels = graph.call_function(aten.masked_fill.Scalar, (t, off, ignore))
        flat_t = graph.call_function(aten.reshape.default, (labels, [rows]))
        new += [labels, flat_t]
    _new(graph, xs[0], new)
    _unpick(graph, [xs, ts], [flat, flat_t])
    fake_val(loss)  # now over every row
    return True


def unpick_losses(gm: fx.GraphModule) -> None:
    """Rewrite every classification loss over mask-picked rows into the same loss over
    every row, the unpicked ones ignored (exact; see the module's docstring)."""
    graph = gm.graph
    keys: dict[fx.Node, Any] = {}
    changed = False
    for loss in [n for n in graph.nodes if n.target in _LOSSES]:
        changed |= _rewrite(graph, loss, keys)
    if changed:  # nothing else to clean: each rewrite erased what it left unread
        gm.recompile()
