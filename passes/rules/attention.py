"""Scaled dot-product attention: heads whole on a rank (GQA included); on a sequence cut
over ``context``, by a ring (runtime/ring.py)."""
from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.fx as fx

from shardc.core.ir import Val
from shardc.core.mesh import CONTEXT, Mesh
from shardc.core.placement import Layout
from shardc.passes.rules.common import (
    Strategy,
    apply_strategy,
    aten,
    emit_like,
    fallback_rule,
    no_partial,
    register_rule,
    replicate_dims,
    strategy,
)
from shardc.runtime import ops as R
from shardc.runtime.ring import RING_ATTENTION

if TYPE_CHECKING:  # the lowering calls the rules; they only name its type
    from shardc.passes.lower import Lowering


# -------------------------------------------------------------------- attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _sdpa_arg(node: fx.Node, name: str, default: Any) -> Any:
    i = _SDPA_ARGS.index(name)
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


@register_rule(aten.scaled_dot_product_attention.default)
def sdpa_rule(L: Lowering, node: fx.Node) -> Any:
    if _sdpa_arg(node, "dropout_p", 0.0):
        return sdpa_dropout_rule(L, node)
    vals = {a: L.env[a] for a in node.all_input_nodes}
    ring = ring_strategy(node, vals, L.mesh)
    if ring is not None and not _mask_may_need_grad(L, _sdpa_arg(node, "attn_mask", None)):
        if L.ctx.options.context_attention == "ulysses":
            heads = ulysses_strategy(node, vals, L.mesh, ring)
            if heads is not None:
                return ulysses_rule(L, node, heads, ring.out)
            L.decisions.append(f"{L.src.module or node.name}: context_attention='ulysses' needs heads "
                               f"that context = {L.mesh.size(CONTEXT)} divides; this attention runs "
                               "by a ring")
        return ring_rule(L, node, ring)
    return apply_strategy(L, node, sdpa_strategy)


def ulysses_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh, ring: Strategy
                     ) -> Strategy | None:
    """The all-to-all form of a sequence-cut attention (DeepSpeed-Ulysses): q, k and v
    re-cut from the sequence to the heads over ``context`` (one all-to-all each), a local
    attention over the whole sequence for this rank's heads, the output re-cut back to the
    sequence. None where context (times the heads' other cuts) does not divide the
    query and key/value heads."""
    q, k = (vals[a] for a in node.args[:2])
    ql = ring.out
    head = ql.with_replicated(CONTEXT).with_shard(CONTEXT, 1)
    f = math.prod(mesh.size(a) for a in head.dims[1])
    if q.shape[1] % f or k.shape[1] % f:
        return None
    need = {a: head for a in node.args[:3]}
    mask_node = _sdpa_arg(node, "attn_mask", None)
    if isinstance(mask_node, fx.Node):
        m = vals[mask_node]
        off = 4 - m.ndim
        dims = [head.dims[d + off] if d + off < 2 and m.shape[d] == q.shape[d + off] else ()
                for d in range(m.ndim)]
        need[mask_node] = Layout(m.ndim, tuple(dims))
    return Strategy(need, Layout(4, head.dims[:2] + ((), ()), (), head.interleave[:2] + (1, 1)))


def ulysses_rule(L: Lowering, node: fx.Node, s: Strategy, seq: Layout) -> Val:
    out = emit_like(L, node, s.needs, s.out)
    g = L.mesh.size(CONTEXT)
    L.decisions.append(f"{L.src.module or node.name}: attention by all-to-all over context ({g} ranks, "
                       "Ulysses): queries, keys and values re-cut from the sequence to the heads, "
                       "the output back")
    back = L.to_layout(out, seq)
    return Val(back, seq.clean(L.mesh), node.meta["val"])


