"""Shape-changing ops: views and reshapes, permutes, slices along a dim, split, cat, pad."""
from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any, Mapping, cast

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


# ---------------------------------------------------------------- shape-changing
def _view_groups(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims of equal product: [( [in dims], [out dims] ), ...]."""
    groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        if i < len(src):
            gi.append(i)
            pi *= src[i]
            i += 1
        if j < len(dst):
            gj.append(j)
            pj *= dst[j]
            j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i)
                pi *= src[i]
                i += 1
            elif j < len(dst):
                gj.append(j)
                pj *= dst[j]
                j += 1
            else:
                break
        # absorb trailing size-1 dims into this group
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            gi.append(i)
            i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def view_layout(L: Lowering, lay: Layout, src: list[int], dst: list[int]) -> tuple[Layout, Layout]:
    """(input layout the view needs, output layout) for a reshape src -> dst."""
    need = lay
    out_dims: list[tuple[str, ...]] = [() for _ in dst]
    out_il = [1] * len(dst)
    for gi, gj in _view_groups(src, dst):
        sharded = [d for d in gi if lay.dims[d]]
        if not sharded:
            continue
        g_in = [d for d in gi if src[d] != 1]
        g_out = [d for d in gj if dst[d] != 1]
        d = sharded[0]
        axes = lay.dims[d]
        f = 1
        for a in axes:
            f *= L.mesh.size(a)
        k = lay.interleave[d]
        if len(sharded) > 1 and g_in and g_in[0] == d and len(g_out) == 1 and k == 1:
            # several cut dims merged (a batch cut over data and a sequence over context,
            # flattened for the loss): keep the outermost cut, gather the inner ones
            for dd in sharded[1:]:
                for a in lay.dims[dd]:
                    need = need.with_replicated(a)
            sharded = sharded[:1]
        ok = len(sharded) == 1 and g_in and g_in[0] == d and g_out
        target = None
        if len(sharded) == 1 and len(g_in) > 1 and g_in[0] != d and len(g_out) == 1 and d in g_in:
            # dims merged around a cut inner dim ([B, S] with S over context -> [B*S]): each
            # rank holds the same part of every outer index, which reading the merged dim
            # as (outer * k, rest) and cutting the rest says exactly
            out_dims[g_out[0]] = axes
            out_il[g_out[0]] = math.prod(src[x] for x in g_in[:g_in.index(d)]) * k
            continue
        if ok:
            if len(g_in) == 1 and len(g_out) == 1:
                target, til = g_out[0], k
            elif len(g_in) == 1:  # one dim split into several
                if k == 1 and dst[g_out[0]] % f == 0:
                    target, til = g_out[0], 1
                elif k > 1 and dst[g_out[0]] == k and len(g_out) > 1 and dst[g_out[1]] % f == 0:
                    target, til = g_out[1], 1
            elif k == 1 and len(g_out) == 1:  # several dims merged, shard on the outermost
                target, til = g_out[0], 1
        if target is None:
            for dd in sharded:
                for a in lay.dims[dd]:
                    need = need.with_replicated(a)
            continue
        out_dims[target] = axes
        out_il[target] = til
    out = Layout(len(dst), tuple(out_dims), need.partial, tuple(out_il))
    return need, out


@register_rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
               aten.flatten.using_ints, aten.unflatten.int, aten.expand.default, aten.squeeze.dim,
               aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default)
def view_rule(L: Lowering, node: fx.Node) -> Any:
    x = L.env[node.args[0]]
    val = node.meta["val"]
    dst = list(val.shape)
    if x.layout is None:  # a reshaped parameter: use it whole
        return materialise_then(L, node)
    if node.target is aten.expand.default:
        off = len(dst) - x.ndim
        need = x.layout
        for d in range(x.ndim):
            if x.shape[d] != dst[d + off]:
                need = replicate_dims(need, [d])
        keep = [d + off for d in range(x.ndim)]
        out = drop_dims(need, keep, len(dst))
    else:
        need, out = view_layout(L, x.layout, x.shape, dst)
    xn = L.to_layout(x, need)
    local = out.clean(L.mesh).local_shape(dst, L.mesh)
    if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                       aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.dim,
                       aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default):
        n = L.emit(aten.reshape.default, (xn, local), layout=out, val=val)
    else:
        n = L.emit(aten.expand.default, (xn, local), layout=out, val=val)
    return Val(n, out.clean(L.mesh), val)


@register_rule(aten.transpose.int, aten.permute.default, aten.t.default)
def permute_rule(L: Lowering, node: fx.Node) -> Any:
    x = L.env[node.args[0]]
    if x.layout is None and x.param in L.pinned and not x.ptrans:
        # a weight whose storage is fixed (an expert weight cut on its expert dim): its
        # view keeps the stored layout, permuted, instead of gathering it whole
        lay = L.storage[x.param]
        perm = _perm(node, x.ndim)
        out = Layout(x.ndim, tuple(lay.dims[p] for p in perm), (), tuple(lay.interleave[p] for p in perm))
        n = L.emit(node.target, (L.to_layout(x, lay), *node.args[1:]), dict(node.kwargs), layout=out,
                   val=node.meta["val"])
        return Val(n, out.clean(L.mesh), node.meta["val"])
    if x.layout is None:
        if x.ndim == 2 and _perm(node, 2) == [1, 0]:  # a transposed weight: decided at its use
            return Val(None, None, node.meta["val"], x.param, not x.ptrans, x.pchain, x.pcast)
        return materialise_then(L, node)
    return apply_strategy(L, node, permute_strategy)


def _perm(node: fx.Node, nd: int) -> list[int]:
    if node.target is aten.t.default:
        return list(range(nd))[::-1]
    if node.target is aten.transpose.int:
        a, b = node.args[1] % max(nd, 1), node.args[2] % max(nd, 1)
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    return [d % nd for d in node.args[1]]


@strategy(aten.transpose.int, aten.permute.default, aten.t.default)
def permute_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    x = vals[node.args[0]]
    keep: list[int | None] = [None] * x.ndim
    for new, old in enumerate(_perm(node, x.ndim)):
        keep[old] = new
    return Strategy({node.args[0]: x.layout}, drop_dims(x.layout, keep, x.ndim))


@register_rule(aten.repeat.default)
def repeat_rule(L: Lowering, node: fx.Node) -> Any:
    if L.env[node.args[0]].layout is None:
        return materialise_then(L, node)
    s = repeat_strategy(node, input_vals(L, node), L.mesh)
    xn = L.to_layout(L.env[node.args[0]], s.needs[node.args[0]])
    val = node.meta["val"]
    # the local tensor is tiled as many times as the whole one: each copy of a dim holds
    # this rank's part of it, which is what the interleaved output layout says
    n = L.emit(aten.repeat.default, (xn, list(node.args[1])), layout=s.out, val=val)
    return Val(n, s.out.clean(L.mesh), val)


@strategy(aten.repeat.default)
def repeat_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """``x.repeat(r0, r1, ...)`` tiles each dim: a dim of n entries, cut into blocks of
    (k, n/k) with the second factor split (interleave k), becomes r*n entries read as
    (r*k, n/k), split the same way. So shards stay where they are, the interleave grows
    by the tile count, leading new dims are whole, and a partial sum stays partial (tiling
    is linear). DeBERTa tiles its relative-position keys, cut by head, over the batch."""
    x = vals[node.args[0]]
    reps = [int(r) for r in node.args[1]]
    off = len(reps) - x.ndim
    lay = x.layout
    dims: list[tuple[str, ...]] = [()] * off
    il = [1] * off
    for d in range(x.ndim):
        dims.append(lay.dims[d])
        il.append(lay.interleave[d] * reps[d + off] if lay.dims[d] else 1)
    return Strategy({node.args[0]: lay}, Layout(len(reps), tuple(dims), lay.partial, tuple(il)))


@register_rule(aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.cumsum.default,
               aten.cumprod.default,
               aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
               aten._log_softmax.default, aten.flip.default, aten.roll.default)
def along_dim_rule(L: Lowering, node: fx.Node) -> Any:
    if L.env[node.args[0]].layout is None:
        return materialise_then(L, node)
    return apply_strategy(L, node, along_dim_strategy)


@strategy(aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.cumsum.default,
          aten.cumprod.default,
          aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
          aten._log_softmax.default, aten.flip.default, aten.roll.default)
def along_dim_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """Ops that work along one dim: that dim must be whole, the others keep their shards."""
    x = vals[node.args[0]]
    if node.target is aten.slice.Tensor and whole_slice(node):
        # ``mask[:, 0]`` on torch 2.6 traces as a slice of all of dim 0, then the select:
        # that slice is the tensor itself, on each rank its own shard (it gathered the batch)
        return Strategy({node.args[0]: x.layout}, x.layout)
    if node.target in (aten.flip.default, aten.roll.default):
        dims = as_list(node.args[1] if node.target is aten.flip.default else
                       (node.args[2] if len(node.args) > 2 else list(range(x.ndim))))
    else:
        dims = [node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)]
    dims = [d % x.ndim for d in dims]
    need = no_partial(replicate_dims(x.layout, dims))
    if node.target is aten.select.int:
        keep = [None if d == dims[0] else (d if d < dims[0] else d - 1) for d in range(x.ndim)]
        out = drop_dims(need, keep, x.ndim - 1)
    else:
        out = need
    return Strategy({node.args[0]: need}, out)


def whole_slice(node: fx.Node) -> bool:
    """Does ``aten.slice(x, dim, start, end, step)`` take every element of its dim?"""
    args = list(node.args) + [None] * (5 - len(node.args))
    dim, start, end, step = (node.kwargs.get(k, a) for k, a in
                             zip(("dim", "start", "end", "step"), args[1:5]))
    size = node.args[0].meta["val"].shape[dim or 0]
    if not isinstance(size, int):
        return False
    if isinstance(end, int) and end < 0:
        end += size
    return (start in (None, 0) and (step in (None, 1))
            and (end is None or (isinstance(end, int) and end >= size)))


@register_rule(aten.unfold.default, aten.diagonal.default)
def one_input_view_rule(L: Lowering, node: fx.Node) -> Any:
    """Views of one tensor that need some of its dims whole (``windows_strategy``,
    ``diagonal_strategy``)."""
    if L.env[node.args[0]].layout is None:
        return materialise_then(L, node)
    decide = windows_strategy if node.target is aten.unfold.default else diagonal_strategy
    return apply_strategy(L, node, decide)


@strategy(aten.unfold.default)
def windows_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """``x.unfold(dim, size, step)``: windows along ``dim`` (PatchTST's patches, audio
    frames), a new last dim of ``size``. ``dim`` whole (a window may cross any cut), the
    others keep their cuts. A view, so a partial x stays partial."""
    x = vals[node.args[0]]
    need = replicate_dims(x.layout, [node.args[1] % max(x.ndim, 1)])
    out = Layout(x.ndim + 1, need.dims + ((),), need.partial, need.interleave + (1,))
    return Strategy({node.args[0]: need}, out)


@strategy(aten.diagonal.default)
def diagonal_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """``diagonal(x, offset, dim1, dim2)``: the two dims whole, the others keep their
    cuts, in order, and the diagonal comes last (a Cholesky factor's diagonal per
    sample). A view, so a partial x stays partial."""
    x = vals[node.args[0]]
    d1 = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim1", 0)) % x.ndim
    d2 = (node.args[3] if len(node.args) > 3 else node.kwargs.get("dim2", 1)) % x.ndim
    need = replicate_dims(x.layout, [d1, d2])
    rest = [d for d in range(x.ndim) if d not in (d1, d2)]
    out = Layout(len(rest) + 1, tuple(need.dims[d] for d in rest) + ((),), need.partial,
                 tuple(need.interleave[d] for d in rest) + (1,))
    return Strategy({node.args[0]: need}, out)


@register_rule(aten._fft_c2c.default, aten._fft_r2c.default, aten._fft_c2r.default)
def fft_rule(L: Lowering, node: fx.Node) -> Any:
    if L.env[node.args[0]].layout is None:
        return materialise_then(L, node)
    return apply_strategy(L, node, fft_strategy)


@strategy(aten._fft_c2c.default, aten._fft_r2c.default, aten._fft_c2r.default)
def fft_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """A discrete Fourier transform over some dims: those whole, every other dim keeps
    its cut (FNet mixes tokens with a 2-D FFT over sequence and hidden, per sample, so
    the batch stays cut). The one-sided real transforms change the last transformed
    dim's size, which is whole. Never partial (simpler than tracking a complex sum)."""
    x = vals[node.args[0]]
    dims = [d % x.ndim for d in as_list(node.args[1])]
    need = no_partial(replicate_dims(x.layout, dims))
    return Strategy({node.args[0]: need}, need)


@register_rule(aten.view_as_real.default, aten.view_as_complex.default)
def complex_view_rule(L: Lowering, node: fx.Node) -> Any:
    if L.env[node.args[0]].layout is None:
        return materialise_then(L, node)
    s = complex_view_strategy(node, input_vals(L, node), L.mesh)
    xn = L.to_layout(L.env[node.args[0]], s.needs[node.args[0]])
    if node.target is aten.view_as_complex.default:
        # pairs gathered along the last dim arrive strided; the view needs them adjacent
        xn = L.emit(aten.contiguous.default, (xn,), layout=s.needs[node.args[0]],
                    val=node.args[0].meta["val"])
    val = node.meta["val"]
    return Val(L.emit(node.target, (xn,), layout=s.out, val=val), s.out.clean(L.mesh), val)


@strategy(aten.view_as_real.default, aten.view_as_complex.default)
def complex_view_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """A complex tensor seen as real pairs (a new last dim of 2, whole) and back (that
    dim, whole, goes away); every other dim keeps its cut, a partial sum stays one."""
    x = vals[node.args[0]]
    if node.target is aten.view_as_real.default:
        lay = x.layout
        out = Layout(x.ndim + 1, lay.dims + ((),), lay.partial, lay.interleave + (1,))
        return Strategy({node.args[0]: lay}, out)
    need = replicate_dims(x.layout, [x.ndim - 1])
    if any(op not in ("sum", "avg") for _, op in need.partial):
        need = no_partial(need)  # complex numbers have no max or min
    out = Layout(x.ndim - 1, need.dims[:-1], need.partial, need.interleave[:-1])
    return Strategy({node.args[0]: need}, out)


# ops along one dim that return (values, indices): the dim whole, the others keep their
# shards, and an index counts positions along the whole dim, so it is the global one.
# op -> (position of ``dim`` and its default, whether the dim goes away without keepdim)
_ALONG_PAIR = {aten.topk.default: (2, -1, False), aten.sort.default: (1, -1, False),
               aten.sort.stable: (None, -1, False), aten.cummax.default: (1, None, False),
               aten.cummin.default: (1, None, False), aten.max.dim: (1, None, True),
               aten.min.dim: (1, None, True), aten.kthvalue.default: (2, -1, True),
               aten.median.dim: (1, None, True), aten.mode.default: (1, -1, True)}


@register_rule(*_ALONG_PAIR)
def along_dim_pair_rule(L: Lowering, node: fx.Node) -> Any:
    if L.env[node.args[0]].layout is None:
        return fallback_rule(L, node)
    s = along_dim_pair_strategy(node, {a: L.env[a] for a in node.all_input_nodes}, L.mesh)
    return emit_outputs(L, node, L.to_layout(L.env[node.args[0]], s.needs[node.args[0]]), s.out)


@strategy(*_ALONG_PAIR)
def along_dim_pair_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    x = vals[node.args[0]]
    at, default, reduces = _ALONG_PAIR[node.target]
    dim = node.args[at] if at is not None and len(node.args) > at else node.kwargs.get("dim", default)
    dim %= x.ndim
    need = no_partial(replicate_dims(x.layout, [dim]))
    keepdim = node.args[at + 1] if at is not None and len(node.args) > at + 1 and reduces \
        else node.kwargs.get("keepdim", False)
    if reduces and not keepdim:
        out = drop_dims(need, [None if d == dim else d - (d > dim) for d in range(x.ndim)], x.ndim - 1)
    else:
        out = need
    return Strategy({node.args[0]: need}, out)


@register_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
               aten.unbind.int)
