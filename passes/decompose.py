"""The export's ops that have no sharding rule, decomposed where they stand. Not a pass:
``trace.py`` runs it on the export, in place of a whole ``run_decompositions``.

Why: ``ExportedProgram.run_decompositions`` re-traces the whole program to decompose any
op in it. Every transformers language model tested holds one op without a rule (the
``aten.diff`` of its packed-sequence test among 175-241 nodes), and re-tracing around it
took 0.4-0.7 s of a 0.6-1.1 s trace (GPT-2, Llama, Mistral, measured 2026-12-07), paid by
every rank of every compile: about two thirds of the trace.

Decomposing only those nodes gives the same program where the export is already
functional, as a graph with no op that writes into a tensor is: each node is traced on its
own with ``make_fx`` over its inputs' fake values and the same decomposition table
(recursively, to ops that have a rule), and its subgraph takes its place, with the node's
metadata (module path, source line). ``run_decompositions`` does more than decompose: it
functionalizes (an in-place op becomes out of place, BatchNorm's running statistics a
buffer write-back), which such a graph does not need. Anything else takes the whole
``run_decompositions`` as before:

* a node whose op writes into a tensor (its schema says so), anywhere in the graph;
* an op without a rule that is not an ATen op of the table, that draws random numbers, or
  whose values have sizes the data decides (symbolic);
* a decomposition that leaves an op without a rule, or makes a tensor constant (which the
  export would have to lift into its signature).
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

# a decomposed node's own values; its other metadata (module path, source) goes to each
# node of its subgraph
_OWN = frozenset({"val", "tensor_meta", "example_value", "unbacked_bindings"})


def decompose(ep: torch.export.ExportedProgram, table: dict, has_rule: Callable[[Any], bool]
              ) -> torch.export.ExportedProgram:
    """``ep`` with every op ``has_rule`` rejects decomposed by ``table``: in place where the
    graph allows it (see the module's text), else ``ep.run_decompositions(table)``."""
    gm = ep.graph_module
    missing = [n for n in gm.graph.nodes if n.op == "call_function" and not has_rule(n.target)]
    subgraphs = _local(gm, missing, table, has_rule)
    if subgraphs is None:
        return ep.run_decompositions(table)
    for n, sub in zip(missing, subgraphs):
        _splice(gm.graph, n, sub)
    gm.graph.lint()
    gm.recompile()
    return ep


def _writes(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable


def _static(v: Any) -> bool:
    return not isinstance(v, torch.Tensor) or all(isinstance(s, int) for s in v.shape)


def _local(gm: fx.GraphModule, missing: list[fx.Node], table: dict,
           has_rule: Callable[[Any], bool]) -> list[fx.GraphModule] | None:
    """Each missing node's decomposition traced alone, or None where one of them (or the
    graph) needs the whole re-trace. Nothing in ``gm`` is changed here."""
    if any(_writes(n) for n in gm.graph.nodes):
        return None
    out = []
    for n in missing:
        t = n.target
        if not isinstance(t, torch._ops.OpOverload) or t not in table \
                or torch.Tag.nondeterministic_seeded in t.tags:
            return None
        flat, spec = pytree.tree_flatten((n.args, n.kwargs))
        vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in flat]
        where = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
        if any(not isinstance(vals[i], torch.Tensor) or not _static(vals[i]) for i in where) \
                or not all(_static(v) for v in pytree.tree_leaves(n.meta.get("val"))):
            return None
        fake_mode = detect_fake_mode(tuple(vals[i] for i in where))
        if fake_mode is None:
            return None

        def call(*tensors: Any, _t: Any = t, _vals: list = vals, _where: list = where,
                 _spec: Any = spec) -> Any:
            full = list(_vals)
            for i, x in zip(_where, tensors):
                full[i] = x
            args, kwargs = pytree.tree_unflatten(full, _spec)
            return _t(*args, **kwargs)

        args = [vals[i] for i in where]
        with fake_mode:
            sub = make_fx(call, decomposition_table=table)(*args)
            if any(_writes(s) for s in sub.graph.nodes):
                # functionalized, as the whole re-trace would be: a decomposition may write
                # into its own intermediates (cosine_similarity's clamp_min_), and make_fx
                # applies the table below functionalization, so the ops it wrote are traced
                # through it once more
                sub = make_fx(torch.func.functionalize(sub))(*args)
        for s in sub.graph.nodes:
            if s.op == "get_attr" or (s.op == "call_function" and not has_rule(s.target)):
                return None
            if _writes(s):
                return None
        result = sub.graph.output_node().args[0]
        if isinstance(result, (tuple, list)):
            # a tuple-valued op: each reader must be a getitem of a tensor of the subgraph
            if not all(u.target is operator.getitem and isinstance(i := u.args[1], int)
                       and isinstance(result[i], fx.Node) for u in n.users):
                return None
        elif not isinstance(result, fx.Node):
            return None
        out.append(sub)
    return out


def _splice(graph: fx.Graph, n: fx.Node, sub: fx.GraphModule) -> None:
    """``sub``'s nodes in place of ``n``, its placeholders bound to ``n``'s tensor inputs."""
    inputs = iter(a for a in pytree.tree_leaves((n.args, n.kwargs)) if isinstance(a, fx.Node))
    env: dict[fx.Node, Any] = {}
    result: Any = None
    with graph.inserting_before(n):
        for s in sub.graph.nodes:
            if s.op == "placeholder":
                env[s] = next(inputs)
            elif s.op == "output":
                result = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, s.args[0])
            else:
                new = graph.node_copy(s, lambda a: env[a])
                for k, v in n.meta.items():
                    if k not in _OWN:
                        new.meta.setdefault(k, v)
                env[s] = new
    if isinstance(result, fx.Node):
        n.replace_all_uses_with(result)
    else:
        # a tuple-valued op: its readers are getitems
        for user in list(n.users):
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(n)
