"""Sharding rules, one per ATen op: the table the lowering pass looks ops up in.

A rule receives the lowering state and one node of the global graph. It reads the
placements its inputs already have, decides the placements it needs (the lowering
inserts the collectives that get them there) and the placement of its output, and emits
the local op. Ops without a rule fall back to ``fallback_rule``: inputs gathered, run
replicated, recorded so ``explain`` and the comm report name the op and its source line.

Tags: an ATen op tagged ``torch.Tag.pointwise`` uses the pointwise rule unless the table
names it.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from shardc.context import FALLBACK
from shardc.errors import ShardcError
from shardc.mesh import BATCH_AXES
from shardc.placement import PARTIAL_OPS, Layout
from shardc.runtime import ops as R
from shardc.passes.lower import Fallback, Lowering, Val

aten = torch.ops.aten
Rule = Callable[[Lowering, fx.Node], Any]
RULES: dict[Any, Rule] = {}


def register_rule(*ops: Any) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn
    return deco


# ------------------------------------------------------------------------ helpers
def is_val(a: Any) -> bool:
    return isinstance(a, Val)


def local_args(L: Lowering, node: fx.Node, repl: dict[fx.Node, fx.Node]) -> tuple[tuple, dict]:
    """The node's args with old nodes replaced by their new nodes."""
    def sub(n: fx.Node) -> Any:
        if n in repl:
            return repl[n]
        v = L.env[n]
        if isinstance(v, Val):
            assert v.node is not None, f"unmaterialised parameter used by {node.format_node()}"
            return v.node
        return v
    args = fx.node.map_arg(node.args, sub)
    kwargs = fx.node.map_arg(node.kwargs, sub)
    return args, kwargs


def tensor_inputs(L: Lowering, node: fx.Node) -> list[tuple[fx.Node, Val]]:
    out = []
    seen = set()
    for a in node.all_input_nodes:
        v = L.env.get(a)
        if isinstance(v, Val) and a not in seen:
            seen.add(a)
            out.append((a, v))
    return out


def drop_dims(lay: Layout, keep: list[int | None], ndim: int) -> Layout:
    """Map a layout through a dim map (old dim -> new dim or None); unmapped shards must
    have been gathered already."""
    dims: list[tuple[str, ...]] = [() for _ in range(ndim)]
    il = [1] * ndim
    for d, axes in enumerate(lay.dims):
        if not axes:
            continue
        nd = keep[d]
        assert nd is not None, (lay, keep)
        dims[nd] = axes
        il[nd] = lay.interleave[d]
    return Layout(ndim, tuple(dims), lay.partial, tuple(il))


def replicate_dims(lay: Layout, dims: list[int]) -> Layout:
    for d in dims:
        for a in lay.dims[d % lay.ndim] if lay.ndim else ():
            lay = lay.with_replicated(a)
    return lay


def no_partial(lay: Layout) -> Layout:
    for a, _ in lay.partial:
        lay = lay.with_replicated(a)
    return lay


def emit_like(L: Lowering, node: fx.Node, need: dict[fx.Node, Layout], out: Layout,
              args_fix: Callable[[tuple], tuple] | None = None, target: Any = None) -> Val:
    """Bring each input to its needed layout, emit the node's op on the local tensors."""
    repl = {a: L.to_layout(L.env[a], lay) for a, lay in need.items()}
    args, kwargs = local_args(L, node, repl)
    if args_fix is not None:
        args = args_fix(args)
    n = L.emit(target or node.target, args, kwargs, layout=out, val=node.meta.get("val"))
    return Val(n, out.clean(L.mesh), node.meta.get("val"))


def as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


# ---------------------------------------------------------------------- fallback
def fallback_rule(L: Lowering, node: fx.Node) -> Any:
    """No rule: gather every input, run the op on whole tensors, output replicated."""
    need = {}
    gathered = []
    for a, v in tensor_inputs(L, node):
        rep = Layout.replicate(v.ndim)
        if v.layout is not None and v.layout.clean(L.mesh) != rep:
            gathered.append(f"{a.name} {v.layout}")
        need[a] = rep
    fb = Fallback(str(node.target), L.src.module, L.src.line, gathered)
    L.fallbacks.append(fb)
    val = node.meta.get("val")
    repl = {a: L.to_layout(L.env[a], lay) for a, lay in need.items()}
    args, kwargs = local_args(L, node, repl)
    if isinstance(val, (list, tuple)):
        n = L.emit(node.target, args, kwargs, layout=None, val=val)
        n.meta[FALLBACK] = fb
        outs = []
        for i, v in enumerate(val):
            if isinstance(v, torch.Tensor):
                lay = Layout.replicate(v.dim())
                outs.append(Val(L.emit(operator.getitem, (n, i), layout=lay, val=v), lay, v))
            else:
                outs.append(v)
        return outs
    lay = Layout.replicate(val.dim()) if isinstance(val, torch.Tensor) else None
    n = L.emit(node.target, args, kwargs, layout=lay, val=val)
    n.meta[FALLBACK] = fb
    if lay is None:
        return val
    return Val(n, lay, val)