def split_rule(L: Lowering, node: fx.Node) -> Any:
    x = L.env[node.args[0]]
    vals = node.meta["val"]
    if x.layout is None:
        return fallback_rule(L, node)
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if node.target is aten.unbind.int:
        dim = node.args[1] if len(node.args) > 1 else 0
    dim %= x.ndim
    lay = no_partial(x.layout) if any(p[1] in ("max", "min") for p in x.layout.partial) else x.layout
    # unbind's pieces have no ``dim`` (a 1-D tensor unbinds into 0-d ones)
    sizes = [1] * len(vals) if node.target is aten.unbind.int else [v.shape[dim] for v in vals]
    axes = lay.dims[dim]
    k = lay.interleave[dim]
    if axes and not (node.target is not aten.unbind.int and k == len(sizes) and len(set(sizes)) == 1):
        lay = replicate_dims(lay, [dim])
        axes = ()
    xn = L.to_layout(x, lay)
    f = 1
    for a in axes:
        f *= L.mesh.size(a)
    if node.target is aten.unbind.int:
        n = L.emit(node.target, (xn, dim), layout=None, val=vals)
        keep = [None if d == dim else (d if d < dim else d - 1) for d in range(x.ndim)]
        out_lay = drop_dims(lay, keep, x.ndim - 1)
    else:
        local_sizes = [s // f for s in sizes]
        n = L.emit(aten.split_with_sizes.default, (xn, local_sizes, dim), layout=None, val=vals)
        out_lay = lay.with_interleave(dim, 1)
    outs = []
    for i, v in enumerate(vals):
        g = L.emit(operator.getitem, (n, i), layout=out_lay, val=v)
        outs.append(Val(g, out_lay.clean(L.mesh), v))
    return outs


@register_rule(aten.cat.default, aten.stack.default)
def cat_rule(L: Lowering, node: fx.Node) -> Any:
    return apply_strategy(L, node, cat_strategy)


def _legacy_empty(t: Any, out_ndim: int) -> bool:
    return t.ndim == 1 and t.shape[0] == 0 and out_ndim != 1


@strategy(aten.cat.default, aten.stack.default)
def cat_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    val = node.meta["val"]
    # torch.cat skips a 1-D empty tensor beside tensors of more dims (the legacy empty
    # tensor: transformers' DynamicCache starts from one, and T5 concatenates its keys
    # onto it in training); it has no data to place, so it stays whole
    skipped = {t for t in node.args[0] if node.target is aten.cat.default and
               _legacy_empty(vals[t], val.dim())}
    kept = [t for t in node.args[0] if t not in skipped]
    tensors = [vals[t] for t in kept]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim %= val.dim()
    first = next((t for t in tensors if t.layout is not None), None)
    base = no_partial(first.layout) if first is not None else Layout.replicate(
        val.dim() if node.target is aten.cat.default else val.dim() - 1)
    if node.target is aten.cat.default:
        base = replicate_dims(base, [dim])
        out = base
    else:
        keep = [d if d < dim else d + 1 for d in range(base.ndim)]
        out = drop_dims(base, keep, val.dim())
    need = {t: Layout.replicate(1) for t in skipped}
    for t_node, t in zip(kept, tensors):
        lay = base
        for d in range(t.ndim):
            if t.shape[d] != first.shape[d] if first is not None else False:
                lay = replicate_dims(lay, [d])
        need[t_node] = lay
    return Strategy(need, out)


@register_rule(aten.constant_pad_nd.default, aten.pad.default)
def pad_rule(L: Lowering, node: fx.Node) -> Any:
    return apply_strategy(L, node, pad_strategy)


@strategy(aten.constant_pad_nd.default, aten.pad.default)
def pad_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    x = vals[node.args[0]]
    dims = [x.ndim - 1 - i for i in range(len(node.args[1]) // 2)]
    need = no_partial(replicate_dims(x.layout, dims)) if x.layout is not None else Layout.replicate(x.ndim)
    return Strategy({node.args[0]: need}, need)


# ------------------------------------------------------------- writes and lookups
def _shared(pair: list[fx.Node], vals: Mapping[fx.Node, Any], whole: list[int]) -> Layout:
    """One layout for same-rank tensors that meet elementwise outside the dims in
    ``whole`` (which must be whole): the shards of whichever of them is cut on such a dim
    (the others are then cut to match, which costs nothing when they are whole), with
    every dim whose sizes differ between them also whole. Never partial: a partial sum's
    parts could be looked up or written one by one only if all were partial alike, which
    is not worth a case of its own."""
    vs = [vals[n] for n in pair]
    skip = set(whole) | {d for d in range(vs[0].ndim)
                         if any(v.shape[d] != vs[0].shape[d] for v in vs[1:])}
    lays = [no_partial(replicate_dims(v.layout, sorted(skip))) for v in vs]
    return next((lay for lay in lays if any(lay.dims)), lays[0])


@register_rule(aten.gather.default, aten.slice_scatter.default, aten.select_scatter.default)
def write_lookup_rule(L: Lowering, node: fx.Node) -> Any:
    pair = (node.args[0], node.args[2 if node.target is aten.gather.default else 1])
    if not all(isinstance(a, fx.Node) and isinstance(L.env[a], Val) and L.env[a].layout is not None
               for a in pair):  # one of them is a parameter itself (rare): run it whole
        return fallback_rule(L, node)
    return apply_strategy(L, node, write_lookup_strategy)


# scatter(self, dim, index, src | value): index[p] says where along ``dim`` of self the
# entry p of src goes; outside ``dim`` all three meet at the same coordinates
_SCATTERS = (aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
             aten.scatter_reduce.two)


def _scatter_operands(node: fx.Node) -> list[fx.Node]:
    return [a for a in (node.args[0], node.args[2], node.args[3] if len(node.args) > 3 else None)
            if isinstance(a, fx.Node)]


@register_rule(*_SCATTERS)
def scatter_rule(L: Lowering, node: fx.Node) -> Any:
    if not all(isinstance(L.env[a], Val) and L.env[a].layout is not None
               and L.env[a].ndim == L.env[node.args[0]].ndim for a in _scatter_operands(node)):
        return fallback_rule(L, node)
    return apply_strategy(L, node, scatter_strategy)


@strategy(*_SCATTERS)
def scatter_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """``scatter`` / ``scatter_add`` / ``scatter_reduce`` along ``dim`` (a graph network's
    messages summed into their nodes, a one-hot written per row): ``dim`` whole in all
    three, and every other dim cut alike in all three, as ``gather``'s pair is (a dim
    whose sizes differ is whole). Each rank writes its own rows."""
    ops = _scatter_operands(node)
    lay = _shared(ops, vals, [node.args[1] % vals[node.args[0]].ndim])
    return Strategy({a: lay for a in ops}, lay)


@strategy(aten.gather.default, aten.slice_scatter.default, aten.select_scatter.default)
def write_lookup_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """``gather(x, dim, index)``: the output is shaped like ``index``; outside ``dim`` it
    reads x at the same coordinates, so both keep the same shards wherever their sizes
    agree. ``slice_scatter(x, src, dim, ...)`` / ``select_scatter``: ``src`` is written
    into x's slice along ``dim``; outside ``dim`` the two meet elementwise."""
    t = node.target
    x = cast(fx.Node, node.args[0])
    other = cast(fx.Node, node.args[2 if t is aten.gather.default else 1])
    xv = vals[x]
    dim = node.args[1] if t is aten.gather.default else (
        node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0))
    whole = [dim % xv.ndim]
    if t is aten.select_scatter.default:
        # src is x without ``dim``: lift its layout to x's dims, ``dim`` whole
        d = dim % xv.ndim
        sl = no_partial(vals[other].layout)
        lifted = Layout(xv.ndim, sl.dims[:d] + ((),) + sl.dims[d:], (),
                        sl.interleave[:d] + (1,) + sl.interleave[d:])
        lay = no_partial(replicate_dims(xv.layout, [d]))
        if not any(lay.dims):
            lay = lifted
        src = Layout(xv.ndim - 1, lay.dims[:d] + lay.dims[d + 1:], (),
                     lay.interleave[:d] + lay.interleave[d + 1:])
        return Strategy({x: lay, other: src}, lay)
    lay = _shared([x, other], vals, whole)
    return Strategy({x: lay, other: lay}, lay)


def _one_index(node: fx.Node, vals: Mapping[fx.Node, Any]) -> tuple[int, fx.Node] | None:
    """(dim, index) of a lookup along one dim: ``index_select(x, dim, index)``, or
    ``x[..., index, ...]`` (``aten.index.Tensor`` with one integer index tensor, every
    other position None). None for anything else (boolean masks, several index tensors),
    which the fallback runs whole."""
    x = vals.get(node.args[0])
    if not isinstance(x, Val) or x.layout is None:
        return None
    if node.target is aten.index_select.default:
        d, idx = node.args[1] % max(x.ndim, 1), node.args[2]
    else:
        tensors = [(d, i) for d, i in enumerate(node.args[1]) if i is not None]
        if len(tensors) != 1:
            return None
        d, idx = tensors[0]
    if not isinstance(idx, fx.Node):
        return None
    v = vals.get(idx)
    if not isinstance(v, Val) or v.layout is None or v.val.dtype in (torch.bool, torch.uint8):
        return None
    return int(cast(int, d)), idx


def _per_row(node: fx.Node, vals: Mapping[fx.Node, Any]) -> fx.Node | None:
    """The index of ``x[arange(n), index]`` (one entry of each row: a classifier's last
    token, CLIP's end-of-text position), where ``arange(n)`` counts every row of x and
    ``index`` holds one integer per row; None for anything else."""
    if node.target is not aten.index.Tensor:
        return None
    x = vals.get(node.args[0])
    idx = list(node.args[1])
    if not isinstance(x, Val) or x.layout is None or x.ndim < 2 or len(idx) != 2:
        return None
    rows, pick = idx
    if not (isinstance(rows, fx.Node) and rows.op == "call_function" and isinstance(pick, fx.Node)):
        return None
    if rows.target is aten.arange.default:
        span = (0, rows.args[0], 1)
    elif rows.target in (aten.arange.start, aten.arange.start_step):
        span = (rows.args[0], rows.args[1], rows.args[2] if len(rows.args) > 2 else 1)
    else:
        return None
    v = vals.get(pick)
    if span != (0, x.shape[0], 1) or not isinstance(v, Val) or v.layout is None \
            or list(v.shape) != [x.shape[0]] or v.val.dtype in (torch.bool, torch.uint8) \
            or v.val.dtype.is_floating_point:
        return None
    return pick


# ops an index tensor may pass through after ``arange(n)`` and still hold 0..n-1 in order
# along its one dim longer than 1: the unsqueezes of ``idx[:, None, None]``, views, the
# ``+ 0`` of an offset that is zero (transformers' kv_arange + kv_offset)
_ORDER_KEEPING = {aten.unsqueeze.default, aten.view.default, aten.reshape.default,
                  aten._unsafe_view.default, aten.alias.default, aten.clone.default,
                  aten.lift_fresh_copy.default, aten.detach.default}


def _static(shape: Any) -> bool:
    """Every size a plain int: comparing a size known only when the step runs (a
    ``nonzero``'s) would make torch guard on it, which fails at compile."""
    return all(type(s) is int for s in shape)


def _arange_position(idx: Any, n: int) -> int | None:
    """The dim of index tensor ``idx`` along which it holds 0, 1, ..., n-1 (every other dim
    of size 1), if it is ``arange(n)`` reshaped; None otherwise."""
    if not isinstance(idx, fx.Node) or n < 2:
        return None
    val = idx.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point or val.dtype == torch.bool \
            or not _static(val.shape):
        return None
    long = [d for d, size in enumerate(val.shape) if size != 1]
    if len(long) != 1 or val.shape[long[0]] != n:
        return None
    t = idx
    while t.op == "call_function":
        if t.target in _ORDER_KEEPING or t.target is aten._to_copy.default:
            t = t.args[0]
        elif t.target in (aten.add.Tensor, aten.sub.Tensor) and t.args[1] == 0:
            t = t.args[0]
        elif t.target is aten.arange.default:
            return long[0] if t.args[0] == n else None
        elif t.target in (aten.arange.start, aten.arange.start_step):
            step = t.args[2] if len(t.args) > 2 else 1
            return long[0] if (t.args[0], t.args[1], step) == (0, n, 1) else None
        else:
            return None
        if not isinstance(t, fx.Node):
            return None
    return None


def _by_aranges(node: fx.Node, vals: Mapping[fx.Node, Any]) -> tuple[int, list[int], int] | None:
    """``x[i0, i1, ...]`` (``aten.index.Tensor``) where every index tensor is ``arange`` of
    the whole dim it indexes, reshaped to lie along its own dim of the indices' broadcast
    shape: transformers' attention masks, ``padding_mask[batch_arange[:, None, None, None],
    kv_arange[None, None, None, :]]``. That is no lookup, only x's dims moved apart by
    size-1 dims, so each keeps its cut. Returns (first indexed dim, each index's position
    in the broadcast shape, the broadcast shape's length); None for anything else."""
    if node.target is not aten.index.Tensor:
        return None
    x = vals.get(node.args[0])
    if not isinstance(x, Val) or x.layout is None or not _static(x.shape):
        return None
    idx = list(node.args[1])
    at = [d for d, i in enumerate(idx) if i is not None]
    if not at or at != list(range(at[0], at[0] + len(at))):
        return None  # apart (a slice between them): the broadcast dims go first
    first = at[0]
    ranks = [len(idx[d].meta["val"].shape) if isinstance(idx[d], fx.Node) else -1 for d in at]
    width = max(ranks)
    positions = []
    for d, r in zip(at, ranks):
        k = _arange_position(idx[d], x.shape[d]) if d < x.ndim else None
        if k is None:
            return None
        positions.append(k + width - r)  # broadcasting aligns the index shapes right
    if len(set(positions)) != len(positions):
        return None  # two aranges along one dim: a diagonal
    shape = list(x.shape[:first]) + [1] * width + list(x.shape[first + len(at):])
    for d, k in zip(at, positions):
        shape[first + k] = x.shape[d]
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not _static(val.shape) or list(val.shape) != shape:
        return None
    return first, positions, width


def by_aranges_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh,
                        found: tuple[int, list[int], int] | None = None) -> Strategy:
    """x as it is (cut, partial); the output's dims are x's, each indexed dim's cut moved
    to where its arange lies. ``found``: ``_by_aranges``'s answer, when the caller has it."""
    first, positions, width = found or cast(tuple, _by_aranges(node, vals))
    x = vals[node.args[0]]
    lay = x.layout
    n = len(positions)
    dims: list[tuple[str, ...]] = [()] * width
    il = [1] * width
    for j, k in enumerate(positions):
        dims[k], il[k] = lay.dims[first + j], lay.interleave[first + j]
    out = Layout(x.ndim - n + width, lay.dims[:first] + tuple(dims) + lay.dims[first + n:],
                 lay.partial, lay.interleave[:first] + tuple(il) + lay.interleave[first + n:])
    return Strategy({node.args[0]: lay}, out)


@register_rule(aten.index_select.default, aten.index.Tensor)
def index_along_rule(L: Lowering, node: fx.Node) -> Any:
    vals = {a: L.env[a] for a in node.all_input_nodes}
    found = _by_aranges(node, vals)
    if found is not None:
        s = by_aranges_strategy(node, vals, L.mesh, found)
        first, positions, width = found
        x = L.to_layout(L.env[node.args[0]], s.needs[node.args[0]])
        val = node.meta["val"]
        out = L.emit(R.take_by_aranges, (x, first, positions, width), layout=s.out, val=val)
        return Val(out, s.out.clean(L.mesh), val)
    pick = _per_row(node, vals)
    if pick is not None:
        s = per_row_strategy(node, vals, L.mesh)
        x = L.to_layout(L.env[node.args[0]], s.needs[node.args[0]])
        i = L.to_layout(L.env[pick], s.needs[pick])
        val = node.meta["val"]
        return Val(L.emit(R.pick_per_row, (x, i), layout=s.out, val=val), s.out.clean(L.mesh), val)
    x = vals.get(node.args[0])
    if isinstance(x, Val) and x.layout is None:
        # a parameter looked up by a tensor of indices (MoE experts' weights by each
        # token's expert): decide as if it were whole, which is where its first use
        # materialises it; the index keeps its cut
        vals[node.args[0]] = Val(None, Layout.replicate(x.ndim), x.val, param=x.param)
    if _one_index(node, vals) is None and _many_index(node, vals) is None:
        return fallback_rule(L, node)
    s = index_along_strategy(node, vals, L.mesh)
    return emit_like(L, node, s.needs, s.out)


def _many_index(node: fx.Node, vals: Mapping[fx.Node, Any]) -> list[int] | None:
    """The dims of ``x[..., i, j, ...]`` (``aten.index.Tensor`` with several integer index
    tensors, broadcast together: ``F.unfold``'s patches, a gather of (row, column) pairs);
    None for anything else."""
    if node.target is not aten.index.Tensor:
        return None
    x = vals.get(node.args[0])
    if not isinstance(x, Val) or x.layout is None:
        return None
    at = _integer_indices(node.args[1], vals)
    return at if at is not None and len(at) >= 2 else None


def _integer_indices(idx: Any, vals: Mapping[fx.Node, Any]) -> list[int] | None:
    """The dims an advanced index's integer tensors index (``idx``: one entry per dim,
    None for a dim it leaves alone); None if there is none, or one is a mask."""
    at = [d for d, i in enumerate(idx) if i is not None]
    for d in at:
        v = vals.get(idx[d])
        if not isinstance(v, Val) or v.layout is None or v.val.dtype in (torch.bool, torch.uint8):
            return None
    return at or None


def many_index_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], at: list[int]) -> Strategy:
    """``x[..., i, j, ...]``: the indexed dims whole (the indices reach anywhere along
    them) and the index tensors whole; every other dim of x keeps its cut, in torch's
    order for the result: the indices' broadcast dims where the indexed dims were when
    those are adjacent, else first. A lookup is linear in x, so a partial x stays
    partial."""
    x = vals[node.args[0]]
    need_x = replicate_dims(x.layout, at)
    order = _index_order(x.ndim, at, len(node.meta["val"].shape) - (x.ndim - len(at)))
    out = _in_order(need_x, order)
    needs = {node.args[0]: need_x}
    for d in at:
        i = node.args[1][d]
        needs[i] = Layout.replicate(vals[i].ndim)
    return Strategy(needs, out)


