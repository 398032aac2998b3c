"""Put a part of the step program in a form a compiler can take whole: every collective
an issue op and a wait op of ``runtime.ordered_ops``, chained in the program's order.

Reads:  a part of the step program (``joint.py``), after every other step pass: its
        ``run_*`` issue nodes (``step_nodes.RUN_FUNCTIONS``) and ``run_wait`` nodes
Writes: a new GraphModule (the part itself is left as it is: the reports, ``explain``
        and the eager fallback read it) in which each issue is ``shardc::issue``, its wait
        ``shardc::wait`` (or ``shardc::hand_off`` where the part returns the buffer in
        flight: a deferred output, ``defer.py``), and an empty token threads every issue
        and wait in program order
Keeps:  every collective, its bytes, its axis, its phase and its place: the issue and
        the wait sit where the schedule (``schedule.py``) put them, and the token chain
        means no compiler can reorder two of them
Refuses: a wait on a buffer the part did not issue (raises ``NotCompilable``; the
        backend then compiles the part piece by piece)

Why: inductor compiles a graph whole when nothing in it is Python it cannot trace. The
``run_*`` functions keep each collective's ``Work`` in a dict keyed by the buffer; these
ops keep it under a slot number fixed here, which is a constant of the graph.
"""
from __future__ import annotations

import itertools
import operator
from typing import cast

import torch
import torch.fx as fx

from shardc.core.context import COMM, CompileContext
from shardc.passes.step_nodes import RUN_FUNCTIONS
from shardc.runtime import functional as F
from shardc.runtime import ordered_ops as O

_slots = itertools.count()


class NotCompilable(Exception):
    """The part cannot be handed to a compiler whole; the message says why."""


def _issue_args(n: fx.Node) -> tuple:
    """(x, collective, op, group_size, out_splits, in_splits, rt, axis, ph) of a ``run_*``
    node, whose arguments are the functional collective's followed by (rt, axis, ph)."""
    t, a = n.target, n.args
    rt, axis, ph = a[-3:]
    if t is F.run_all_gather:
        return a[0], "all_gather", "sum", a[1], [], [], rt, axis, ph
    if t is F.run_reduce_scatter:
        return a[0], "reduce_scatter", a[1], a[2], [], [], rt, axis, ph
    if t is F.run_all_reduce:
        return a[0], "all_reduce", a[1], 1, [], [], rt, axis, ph
    if t in (F.run_all_to_all, F.run_restripe):
        kind = "all_to_all" if t is F.run_all_to_all else "restripe"
        return a[0], kind, "sum", 1, list(cast(list, a[1])), list(cast(list, a[2])), rt, axis, ph
    raise NotCompilable(f"no issue op for {getattr(t, '__name__', t)}")


def is_draw(n: fx.Node) -> bool:
    """Does ``n`` take numbers from a random generator? An op that is tagged as random only
    for its dropout (the attention kernels) draws nothing with ``dropout_p`` = 0."""
    t = n.target
    if not (isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags):
        return False
    for i, a in enumerate(t._schema.arguments):
        if a.name == "dropout_p":
            p = n.kwargs.get("dropout_p", n.args[i] if i < len(n.args) else a.default_value)
            return not (isinstance(p, (int, float)) and p == 0)
    return True


