"""Scaled dot-product attention: heads whole on a rank (GQA included)."""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch.fx as fx

from shardc.mesh import Mesh
from shardc.placement import Layout
from shardc.passes.lower import Lowering
from shardc.passes.rules.common import (Strategy, apply_strategy, aten, fallback_rule, no_partial,
                                        register_rule, replicate_dims, strategy)


# -------------------------------------------------------------------- attention
@register_rule(aten.scaled_dot_product_attention.default)
def sdpa_rule(L: Lowering, node: fx.Node) -> Any:
    if node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0):
        return fallback_rule(L, node)  # its kernel draws its own dropout mask
    return apply_strategy(L, node, sdpa_strategy)


@strategy(aten.scaled_dot_product_attention.default)
def sdpa_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """Heads stay whole on a rank: q, k, v keep the batch and head cuts, sequence and
    head dim whole; k/v heads (GQA) follow q's cut when it divides them."""
    q, k, v = (vals[a] for a in node.args[:3])
    ql = no_partial(q.layout.clean(mesh))
    ql = replicate_dims(ql, [2, 3])
    head = ql.dims[1]
    if head and k.shape[1] != q.shape[1]:
        f = math.prod(mesh.size(a) for a in head)
        if k.shape[1] % f:
            ql = replicate_dims(ql, [1])
    kl = Layout(4, ql.dims[:2] + ((), ()), (), ql.interleave[:2] + (1, 1))
    need = {node.args[0]: ql, node.args[1]: kl, node.args[2]: kl}
    mask_node = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask_node, fx.Node):
        m = vals[mask_node]
        off = 4 - m.ndim
        dims = []
        for d in range(m.ndim):
            od = d + off
            dims.append(ql.dims[od] if od < 2 and m.shape[d] == q.shape[od] else ())
        need[mask_node] = Layout(m.ndim, tuple(dims))
    out = Layout(4, ql.dims[:2] + ((), ()), (), ql.interleave[:2] + (1, 1))
    return Strategy(need, out)
