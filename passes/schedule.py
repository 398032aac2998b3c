"""Order each part of the step program so collectives overlap compute.

Reads:  a part (forward or backward) of the step program (``joint.py``): its
        collective issues (``run_*`` nodes) and their ``wait_tensor`` nodes
Writes: nothing new; a new order of the nodes; ``gm.meta[SCHEDULE]``: per collective,
        the compute it now overlaps (nodes between its issue and its wait), and whether
        its wait is deferred past the part (``passes/defer.py``)
Keeps:  every data dependence; the order of the weight all-gathers of forward (the
        prefetch pass chose it); the order of the draws from the random generator
        (dropout masks); every rank computes the same order (the same graph and
        the same rule), so every group still sees its collectives in the same order

Why: traced in autograd's order, a backward collective is waited right after it is
issued, and a GEMM's input gradient (dI) comes after its weight gradient (dW), so
nothing overlaps. The paper's OAR issues dI's all-reduce before the dW GEMM and waits
after it; ORS issues a weight gradient's reduce-scatter as soon as the gradient exists
and waits as late as possible; a data-parallel bucket goes out when its last gradient
exists. All three are one rule on the dependency graph:

* a collective is issued as soon as its input exists;
* a node on the way to a *blocking* collective (one whose result later compute reads:
  dI's all-reduce, an activation's all-gather) comes before other ready compute, so the
  collective leaves early and the other compute (dW) runs while it is in flight;
* a wait runs only when nothing else can: when the next compute needs its result, or at
  the end.

The order is ``networkx.lexicographical_topological_sort`` of the dependency graph with
that priority (ties: the traced order). A weight all-gather of forward reads only a
parameter, so it could go first; it keeps the place the prefetch pass gave it (an edge
from the node before it), or every gather would be in flight at once.
"""
from __future__ import annotations

from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from shardc.core.context import COMM, CompileContext
from shardc.passes import aliases
from shardc.passes.step_nodes import collective_nodes
from shardc.runtime import functional as F

SCHEDULE = "shardc_schedule"  # gm.meta: list of {collective, axis, phase, overlapped}


def _feeds_only_outputs(n: fx.Node, issues: set[fx.Node], seen: dict[fx.Node, bool]) -> bool:
    """Whether ``n``'s value reaches nothing but the graph's outputs (through waits,
    views and further collectives): a terminal value, e.g. a reduced gradient."""
    if n in seen:
        return seen[n]
    res = True
    for u in n.users:
        if u.op == "output":
            continue
        if u.op == "call_function" and (u.target is F.WAIT or u in issues or _is_view(u)):
            res = _feeds_only_outputs(u, issues, seen)
        else:
            res = False
        if not res:
            break
    seen[n] = res
    return res


def _is_view(n: fx.Node) -> bool:
    name = getattr(n.target, "__name__", "")
    return name.split(".")[0] in ("view", "slice", "reshape", "cat", "_unsafe_view")


def _param_gather(n: fx.Node) -> bool:
    """An all-gather whose input is computed from placeholders alone (a weight shard,
    maybe viewed): the prefetch pass placed it."""
    stack, seen = [n.args[0]], set()
    while stack:
        a = stack.pop()
        if not isinstance(a, fx.Node) or a in seen:
            continue
        seen.add(a)
        if a.op == "placeholder":
            continue
        if a.op != "call_function" or a.target is F.WAIT or a.target in _RUN:
            return False
        stack.extend(a.all_input_nodes)
    return True