def _draw(g: fx.Graph, n: fx.Node, chain: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    """Replace the random op ``n`` by ``shardc::draw`` after ``chain``; the new token."""
    t = n.target
    assert isinstance(t, torch._ops.OpOverload)
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise NotCompilable(f"the random op {n.name} ({t}) returns more than a tensor")
    tensors: list[fx.Node] = []

    def mark(v: object) -> object:
        if isinstance(v, fx.Node):
            tensors.append(v)
            return O.Arg(len(tensors) - 1)
        if isinstance(v, (list, tuple)):
            return type(v)(mark(a) for a in v)
        return v

    args, kwargs = mark(tuple(n.args)), {k: mark(v) for k, v in n.kwargs.items()}
    inplace = t._schema.is_mutable
    if inplace and not (t._schema.arguments[0].alias_info is not None
                        and t._schema.arguments[0].alias_info.is_write and n.args):
        raise NotCompilable(f"the random op {n.name} ({t}) writes into an argument other than its first")
    key = next(_slots)
    O.DRAWS[key] = (t, args, kwargs, tuple(val.shape), tuple(val.stride()), val.dtype, inplace)
    with g.inserting_before(n):
        pair = g.call_function(torch.ops.shardc.draw.default, (tensors, chain, key))
        res = g.call_function(operator.getitem, (pair, 0))
        token = g.call_function(operator.getitem, (pair, 1))
    res.meta.update(n.meta)
    if inplace:
        # what reads the tensor drawn into from now on reads the new one
        target = n.args[0]
        assert isinstance(target, fx.Node)
        for u in list(target.users):
            if u is not n and order.get(u, -1) > order[n]:
                u.replace_input_with(target, res)
    n.replace_all_uses_with(res)
    g.erase_node(n)
    return token


def _waited_here(n: fx.Node) -> bool:
    """Is the issue ``n`` waited in this graph, and read nowhere else?"""
    return len(n.users) == 1 and next(iter(n.users)).target is F.WAIT


def _reduced_in_place(n: fx.Node) -> bool:
    """Is ``n`` an all-reduce of a gradient bucket that ``inplace.py`` marked (a fresh
    buffer nothing else reads), waited in this graph? Only the step's buckets: a backward
    all-reduce of a GEMM's partial sum reduced in place gave wrong gradients under
    ``precision="bf16"`` (Llama on ``x2y1z2d1``, 4 gloo ranks: ``lm_head.weight`` 3.2e-3
    from float64 against one bf16 device's 2.8e-4), where its input is the fp32 cast of the
    bf16 product; it reduces a copy, as every other all-reduce does. The cause inside
    inductor was not found; the buckets, cast the same way, train as one device."""
    return (n.target is F.run_all_reduce and bool(n.kwargs.get("inplace")) and _waited_here(n)
            and n.meta.get(COMM, {}).get("phase") == "step")


def _device(gm: fx.GraphModule) -> torch.device:
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def ordered_ops_pass(gm: fx.GraphModule, ctx: CompileContext | None = None) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(gm.graph, env)
    g.output(out)
    copy = fx.GraphModule(gm, g)
    copy.meta.update(gm.meta)
    g = copy.graph
    if not any(n.op == "call_function" and (n.target in RUN_FUNCTIONS or is_draw(n)) for n in g.nodes):
        return copy
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else next(iter(g.nodes))
    with g.inserting_after(anchor):
        chain = g.call_function(torch.ops.aten.empty.memory_format, ([0],),
                                {"dtype": torch.uint8, "device": _device(gm)})
    slot_of: dict[fx.Node, tuple[fx.Node, int, fx.Node | None]] = {}
    in_place: dict[fx.Node, tuple[fx.Node, int, fx.Node]] = {}
    order = {n: i for i, n in enumerate(g.nodes)}
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if is_draw(n):
            chain = _draw(g, n, chain, order)
        elif _reduced_in_place(n):
            # a fresh bucket nothing else reads: reduced in place, read after its wait
            x, _, op, _, _, _, rt, axis, ph = _issue_args(n)
            slot = next(_slots)
            with g.inserting_before(n):
                tok = g.call_function(torch.ops.shardc.issue_in_place.default,
                                      (x, chain, slot, op, rt, axis, ph))
            tok.meta.update({k: v for k, v in n.meta.items() if k != "val"})
            chain = tok
            in_place[n] = (tok, slot, x)
        elif n.target is F.WAIT and n.args[0] in in_place:
            tok, slot, x = in_place.pop(n.args[0])
            with g.inserting_before(n):
                chain = g.call_function(torch.ops.shardc.wait_in_place.default, (tok, x, chain, slot))
            issue = n.args[0]
            n.replace_all_uses_with(x)
            g.erase_node(n)
            g.erase_node(issue)
        elif n.target in RUN_FUNCTIONS:
            x, collective, op, size, outs, ins, rt, axis, ph = _issue_args(n)
            slot = next(_slots)
            with g.inserting_before(n):
                tok = g.call_function(torch.ops.shardc.issue.default,
                                      (x, chain, slot, collective, op, size, outs, ins, rt, axis, ph))
            tok.meta.update({k: v for k, v in n.meta.items() if k != "val"})
            chain = tok
            # an all-reduce reduces a copy it makes at the issue; the others read x until
            # their wait
            slot_of[n] = (tok, slot, None if collective == "all_reduce" else x)
        elif n.target is F.WAIT:
            src = n.args[0]
            if src not in slot_of:
                raise NotCompilable(f"{n.name} waits on {src}, which this part does not issue")
            tok, slot, keep = slot_of[src]
            val = n.meta["val"]
            with g.inserting_before(n):
                pair = g.call_function(torch.ops.shardc.wait.default,
                                       (tok, keep, chain, slot, list(val.shape), val.dtype))
                res = g.call_function(operator.getitem, (pair, 0))
                chain = g.call_function(operator.getitem, (pair, 1))
            res.meta.update(n.meta)
            n.replace_all_uses_with(res)
            g.erase_node(n)
    for n, (tok, slot, keep) in slot_of.items():
        if n.users:
            # the buffer in flight leaves the part: a deferred output's all-reduce
            val = n.meta["val"]
            with g.inserting_before(n):
                h = g.call_function(torch.ops.shardc.hand_off.default,
                                    (tok, keep, slot, list(val.shape), val.dtype))
            h.meta.update(n.meta)
            n.replace_all_uses_with(h)
        g.erase_node(n)
    g.lint()
    copy.recompile()
    return copy
