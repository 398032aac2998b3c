"""The rule table, the helpers every family shares, and the replicated fallback."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from shardc.core.context import FALLBACK
from shardc.core.ir import Fallback, Val
from shardc.core.mesh import Mesh
from shardc.core.placement import Layout
from shardc.passes.branch_checks import CHECKED_NUMBER, KEEP_CHECK
from shardc.runtime.ops import as_strided_on_traced_storage, check_branch

if TYPE_CHECKING:  # the lowering calls the rules; they only name its type
    from shardc.passes.lower import Lowering


aten = torch.ops.aten
Rule = Callable[["Lowering", fx.Node], Any]


def existing_ops(*names: str) -> tuple:
    """The ATen overloads ``"op.overload"`` this torch has (the project accepts a range
    of torch versions; an op or overload newer than the one installed is left out)."""
    found = []
    for name in names:
        op, overload = name.split(".")
        packet = getattr(aten, op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return tuple(found)
RULES: dict[Any, Rule] = {}


def register_rule(*ops: Any) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn
    return deco


# ------------------------------------------------------------------------ helpers
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


def emit_outputs(L: Lowering, node: fx.Node, xn: fx.Node, out: Layout) -> list[Val]:
    """Emit an op of several outputs (values and indices) on its first input, already
    laid out (``xn``); every output laid out as ``out``."""
    vals = node.meta["val"]
    n = L.emit(node.target, (xn, *node.args[1:]), dict(node.kwargs), layout=None, val=vals)
    return [Val(L.emit(operator.getitem, (n, i), layout=out, val=v), out.clean(L.mesh), v)
            for i, v in enumerate(vals)]


@dataclass
class Strategy:
    """What a rule decides, before anything is emitted: the layout each tensor input must
    arrive in (the lowering inserts the collectives or local slices that get it there)
    and the layout of the output. A strategy function computes it from the node's static
    arguments and its inputs' layouts and shapes alone, so it can be tested one by one
    without compiling or running anything."""

    needs: dict[fx.Node, Layout]
    out: Layout


# node of the global graph, the value of each of its input nodes (a Val for a tensor), the
# mesh -> Strategy
Decide = Callable[[fx.Node, Mapping[fx.Node, Any], Mesh], Strategy]
STRATEGIES: dict[Any, Decide] = {}


def strategy(*ops: Any) -> Callable[[Decide], Decide]:
    """Record ``fn`` as the pure layout decision of ``ops`` (its rule applies it)."""
    def deco(fn: Decide) -> Decide:
        for op in ops:
            STRATEGIES[op] = fn
        return fn
    return deco


def input_vals(L: Lowering, node: fx.Node) -> dict[fx.Node, Any]:
    return {a: L.env[a] for a in node.all_input_nodes}


def tensor_vals(vals: Mapping[fx.Node, Any]) -> list[tuple[fx.Node, Val]]:
    return [(a, v) for a, v in vals.items() if isinstance(v, Val)]


def apply_strategy(L: Lowering, node: fx.Node, decide: Decide) -> Val:
    """The one lowering step of a strategy rule: decide, redistribute, emit the local op."""
    s = decide(node, input_vals(L, node), L.mesh)
    return emit_like(L, node, s.needs, s.out)


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
    val = node.meta.get("val")
    if gathered or isinstance(val, (torch.Tensor, list, tuple)):
        # a number made from numbers or from whole tensors (the size of a nonzero's
        # result, ``n >= 0`` on it: what draft_export leaves of a branch on values) costs
        # every rank the same scalar work it costs one device: nothing to report
        L.fallbacks.append(fb)
    repl = {a: L.to_layout(L.env[a], lay) for a, lay in need.items()}
    args, kwargs = local_args(L, node, repl)
    target = node.target
    if target is aten.as_strided.default:
        # as_strided reads its input's storage, not its elements: the trace recorded
        # strides for the input as the model laid it out (Longformer's chunking: a view
        # whose storage is ordered (seq, batch*heads, head_dim)), which a gathered or
        # otherwise re-laid-out input does not have. Rebuild that storage first.

        base = node.args[0].meta["val"]
        size, stride = args[1], args[2]
        offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
        target = as_strided_on_traced_storage
        args = (args[0], list(base.shape), list(base.stride()), base.storage_offset(), size,
                stride, offset)
        kwargs = {}
    if isinstance(val, (list, tuple)):
        n = L.emit(target, args, kwargs, layout=None, val=val)
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
    n = L.emit(target, args, kwargs, layout=lay, val=val)
    n.meta[FALLBACK] = fb
    if lay is None:
        # a number known only when the step runs (``x.any().item()`` feeding a check that
        # draft_export put on a branch) is the node's result; any other number is the
        # value the trace saw, the same at every step
        return n if _unbacked(val) or node.meta.get(CHECKED_NUMBER) else val
    return Val(n, lay, val)


def _unbacked(v: Any) -> bool:

    if not isinstance(v, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        return False
    try:
        return bool(free_unbacked_symbols(v))
    except Exception:  # noqa: BLE001 - a value it cannot walk is not one of these
        return False


@register_rule(operator.getitem)
def getitem_rule(L: Lowering, node: fx.Node) -> Any:
    src = L.env[node.args[0]]
    if isinstance(src, (list, tuple)):
        return src[node.args[1]]
    return fallback_rule(L, node)


@register_rule(aten._assert_tensor_metadata.default, aten._assert_scalar.default,
               aten.sym_constrain_range_for_size.default)
def drop_rule(L: Lowering, node: fx.Node) -> Any:
    """The trace's checks are dropped (the model's own asserts on values: XLM's
    ``lengths.max().item() <= slen`` would gather the lengths each step for nothing),
    except those guarding a branch draft_export fixed (passes/trace.py): without them a
    batch that takes the other branch would be computed on the wrong one."""

    where = node.meta.get(KEEP_CHECK)
    if where and node.target is aten._assert_scalar.default:
        cond = local_args(L, node, {})[0][0]
        if isinstance(cond, fx.Node):
            expression = str(node.args[1]).removeprefix("Runtime assertion failed for expression ")
            L.emit(check_branch, (cond, expression.split(" on node ")[0], where), {},
                   layout=None, val=None)
    return None


def materialise_then(L: Lowering, node: fx.Node) -> Any:
    ins_nodes = tensor_inputs(L, node)
    need = {a: Layout.replicate(v.ndim) for a, v in ins_nodes}
    return emit_like(L, node, need, Layout.replicate(node.meta["val"].dim()))
