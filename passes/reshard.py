"""Reshard after forward: gather weights (and, under a selective policy inside the step
program, a block's gathered activations; under block recompute there, its weights too)
again in backward instead of keeping them.

Reads:  the unsplit step program's graph (``joint.py``, before its split into forward and
        backward; ``gm.meta[N_OUTPUTS]``), its forward weight all-gathers (an all-gather
        whose input is computed from placeholders alone: a parameter shard) and
        ``ctx.options.reshard_after_forward``; placeholders that hold a parameter carry
        ``meta[PARAM]`` (set by ``joint.py``)
Writes: for each gathered weight that backward reads, a copy of its gather (issue, wait,
        and the view/cast ops that make the weight from the buffer) placed in backward,
        with phase "backward" and ``meta[REGATHER]`` naming the forward collective it
        repeats; backward reads the copy
Keeps:  values (the same shard gathered the same way gives the same weight, bit for
        bit); forward untouched

Why: forward's gathered weight is otherwise saved for backward (dI = g·Wᵀ needs it), so
every layer's whole weight stays in memory from its forward to its backward: the
sharding over z saves nothing on weights between the two. FSDP2 frees each gathered
block after forward and gathers it again in backward (its default); this is that
choice, at the cost of one more all-gather of each such weight per step (the comm
report counts it: phase "backward"). A weight backward does not read (an embedding
table: its gradient needs only the indices) is not gathered again.

The copies are prefetched like forward's: each backward re-gather is issued just before
the program waits for the previous one, so one is in flight while a layer's backward
runs.
"""
from __future__ import annotations

import torch.fx as fx

from shardc.core.context import COMM, PARAM, CompileContext
from shardc.passes.recompute import BLOCK
from shardc.passes.step_nodes import (
    N_OUTPUTS,
    RUN_FUNCTIONS,
    collective_nodes,
    forward_nodes,
)
from shardc.runtime import functional as F

REGATHER = "shardc_regather_of"  # node.meta of a backward copy: the forward issue's origin
# node.meta of a backward copy of an activation's gather: its input is a saved activation,
# which a part's passes see as a placeholder, as they see a weight shard
ACTIVATION = "shardc_regather_activation"
# node.meta of every node of a backward copy: the name of the forward node it repeats
# (``remat.py`` has a block recomputed in backward read the copy, not a saved value)
COPY_OF = "shardc_copy_of"


def _weight_gathers(g: fx.Graph, fwd: set[fx.Node]) -> list[fx.Node]:
    out = []
    for n in collective_nodes(g):
        if n not in fwd or n.target is not F.run_all_gather:
            continue
        stack, ok = [n.args[0]], True
        while stack and ok:
            a = stack.pop()
            if not isinstance(a, fx.Node):
                continue
            if a.op == "placeholder":
                # a parameter's shard; an input (ViT-MAE's pixels, Hiera's patches) makes
                # an activation, which forward computes and backward cannot gather again
                ok = PARAM in a.meta
                continue
            if a.op != "call_function" or a.target is F.WAIT or a.target in RUN_FUNCTIONS:
                ok = False
            stack.extend(a.all_input_nodes)
        if ok:
            out.append(n)
    return out


def _chain(issue: fx.Node, fwd: set[fx.Node]) -> list[fx.Node]:
    """The input ops of ``issue`` (views of the shard), the issue, its wait, and the
    forward ops computed from the gathered buffer and placeholders alone (concatenation,
    views, casts): everything that makes the weight; in graph order."""
    inside: set[fx.Node] = {issue}
    stack = [issue.args[0]]
    while stack:
        a = stack.pop()
        if isinstance(a, fx.Node) and a.op == "call_function" and a not in inside:
            inside.add(a)
            stack.extend(a.all_input_nodes)
    frontier = list(issue.users)
    while frontier:
        u = frontier.pop()
        if u in inside or u not in fwd or u.op != "call_function":
            continue
        if any(a not in inside and a.op != "placeholder" for a in u.all_input_nodes):
            continue
        if _random(u) or u.target in RUN_FUNCTIONS or (u.target is F.WAIT and u.args[0] is not issue):
            continue  # another collective is not part of making this weight
        inside.add(u)
        frontier.extend(u.users)
    order = {n: i for i, n in enumerate(issue.graph.nodes)}
    return sorted(inside, key=order.__getitem__)


