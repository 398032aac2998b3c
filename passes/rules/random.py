"""Dropout, Bernoulli and the other draws shaped like a tensor (``randn_like``,
``rand_like``, ``randint_like``, the functional ``exponential``/``uniform``/``normal``
that ``Tensor.exponential_()`` and friends become): the global tensor one device would
draw, cut to this rank's piece."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from shardc.core.ir import Val
from shardc.core.placement import Layout
from shardc.passes.rules.common import aten, existing_ops, fallback_rule, register_rule
from shardc.runtime import ops as R

if TYPE_CHECKING:  # the lowering calls the rules; they only name its type
    from shardc.passes.lower import Lowering


@register_rule(aten.dropout.default, aten.native_dropout.default)
def dropout_rule(L: Lowering, node: fx.Node) -> Any:
    x = L.env[node.args[0]]
    p = float(node.args[1])
    train = bool(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else True
    lay = x.layout if x.layout is not None else Layout.replicate(x.ndim)
    # dropout scales each entry by 0 or 1/(1-p): linear, so a sum or mean stays partial
    keep = tuple(q for q in lay.partial if q[1] in ("sum", "avg"))
    lay = Layout(lay.ndim, lay.dims, keep, lay.interleave).clean(L.mesh)
    xn = L.to_layout(x, lay)
    gval = x.val
    n = L.emit(R.global_dropout, (xn, p, train, list(gval.shape), L.rt, lay.dims, lay.interleave),
               L.draw_site() if train and p > 0 else None, layout=lay, val=gval)
    out = Val(n, lay, gval)
    if node.target is aten.native_dropout.default:
        mask_val = node.meta["val"][1]
        # the mask is rarely used (only by a hand-written backward); give it whole
        m = L.emit(aten.ones_like.default, (n,), {"dtype": torch.bool}, layout=lay, val=mask_val)
        return [out, Val(m, lay, mask_val)]
    return out


@register_rule(aten.bernoulli.p)
def bernoulli_rule(L: Lowering, node: fx.Node) -> Any:
    """``bernoulli(x, p)`` reads only ``x``'s shape, dtype and device. In-place dropout
    (``F.dropout(h, p, inplace=True)``: torchvision's MobileNet and EfficientNet heads,
    MobileViT's) decomposes into ``bernoulli(empty_like(h), 1 - p)``; the draw is made for
    the global shape and cut to the layout ``x`` has, so nothing is gathered."""
    x = L.env[node.args[0]]
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    if x.layout is None or node.kwargs.get("generator") is not None:
        return fallback_rule(L, node)  # a parameter's shape, or the user's own generator
    # x's values are not read: a partial x needs no reduction first
    lay = Layout(x.layout.ndim, x.layout.dims, (), x.layout.interleave).clean(L.mesh)
    gval = node.meta["val"]
    n = L.emit(R.global_bernoulli, (x.node, float(p), list(gval.shape), L.rt, lay.dims,
                                    lay.interleave), L.draw_site(), layout=lay, val=gval)
    return Val(n, lay, gval)


# draws that read only their first argument's shape, dtype and device (a user's own
# generator, or a bound given as a tensor, runs whole, as one device would draw it)
DRAWS_LIKE = existing_ops("randn_like.default", "rand_like.default", "randint_like.default",
                     "randint_like.low_dtype", "randint_like.Tensor", "exponential.default",
                     "uniform.default", "normal_functional.default", "log_normal.default",
                     "cauchy.default", "geometric.default")


@register_rule(*DRAWS_LIKE)
def draw_like_rule(L: Lowering, node: fx.Node) -> Any:
    """A draw shaped like ``x`` (diffusion's ``noise = torch.randn_like(latents)``, a VAE's
    reparameterisation, Gumbel noise ``empty_like(h).exponential_()``): drawn for the
    global shape by the same op, so it consumes the default generator as one device
    does, and cut to the layout ``x`` has. Nothing is gathered: ``x``'s values are not
    read."""
    x = L.env[node.args[0]]
    if x.layout is None or node.kwargs.get("generator") is not None or any(
            isinstance(a, fx.Node) for a in node.args[1:]):
        return fallback_rule(L, node)  # a parameter's shape, a generator, a tensor bound
    lay = Layout(x.layout.ndim, x.layout.dims, (), x.layout.interleave).clean(L.mesh)
    gval = node.meta["val"]
    n = L.emit(R.global_draw_like, (x.node, node.target, list(node.args[1:]), dict(node.kwargs),
                                    list(gval.shape), L.rt, lay.dims, lay.interleave),
               L.draw_site(), layout=lay, val=gval)
    return Val(n, lay, gval)