def per_row_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """``x[arange(n), index]``: each row keeps its own entry, so the rows keep their cut
    (the batch's), the index is cut like them, dim 1 is whole, the rest keep theirs;
    linear in x, so a partial x stays partial."""
    pick = _per_row(node, vals)
    assert pick is not None
    x = vals[node.args[0]]
    need_x = replicate_dims(x.layout, [1])
    need_i = Layout(1, (need_x.dims[0],), (), (need_x.interleave[0],))
    out = Layout(x.ndim - 1, (need_x.dims[0],) + need_x.dims[2:], need_x.partial,
                 (need_x.interleave[0],) + need_x.interleave[2:])
    return Strategy({node.args[0]: need_x, pick: need_i}, out)


@strategy(aten.index_select.default, aten.index.Tensor)
def index_along_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """A lookup along one dim d: the output is x's dims before d, the index's dims, x's
    dims after d. So d must be whole, x's other dims keep their cuts, the index keeps its
    own (position ids cut with the batch: sinusoidal position tables), and the output
    takes both. A lookup is linear in x, so a partial x stays partial (SwinV2's
    relative-position bias, a row-parallel GEMM's output, is looked up before its sum).
    An axis that would cut both (or cut the index and leave x partial) is taken off the
    index."""
    if _per_row(node, vals) is not None:
        return per_row_strategy(node, vals, mesh)
    by_aranges = _by_aranges(node, vals)
    if by_aranges is not None:
        return by_aranges_strategy(node, vals, mesh, by_aranges)
    found = _one_index(node, vals)
    if found is None:
        many = _many_index(node, vals)
        assert many is not None
        return many_index_strategy(node, vals, many)
    d, idx = found
    x, iv = vals[node.args[0]], vals[idx]
    need_x = replicate_dims(x.layout, [d])
    need_i = no_partial(iv.layout)
    busy = set(need_x.sharded_axes()) | {a for a, _ in need_x.partial}
    for a in need_i.sharded_axes():
        if a in busy:
            need_i = need_i.with_replicated(a)
    dims = need_x.dims[:d] + need_i.dims + need_x.dims[d + 1:]
    il = need_x.interleave[:d] + need_i.interleave + need_x.interleave[d + 1:]
    out = Layout(len(dims), dims, need_x.partial, il)
    return Strategy({node.args[0]: need_x, idx: need_i}, out)


