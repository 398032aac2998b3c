"""Reductions, normalisation and losses: sums and means over cut dims leave partials,
layer norm over a cut hidden dim uses distributed statistics or a gather, and
cross-entropy over cut vocabulary is Megatron's fused form."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.fx as fx

from shardc.core.ir import Val
from shardc.core.mesh import Mesh
from shardc.core.placement import Layout
from shardc.passes.rules.common import (
    Strategy,
    apply_strategy,
    as_list,
    aten,
    drop_dims,
    emit_like,
    emit_outputs,
    fallback_rule,
    input_vals,
    materialise_then,
    no_partial,
    register_rule,
    replicate_dims,
    strategy,
)
from shardc.runtime import ops as R

if TYPE_CHECKING:  # the lowering calls the rules; they only name its type
    from shardc.passes.lower import Lowering


# -------------------------------------------------------------------- reductions
# Reductions that do not add: the reduced dims must be whole on each rank and a partial
# input is reduced first (the norm of a sum is not the sum of norms). op -> positions of
# its dim and keepdim arguments.
_WHOLE = {aten.amax.default: (1, 2), aten.amin.default: (1, 2), aten.argmax.default: (1, 2),
          aten.argmin.default: (1, 2), aten.linalg_vector_norm.default: (2, 3),
          aten.max.default: (1, 2), aten.min.default: (1, 2),  # these two: every dim
          # variance and standard deviation (keepdim is keyword-only: position 9 is never
          # given); var_mean / std_mean below, which return two tensors
          aten.var.correction: (1, 9), aten.std.correction: (1, 9),
          aten.var_mean.correction: (1, 9), aten.std_mean.correction: (1, 9)}
_PAIRS = (aten.var_mean.correction, aten.std_mean.correction)
# any / all: each rank reduces its own piece, and the pieces combine by a max (any) or a
# min (all) over the axes that cut the reduced dims, so one value a row moves, not the
# tensor. A bool carries no gradient, so no rule for ties between ranks to keep.
_LOGICAL = {aten.any.default: "max", aten.any.dim: "max", aten.any.dims: "max",
            aten.all.default: "min", aten.all.dim: "min", aten.all.dims: "min"}


@register_rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, *_WHOLE,
               *_LOGICAL)
def reduce_rule(L: Lowering, node: fx.Node) -> Any:
    if L.env[node.args[0]].layout is None:
        return fallback_rule(L, node) if node.target in _PAIRS else materialise_then(L, node)
    if node.target in _PAIRS:
        s = reduce_strategy(node, input_vals(L, node), L.mesh)
        return emit_outputs(L, node, L.to_layout(L.env[node.args[0]], s.needs[node.args[0]]), s.out)
    return apply_strategy(L, node, reduce_strategy)


@strategy(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, *_WHOLE,
          *_LOGICAL)
def reduce_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """Sums and means over shards leave partial values; the ``_WHOLE`` reductions (max,
    min, their indices, vector norms: ConvNeXt-V2's global response norm, SwinV2's
    cosine attention, CLIP's end-of-text position; variance and standard deviation, a
    hand-written norm's statistics) keep every dim they do not reduce cut as it is, and
    need only the reduced ones whole (var_mean's two outputs both so); ``any`` / ``all``
    leave a partial max / min. ``dim=None`` reduces every dim (an argmax then indexes the
    flattened whole tensor)."""
    x = vals[node.args[0]]
    val = node.meta["val"]
    if isinstance(val, (tuple, list)):  # var_mean, std_mean: two outputs of one shape
        val = val[0]
    if node.target in (aten.sum.default, aten.mean.default):
        dims, keepdim = list(range(x.ndim)), False
    else:
        dpos, kpos = _WHOLE.get(node.target, (1, 2))
        dims = node.args[dpos] if len(node.args) > dpos else node.kwargs.get("dim")
        dims = list(range(x.ndim)) if dims is None or dims == [] else [d % x.ndim for d in as_list(dims)]
        keepdim = node.args[kpos] if len(node.args) > kpos else node.kwargs.get("keepdim", False)
    is_max = node.target in _WHOLE
    logical = _LOGICAL.get(node.target)
    need = x.layout
    if is_max:
        need = no_partial(replicate_dims(need, dims))
    elif logical or any(p[1] in ("max", "min") for p in need.partial):
        need = no_partial(need)
    mean = node.target in (aten.mean.dim, aten.mean.default)
    # a sum over shards is a partial sum, a mean over equal shards the mean of their
    # means; a partial input stays partial (the mean of a partial sum is a partial sum)
    out_partial: dict[str, str] = dict(need.partial)
    for d in dims:
        for a in need.dims[d]:
            out_partial[a] = logical or ("avg" if mean else "sum")
    keep = []
    j = 0
    for d in range(x.ndim):
        if d in dims:
            keep.append(j if keepdim else None)
            j += 1 if keepdim else 0
        else:
            keep.append(j)
            j += 1
    base = Layout(x.ndim, tuple(() if d in dims else need.dims[d] for d in range(x.ndim)), (),
                  tuple(1 if d in dims else need.interleave[d] for d in range(x.ndim)))
    out = drop_dims(base, keep, val.dim())
    out = Layout(out.ndim, out.dims, tuple(sorted(out_partial.items())), out.interleave)
    return Strategy({node.args[0]: need}, out)


@register_rule(aten.histc.default)
def histc_rule(L: Lowering, node: fx.Node) -> Any:
    """``histc(x, bins, min, max)`` with a fixed range: counts add up over shards, so each
    rank counts its own piece and the histogram is a partial sum over the axes that cut
    ``x`` (MoE routing's tokens per expert). With ``min == max`` the range is the data's
    own: whole."""
    x = L.env[node.args[0]]
    lo = node.args[2] if len(node.args) > 2 else node.kwargs.get("min", 0)
    hi = node.args[3] if len(node.args) > 3 else node.kwargs.get("max", 0)
    if x.layout is None or lo == hi:
        return fallback_rule(L, node)
    xl = no_partial(x.layout.clean(L.mesh))
    out = Layout(1)
    for a in xl.sharded_axes():
        out = out.with_partial(a, "sum")
    return emit_like(L, node, {node.args[0]: xl}, out)


# ------------------------------------------------------------------ normalisation
@register_rule(aten.layer_norm.default)
def layer_norm_rule(L: Lowering, node: fx.Node) -> Any:
    x = L.env[node.args[0]]
    shape = list(node.args[1])
    w = L.env[node.args[2]] if len(node.args) > 2 and node.args[2] is not None else None
    b = L.env[node.args[3]] if len(node.args) > 3 and node.args[3] is not None else None
    eps = node.args[4] if len(node.args) > 4 else 1e-5
    val = node.meta["val"]
    mesh = L.mesh
    xl = no_partial(x.layout.clean(mesh))
    nd = len(shape)
    norm_dims = list(range(x.ndim - nd, x.ndim))
    feat_axes = [a for d in norm_dims for a in xl.dims[d]]
    D = math.prod(shape)
    rows = math.prod(x.shape[:-nd]) if x.ndim > nd else 1
    use_stats = False
    if len(feat_axes) == 1 and nd == 1:
        a = feat_axes[0]
        g = mesh.size(a)
        # bytes of the two statistic all-reduces vs gathering the input over the axis
        stats = 2 * (2 * (g - 1) / g) * rows / math.prod(mesh.size(b) for b in xl.dims[0] or ())
        gather = (g - 1) * rows * D / g / math.prod(mesh.size(b) for b in xl.dims[0] or ())
        use_stats = stats < gather
    if not use_stats:
        xl = replicate_dims(xl, norm_dims)
        need = {node.args[0]: xl}
        pl = Layout.replicate(nd)
        if w is not None:
            need[node.args[2]] = pl
        if b is not None:
            need[node.args[3]] = pl
        return emit_like(L, node, need, xl)
    a = feat_axes[0]
    L.decisions.append(f"{L.src.module or node.name}: layer norm over a hidden dim cut over {a}: "
                       f"distributed statistics (2 all-reduces of {rows} values) instead of a gather")
    xn = L.to_layout(x, xl)
    gval = x.val
    stat_val = torch.empty(list(x.shape[:-1]) + [1], device="meta", dtype=gval.dtype)
    stat_lay = Layout(x.ndim, xl.dims[:-1] + ((),), (), xl.interleave[:-1] + (1,))
    part = stat_lay.with_partial(a, "sum")

    def allreduce(n: fx.Node) -> fx.Node:
        return L._all_reduce(n, part, a, "sum", stat_val)

    s = L.emit(aten.sum.dim_IntList, (xn, [-1], True), layout=part, val=stat_val)
    mean = L.emit(aten.div.Tensor, (allreduce(s), D), layout=stat_lay, val=stat_val)
    xc = L.emit(aten.sub.Tensor, (xn, mean), layout=xl, val=gval)
    sq = L.emit(aten.mul.Tensor, (xc, xc), layout=xl, val=gval)
    s2 = L.emit(aten.sum.dim_IntList, (sq, [-1], True), layout=part, val=stat_val)
    var = L.emit(aten.div.Tensor, (allreduce(s2), D), layout=stat_lay, val=stat_val)
    ve = L.emit(aten.add.Tensor, (var, eps), layout=stat_lay, val=stat_val)
    rstd = L.emit(aten.rsqrt.default, (ve,), layout=stat_lay, val=stat_val)
    y = L.emit(aten.mul.Tensor, (xc, rstd), layout=xl, val=gval)
    pl = Layout(1).with_shard(a, 0)
    if w is not None:
        y = L.emit(aten.mul.Tensor, (y, L.to_layout(w, pl)), layout=xl, val=gval)
    if b is not None:
        y = L.emit(aten.add.Tensor, (y, L.to_layout(b, pl)), layout=xl, val=gval)
    return Val(y, xl, val)


@register_rule(aten._native_batch_norm_legit_functional.default,
               aten._native_batch_norm_legit.no_stats)
def batch_norm_rule(L: Lowering, node: fx.Node) -> Any:
    """Batch norm in training: the statistics of the global batch, as on one device.

    Each rank keeps its samples; the per-channel sums over the dims the ranks cut (the
    batch, over data and z) are all-reduced, then the mean-centred squares' sums (the
    two-pass variance of torch's own decomposition), so every rank normalises with the
    mean and variance one device would compute, and backward's sums over the batch come
    from the same all-reduces' gradients (SyncBatchNorm, derived rather than written).
    The running statistics are updated from those global values: replicated outputs
    that ShardedModule writes back into the buffers."""
    x = L.env[node.args[0]]
    stats = node.target is aten._native_batch_norm_legit_functional.default
    if stats:
        w, b, rm, rv = (L.env[a] if isinstance(a, fx.Node) else None for a in node.args[1:5])
        training, momentum, eps = node.args[5], node.args[6], node.args[7]
    else:  # track_running_stats=False: the batch's statistics, nothing to update
        w, b = (L.env[a] if isinstance(a, fx.Node) else None for a in node.args[1:3])
        rm = rv = None
        training, momentum, eps = node.args[3], node.args[4], node.args[5]
    mesh = L.mesh
    if not training or not isinstance(x, Val) or x.layout is None or x.ndim < 2 \
            or (stats and (rm is None or rv is None)):
        return fallback_rule(L, node)
    xl = replicate_dims(no_partial(x.layout.clean(mesh)), [1])  # channels whole
    red = [d for d in range(x.ndim) if d != 1]
    axes = [a for d in red for a in xl.dims[d]]
    vals = node.meta["val"]
    C = x.shape[1]
    n = math.prod(x.shape) // C
    acc = torch.float32 if x.val.dtype in (torch.float16, torch.bfloat16) else x.val.dtype
    bshape = [1, C] + [1] * (x.ndim - 2)
    rep = Layout.replicate(1)
    cval = torch.empty([C], device="meta", dtype=acc)
    xval = torch.empty(x.shape, device="meta", dtype=acc)
    L.decisions.append(
        f"{L.src.module or node.name}: batch norm over the global batch"
        + (f" (per-channel sums all-reduced over {', '.join(axes)}, twice)" if axes else ""))

    def total(t: fx.Node) -> fx.Node:
        part = rep
        for a in axes:
            part = part.with_partial(a, "sum")
        s = L.emit(aten.sum.dim_IntList, (t, red), layout=part, val=cval)
        lay = part
        for a in axes:
            s = L._all_reduce(s, lay, a, "sum", cval)
            lay = lay.with_replicated(a)
        return L.emit(aten.div.Tensor, (s, n), layout=rep, val=cval)

    def chan(t: fx.Node) -> fx.Node:  # a per-channel value, broadcast over the rest
        return L.emit(aten.view.default, (t, bshape), layout=Layout.replicate(x.ndim),
                      val=torch.empty(bshape, device="meta", dtype=acc))

    xn = L.to_layout(x, xl)
    if acc != x.val.dtype:
        xn = L.emit(aten._to_copy.default, (xn,), {"dtype": acc}, layout=xl, val=xval)
    mean = total(xn)
    xc = L.emit(aten.sub.Tensor, (xn, chan(mean)), layout=xl, val=xval)
    var = total(L.emit(aten.mul.Tensor, (xc, xc), layout=xl, val=xval))
    rstd = L.emit(aten.rsqrt.default, (L.emit(aten.add.Tensor, (var, eps), layout=rep, val=cval),),
                  layout=rep, val=cval)
    y = L.emit(aten.mul.Tensor, (xc, chan(rstd)), layout=xl, val=xval)
    for p, op in ((w, aten.mul.Tensor), (b, aten.add.Tensor)):
        if p is not None:
            y = L.emit(op, (y, chan(L.to_layout(p, rep))), layout=xl, val=xval)
    if acc != x.val.dtype:
        y = L.emit(aten._to_copy.default, (y,), {"dtype": x.val.dtype}, layout=xl, val=vals[0])

    def running(old: Val, new: fx.Node, scale: float) -> fx.Node:
        # torch's update: momentum * batch statistic + (1 - momentum) * running; the
        # statistic carries no gradient into the buffer
        stat = L.emit(aten.detach.default, (new,), layout=rep, val=cval)
        if scale != 1.0:
            stat = L.emit(aten.mul.Tensor, (stat, scale), layout=rep, val=cval)
        o = L.to_layout(old, rep)
        return L.emit(aten.add.Tensor, (L.emit(aten.mul.Tensor, (stat, momentum), layout=rep, val=cval),
                                        L.emit(aten.mul.Tensor, (o, 1 - momentum), layout=rep, val=cval)),
                      layout=rep, val=cval)

    outs = [(y, xl), (mean, rep), (rstd, rep)]
    if rm is not None and rv is not None:
        outs += [(running(rm, mean, 1.0), rep),
                 (running(rv, var, n / (n - 1) if n > 1 else 1.0), rep)]
    return [Val(t, lay.clean(mesh), v) for (t, lay), v in zip(outs, vals)]


# ------------------------------------------------------------------------- losses
@register_rule(aten.cross_entropy_loss.default)
def cross_entropy_rule(L: Lowering, node: fx.Node) -> Any:
    """``F.cross_entropy`` in every form torch takes: classes on dim 1 of a tensor of any
    rank (``(N, C)``, ``(N, C, L)`` for sequences, ``(N, C, H, W)`` for segmentation),
    class-index or probability targets, class weights, label smoothing and
    ``ignore_index``. The other dims keep their cuts (the batch stays on its rank).
    Classes cut over one axis are Megatron's vocabulary-parallel form: a max and one
    stacked sum over that axis, never the logits (``runtime/ops.py: class_partials``)."""
    x, tgt = L.env[node.args[0]], L.env[node.args[1]]

    def arg(i: int, name: str, default: Any) -> Any:
        return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)

    weight = arg(2, "weight", None)
    reduction = arg(3, "reduction", 1)
    ignore = arg(4, "ignore_index", -100)
    smoothing = float(arg(5, "label_smoothing", 0.0))
    val = node.meta["val"]
    mesh = L.mesh
    if x.layout is None or tgt.layout is None:
        return materialise_then(L, node)
    probs = tgt.val.dtype.is_floating_point
    if x.ndim < 2 or tgt.ndim != (x.ndim if probs else x.ndim - 1):
        return fallback_rule(L, node)  # unbatched (classes on dim 0): rare, left whole
    xl = no_partial(x.layout.clean(mesh))
    cls = xl.dims[1]
    if len(cls) > 1 or xl.interleave[1] != 1:
        xl = replicate_dims(xl, [1])
        cls = ()
    others = [d for d in range(x.ndim) if d != 1]
    vec = Layout(x.ndim - 1, tuple(xl.dims[d] for d in others), (),
                 tuple(xl.interleave[d] for d in others))
    rows = [a for d in others for a in xl.dims[d]]  # the axes that cut the rows
    xn = L.to_layout(x, xl)
    tn = L.to_layout(tgt, xl if probs else vec)
    wv = L.env[weight] if weight is not None else None
    w_whole = L.to_layout(wv, Layout(1)) if wv is not None else None
    n_classes = x.shape[1]
    vec_val = torch.empty(x.shape[:1] + x.shape[2:], device="meta", dtype=x.val.dtype)
    part = Layout(0)
    for a in rows:
        part = part.with_partial(a, "sum")
    if cls:
        c = cls[0]
        k = 3 if probs or smoothing else 2
        L.decisions.append(f"{L.src.module or node.name}: vocabulary-parallel cross-entropy over {c} "
                           f"(2 all-reduces, of {vec_val.numel()} and {k} x {vec_val.numel()} "
                           f"values, never the logits)")
        mx = L.emit(R.row_max, (xn,), layout=vec.with_partial(c, "max"), val=vec_val)
        mx = L._all_reduce(mx, vec.with_partial(c, "max"), c, "max", vec_val)
        # this rank's classes of the weights, for sums over classes
        w_cut = (L.to_layout(wv, Layout(1, (cls,)))
                 if wv is not None and (probs or smoothing) else None)
        stack_val = torch.empty([k, *vec_val.shape], device="meta", dtype=x.val.dtype)
        stack = Layout(vec.ndim + 1, ((),) + vec.dims, (), (1,) + vec.interleave)
        # every per-row sum in one all-reduce: one collective's fixed cost (and one wait
        # every rank stands still for) less per step for each one folded in
        sums = L.emit(R.class_partials, (xn, mx, tn, w_cut, L.rt, c, smoothing, n_classes, probs),
                      layout=stack.with_partial(c, "sum"), val=stack_val)
        sums = L._all_reduce(sums, stack.with_partial(c, "sum"), c, "sum", stack_val)
        per_row = L.emit(R.ce_rows, (sums, tn, None if probs else w_whole, ignore, smoothing,
                                     n_classes, probs), layout=vec, val=vec_val)
        if reduction == 0:
            return Val(per_row, vec.clean(mesh), val)
        total = L.emit(aten.sum.default, (per_row,), layout=part, val=val)
    else:
        if reduction == 0:
            need = {node.args[0]: xl, node.args[1]: xl if probs else vec}
            if weight is not None:
                need[weight] = Layout(1)
            return emit_like(L, node, need, vec)
        total = L.emit(R.cross_entropy_sum, (xn, tn, ignore, w_whole, smoothing), layout=part, val=val)
    if reduction == 2:
        return Val(total, part.clean(mesh), val)
    shards = math.prod(mesh.size(a) for a in rows) if rows else 1
    avg = Layout(0)
    for a in rows:
        avg = avg.with_partial(a, "avg")
    if probs:  # every row counts: a mean over a number known now
        n = L.emit(R.mean_of_rows, (total, vec_val.numel(), shards), layout=avg, val=val)
        return Val(n, avg.clean(mesh), val)
    # mean: divide by the counted targets (their weights) over the whole batch. The sum
    # and the count go in one all-reduce a row axis, so the loss comes out whole: a count
    # reduced alone and then the loss's mean would be two collectives a step
    if wv is None:
        cnt_val = torch.empty([], device="meta", dtype=torch.float32)
        cnt = L.emit(R.valid_count, (tn, ignore), layout=part, val=cnt_val)
    else:
        cnt_val = torch.empty([], device="meta", dtype=wv.val.dtype)
        cnt = L.emit(R.target_weight_total, (tn, w_whole, ignore), layout=part, val=cnt_val)
    # at least float32: a bfloat16 count is exact only up to 256
    pair_dtype = torch.promote_types(torch.promote_types(val.dtype, cnt_val.dtype), torch.float32)
    pair_val = torch.empty([2], device="meta", dtype=pair_dtype)
    pair_part = Layout(1, ((),), part.partial, (1,))
    pair = L.emit(R.sum_and_count, (total, cnt, pair_dtype), layout=pair_part, val=pair_val)
    lay = pair_part
    for a in rows:
        pair = L._all_reduce(pair, lay, a, "sum", pair_val)
        lay = lay.with_replicated(a)
    n = L.emit(R.mean_of_sums, (pair, val.dtype), layout=Layout(0), val=val)
    return Val(n, Layout(0), val)