def _draws_random(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def _urgency(g: fx.Graph, blocking: list[fx.Node]) -> dict[fx.Node, int]:
    """For each node on the way to a blocking collective (not through a wait): the rank
    of the soonest such collective it leads to. Soonest = the shortest longest path from
    the program's inputs (ties: the traced order), so the collective that can leave
    first does: the loss's token count (a few ops on the targets) before the whole
    forward that the loss itself waits on, in whatever order the tracer met them."""
    depth: dict[fx.Node, int] = {}
    for n in g.nodes:
        depth[n] = 1 + max((depth[a] for a in n.all_input_nodes), default=-1)
    rank = {c: i for i, c in enumerate(sorted(blocking, key=lambda c: depth[c]))}
    urgency: dict[fx.Node, int] = {}
    for n in reversed(list(g.nodes)):
        if n.op == "placeholder" or n.target is F.WAIT:
            continue
        best = min((urgency[u] for u in n.users if u in urgency), default=None)
        if n in rank:  # the collective's own rank goes to its inputs, not to its key
            best = rank[n] if best is None else min(best, rank[n])
        if best is not None:
            urgency[n] = best
    for c in blocking:  # an issue is keyed as an issue
        urgency.pop(c, None)
    return urgency


def _write_order(g: fx.Graph, body: list[fx.Node]) -> list[tuple[fx.Node, fx.Node]]:
    """Edges that keep each in-place write where it was among the other uses of the
    storage it writes (through any view of it). Data edges do not: a write's result is
    often unused, and its effect reaches readers only through the buffer (make_fx keeps
    ``copy_(as_strided(new_zeros(...)), grad)`` from adaptive_avg_pool1d's backward; the
    schedule once moved that copy after the reads of the buffer, and Swin's gradients
    came out zero)."""
    root: dict[fx.Node, fx.Node] = {}
    written: dict[fx.Node, list[fx.Node]] = {}
    for n in g.nodes:
        for v in aliases.written(n):
            written.setdefault(root.get(v, v), []).append(n)
        base = aliases.view_of(n)
        if base is not None:
            root[n] = root.get(base, base)
    if not written:
        return []
    views: dict[fx.Node, list[fx.Node]] = {}
    for v, r in root.items():
        views.setdefault(r, []).append(v)
    order = {n: i for i, n in enumerate(g.nodes)}
    in_body = set(body)
    edges = []
    for base, writers in written.items():
        family = [base, *views.get(base, [])]
        # every node that reads the storage or views it, and the writers themselves
        touch = ({u for n in family for u in n.users} | set(family[1:]) | set(writers)) & in_body
        for w in writers:
            if w in in_body:
                edges += [(u, w) if order[u] < order[w] else (w, u) for u in touch if u is not w]
    return edges


def schedule_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    g = gm.graph
    if not ctx.options.overlap:
        gm.meta[SCHEDULE] = overlaps(g)
        return gm
    order = {n: i for i, n in enumerate(g.nodes)}
    body = [n for n in g.nodes if n.op not in ("placeholder", "output")]
    issues = collective_nodes(g)
    issue_set = set(issues)
    pinned = {n for n in issues if n.target is F.run_all_gather and _param_gather(n)}
    seen: dict[fx.Node, bool] = {}
    blocking = [n for n in issues if n not in pinned and not _feeds_only_outputs(n, issue_set, seen)]
    urgency = _urgency(g, blocking)

    dag = nx.DiGraph()
    dag.add_nodes_from(body)
    for n in body:
        for a in n.all_input_nodes:
            if a.op != "placeholder":
                dag.add_edge(a, n)
    prev = None
    for n in body:
        if n in pinned and prev is not None:
            dag.add_edge(prev, n)
        prev = n
    # draws from the default generator keep their order: a dropout moved ahead of another
    # would take the other's random numbers, and the masks would no longer be one device's
    draws = [n for n in body if _draws_random(n)]
    dag.add_edges_from(zip(draws, draws[1:]))
    dag.add_edges_from(_write_order(g, body))

    def key(n: fx.Node) -> tuple[int, int, int]:
        if n.target is F.WAIT:
            return (2, 0, order[n])
        if n in issue_set and n not in pinned:
            return (0, 0, order[n])
        if n in urgency:
            return (0, 1 + urgency[n], order[n])
        return (1, 0, order[n])

    new = list(nx.lexicographical_topological_sort(dag, key=key))
    out = next(n for n in g.nodes if n.op == "output")
    for n in new:
        out.prepend(n)
    g.lint()
    gm.recompile()
    gm.meta[SCHEDULE] = overlaps(g)
    return gm


def overlaps(g: fx.Graph) -> list[dict[str, Any]]:
    """Per collective: how many compute nodes (and which GEMMs) run between its issue and
    its wait; what explain prints."""
    pos = {n: i for i, n in enumerate(g.nodes)}
    res = []
    for n in collective_nodes(g):
        waits = [u for u in n.users if u.target is F.WAIT]
        # no wait in the part: the output is waited on first read (passes/defer.py), so
        # everything after the issue, and what runs after the part, overlaps it
        deferred = not waits and any(u.op == "output" for u in n.users)
        end = pos[waits[0]] if waits else len(pos) if deferred else pos[n]
        between = [m for m in g.nodes if pos[n] < pos[m] < end and m.op == "call_function"
                   and m.target is not F.WAIT and m.target not in _RUN]
        gemms = [m.name for m in between if "mm" in str(m.target)]
        info = dict(n.meta.get(COMM, {}))
        info.update(node=n.name, overlapped=len(between), gemms=gemms, deferred=deferred)
        res.append(info)
    return res


_RUN = set(F.RUN_FUNCTIONS)