def _mask_may_need_grad(L: Lowering, mask: Any) -> bool:
    """Could a gradient flow into the attention's mask (T5's and ALiBi-like learned
    position biases are added as a floating mask)? The ring gives none to its mask, so
    such a mask keeps the gathering attention. True when a floating mask depends on a
    parameter or a floating input of the model; a boolean mask, or one made from integer
    inputs and buffers (transformers' padding masks), carries none."""
    if not isinstance(mask, fx.Node) or not mask.meta["val"].dtype.is_floating_point:
        return False
    seen, todo = set(), [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            role = L.roles.get(n.name, ("input", n.name))[0]
            val = n.meta.get("val")
            if role == "param" or (role == "input" and isinstance(val, torch.Tensor)
                                   and val.dtype.is_floating_point):
                return True
        todo.extend(n.all_input_nodes)
    return False


def ring_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy | None:
    """Attention on queries whose sequence dim is cut over ``context`` alone: by a ring
    (runtime/ring.py), each input keeping its batch, head and sequence cuts; None where
    it does not apply (no context cut, cross-attention of another length, a mask with a
    gradient), and the attention gathers its keys and values as before."""
    if mesh.size(CONTEXT) == 1:
        return None
    q, k, v = (vals[a] for a in node.args[:3])
    if not all(isinstance(t, Val) and t.layout is not None and t.ndim == 4 for t in (q, k, v)):
        return None
    ql = no_partial(q.layout.clean(mesh))
    if ql.dims[2] != (CONTEXT,) or k.shape[2] != q.shape[2] or q.shape[2] % mesh.size(CONTEXT):
        return None
    mask_node = _sdpa_arg(node, "attn_mask", None)
    if isinstance(mask_node, fx.Node):
        m = vals[mask_node]
        if not isinstance(m, Val) or m.ndim > 4 or m.val.requires_grad:
            return None
    ql = replicate_dims(ql, [3])
    for a in ql.dims[1]:  # heads stay whole on a rank, as without a ring
        if k.shape[1] % mesh.size(a) or q.shape[1] % mesh.size(a):
            ql = replicate_dims(ql, [1])
    kl = Layout(4, ql.dims, (), ql.interleave)
    need = {node.args[0]: ql, node.args[1]: kl, node.args[2]: kl}
    if isinstance(mask_node, fx.Node):
        m = vals[mask_node]
        off = 4 - m.ndim
        dims, il = [], []
        for d in range(m.ndim):
            od = d + off
            keep = od < 3 and m.shape[d] == q.shape[od]
            dims.append(ql.dims[od] if keep else ())
            il.append(ql.interleave[od] if keep and ql.dims[od] else 1)
        need[mask_node] = Layout(m.ndim, tuple(dims), (), tuple(il))
    return Strategy(need, ql)


def ring_rule(L: Lowering, node: fx.Node, s: Strategy) -> Val:
    q, k = (L.env[a] for a in node.args[:2])
    gval = node.meta["val"]
    args = [L.to_layout(L.env[a], s.needs[a]) for a in node.args[:3]]
    mask_node = _sdpa_arg(node, "attn_mask", None)
    mask = L.to_layout(L.env[mask_node], s.needs[mask_node]) if isinstance(mask_node, fx.Node) else None
    causal = bool(_sdpa_arg(node, "is_causal", False))
    scale = _sdpa_arg(node, "scale", None)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    seq = q.shape[2]
    il = s.out.interleave[2]
    lse = torch.empty(gval.shape[:-1], device="meta", dtype=torch.promote_types(gval.dtype, torch.float32))
    n = L.emit(RING_ATTENTION, (*args, mask, causal, scale, seq, il, L.rt, CONTEXT), layout=None,
               val=(gval, lse))
    out = L.emit(operator.getitem, (n, 0), layout=s.out, val=gval)
    g = L.mesh.size(CONTEXT)
    how = "balanced" if il != 1 else "contiguous"
    L.decisions.append(f"{L.src.module or node.name}: attention by a ring over context ({g} ranks, "
                       f"{how} sequence cut{', causal' if causal else ''}{', masked' if mask is not None else ''}"
                       f"{', grouped-query' if k.shape[1] != q.shape[1] else ''}): keys and values "
                       f"passed {g - 1} times, never gathered")
    return Val(out, s.out.clean(L.mesh), gval)


def sdpa_dropout_rule(L: Lowering, node: fx.Node) -> Any:
    """Attention with dropout on the probabilities, per head as without it, in the math
    form torch's CPU kernel runs: q and k each scaled by sqrt(scale), softmax, dropout,
    times v. The dropout is shardc's global one (the mask one device draws for the whole
    (batch, heads, L, S) tensor, cut to this rank's heads and samples): on the CPU the
    fused kernel draws its mask with that same call, so the masks are one device's.

    Elsewhere (CUDA's flash and memory-efficient kernels draw their masks inside the
    kernel, in an order no slice reproduces) the attention runs replicated, whole, so
    that it still draws one device's mask; a GQA attention (fewer k/v heads) too."""
    q, k, v = (L.env[a] for a in node.args[:3])
    gval = node.meta["val"]
    if (not all(isinstance(t, Val) and t.layout is not None for t in (q, k, v))
            or gval.device.type != "cpu" or k.shape[1] != q.shape[1] or q.ndim != 4
            or _sdpa_arg(node, "enable_gqa", False)):
        return fallback_rule(L, node)
    p = float(_sdpa_arg(node, "dropout_p", 0.0))
    causal = bool(_sdpa_arg(node, "is_causal", False))
    scale = _sdpa_arg(node, "scale", None)
    mask_node = _sdpa_arg(node, "attn_mask", None)
    s = sdpa_strategy(node, {a: L.env[a] for a in node.all_input_nodes}, L.mesh)
    qn, kn, vn = (L.to_layout(L.env[a], s.needs[a]) for a in node.args[:3])
    B, H, Lq, D = q.shape
    S = k.shape[2]
    lay = s.out  # batch and head cuts; the (L, S) matrix whole
    dt = gval.dtype

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device="meta", dtype=dt)

    root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(D))
    qs = L.emit(aten.mul.Tensor, (qn, root), layout=s.needs[node.args[0]], val=meta(B, H, Lq, D))
    kt = L.emit(aten.transpose.int, (kn, -2, -1), layout=lay, val=meta(B, H, D, S))
    kt = L.emit(aten.mul.Tensor, (kt, root), layout=lay, val=meta(B, H, D, S))
    att = L.emit(aten.matmul.default, (qs, kt), layout=lay, val=meta(B, H, Lq, S))
    if causal:
        keep = L.emit(aten.ones.default, ([Lq, S],), {"dtype": torch.bool, "device": gval.device},
                      layout=Layout.replicate(2), val=torch.empty(Lq, S, device="meta", dtype=torch.bool))
        keep = L.emit(aten.tril.default, (keep,), layout=Layout.replicate(2),
                      val=torch.empty(Lq, S, device="meta", dtype=torch.bool))
        drop = L.emit(aten.logical_not.default, (keep,), layout=Layout.replicate(2),
                      val=torch.empty(Lq, S, device="meta", dtype=torch.bool))
        att = L.emit(aten.masked_fill.Scalar, (att, drop, float("-inf")), layout=lay, val=meta(B, H, Lq, S))
    if isinstance(mask_node, fx.Node):
        m = L.to_layout(L.env[mask_node], s.needs[mask_node])
        mval = mask_node.meta["val"]
        if mval.dtype == torch.bool:
            inv = L.emit(aten.logical_not.default, (m,), layout=s.needs[mask_node], val=mval)
            att = L.emit(aten.masked_fill.Scalar, (att, inv, float("-inf")), layout=lay,
                         val=meta(B, H, Lq, S))
        else:
            att = L.emit(aten.add.Tensor, (att, m), layout=lay, val=meta(B, H, Lq, S))
    att = L.emit(aten._softmax.default, (att, -1, False), layout=lay, val=meta(B, H, Lq, S))
    att = L.emit(R.global_dropout, (att, p, True, [B, H, Lq, S], L.rt, lay.dims, lay.interleave),
                 L.draw_site() if p > 0 else None, layout=lay, val=meta(B, H, Lq, S))
    out = L.emit(aten.matmul.default, (att, vn), layout=lay, val=gval)
    L.decisions.append(f"{L.src.module or node.name}: attention with dropout p={p} in the math "
                       "form, per head, one device's mask")
    return Val(out, lay.clean(L.mesh), gval)


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
    mask_node = _sdpa_arg(node, "attn_mask", None)
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