def _masked_write(node: fx.Node, vals: Mapping[fx.Node, Any]) -> bool:
    """``x[mask] = v`` (``index_put(x, [mask], v)``): one boolean index over x's leading
    dims, and a value that broadcasts over the trailing dims alone (its shape does not
    depend on how many entries the mask selects)."""
    idx = node.args[1]
    if not isinstance(idx, (list, tuple)) or len(idx) != 1 or not isinstance(idx[0], fx.Node):
        return False
    x, m, v = vals.get(node.args[0]), vals.get(idx[0]), vals.get(node.args[2])
    if not all(isinstance(t, Val) and t.layout is not None for t in (x, m)) or m.val.dtype != torch.bool:
        return False
    k = m.ndim
    if k > x.ndim or list(m.shape) != list(x.shape[:k]):
        return False
    vshape = list(v.shape) if isinstance(v, Val) else []
    return len(vshape) <= x.ndim - k and all(
        a in (1, b) for a, b in zip(reversed(vshape), reversed(list(x.shape[k:]))))


@register_rule(aten.index_put.default)
def masked_write_rule(L: Lowering, node: fx.Node) -> Any:
    vals = {a: L.env[a] for a in node.all_input_nodes}
    if not _masked_write(node, vals) and _indexed_write(node, vals) is None:
        return fallback_rule(L, node)
    return apply_strategy(L, node, masked_write_strategy)


