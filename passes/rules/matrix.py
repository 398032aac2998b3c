"""GEMMs: Algorithm 1's weight blocks, the alternating transposition, fused projections
(interleaved columns), and products of two activations; batched linear algebra (a solve,
factorisation or decomposition per sample)."""
from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from shardc.core.errors import ShardcError
from shardc.core.ir import Val
from shardc.core.placement import Layout
from shardc.passes.rules.common import (
    aten,
    emit_like,
    existing_ops,
    fallback_rule,
    local_args,
    no_partial,
    register_rule,
    replicate_dims,
)
from shardc.passes.rules.pointwise import pointwise_layouts
from shardc.passes.rules.sequence import cut_tokens

if TYPE_CHECKING:  # the lowering calls the rules; they only name its type
    from shardc.passes.lower import Lowering


# ------------------------------------------------------------------------- GEMMs
def _infer_interleave(L: Lowering, node: fx.Node, n_out: int, g: int) -> int:
    """How a GEMM's output features are later cut: a fused QKV projection is split into
    3 equal parts (or viewed as (3, heads, head_dim)); sharding its columns in plain
    blocks would give a rank all of q and none of v, so they are interleaved instead."""
    frontier = [(node, 0)]
    seen = set()
    while frontier:
        n, depth = frontier.pop(0)
        if n in seen or depth > 6:
            continue
        seen.add(n)
        for u in n.users:
            t = u.target
            if t in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
                val = u.meta.get("val")
                dim = (u.args[2] if len(u.args) > 2 else 0) % len(n.meta["val"].shape)
                if dim == len(n.meta["val"].shape) - 1 and isinstance(val, (list, tuple)):
                    sizes = {v.shape[dim] for v in val}
                    if len(sizes) == 1 and len(val) > 1:
                        return len(val)
            elif t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
                src = list(n.meta["val"].shape)
                dst = list(u.meta["val"].shape)
                if dst and src and dst[-1] == src[-1]:
                    frontier.append((u, depth + 1))
                    continue
                # the last dim split as (c, ...): interleave when c is not cut by g
                prod, i = 1, len(dst)
                while i > 0 and prod < src[-1]:
                    i -= 1
                    prod *= dst[i]
                if prod == src[-1] and i < len(dst) - 1:
                    c = dst[i]
                    if c % g != 0 and (src[-1] // c) % g == 0:
                        return c
            elif t in (aten.add.Tensor, aten.dropout.default, aten._to_copy.default, aten.to.dtype,
                       aten.alias.default, aten.clone.default, aten.contiguous.default,
                       aten.mul.Tensor):
                frontier.append((u, depth + 1))
    return 1


def _is_param(v: Any) -> bool:
    return isinstance(v, Val) and v.layout is None and v.param is not None and v.ndim == 2


@register_rule(aten.linear.default, aten.mm.default, aten.matmul.default, aten.addmm.default)
def gemm_rule(L: Lowering, node: fx.Node) -> Any:
    t = node.target
    if t is aten.addmm.default:
        bias_node, x_node, w_node = node.args[0], node.args[1], node.args[2]
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return fallback_rule(L, node)
    elif t is aten.linear.default:
        x_node, w_node = node.args[0], node.args[1]
        bias_node = node.args[2] if len(node.args) > 2 else None
    else:
        x_node, w_node = node.args[0], node.args[1]
        bias_node = None
    x, w = L.env[x_node], L.env[w_node]
    if not _is_param(w) or not isinstance(x, Val) or x.layout is None:
        if t in (aten.matmul.default,) or (t is aten.mm.default):
            return act_gemm_rule(L, node)
        if isinstance(w, Val) and w.ndim == 2 and isinstance(x, Val) and x.layout is not None:
            return _computed_weight_gemm(L, node, x_node, w_node, bias_node)
        return fallback_rule(L, node)
    mesh = L.mesh
    # weight in (k, n) terms: linear stores (n, k)
    w_kn_shape = w.shape[::-1] if t is aten.linear.default else w.shape
    K, N = w_kn_shape
    feat = x.layout.clean(mesh).dims[-1]
    if not L.ctx.options.transpose_alternate:
        transposed = False
    elif "x" in feat:
        transposed = True  # the previous layer left its columns over x: swap roles
    elif "y" in feat or mesh.size("y") == 1:
        transposed = False
    else:
        # Whole input features on a mesh with y > 1 and x == 1: the transposed layer cuts
        # nothing over x and leaves its output over y, so the next layer needs no slice;
        # the normal one would slice this input over y and pay an all-reduce of dI for it.
        transposed = mesh.size("x") == 1
    k_axis, n_axis = ("x", "y") if transposed else ("y", "x")
    gk, gn = mesh.size(k_axis), mesh.size(n_axis)
    il = _infer_interleave(L, node, N, gn) if gn > 1 else 1
    whole = []
    for size, what, axis, g, mult in ((K, "in_features (k)", k_axis, gk, 1),
                                      (N, "out_features (n)", n_axis, gn, il)):
        if g > 1 and size % (g * mult):
            if L.ctx.options.refuse_indivisible:
                fix = -(-size // (g * mult)) * g * mult
                raise ShardcError(
                    f"shardc.compile: {w.param!r} ({node.target} in {L.src.module or '?'} at "
                    f"{L.src.line or '?'}) has {what}={size}, which mesh axis {axis!r} (size {g})"
                    + (f" in {mult} interleaved groups" if mult > 1 else "")
                    + f" does not evenly divide. {L.mesh}. Pad {what.split()[0]} to {fix} or change "
                    f"the size of {axis!r}.")
            # kept whole on that axis, as an embedding keeps a vocabulary it does not
            # divide: correct, and the redundant product is small in the usual case (a
            # classifier's few classes); uneven shards would cost every rank a padded copy
            whole.append(f"{what.split()[0]}={size}, which {axis!r} ({g})"
                         + (f" in {mult} interleaved groups" if mult > 1 else "")
                         + " does not divide, kept whole")
    shard_k = gk > 1 and K % gk == 0
    shard_n = gn > 1 and N % (gn * il) == 0
    if not shard_n:
        il = 1
    # activation: features cut over the k axis, whole over the n axis
    xl = no_partial(x.layout.clean(mesh))
    for a in (k_axis, n_axis):
        xl = xl.with_replicated(a)
    # the contraction dim is cut over the k axis only: an input whose features arrive cut
    # over another axis (z, data) is gathered there first
    xl = replicate_dims(xl, [-1])
    if shard_k:
        xl = xl.with_shard(k_axis, -1)
    # weight: Algorithm 1's block (k over k_axis, n over n_axis)
    w_kn = Layout(2)
    if shard_k:
        w_kn = w_kn.with_shard(k_axis, 0)
    if shard_n:
        w_kn = w_kn.with_shard(n_axis, 1).with_interleave(1, il)
    if t is aten.linear.default:
        w_need = Layout(2, tuple(reversed(w_kn.dims)), (), tuple(reversed(w_kn.interleave)))
    else:
        w_need = w_kn
    out = Layout(xl.ndim, xl.dims[:-1] + ((n_axis,) if shard_n else (),), (),
                 xl.interleave[:-1] + (il,))
    if shard_k:
        out = out.with_partial(k_axis, "sum")
    xn = L.to_layout(x, xl)
    wn = L.to_layout(w, w_need)
    L.decisions.append(
        f"{L.src.module or node.name}: {'transposed' if transposed else 'normal'} GEMM "
        f"k={K} over {k_axis if shard_k else '-'}, n={N} over {n_axis if shard_n else '-'}"
        + (f" (columns interleaved in {il} groups)" if il > 1 else "")
        + "".join(f"; {w_}" for w_ in whole))
    gval = node.meta["val"]
    target = aten.mm.default if t is aten.addmm.default else t
    # the rows a GEMM lays out must have a size known at compile time: asking for it
    # raises torch's data-dependent guard on rows picked by nonzero or a mask, which the
    # lowering turns into the message naming the op that made the size and the rewrite
    int(math.prod(x.shape[:-1]))
    if bias_node is not None and not out.clean(mesh).partial:
        # a whole sum: the bias is added by the GEMM itself (addmm), as one device adds
        # it, rather than by a pass of its own over the output (8 of a GPT step's 18 adds)
        b = L.env[bias_node]
        out2, needs = pointwise_layouts(aten.add.Tensor, [Val(None, out.clean(mesh), gval), b],
                                        list(gval.shape))
        if needs[0] == out.clean(mesh) and out2.clean(mesh) == out.clean(mesh):
            bn = L.to_layout(b, needs[1])
            args = (bn, xn, wn) if t is aten.addmm.default else (xn, wn, bn)
            n = L.emit(t, args, layout=out, val=gval)
            return Val(n, out.clean(mesh), gval)
    mm = L.emit(target, (xn, wn), layout=out, val=gval)
    res = Val(mm, out.clean(mesh), gval)
    if shard_k and L.ctx.options.sequence_parallel and node in L.token_wise():
        # the bias add below cannot keep the partial sum: reduce it onto the tokens now
        res = cut_tokens(L, node, res)
    if bias_node is None:
        return res
    b = L.env[bias_node]
    out2, needs = pointwise_layouts(aten.add.Tensor, [res, b], list(gval.shape))
    a = L.to_layout(res, needs[0])
    bn = L.to_layout(b, needs[1])
    n = L.emit(aten.add.Tensor, (a, bn), layout=out2, val=gval)
    return Val(n, out2.clean(mesh), gval)


def _computed_weight_gemm(L: Lowering, node: fx.Node, x_node: fx.Node, w_node: fx.Node,
                          bias_node: Any) -> Val:
    """``linear`` / ``addmm`` whose weight is computed in forward rather than stored: a
    parametrisation (``weight_norm``, ``spectral_norm``), or a piece of a packed weight
    (``nn.MultiheadAttention``'s cross-attention splits its in-projection into q and kv).
    It has no stored block to cut, so it is used whole and each rank multiplies its own
    rows: the input keeps every cut but its features', the output likewise, and the
    weight's gradient is summed over the axes the rows are cut on, as a parameter's is."""
    x = L.env[x_node]
    xl = replicate_dims(no_partial(x.layout.clean(L.mesh)), [-1])
    need = {x_node: xl, w_node: Layout(2)}
    if isinstance(bias_node, fx.Node):
        need[bias_node] = Layout.replicate(L.env[bias_node].ndim)
    return emit_like(L, node, need, xl)


@register_rule(aten.bmm.default)
def act_gemm_rule(L: Lowering, node: fx.Node) -> Any:
    """A product of two activations (attention scores): batch dims keep their shards,
    the matrix dims are whole."""
    a, b = L.env[node.args[0]], L.env[node.args[1]]
    val = node.meta["val"]
    if not isinstance(a, Val) or not isinstance(b, Val) or a.ndim < 2 or b.ndim < 2:
        return fallback_rule(L, node)
    nd = val.dim()
    al = no_partial(a.layout) if a.layout is not None else Layout.replicate(a.ndim)
    al = replicate_dims(al, [a.ndim - 2, a.ndim - 1])
    out = Layout(nd, tuple(al.dims[:-2][-(nd - 2):] if nd > 2 else ()) + ((), ()), (),
                 tuple(al.interleave[:-2][-(nd - 2):] if nd > 2 else ()) + (1, 1)) \
        if a.ndim == nd else Layout.replicate(nd)
    bl = Layout.replicate(b.ndim)
    if b.ndim == nd and b.ndim > 2:
        bl = Layout(b.ndim, tuple(out.dims[d] if b.shape[d] == val.shape[d] else () for d in range(nd - 2)) + ((), ()),
                    (), tuple(out.interleave[d] if b.shape[d] == val.shape[d] else 1 for d in range(nd - 2)) + (1, 1))
    if a.ndim != nd:
        al = Layout.replicate(a.ndim)
    return emit_like(L, node, {node.args[0]: al, node.args[1]: bl}, out)


# ------------------------------------------------------------- batched linear algebra
_LINALG = existing_ops("linalg_solve.default", "linalg_cholesky.default", "linalg_inv.default",
                       "inverse.default", "linalg_matrix_power.default", "cholesky_solve.default",
                       "linalg_lu_factor.default", "_linalg_det.default", "_linalg_slogdet.default",
                       "_linalg_eigh.default", "_linalg_svd.default", "linalg_qr.default",
                       "linalg_solve_triangular.default", "linalg_matrix_exp.default")


@register_rule(*_LINALG)
def batched_linalg_rule(L: Lowering, node: fx.Node) -> Any:
    """A solve, factorisation, inverse or decomposition of a stack of matrices (one per
    sample: ``(N, n, n)``): each rank works on the matrices of its own samples, so dim 0
    keeps its cut and every other dim is whole. Anything else (a single matrix, a
    right-hand side without the batch dim) runs whole, as the fallback does."""
    ins = [a for a in node.all_input_nodes if isinstance(L.env[a], Val)]
    vals = node.meta["val"]
    outs = list(vals) if isinstance(vals, (list, tuple)) else [vals]
    if not ins or any(L.env[a].layout is None or L.env[a].ndim < 3 for a in ins):
        return fallback_rule(L, node)
    n = L.env[ins[0]].shape[0]
    if any(L.env[a].shape[0] != n for a in ins) or any(
            not isinstance(o, torch.Tensor) or o.dim() < 1 or o.shape[0] != n for o in outs):
        return fallback_rule(L, node)
    lay = next((no_partial(L.env[a].layout.clean(L.mesh)) for a in ins
                if L.env[a].layout.clean(L.mesh).dims[0]), None)
    axes, il = (lay.dims[0], lay.interleave[0]) if lay is not None else ((), 1)

    def batch_cut(ndim: int) -> Layout:
        return Layout(ndim, (axes,) + ((),) * (ndim - 1), (), (il,) + (1,) * (ndim - 1))

    need = {a: batch_cut(L.env[a].ndim) for a in ins}
    if not isinstance(vals, (list, tuple)):
        return emit_like(L, node, need, batch_cut(vals.dim()))
    repl = {a: L.to_layout(L.env[a], lay_a) for a, lay_a in need.items()}
    args, kwargs = local_args(L, node, repl)
    whole = L.emit(node.target, args, kwargs, layout=None, val=vals)
    return [Val(L.emit(operator.getitem, (whole, i), layout=batch_cut(v.dim()), val=v),
                batch_cut(v.dim()).clean(L.mesh), v) for i, v in enumerate(vals)]


@register_rule(aten._cdist_forward.default)
def cdist_rule(L: Lowering, node: fx.Node) -> Any:
    """``torch.cdist(a (*, P, M), b (*, R, M))`` -> (*, P, R): the leading (batch) dims cut
    alike in both (``a``'s cut, else ``b``'s), ``a``'s rows keep their cut, and ``b``'s rows
    and the feature dim are whole (every row of ``a`` meets every row of ``b``). Distances
    are not linear: partial inputs are summed first."""
    a, b = L.env[node.args[0]], L.env[node.args[1]]
    if a.layout is None or b.layout is None or a.ndim != b.ndim:
        return fallback_rule(L, node)
    k = a.ndim - 2
    al, bl = no_partial(a.layout.clean(L.mesh)), no_partial(b.layout.clean(L.mesh))
    src = al if any(al.dims[:k]) else bl  # one tensor's cuts for all the batch dims
    lead, il = src.dims[:k], src.interleave[:k]
    if {x for axes in lead for x in axes} & set(al.dims[k]):
        rows, rows_il = (), 1  # an axis the batch dims took from b
    else:
        rows, rows_il = al.dims[k], al.interleave[k]
    need_a = Layout(a.ndim, lead + (rows, ()), (), il + (rows_il, 1))
    need_b = Layout(b.ndim, lead + ((), ()), (), il + (1, 1))
    return emit_like(L, node, {node.args[0]: need_a, node.args[1]: need_b}, need_a)
