"""Decide every collective of the backward pass from the forward placements.

Reads:  meta[PLACEMENT] of every node, which parameters require grad
Writes: the ``grad`` mode of each all-gather ("reduce_scatter" or "slice");
        grad_all_reduce nodes (identity forward, all-reduce of the gradient backward);
        meta[REQUIRES_GRAD] on every node; the axes over which each parameter's gradient
        must be summed after backward (returned)
Keeps:  forward placements and values unchanged

Why: a tensor replicated on an axis whose ranks then compute different things (other
tokens, other output columns) receives only a partial gradient on each rank. Where that
partial gradient must be summed decides the communication: summing it at a weight's
all-gather makes that all-gather's backward a reduce-scatter (Algorithm 1, line 14);
at an activation feeding a GEMM it is the all-reduce of dI (line 12); at a parameter it is
the data-parallel reduction. The analysis walks the graph backwards once per axis and
puts each sum as late (as close to the source) as it can while contributions that are
already whole are never summed twice.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from shardc.core.context import (
    COMM,
    GLOBAL_VAL,
    KIND,
    PARAM,
    PLACEMENT,
    PROGRAM,
    REQUIRES_GRAD,
    CompileContext,
)
from shardc.core.mesh import CUT_AXES
from shardc.core.placement import Layout, Replicate
from shardc.runtime import collectives as C
from shardc.runtime import ops as R

aten = torch.ops.aten
# local ops whose output never carries a gradient: the constants made like a tensor read
# only its shape, dtype and device (a sum placed on one would be reported, and dropped
# as dead by the step program's trace)
_NO_GRAD = {R.row_max, R.valid_count, aten.new_zeros.default, aten.new_ones.default,
            aten.new_full.default, aten.new_empty.default, aten.zeros_like.default,
            aten.ones_like.default, aten.full_like.default, aten.empty_like.default}


def _floating(v: object) -> bool:
    if isinstance(v, torch.Tensor):
        return v.dtype.is_floating_point or v.dtype.is_complex
    if isinstance(v, (list, tuple)):
        return any(_floating(x) for x in v)
    return False


def requires_grad(gm: fx.GraphModule, trainable: set[str], grad_inputs: frozenset[str] = frozenset()
                  ) -> None:
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta[REQUIRES_GRAD] = ((n.meta.get(KIND) == "param" and n.meta.get(PARAM) in trainable)
                                     or (n.meta.get(KIND) == "input" and n.target in grad_inputs))
        elif n.op == "call_function":
            val = n.meta.get(GLOBAL_VAL)
            floating = _floating(val) if val is not None else True
            if n.target is C.all_gather_start or n.target is C.wait:
                floating = True
            n.meta[REQUIRES_GRAD] = (floating and n.target not in _NO_GRAD and
                                     any(a.meta.get(REQUIRES_GRAD) for a in n.all_input_nodes))
        else:
            n.meta[REQUIRES_GRAD] = False


def _is_replicated(n: fx.Node, axis: str) -> bool:
    lay = n.meta.get(PLACEMENT)
    if isinstance(lay, Layout):
        return isinstance(lay.placement(axis), Replicate)
    if n.op == "call_function":  # a tuple: look at its elements
        users = [u for u in n.users if isinstance(u.meta.get(PLACEMENT), Layout)]
        return bool(users) and all(_is_replicated(u, axis) for u in users)
    return False


def grad_sync_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    requires_grad(gm, set(ctx.trainable), ctx.grad_inputs)
    reduce_params: dict[str, list[str]] = {}
    for axis in CUT_AXES:
        if ctx.mesh.size(axis) == 1:
            continue
        kind: dict[fx.Node, str] = {}
        origin: dict[fx.Node, fx.Node] = {}  # the use whose ranks diverge, for the report
        for n in reversed(list(gm.graph.nodes)):
            if n.op == "output" or not n.meta.get(REQUIRES_GRAD) or not _is_replicated(n, axis):
                continue
            contrib: list[tuple[fx.Node, str]] = []
            for u in list(n.users):
                if u.op == "output":
                    contrib.append((u, "R"))
                elif not u.meta.get(REQUIRES_GRAD):
                    continue
                elif not _is_replicated(u, axis):
                    contrib.append((u, "P"))
                    origin.setdefault(n, u)
                elif u in kind:
                    contrib.append((u, kind[u]))
                    if kind[u] == "P" and u in origin:
                        origin.setdefault(n, origin[u])
            kinds = {k for _, k in contrib}
            if not kinds:
                continue
            if kinds == {"R"}:
                kind[n] = "R"
                continue
            if not isinstance(n.meta.get(PLACEMENT), Layout) and n.op == "call_function" and (
                    kinds == {"R", "P"} or not _flows_up(n, axis)):
                # a tuple (an LSTM's gates chunked): the sum cannot wrap it, so each part
                # whose gradient is partial is summed where it leaves (``getitem``)
                for m in [u for u, k in contrib if k == "P"]:
                    _sum_here(gm, m, ctx, axis, origin.get(m))
                kind[n] = "R"
                continue
            if kinds == {"R", "P"}:
                # One all-reduce serves every partial use: autograd sums their gradients
                # into it first. The whole ones bypass it, or they would be counted G times.
                partial_users = [u for u, k in contrib if k == "P"]
                f = _insert_grad_all_reduce(gm, n, ctx, axis, before=partial_users[0])
                for u in partial_users:
                    u.replace_input_with(n, f)
                kind[n] = "R"
                continue
            # every contribution is partial: sum it at the source if the source can
            if n.target is C.all_gather_start and n.args[2] == axis:
                n.update_arg(3, "reduce_scatter")
                if n.args[0].op == "placeholder" and n.args[0].meta.get(KIND) == "param":
                    # a weight's gradient: no_sync may hold it (by this name) until the
                    # synced backward; an activation's is needed upstream right away
                    n.kwargs = {**n.kwargs, "key": n.name}
                kind[n] = "P"
            elif n.op == "placeholder" and n.meta.get(KIND) == "param":
                reduce_params.setdefault(n.meta[PARAM], []).append(axis)
                kind[n] = "P"
            elif n.target is C.wait and n.args[0].target is C.all_reduce_start \
                    and n.args[0].args[2] == axis:
                # the output of an all-reduce over this axis, used where its ranks diverge:
                # sum the gradient right here (Algorithm 1's all-reduce of dI)
                users = list(n.users)
                f = _insert_grad_all_reduce(gm, n, ctx, axis, before=origin.get(n, users[0]))
                for u in users:
                    u.replace_input_with(n, f)
                kind[n] = "R"
            elif _flows_up(n, axis):
                # one differentiable input: let the partial flow up to it, so that a sum at
                # a weight's all-gather or a parameter can absorb it. With several inputs
                # (q, k, v into attention; x and the weight into a norm) the sum is cheaper
                # here, once, than on each of them.
                kind[n] = "P"
            else:
                _sum_here(gm, n, ctx, axis, origin.get(n))
                kind[n] = "R"
    gm.meta[PROGRAM].reduce_params = reduce_params
    gm.graph.lint()
    gm.recompile()
    return gm


def _flows_up(n: fx.Node, axis: str) -> bool:
    return n.op == "call_function" and len(_grad_inputs(n)) == 1 and \
        _is_replicated(_grad_inputs(n)[0], axis)


def _sum_here(gm: fx.GraphModule, n: fx.Node, ctx: CompileContext, axis: str,
              before: fx.Node | None) -> None:
    """Sum the gradient of ``n`` over ``axis`` where it leaves ``n``: every use reads it
    through one ``grad_all_reduce``."""
    users = list(n.users)
    f = _insert_grad_all_reduce(gm, n, ctx, axis, before=before)
    for u in users:
        u.replace_input_with(n, f)


def _grad_inputs(n: fx.Node) -> list[fx.Node]:
    return [a for a in n.all_input_nodes if a.meta.get(REQUIRES_GRAD)]


def _insert_grad_all_reduce(gm: fx.GraphModule, n: fx.Node, ctx: CompileContext, axis: str,
                            before: fx.Node | None) -> fx.Node:
    with gm.graph.inserting_after(n):
        f = gm.graph.call_function(C.grad_all_reduce, (n, ctx.rt, axis))
    f.meta.update({PLACEMENT: n.meta.get(PLACEMENT), GLOBAL_VAL: n.meta.get(GLOBAL_VAL),
                   KIND: "grad_collective", REQUIRES_GRAD: True,
                   COMM: {"collective": "all_reduce", "axis": axis},
                   "shardc_source": n.meta.get("shardc_source")})
    if before is not None and before.meta.get("shardc_source") is not None:
        f.meta["shardc_source"] = before.meta["shardc_source"]
    return f