def _indexed_write(node: fx.Node, vals: Mapping[fx.Node, Any]) -> list[int] | None:
    """The indexed dims of ``x[..., i, ...] = v`` (or ``+=``) with integer index tensors
    (``index_add``, ``index_copy``, ``index_fill`` along a dim, a write at (row, column)
    pairs), where ``v`` has exactly the shape ``x[..., i, ...]`` has; None otherwise."""
    idx = node.args[1]
    x, v = vals.get(node.args[0]), vals.get(node.args[2])
    if not isinstance(idx, (list, tuple)) or not isinstance(x, Val) or x.layout is None \
            or not isinstance(v, Val) or v.layout is None:
        return None
    at = _integer_indices(idx, vals)
    if at is None:
        return None
    want = _index_result_shape(list(x.shape), at, [list(vals[idx[d]].shape) for d in at])
    return at if want is not None and list(v.shape) == want else None


def _index_result_shape(shape: list[int], at: list[int], index_shapes: list[list[int]]
                        ) -> list[int] | None:
    """The shape of ``x[..., i, j, ...]`` with the index tensors at dims ``at``."""
    try:
        b = list(torch.broadcast_shapes(*index_shapes))
    except RuntimeError:
        return None
    order = _index_order(len(shape), at, len(b))
    return [b.pop(0) if d is None else shape[d] for d in order]