def _random(n: fx.Node) -> bool:
    name = str(n.target)
    return any(k in name for k in ("rand", "bernoulli", "dropout", "normal", "uniform"))


def _activation_gathers(g: fx.Graph, fwd: set[fx.Node], weights: list[fx.Node]) -> list[fx.Node]:
    """Forward all-gathers of activations inside a repeated block (``meta[BLOCK]``):
    sequence parallelism's gather before a column-parallel GEMM."""
    return [n for n in collective_nodes(g) if n in fwd and n.target is F.run_all_gather
            and n.meta.get(BLOCK) is not None and n not in weights]


def _gathered_chain(issue: fx.Node, fwd: set[fx.Node]) -> list[fx.Node]:
    """The issue, its wait, and the forward ops computed from the gathered buffer alone
    (views, casts): an activation's gather reads its input from forward as it is."""
    inside: set[fx.Node] = {issue}
    frontier = list(issue.users)
    while frontier:
        u = frontier.pop()
        if u in inside or u not in fwd or u.op != "call_function":
            continue
        if any(a not in inside for a in u.all_input_nodes):
            continue
        if _random(u) or u.target in RUN_FUNCTIONS or (u.target is F.WAIT and u.args[0] is not issue):
            continue
        inside.add(u)
        frontier.extend(u.users)
    order = {n: i for i, n in enumerate(issue.graph.nodes)}
    return sorted(inside, key=order.__getitem__)


def reshard_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    weights = ctx.options.reshard_after_forward
    # a selective policy inside the step program (remat.py) frees a block's activations;
    # the largest a block keeps on a tensor-parallel mesh are its gathered inputs, so it
    # gathers them again in backward, as Megatron does with sequence parallelism
    activations = ctx.options.recompute_in_step
    # block recompute inside the step program frees what a block holds, its gathered
    # weights too (the eager recompute gathers them again when it replays the block)
    block_weights = activations and ctx.options.activation_checkpoint == "blocks"
    if not (weights or activations):
        return gm
    g = gm.graph
    n_outputs, n_primals = gm.meta[N_OUTPUTS]
    fwd = forward_nodes(g, n_outputs, n_primals)
    order = {n: i for i, n in enumerate(g.nodes)}
    copies: list[tuple[list[fx.Node], fx.Node]] = []  # (issue and its input ops, its wait)
    gathers = _weight_gathers(g, fwd)
    chains = [(i, _chain(i, fwd)) for i in gathers
              if weights or (block_weights and i.meta.get(BLOCK) is not None)]
    if activations:
        chains += [(i, _gathered_chain(i, fwd)) for i in _activation_gathers(g, fwd, gathers)]
    acts = {i for i, _ in chains} - set(gathers)
    for issue, chain in chains:
        chain_set = set(chain)
        # the chain's values that backward reads
        uses = [(c, u) for c in chain for u in c.users
                if u not in fwd and u.op != "output" and u not in chain_set]
        if not uses:
            continue
        first = min((u for _, u in uses), key=order.__getitem__)
        env: dict[fx.Node, fx.Node] = {}
        with g.inserting_before(first):
            for c in chain:
                new = g.node_copy(c, lambda a: env.get(a, a))
                new.meta[COPY_OF] = c.name
                env[c] = new
                if c is issue:
                    new.args = (*c.args[:-1], "backward")
                    new.meta[COMM] = dict(c.meta[COMM], phase="backward")
                    new.meta[REGATHER] = c.meta[COMM].get("origin", c.name)
                    if issue in acts:
                        new.meta[ACTIVATION] = True
        for c, u in uses:
            u.replace_input_with(c, env[c])
        wait = next(w for w in env[issue].users if w.target is F.WAIT)
        sent: list[fx.Node] = [env[c] for c in chain[:chain.index(issue) + 1]]
        copies.append((sent, wait))
    # prefetch in backward (in the order backward runs them): each re-gather, with the
    # views of the shard it sends, is issued just before the previous one is waited;
    # it reads only the parameter shard, so it may go anywhere
    pos = {n: i for i, n in enumerate(g.nodes)}
    copies.sort(key=lambda c: pos[c[1]])
    for (_, prev_wait), (sent, _) in zip(copies, copies[1:]):
        for n in sent:
            prev_wait.prepend(n)
    if copies:
        g.lint()
        gm.recompile()
    return gm

