"""Return an output that waits on a collective without waiting: the wait happens when the
output is first read.

Reads:  the forward part of the step program (``joint.py``; ``gm.meta[PART]``,
        ``gm.meta[N_OUTPUTS]``): its outputs and the waits they depend on
Writes: ``gm.meta[DEFERRED]``: per deferred output, its index, the tail (a GraphModule
        of the wait and what follows it, whose placeholders are the tail's inputs) and
        how many inputs it takes; the forward returns those inputs after the saved
        values, and ``None`` in the output's place. ``runtime/step.py`` returns a
        ``PendingOutput`` there, which runs the tail on first read.
Keeps:  every collective's issue in the forward, in the same place (the groups see
        the same order); everything backward reads (a value saved for backward never
        goes into a tail); the numbers (the tail is the same ops on the same values)

Why: a mean loss over the data axis is the local loss all-reduced, and the forward
waited for it before returning, so every step stood still for one small all-reduce's
latency (a few milliseconds on gloo) between forward and backward. Nothing in the step
reads the loss's value: ``loss.backward()`` needs only its shape for the seed of ones.
Deferred, the all-reduce runs while backward computes, and the wait comes when the
training loop logs the loss, or at the end of backward at the latest.
"""
from __future__ import annotations

import torch.fx as fx

from shardc.core.context import CompileContext
from shardc.core.ir import DEFERRED, Deferred
from shardc.passes.schedule import SCHEDULE, overlaps
from shardc.passes.step_nodes import N_OUTPUTS, PART, RUN_FUNCTIONS
from shardc.runtime import functional as F


def _tail(g: fx.Graph, out: fx.Node) -> list[fx.Node]:
    """The nodes computed for ``out`` alone after a wait: ``out`` and its ancestors that
    nothing else uses (not backward, not another output) and that read a wait's result.
    Empty when ``out`` does not wait on a collective."""
    nodes = list(g.nodes)
    mine: set[fx.Node] = {out}
    for n in reversed(nodes[:nodes.index(out)]):
        if (n.op == "call_function" and n.target not in RUN_FUNCTIONS and n.users
                and all(u in mine for u in n.users)):
            mine.add(n)
    # only what comes after a wait needs deferring; the rest stays in the forward
    after: set[fx.Node] = set()
    for n in nodes:
        if n in mine and (n.target is F.WAIT or any(a in after for a in n.all_input_nodes)):
            after.add(n)
    if out not in after:
        return []
    return [n for n in nodes if n in after]


def defer_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if gm.meta.get(PART) != "forward":
        return gm
    gm.meta[DEFERRED] = []
    if not ctx.options.overlap:  # overlap=False: every wait where the trace put it
        return gm
    g = gm.graph
    n_outputs = gm.meta[N_OUTPUTS][0]
    out_node = next(n for n in g.nodes if n.op == "output")
    outs = list(out_node.args[0])
    deferred: list[Deferred] = []
    extra: list[fx.Node] = []
    for i, o in enumerate(outs[:n_outputs]):
        # an output returned twice, or also saved, is read by more than its user
        if not isinstance(o, fx.Node) or sum(x is o for x in outs) != 1 or o.op != "call_function":
            continue
        tail = _tail(g, o)
        if not tail:
            continue
        inside = set(tail)
        inputs = list(dict.fromkeys(a for n in tail for a in n.all_input_nodes if a not in inside))
        tg = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for a in inputs:
            env[a] = tg.placeholder(a.name)
            env[a].meta.update(a.meta)
        for n in tail:
            env[n] = tg.node_copy(n, lambda a: env[a])
        tg.output(env[o])
        deferred.append(Deferred(i, fx.GraphModule(gm, tg), len(inputs), o.meta["val"]))
        extra += inputs
        outs[i] = None
        out_node.args = (tuple(outs),)
        for n in reversed(tail):
            g.erase_node(n)
    if deferred:

        out_node.args = (tuple(outs) + tuple(extra),)
        g.lint()
        gm.recompile()
        if SCHEDULE in gm.meta:
            gm.meta[SCHEDULE] = overlaps(g)
    gm.meta[DEFERRED] = deferred
    return gm