def _in_order(lay: Layout, order: list[int | None]) -> Layout:
    """The layout of ``x[..., i, j, ...]`` when ``x`` is laid out as ``lay`` (its indexed
    dims whole): each dim takes the cut of the dim of x it comes from (``_index_order``),
    the indices' broadcast dims are whole."""
    return Layout(len(order), tuple(() if d is None else lay.dims[d] for d in order), lay.partial,
                  tuple(1 if d is None else lay.interleave[d] for d in order))


def _index_order(ndim: int, at: list[int], width: int) -> list[int | None]:
    """Where each dim of ``x[..., i, j, ...]`` comes from, in torch's order: x's dim, or
    None for one of the ``width`` dims the index tensors broadcast to. Those take the
    indexed dims' place when the indexed dims are adjacent, else they come first."""
    rest = [d for d in range(ndim) if d not in at]
    front = at == list(range(at[0], at[0] + len(at)))
    before = [d for d in rest if front and d < at[0]]
    return before + [None] * width + [d for d in rest if d not in before]


@strategy(aten.index_put.default)
def masked_write_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """``x[mask] = v`` (or ``+=`` with accumulate): the mask picks entries of x's leading
    dims one by one, so x and the mask keep the same cuts there (whichever of them is cut)
    and every rank writes its own entries; the trailing dims, which ``v`` fills, whole, and
    ``v`` whole."""
    x = cast(fx.Node, node.args[0])
    at = None if _masked_write(node, vals) else _indexed_write(node, vals)
    if at is not None:
        return _indexed_write_strategy(node, vals, at)
    m = cast(fx.Node, node.args[1][0])
    xv, mv = vals[x], vals[m]
    k = mv.ndim
    xl = no_partial(replicate_dims(xv.layout, list(range(k, xv.ndim))))
    ml = no_partial(mv.layout)
    lead = Layout(k, xl.dims[:k], (), xl.interleave[:k])
    if not any(lead.dims) and any(ml.dims):  # x is whole there: follow the mask's cuts
        lead = ml
        xl = Layout(xv.ndim, ml.dims + xl.dims[k:], (), ml.interleave + xl.interleave[k:])
    needs = {x: xl, m: lead}
    v = node.args[2]
    if isinstance(v, fx.Node) and isinstance(vals.get(v), Val):
        needs[v] = Layout.replicate(vals[v].ndim)
    return Strategy(needs, xl)


