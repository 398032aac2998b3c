"""Pointwise ops (and every ATen op tagged pointwise) and factories: shards follow the
output, and a partial value flows on only through ops linear in it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.fx as fx

from shardc.core.ir import Val
from shardc.core.mesh import BATCH_AXES, Mesh
from shardc.core.placement import PARTIAL_OPS, Layout
from shardc.core.precision import narrows
from shardc.passes.rules.common import (
    Strategy,
    apply_strategy,
    aten,
    emit_like,
    fallback_rule,
    input_vals,
    materialise_then,
    register_rule,
    strategy,
    tensor_inputs,
    tensor_vals,
)
from shardc.runtime import ops as R

if TYPE_CHECKING:  # the lowering calls the rules; they only name its type
    from shardc.passes.lower import Lowering


# --------------------------------------------------------------------- factories
@register_rule(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
               aten.zeros.default, aten.ones.default, aten.empty.memory_format,
               aten.scalar_tensor.default, aten.new_ones.default, aten.new_zeros.default,
               aten.new_full.default, aten.new_empty.default, aten.lift_fresh_copy.default,
               aten.tril.default, aten.triu.default)
def factory_rule(L: Lowering, node: fx.Node) -> Any:
    return apply_strategy(L, node, factory_strategy)


@strategy(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
               aten.zeros.default, aten.ones.default, aten.empty.memory_format,
               aten.scalar_tensor.default, aten.new_ones.default, aten.new_zeros.default,
               aten.new_full.default, aten.new_empty.default, aten.lift_fresh_copy.default,
               aten.tril.default, aten.triu.default)
def factory_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """Tensors made from constants: every rank computes the whole (global) tensor; a
    consumer that needs a shard cuts it locally. ``x.new_zeros(shape)`` and its kin read
    only x's dtype and device, so x stays where it is: gathering it moved bytes for
    nothing (and gave the gather a backward that the step program drops as dead)."""
    keep = node.target in _NEW
    return Strategy({a: v.layout if keep and v.layout is not None else Layout.replicate(v.ndim)
                     for a, v in tensor_vals(vals)},
                    Layout.replicate(node.meta["val"].dim()))


_NEW = {aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
        aten.new_empty.default}


_LIKE = (aten.full_like.default, aten.zeros_like.default, aten.ones_like.default,
         aten.empty_like.default)


@register_rule(*_LIKE)
def like_rule(L: Lowering, node: fx.Node) -> Any:
    if L.env[node.args[0]].layout is None:  # shaped like a parameter: made whole
        return apply_strategy(L, node, factory_strategy)
    return apply_strategy(L, node, like_strategy)


@strategy(*_LIKE)
def like_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """A constant shaped like its input: made where the input is, in the input's shards
    (the input's values are never read, so it moves nowhere, partial or not); the constant
    is the same on every rank, so it is whole where the input was partial."""
    x = vals[node.args[0]]
    out = x.layout
    for a, _ in out.partial:
        out = out.with_replicated(a)
    return Strategy({node.args[0]: x.layout}, out)


# --------------------------------------------------------------------- pointwise
LINEAR_UNARY = {aten.clone.default, aten.alias.default, aten.contiguous.default, aten.neg.default,
                aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
                aten.detach.default, aten.type_as.default, aten.view_as.default}


# Ops through which a partial value may flow and stay partial, by how they are linear.
# Anything else needs its partial inputs reduced first: f(a + b) != f(a) + f(b).
_ADDITIVE = {aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar}
_SCALING = {aten.mul.Tensor, aten.mul.Scalar}
_DIVIDING = {aten.div.Tensor, aten.div.Scalar}
_MASKING = {aten.masked_fill.Scalar}


def _arg_kind(a: Any, axis: str) -> str:
    """How one argument of a pointwise op sits on ``axis``: a partial op (PARTIAL_OPS),
    "S" (sharded), "R" (replicated tensor), "0" (the number zero), "c" (another number)."""
    if isinstance(a, Val):
        if a.layout is None:
            return "R"
        p = dict(a.layout.partial).get(axis)
        if p is not None:
            return p
        return "S" if a.layout.shard_dim(axis) is not None else "R"
    if isinstance(a, bool) or a is None:
        return "c"
    if isinstance(a, (int, float)):
        return "0" if a == 0 else "c"
    return "c"


def partial_ok(target: Any, args: list[Any], axis: str, out_dtype: Any = None) -> bool:
    """Can ``target`` run on each rank's piece of a partial value over ``axis`` and give a
    partial value of the same kind? ``args`` are the op's positional arguments, tensors as
    ``Val``s. Only for ops linear in their partial arguments: a sum of pieces commutes
    with additions of other pieces and with scaling by a replicated factor; a mean of
    pieces also commutes with adding a replicated value (mean(a_r + c) = mean(a_r) + c).
    Repeated arguments count as often as they appear: x * x is not linear in x."""
    kinds = [_arg_kind(a, axis) for a in args]
    ps = {k for k in kinds if k in PARTIAL_OPS}
    if len(ps) != 1 or ps & {"max", "min"}:
        return False
    op = ps.pop()
    n_partial = sum(1 for k in kinds if k == op)
    others = [k for k in kinds if k != op]
    if target in LINEAR_UNARY or target in (aten.dropout.default, aten.native_dropout.default):
        if out_dtype is not None and not (out_dtype.is_floating_point or out_dtype.is_complex):
            return False  # a cast to an integer type rounds each piece
        src = args[0].val.dtype if isinstance(args[0], Val) else None
        if out_dtype is not None and src is not None and src.is_floating_point and \
                out_dtype.is_floating_point and torch.finfo(out_dtype).eps > torch.finfo(src).eps:
            return False  # a narrowing cast: sum in the wider type, round once, as one device
        # type_as / view_as read only the dtype or shape of their second argument, so the
        # partial value must be the first
        return kinds[0] == op and n_partial == 1 and all(k in ("c", "0", "R", "S") for k in others)
    if target in _ADDITIVE:
        # a + b of two partial pieces is the piece of the sum; a constant or replicated
        # addend would be added once per rank to a sum (but exactly once to a mean)
        return all(k == "0" or (op == "avg" and k in ("R", "c")) for k in others)
    if target in _SCALING:
        return n_partial == 1 and all(k in ("R", "c", "0") for k in others)
    if target in _DIVIDING:
        return kinds[0] == op and n_partial == 1 and all(k in ("R", "c") for k in kinds[1:])
    if target in _MASKING:
        # masked_fill(x, mask, 0): zeroing entries is linear in x; any other fill is not
        return kinds[0] == op and n_partial == 1 and kinds[1] == "R" and kinds[2] == "0"
    return False


def pointwise_layouts(target: Any, ins: list[Val | None], out_shape: list[int],
                      args: list[Any] | None = None, out_dtype: Any = None
                      ) -> tuple[Layout, list[Layout | None]]:
    """(output layout, layout each of ``ins`` must arrive in). ``args`` are the op's
    positional arguments (default: ``ins``), which decide whether a partial input may
    stay partial."""
    if args is None:
        args = list(ins)
    nd = len(out_shape)
    decided = [v for v in ins if v is not None and v.layout is not None and v.ndim == nd
               and v.shape == out_shape]
    decided.sort(key=lambda v: -len(v.layout.sharded_axes()) if v.layout else 0)
    out = Layout.replicate(nd)
    if decided:
        p = decided[0].layout
        out = Layout(nd, p.dims, (), p.interleave)
    # batch-dim shards from any input whose dim matches (e.g. a mask broadcast over heads)
    for v in ins:
        if v is None or v.layout is None:
            continue
        off = nd - v.ndim
        for d, axes in enumerate(v.layout.dims):
            for a in axes:
                if out.placement(a).__class__.__name__ == "Replicate" and v.shape[d] == out_shape[d + off] \
                        and not out.dims[d + off] and a in BATCH_AXES:
                    out = out.with_shard(a, d + off)
    axes_p = set()
    for v in ins:
        if v is not None and v.layout is not None:
            axes_p |= {a for a, _ in v.layout.partial}
    for a in sorted(axes_p):
        if partial_ok(target, args, a, out_dtype) and out.placement(a).__class__.__name__ == "Replicate":
            op = [dict(v.layout.partial)[a] for v in ins if v is not None and v.layout is not None
                  and a in dict(v.layout.partial)][0]
            out = out.with_partial(a, op)
    needs: list[Layout | None] = []
    for v in ins:
        if v is None:
            needs.append(None)
            continue
        off = nd - v.ndim
        need = Layout.replicate(v.ndim)
        dims = []
        il = []
        for d in range(v.ndim):
            od = d + off
            if v.shape[d] == out_shape[od] and out.dims[od]:
                dims.append(out.dims[od])
                il.append(out.interleave[od])
            else:
                dims.append(())
                il.append(1)
        partial = ()
        if v.layout is not None:
            partial = tuple(p for p in v.layout.partial if p in out.partial)
        need = Layout(v.ndim, tuple(dims), partial, tuple(il))
        needs.append(need)
    return out, needs


@register_rule(aten.copy.default)
def copy_rule(L: Lowering, node: fx.Node) -> Any:
    ins = tensor_inputs(L, node)
    if any(v.layout is None for _, v in ins):  # into or from a parameter: whole
        s = Strategy({a: Layout.replicate(v.ndim) for a, v in ins},
                     Layout.replicate(node.meta["val"].dim()))
    else:
        s = copy_strategy(node, input_vals(L, node), L.mesh)
    return emit_like(L, node, s.needs, s.out, target=R.copy_into)


@strategy(aten.copy.default)
def copy_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    """``x.copy_(src)`` made functional (``x[:, 0] = t``, ``mask[:, -4:] = 0``): src's
    values, broadcast to x's shape and cast to its dtype, elementwise like any pointwise
    op. Never partial: x's values are dropped, so a partial x cannot stay partial, and a
    partial src may be cast to a type in which its pieces do not add up."""
    ins = [vals[a] if isinstance(vals.get(a), Val) else None for a in node.args[:2]]
    # copy is in no partial-linear set, so pointwise_layouts reduces partial inputs
    out, needs = pointwise_layouts(node.target, ins, list(node.meta["val"].shape))
    return Strategy({a: n for a, n in zip(node.args[:2], needs) if n is not None}, out)


def _only_dtype(node: fx.Node) -> bool:
    """A cast that changes the dtype and nothing else (device, layout, memory format)."""
    if node.target is aten._to_copy.default:
        return not node.args[1:] and set(node.kwargs) <= {"dtype"}
    if node.target is aten.to.dtype:
        return not node.kwargs and all(a in (False, None) for a in node.args[2:])
    return False


@register_rule("pointwise", aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
               aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.gelu.default,
               aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
               aten.clone.default, aten.alias.default, aten.contiguous.default, aten._to_copy.default,
               aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.detach.default,
               aten.type_as.default, aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.bitwise_and.Tensor,
               aten.bitwise_or.Tensor, aten.__and__.Tensor, aten.__or__.Tensor, aten.eq.Tensor,
               aten.eq.Scalar, aten.ne.Scalar, aten.ne.Tensor, aten.le.Tensor, aten.lt.Tensor,
               aten.ge.Tensor, aten.gt.Tensor, aten.le.Scalar, aten.lt.Scalar, aten.ge.Scalar,
               aten.gt.Scalar, aten.logical_not.default, aten.bitwise_not.default, aten.neg.default,
               aten.exp.default, aten.log.default, aten.sqrt.default, aten.abs.default,
               aten.reciprocal.default, aten.clamp.default, aten.erf.default, aten.sin.default,
               aten.cos.default, aten.maximum.default, aten.minimum.default, aten.add.Scalar,
               aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.pow.Tensor_Tensor,
               aten.view_as.default, aten.softplus.default, aten.log1p.default, aten.expm1.default,
               aten.polar.default, aten.complex.default)
def pointwise_rule(L: Lowering, node: fx.Node) -> Any:
    val = node.meta["val"]
    if not isinstance(val, torch.Tensor):  # several outputs (frexp): no layout rule for that
        return fallback_rule(L, node)
    if node.target is aten.view_as.default and \
            list(node.args[0].meta["val"].shape) != list(node.args[1].meta["val"].shape):
        return fallback_rule(L, node)  # a reshape, not elementwise
    if node.target is aten.type_as.default:
        # only the other tensor's dtype is read: cast x, never move the other one
        s = pointwise_strategy(node, input_vals(L, node), L.mesh)
        xn = L.to_layout(L.env[node.args[0]], s.needs[node.args[0]])
        n = L.emit(aten._to_copy.default, (xn,), {"dtype": val.dtype}, layout=s.out, val=val)
        return Val(n, s.out.clean(L.mesh), val)
    ins_nodes = tensor_inputs(L, node)
    ins = [v for _, v in ins_nodes]
    # a value derived only from parameters: keep it whole (rare: scaled weights)
    if node.target in (aten.alias.default, aten.detach.default, aten._to_copy.default, aten.to.dtype,
                       aten.to.dtype_layout, aten.contiguous.default, aten.clone.default) \
            and len(ins) == 1 and ins[0].layout is None and ins[0].param:
        v = ins[0]
        extra = tuple(node.args[1:]) if node.target is not aten._to_copy.default else ()
        if node.target in (aten.alias.default, aten.detach.default, aten.contiguous.default,
                           aten.clone.default):
            return Val(None, None, val, v.param, v.ptrans, v.pchain, v.pcast)
        src_dtype = L.param_val[v.param].dtype
        if not v.pchain and v.pcast is None and narrows(src_dtype, val.dtype) and \
                _only_dtype(node):
            # a narrowing cast of the weight (precision='bf16'): cast the stored shard and
            # send it narrow, rather than gather fp32 and cast after
            return Val(None, None, val, v.param, v.ptrans, v.pchain, pcast=val.dtype)
        if node.kwargs and node.target is aten._to_copy.default:
            return materialise_then(L, node)
        return Val(None, None, val, v.param, v.ptrans, v.pchain + ((node.target, extra),))
    return apply_strategy(L, node, pointwise_strategy)


@strategy("pointwise", aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
               aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.gelu.default,
               aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
               aten.clone.default, aten.alias.default, aten.contiguous.default, aten._to_copy.default,
               aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.detach.default,
               aten.type_as.default, aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.bitwise_and.Tensor,
               aten.bitwise_or.Tensor, aten.__and__.Tensor, aten.__or__.Tensor, aten.eq.Tensor,
               aten.eq.Scalar, aten.ne.Scalar, aten.ne.Tensor, aten.le.Tensor, aten.lt.Tensor,
               aten.ge.Tensor, aten.gt.Tensor, aten.le.Scalar, aten.lt.Scalar, aten.ge.Scalar,
               aten.gt.Scalar, aten.logical_not.default, aten.bitwise_not.default, aten.neg.default,
               aten.exp.default, aten.log.default, aten.sqrt.default, aten.abs.default,
               aten.reciprocal.default, aten.clamp.default, aten.erf.default, aten.sin.default,
               aten.cos.default, aten.maximum.default, aten.minimum.default, aten.add.Scalar,
               aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.pow.Tensor_Tensor,
               aten.view_as.default, aten.softplus.default, aten.log1p.default, aten.expm1.default,
               aten.polar.default, aten.complex.default)
def pointwise_strategy(node: fx.Node, vals: Mapping[fx.Node, Any], mesh: Mesh) -> Strategy:
    val = node.meta["val"]
    ins = tensor_vals(vals)
    args = [vals[a] if isinstance(a, fx.Node) else a for a in node.args]
    if node.target is aten.type_as.default:
        # x.type_as(other) reads other's dtype alone, whatever its shape (DeBERTa-v2 casts a
        # 0-d scalar by a matrix): other neither broadcasts nor moves
        ins = [(a, v) for a, v in ins if a is node.args[0]]
        args = args[:1]
    out, needs = pointwise_layouts(node.target, [v for _, v in ins], list(val.shape), args, val.dtype)
    return Strategy({a: n for (a, _), n in zip(ins, needs) if n is not None}, out)
