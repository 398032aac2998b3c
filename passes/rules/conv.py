"""Convolutions, pooling, resampling (interpolate, grid_sample) and group norm: ops that
work over the trailing (spatial) dims of each sample independently. The leading dims (batch, and
channels for pooling and resampling) keep their shards; the window's dims, and for a convolution the channels it
mixes, must be whole on every rank.

Why a rule and not the fallback: the fallback runs an op on whole tensors, so a
convolution fed the data-parallel batch gathered the global batch onto every rank and
computed all of it there (a CNN or a ViT's patch embedding on ``d8`` did 8x the work and
held 8x the activations). Split by samples, each rank convolves its own; the weight is
used whole, and the lowering sums its gradient over the axes the batch is cut on, as for
any parameter that meets different samples on different ranks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch.fx as fx

from shardc.core.mesh import Mesh
from shardc.core.placement import Layout
from shardc.passes.rules.common import (
    Strategy,
    apply_strategy,
    aten,
    emit_like,
    emit_outputs,
    materialise_then,
    no_partial,
    register_rule,
    replicate_dims,
    strategy,
    tensor_vals,
)

if TYPE_CHECKING:  # the lowering calls the rules; they only name its type
    from shardc.passes.lower import Lowering

# convolutions mix every channel (dim 1) as well as the window's dims
_CONV = (aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
         aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding,
         aten.conv_transpose1d.default, aten.conv_transpose2d.input,
         aten.conv_transpose3d.input)
# pooling: op -> how many trailing dims its window covers
_WINDOW = {aten.max_pool1d.default: 1, aten.max_pool2d.default: 2, aten.max_pool3d.default: 3,
           aten.max_pool2d_with_indices.default: 2, aten.max_pool3d_with_indices.default: 3,
           aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3,
           aten.adaptive_avg_pool1d.default: 1, aten.adaptive_avg_pool2d.default: 2,
           aten._adaptive_avg_pool2d.default: 2, aten.adaptive_avg_pool3d.default: 3,
           aten._adaptive_avg_pool3d.default: 3, aten.adaptive_max_pool1d.default: 1,
           aten.adaptive_max_pool2d.default: 2, aten.adaptive_max_pool3d.default: 3}
# resampling (F.interpolate) computes each sample's every channel from that channel alone
_RESAMPLE = {f"upsample_nearest{d}d": d for d in (1, 2, 3)}
_RESAMPLE.update({f"_upsample_nearest_exact{d}d": d for d in (1, 2, 3)})
_RESAMPLE.update(upsample_linear1d=1, upsample_bilinear2d=2, upsample_bicubic2d=2,
                 upsample_trilinear3d=3, _upsample_bilinear2d_aa=2, _upsample_bicubic2d_aa=2)
for _name, _d in _RESAMPLE.items():
    for _overload in ("default", "vec"):
        _op = getattr(getattr(aten, _name, None), _overload, None)
        if _op is not None:
            _WINDOW[_op] = _d
# group norm normalises each sample over its group's channels and every spatial position
_GROUP_NORM = (aten.group_norm.default,)


def _samples_only(x: Any, keep: int) -> Layout:
    """``x``'s layout with only its first ``keep`` dims' shards kept, whole elsewhere,
    summed where it was partial (none of these ops is linear in a way a rank's part could
    go through: a max, a window that crosses a cut, a normalisation)."""
    return no_partial(replicate_dims(x.layout, list(range(keep, x.ndim))))


def _whole(vals: Mapping[fx.Node, Any], skip: fx.Node) -> dict[fx.Node, Layout]:
    return {a: Layout.replicate(v.ndim) for a, v in tensor_vals(vals) if a is not skip}


@strategy(*_CONV)
def conv_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """Batch-parallel: the input keeps the shards of its batch dim (dim 0, when it has one
    beside channels and the spatial dims), the weight and bias are whole."""
    xn = node.args[0]
    x = vals[xn]
    weight = vals[node.args[1]]
    batched = x.ndim == weight.ndim  # (N, C, *spatial) against (C_out, C_in/g, *kernel)
    need = _samples_only(x, 1 if batched else 0)
    out = Layout(node.meta["val"].dim(), need.dims, (), need.interleave)
    return Strategy({**_whole(vals, xn), xn: need}, out)


@strategy(*_WINDOW)
def window_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """Pooling: every dim before the window (batch, channels) keeps its shards."""
    xn = node.args[0]
    x = vals[xn]
    need = _samples_only(x, x.ndim - _WINDOW[node.target])
    return Strategy({xn: need}, need)


@strategy(*_GROUP_NORM)
def group_norm_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """Each sample on its own: the batch dim keeps its shards, weight and bias whole."""
    xn = node.args[0]
    need = _samples_only(vals[xn], 1)
    return Strategy({**_whole(vals, xn), xn: need}, need)


# F.grid_sample: each sample's channels read at that sample's grid of positions
_GRID = (aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)


@strategy(*_GRID)
def grid_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """``grid_sampler(x (N, C, *in), grid (N, *out, k))`` -> (N, C, *out): the batch cut
    alike in both (x's cut, else the grid's), x's channels keep their cut (the grid is the
    same for every channel), the spatial dims and the grid's last dim whole."""
    xn, gn = node.args[0], node.args[1]
    x, g = vals[xn], vals[gn]
    need_x = _samples_only(x, 2)
    batch = need_x.dims[0] or tuple(a for a in no_partial(g.layout).dims[0]
                                    if a not in need_x.dims[1])
    il = need_x.interleave[0] if need_x.dims[0] else (g.layout.interleave[0] if batch else 1)
    need_x = Layout(x.ndim, (batch,) + need_x.dims[1:], (), (il,) + need_x.interleave[1:])
    need_g = Layout(g.ndim, (batch,) + ((),) * (g.ndim - 1), (), (il,) + (1,) * (g.ndim - 1))
    out = Layout(node.meta["val"].dim(), need_x.dims[:2] + ((),) * (x.ndim - 2), (),
                 need_x.interleave[:2] + (1,) * (x.ndim - 2))
    return Strategy({xn: need_x, gn: need_g}, out)


@register_rule(*_GRID)
def grid_rule(L: Lowering, node: fx.Node) -> Any:
    if L.env[node.args[0]].layout is None or L.env[node.args[1]].layout is None:
        return materialise_then(L, node)
    return apply_strategy(L, node, grid_strategy)


@register_rule(*_CONV, *_GROUP_NORM)
def batch_parallel_rule(L: Lowering, node: fx.Node) -> Any:
    if L.env[node.args[0]].layout is None:  # the op runs on a parameter itself
        return materialise_then(L, node)
    decide = group_norm_strategy if node.target in _GROUP_NORM else conv_strategy
    return apply_strategy(L, node, decide)


@register_rule(*_WINDOW)
def window_rule(L: Lowering, node: fx.Node) -> Any:
    if L.env[node.args[0]].layout is None:
        return materialise_then(L, node)
    s = window_strategy(node, {a: L.env[a] for a in node.all_input_nodes}, L.mesh)
    vals = node.meta["val"]
    if not isinstance(vals, (list, tuple)):
        return emit_like(L, node, s.needs, s.out)
    # (values, indices): both shaped like the output, both laid out alike; an index
    # counts positions inside the window's dims, which are whole, so it is the global one
    return emit_outputs(L, node, L.to_layout(L.env[node.args[0]], s.needs[node.args[0]]), s.out)