def _indexed_write_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], at: list[int]) -> Strategy:
    """``x[..., i, ...] = v`` (``+=`` with accumulate) by integer index tensors: the
    indexed dims whole (an index may point anywhere along them) and the index tensors
    whole; every other dim of x keeps its cut, and ``v`` is cut as ``x[..., i, ...]``
    would be (``many_index_strategy``'s order), so each rank writes its own rows."""
    x = cast(fx.Node, node.args[0])
    xv = vals[x]
    xl = no_partial(replicate_dims(xv.layout, at))
    idx = node.args[1]
    order = _index_order(xv.ndim, at, vals[node.args[2]].ndim - (xv.ndim - len(at)))
    src = no_partial(vals[node.args[2]].layout)
    if not any(xl.dims) and any(src.dims[p] for p, d in enumerate(order) if d is not None):
        # a fresh whole target (``torch.zeros(...).index_add_(1, i, h)``): take the cuts
        # of the values written into it, which cost nothing to cut it to
        dims, il = list(xl.dims), list(xl.interleave)
        for p, d in enumerate(order):
            if d is not None:
                dims[d], il[d] = src.dims[p], src.interleave[p]
        xl = Layout(xv.ndim, tuple(dims), (), tuple(il))
    needs = {x: xl, node.args[2]: _in_order(xl, order)}
    for d in at:
        needs[idx[d]] = Layout.replicate(vals[idx[d]].ndim)
    return Strategy(needs, xl)