@register_rule(operator.getitem)
def getitem_rule(L: Lowering, node: fx.Node) -> Any:
    src = L.env[node.args[0]]
    if isinstance(src, (list, tuple)):
        return src[node.args[1]]
    return fallback_rule(L, node)


@register_rule(aten._assert_tensor_metadata.default, aten._assert_scalar.default,
               aten.sym_constrain_range_for_size.default)
def drop_rule(L: Lowering, node: fx.Node) -> Any:
    return None


# --------------------------------------------------------------------- factories
@register_rule(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
               aten.zeros.default, aten.ones.default, aten.empty.memory_format,
               aten.scalar_tensor.default, aten.new_ones.default, aten.new_zeros.default,
               aten.new_full.default, aten.new_empty.default, aten.lift_fresh_copy.default,
               aten.tril.default, aten.triu.default)
def factory_rule(L: Lowering, node: fx.Node) -> Any:
    """Tensors made from constants: every rank computes the whole (global) tensor; a
    consumer that needs a shard cuts it locally."""
    val = node.meta["val"]
    need = {a: Layout.replicate(v.ndim) for a, v in tensor_inputs(L, node)}
    return emit_like(L, node, need, Layout.replicate(val.dim()))


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


def _partial_ok(target: Any, args: list[Any], axis: str, out_dtype: Any = None) -> bool:
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


def pointwise_layouts(L: Lowering, target: Any, ins: list[Val | None], out_shape: list[int],
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
        if _partial_ok(target, args, a, out_dtype) and out.placement(a).__class__.__name__ == "Replicate":
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
               aten.view_as.default, aten.softplus.default, aten.log1p.default, aten.expm1.default)
def pointwise_rule(L: Lowering, node: fx.Node) -> Any:
    val = node.meta["val"]
    if not isinstance(val, torch.Tensor):  # several outputs (frexp): no layout rule for that
        return fallback_rule(L, node)
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
            return Val(None, None, val, v.param, v.ptrans, v.pchain)
        if node.kwargs and node.target is aten._to_copy.default:
            return _materialise_then(L, node)
        return Val(None, None, val, v.param, v.ptrans, v.pchain + ((node.target, extra),))
    args = [L.env[a] if isinstance(a, fx.Node) else a for a in node.args]
    out, needs = pointwise_layouts(L, node.target, ins, list(val.shape), args, val.dtype)
    need = {a: n for (a, _), n in zip(ins_nodes, needs)}
    return emit_like(L, node, need, out)


def _materialise_then(L: Lowering, node: fx.Node) -> Any:
    ins_nodes = tensor_inputs(L, node)
    need = {a: Layout.replicate(v.ndim) for a, v in ins_nodes}
    return emit_like(L, node, need, Layout.replicate(node.meta["val"].dim()))


