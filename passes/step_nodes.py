"""Reading a traced step program: which nodes issue collectives, and which belong to the
forward part. Shared by the trace of the step (``joint.py``) and the step passes that
rewrite it (``reshard.py``, ``schedule.py``, ...), and by the readouts.

Not a pass: helpers over the graph ``joint.trace_joint`` makes.
"""
from __future__ import annotations

import torch.fx as fx

from shardc.runtime import functional as F

# node.meta keys
PART = "shardc_part"  # node.meta (and a part's gm.meta): "forward" or "backward"
N_OUTPUTS = "shardc_n_outputs"  # gm.meta of the unsplit step program and of the forward

RUN_FUNCTIONS = set(F.RUN_FUNCTIONS)


def collective_nodes(g: fx.Graph) -> list[fx.Node]:
    """The collective issues of a step program's graph (after tracing), in graph order."""
    return [n for n in g.nodes if n.op == "call_function" and n.target in RUN_FUNCTIONS]


def forward_nodes(g: fx.Graph, n_outputs: int, n_primals: int) -> set[fx.Node]:
    """The primals (the placeholders before the tangents) and every node a forward
    output depends on."""
    out_node = next(n for n in g.nodes if n.op == "output")
    fwd: set[fx.Node] = set([n for n in g.nodes if n.op == "placeholder"][:n_primals])
    stack = [o for o in list(out_node.args[0])[:n_outputs] if isinstance(o, fx.Node)]
    while stack:
        n = stack.pop()
        if n in fwd:
            continue
        fwd.add(n)
        stack.extend(n.all_input_nodes)
    return fwd


def is_grad_use(out: fx.Node, n: fx.Node, n_outputs: int) -> bool:
    """Whether ``n`` appears among the gradients the step program's graph returns (a gradient that
    is a forward value, e.g. of an input used once through an identity)."""
    outs = out.args[0]
    assert isinstance(outs, (tuple, list))
    return any(o is n for o in list(outs)[n_outputs:])
