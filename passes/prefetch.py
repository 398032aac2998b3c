"""Issue weight all-gathers ahead of the GEMMs that need them.

Reads:  the program's all_gather_start nodes whose input is a parameter (placeholder)
Writes: nothing new; moves those start nodes earlier in the graph
Keeps:  the relative order of all collectives on one axis (every rank issues them in
        the same order: the same graph); each wait stays where it was

Why: a weight's all-gather does not depend on any activation (Algorithm 1, line 2), so
it can be in flight while the previous layer computes (the paper's OAG). The order is the
graph's topological order, which is the order the GEMMs really run in, not the order the
modules were registered in. With ``prefetch_depth = d``, the gather of the i-th weight is
issued just before the program waits for the (i-d)-th one, so d gathers are in flight
while a layer computes, and the gathers keep their order.
"""
from __future__ import annotations

import torch.fx as fx

from shardc.core.context import CompileContext
from shardc.runtime import collectives as C


def prefetch_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    depth = ctx.options.prefetch_depth if ctx.options.overlap else 0
    if depth <= 0:
        return gm
    starts = [n for n in gm.graph.nodes
              if n.target is C.all_gather_start and n.args[0].op == "placeholder"]
    moved = 0
    for i in range(1, len(starts)):
        # the first d gathers go out together, before the program waits for the first
        waits = [u for u in starts[max(i - depth, 0)].users if u.target is C.wait]
        if not waits:
            continue
        # Every rank moves the same nodes the same way, so every rank still issues the
        # same collectives in the same order.
        waits[0].prepend(starts[i])
        moved += 1
    if moved:
        gm.graph.lint()
        gm.recompile()
    return gm