@register_rule(aten.dropout.default, aten.native_dropout.default)
def dropout_rule(L: Lowering, node: fx.Node) -> Any:
    x = L.env[node.args[0]]
    p = float(node.args[1])
    train = bool(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else True
    lay = x.layout if x.layout is not None else Layout.replicate(x.ndim)
    lay = Layout(lay.ndim, lay.dims, tuple(q for q in lay.partial if q[1] != "max"), lay.interleave).clean(L.mesh)
    xn = L.to_layout(x, lay)
    gval = x.val
    n = L.emit(R.global_dropout, (xn, p, train, list(gval.shape), L.rt, lay.dims, lay.interleave),
               layout=lay, val=gval)
    out = Val(n, lay, gval)
    if node.target is aten.native_dropout.default:
        mask_val = node.meta["val"][1]
        # the mask is rarely used (only by a hand-written backward); give it whole
        m = L.emit(aten.ones_like.default, (n,), {"dtype": torch.bool}, layout=lay, val=mask_val)
        return [out, Val(m, lay, mask_val)]
    return out


# ---------------------------------------------------------------- shape-changing
def _view_groups(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims of equal product: [( [in dims], [out dims] ), ...]."""
    groups = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        if i < len(src):
            gi.append(i); pi *= src[i]; i += 1
        if j < len(dst):
            gj.append(j); pj *= dst[j]; j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i); pi *= src[i]; i += 1
            elif j < len(dst):
                gj.append(j); pj *= dst[j]; j += 1
            else:
                break
        # absorb trailing size-1 dims into this group
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            gi.append(i); i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            gj.append(j); j += 1
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
        ok = len(sharded) == 1 and g_in and g_in[0] == d and g_out
        target = None
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
        return _materialise_then(L, node)
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
    val = node.meta["val"]
    nd = x.ndim
    if node.target is aten.t.default:
        perm = list(range(nd))[::-1]
    elif node.target is aten.transpose.int:
        a, b = node.args[1] % max(nd, 1), node.args[2] % max(nd, 1)
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
    else:
        perm = [d % nd for d in node.args[1]]
    if x.layout is None:
        if nd == 2 and perm == [1, 0]:
            return Val(None, None, val, x.param, not x.ptrans, x.pchain)
        return _materialise_then(L, node)
    keep: list[int | None] = [None] * nd
    for new, old in enumerate(perm):
        keep[old] = new
    out = drop_dims(x.layout, keep, nd)
    return emit_like(L, node, {node.args[0]: x.layout}, out)


@register_rule(aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.cumsum.default,
               aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
               aten._log_softmax.default, aten.flip.default, aten.roll.default)
def along_dim_rule(L: Lowering, node: fx.Node) -> Any:
    """Ops that work along one dim: that dim must be whole, the others keep their shards."""
    x = L.env[node.args[0]]
    if x.layout is None:
        return _materialise_then(L, node)
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
    return emit_like(L, node, {node.args[0]: need}, out)


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
    lay = no_partial(x.layout) if any(p[1] == "max" for p in x.layout.partial) else x.layout
    sizes = [v.shape[dim] for v in vals]
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
    tensors = [L.env[t] for t in node.args[0]]
    val = node.meta["val"]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim %= val.dim()
    first = next((t for t in tensors if t.layout is not None), None)
    base = no_partial(first.layout) if first is not None else Layout.replicate(tensors[0].ndim)
    if node.target is aten.cat.default:
        base = replicate_dims(base, [dim])
        out = base
    else:
        keep = [d if d < dim else d + 1 for d in range(base.ndim)]
        out = drop_dims(base, keep, val.dim())
    need = {}
    for t_node, t in zip(node.args[0], tensors):
        lay = base
        for d in range(t.ndim):
            if t.shape[d] != first.shape[d] if first is not None else False:
                lay = replicate_dims(lay, [d])
        need[t_node] = lay
    return emit_like(L, node, need, out)


@register_rule(aten.constant_pad_nd.default, aten.pad.default)
def pad_rule(L: Lowering, node: fx.Node) -> Any:
    x = L.env[node.args[0]]
    pads = node.args[1]
    dims = [x.ndim - 1 - i for i in range(len(pads) // 2)]
    need = no_partial(replicate_dims(x.layout, dims)) if x.layout is not None else Layout.replicate(x.ndim)
    return emit_like(L, node, {node.args[0]: need}, need)


# -------------------------------------------------------------------- reductions
@register_rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default,
               aten.amax.default, aten.amin.default)
def reduce_rule(L: Lowering, node: fx.Node) -> Any:
    x = L.env[node.args[0]]
    val = node.meta["val"]
    if x.layout is None:
        return _materialise_then(L, node)
    if node.target in (aten.sum.default, aten.mean.default):
        dims, keepdim = list(range(x.ndim)), False
    else:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        dims = list(range(x.ndim)) if dims is None or dims == [] else [d % x.ndim for d in as_list(dims)]
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    is_max = node.target in (aten.amax.default, aten.amin.default)
    need = x.layout
    if is_max:
        need = no_partial(replicate_dims(need, dims))
    elif any(p[1] == "max" for p in need.partial):
        need = no_partial(need)
    mean = node.target in (aten.mean.dim, aten.mean.default)
    # a sum over shards is a partial sum, a mean over equal shards the mean of their
    # means; a partial input stays partial (the mean of a partial sum is a partial sum)
    out_partial: dict[str, str] = dict(need.partial)
    for d in dims:
        for a in need.dims[d]:
            out_partial[a] = "avg" if mean else "sum"
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
    return emit_like(L, node, {node.args[0]: need}, out)


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
    for size, what, axis, g, mult in ((K, "in_features (k)", k_axis, gk, 1),
                                      (N, "out_features (n)", n_axis, gn, il)):
        if g > 1 and size % (g * mult):
            fix = -(-size // (g * mult)) * g * mult
            raise ShardcError(
                f"shardc.compile: {w.param!r} ({node.target} in {L.src.module or '?'} at "
                f"{L.src.line or '?'}) has {what}={size}, which mesh axis {axis!r} (size {g})"
                + (f" in {mult} interleaved groups" if mult > 1 else "")
                + f" does not evenly divide. {L.mesh}. Pad {what.split()[0]} to {fix} or change "
                f"the size of {axis!r}.")
    shard_k = gk > 1
    shard_n = gn > 1
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
        + (f" (columns interleaved in {il} groups)" if il > 1 else ""))
    gval = node.meta["val"]
    target = aten.mm.default if t is aten.addmm.default else t
    mm = L.emit(target, (xn, wn), layout=out, val=gval)
    mm.meta["shardc_gemm"] = {"m": int(math.prod(x.shape[:-1])), "k": K, "n": N,
                              "transposed": transposed, "param": w.param}
    res = Val(mm, out.clean(mesh), gval)
    if bias_node is None:
        return res
    b = L.env[bias_node]
    out2, needs = pointwise_layouts(L, aten.add.Tensor, [res, b], list(gval.shape))
    a = L.to_layout(res, needs[0])
    bn = L.to_layout(b, needs[1])
    n = L.emit(aten.add.Tensor, (a, bn), layout=out2, val=gval)
    return Val(n, out2.clean(mesh), gval)


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


# ------------------------------------------------------------------- embeddings
@register_rule(aten.embedding.default)
def embedding_rule(L: Lowering, node: fx.Node) -> Any:
    w, ids = L.env[node.args[0]], L.env[node.args[1]]
    val = node.meta["val"]
    mesh = L.mesh
    V, D = w.shape
    if w.layout is None:
        # Vocabulary over x and features over y: the embedding is the transposed GEMM
        # (one-hot @ table), so the hidden state comes out cut over y like Algorithm 1's
        # input, and a tied LM head (the normal GEMM) wants this very layout.
        wl = Layout(2)
        if mesh.size("x") > 1 and V % mesh.size("x") == 0:
            wl = wl.with_shard("x", 0)
        if mesh.size("y") > 1 and D % mesh.size("y") == 0:
            wl = wl.with_shard("y", 1)
    else:
        wl = no_partial(w.layout.clean(mesh))
        if len(wl.dims[0]) > 1:
            wl = replicate_dims(wl, [0])
    vocab_axes = wl.dims[0]
    il = ids.layout.clean(mesh) if ids.layout is not None else Layout.replicate(ids.ndim)
    for a in wl.sharded_axes():
        il = il.with_replicated(a)
    il = no_partial(il)
    out = Layout(val.dim(), il.dims + (wl.dims[1],), (), il.interleave + (wl.interleave[1],))
    wn = L.to_layout(w, wl)
    idn = L.to_layout(ids, il)
    if vocab_axes:
        axis = vocab_axes[0]
        out = out.with_partial(axis, "sum")
        padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
        n = L.emit(R.vocab_parallel_embedding, (wn, idn, L.rt, axis, padding_idx), layout=out, val=val)
    else:
        args, kwargs = local_args(L, node, {node.args[0]: wn, node.args[1]: idn})
        n = L.emit(aten.embedding.default, args, kwargs, layout=out, val=val)
    return Val(n, out.clean(mesh), val)


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


# -------------------------------------------------------------------- attention
@register_rule(aten.scaled_dot_product_attention.default)
def sdpa_rule(L: Lowering, node: fx.Node) -> Any:
    q, k, v = (L.env[a] for a in node.args[:3])
    dropout_p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    if dropout_p:
        return fallback_rule(L, node)
    ql = no_partial(q.layout.clean(L.mesh))
    ql = replicate_dims(ql, [2, 3])
    head = ql.dims[1]
    if head and k.shape[1] != q.shape[1]:
        f = math.prod(L.mesh.size(a) for a in head)
        if k.shape[1] % f:
            ql = replicate_dims(ql, [1])
    kl = Layout(4, ql.dims[:2] + ((), ()), (), ql.interleave[:2] + (1, 1))
    need = {node.args[0]: ql, node.args[1]: kl, node.args[2]: kl}
    mask_node = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask_node, fx.Node):
        m = L.env[mask_node]
        off = 4 - m.ndim
        dims = []
        for d in range(m.ndim):
            od = d + off
            dims.append(ql.dims[od] if od < 2 and m.shape[d] == q.shape[od] else ())
        need[mask_node] = Layout(m.ndim, tuple(dims))
    out = Layout(4, ql.dims[:2] + ((), ()), (), ql.interleave[:2] + (1, 1))
    return emit_like(L, node, need, out)


# ------------------------------------------------------------------------- losses
@register_rule(aten.cross_entropy_loss.default)
def cross_entropy_rule(L: Lowering, node: fx.Node) -> Any:
    x, tgt = L.env[node.args[0]], L.env[node.args[1]]
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
    smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
    val = node.meta["val"]
    mesh = L.mesh
    if weight is not None or smoothing or x.ndim != 2 or tgt.ndim != 1:
        return fallback_rule(L, node)
    xl = no_partial(x.layout.clean(mesh))
    rows = xl.dims[0]
    cls = xl.dims[1]
    if len(cls) > 1 or xl.interleave[1] != 1:
        xl = replicate_dims(xl, [1])
        cls = ()
    tl = Layout(1, (rows,), (), (xl.interleave[0],))
    xn = L.to_layout(x, xl)
    tn = L.to_layout(tgt, tl)
    n_rows = x.shape[0]
    vec_val = torch.empty([n_rows], device="meta", dtype=x.val.dtype)
    vec = Layout(1, (rows,))
    if cls:
        c = cls[0]
        L.decisions.append(f"{L.src.module or node.name}: vocabulary-parallel cross-entropy over {c} "
                           f"(3 all-reduces of {n_rows} values, never the logits)")
        mx = L.emit(R.row_max, (xn,), layout=vec.with_partial(c, "max"), val=vec_val)
        mx = L._all_reduce(mx, vec.with_partial(c, "max"), c, "max", vec_val)
        se = L.emit(R.sum_exp_shifted, (xn, mx), layout=vec.with_partial(c, "sum"), val=vec_val)
        se = L._all_reduce(se, vec.with_partial(c, "sum"), c, "sum", vec_val)
        tlg = L.emit(R.target_logit, (xn, tn, L.rt, c), layout=vec.with_partial(c, "sum"), val=vec_val)
        tlg = L._all_reduce(tlg, vec.with_partial(c, "sum"), c, "sum", vec_val)
        per_row = L.emit(R.nll_from_parts, (se, mx, tlg, tn, ignore), layout=vec, val=vec_val)
        if reduction == 0:
            return Val(per_row, vec.clean(mesh), val)
        total = L.emit(aten.sum.default, (per_row,), layout=Layout(0), val=val)
    else:
        if reduction == 0:
            return emit_like(L, node, {node.args[0]: xl, node.args[1]: tl}, vec)
        total = L.emit(R.cross_entropy_sum, (xn, tn, ignore), layout=Layout(0), val=val)
    part = Layout(0)
    for a in rows:
        part = part.with_partial(a, "sum")
    total.meta[PLACEMENT_KEY] = part.clean(mesh)
    if reduction == 2:
        return Val(total, part.clean(mesh), val)
    # mean: divide by the number of counted targets over the whole batch
    cnt_val = torch.empty([], device="meta", dtype=torch.float32)
    cnt = L.emit(R.valid_count, (tn, ignore), layout=part, val=cnt_val)
    lay = part
    for a in rows:
        cnt = L._all_reduce(cnt, lay, a, "sum", cnt_val)
        lay = lay.with_replicated(a)
    shards = math.prod(mesh.size(a) for a in rows) if rows else 1
    avg = Layout(0)
    for a in rows:
        avg = avg.with_partial(a, "avg")
    n = L.emit(R.mean_over_shards, (total, cnt, shards), layout=avg, val=val)
    return Val(n, avg.clean(mesh), val)


from shardc.context import PLACEMENT as PLACEMENT_KEY  # noqa: E402
