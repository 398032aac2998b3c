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
buffer write-back). Writes the graph can lose where they stand are made out of place
first: a write into a tensor the graph made and nothing views (every mixture of experts
of transformers writes so: the router's ``weights /= weights.sum()``, the experts'
``index_add_`` or ``index_put_`` into zeros) becomes its out-of-place twin, read by every
later reader. Mixtral, GPT-OSS and Mixtral's batched experts then trace in 0.46-0.57 s
where the re-trace made it 1.3-1.8 s (one process, 2026-12-07). A tensor the graph made
and fills part by part (DeepSeek-V3's attention: ``q = k.new_empty(...); q[..., :d] = a;
q[..., d:] = b``) has each copy into a slice or a row made a ``slice_scatter`` or
``select_scatter`` of it, read by every later reader, where the copied value has the
part's shape and dtype and every other view of the tensor is read before the next write
(a view read across a write would see it), and a copy into a slice of a row (Qwen3-Next's
delta rule, ``attn[..., i, :i] = ...``) a ``slice_scatter`` into the row and a
``select_scatter`` of the row. An op without a rule that is not in the table but
decomposes as it is dispatched (``tensor_split``), or takes no tensor (``eye``), is
decomposed where it stands too. DeepSeek-V3's trace went from 1.45 s to 0.56 s and
Qwen3-Next's from 5.32 s to 2.35 s (one process, medians of 4 interleaved, 2026-12-07).
An op with no rule that no trace decomposes (not in the table, no implicit
decomposition: transformers' ``grouped_mm_fallback``) stays as it is. Anything else takes the whole
``run_decompositions`` as before:

* a write into an input, a parameter, a buffer, a view (other than the parts above), a
  tensor a view aliases, or by an op without an out-of-place twin;
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

aten = torch.ops.aten

# a decomposed node's own values; its other metadata (module path, source) goes to each
# node of its subgraph
_OWN = frozenset({"val", "tensor_meta", "example_value", "unbacked_bindings"})


def decompose(ep: torch.export.ExportedProgram, table: dict, has_rule: Callable[[Any], bool]
              ) -> torch.export.ExportedProgram:
    """``ep`` with every op ``has_rule`` rejects decomposed by ``table``: in place where the
    graph allows it (see the module's text), else ``ep.run_decompositions(table)``."""
    gm = ep.graph_module
    if not _functionalize_fresh_writes(gm.graph):
        gm.recompile()
        return ep.run_decompositions(table)
    missing = [n for n in gm.graph.nodes if n.op == "call_function" and not has_rule(n.target)
               and not _leaf(n.target, table)]
    subgraphs = _local(gm, missing, table, has_rule)
    if subgraphs is None:
        gm.recompile()
        return ep.run_decompositions(table)
    for n, sub in zip(missing, subgraphs):
        _splice(gm.graph, n, sub)
    gm.graph.lint()
    gm.recompile()
    return ep


def _leaf(op: Any, table: dict) -> bool:
    """An op any trace keeps as it is: not in the table and with no implicit decomposition
    (transformers' ``grouped_mm_fallback``, an opaque custom op the routing rules read)."""
    return isinstance(op, torch._ops.OpOverload) and op not in table and not _implicit(op)


def _implicit(op: torch._ops.OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _writes(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable


def _aliases(op: Any, results: bool) -> bool:
    """Does ``op`` return a view of an argument (``results``), or take one of its tensor
    arguments as an alias (a view or a write)? Anything not an ATen-style op: assume so."""
    if not isinstance(op, torch._ops.OpOverload):
        return True
    args = op._schema.returns if results else op._schema.arguments
    return any(a.alias_info is not None for a in args)


def _fresh(a: fx.Node) -> bool:
    """Is ``a`` a tensor the graph made that no other tensor views: the output of an op that
    returns no alias (through a getitem of a tuple-valued one)?"""
    while a.op == "call_function" and a.target is operator.getitem:
        if not isinstance(a.args[0], fx.Node):
            return False
        a = a.args[0]
    return a.op == "call_function" and not _aliases(a.target, results=True)


def _functional(op: torch._ops.OpOverload) -> Any:
    """The out-of-place twin of an in-place op (``div_.Tensor`` -> ``div.Tensor``,
    ``detach_`` -> ``detach``); None if there is none. A twin may return a view of its
    input (``detach``): every later reader reads the twin, so nothing observes the alias,
    and a later write into it is into a view, which is refused."""
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(getattr(torch.ops, op.namespace), name[:-1], None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if twin is None or twin._schema.is_mutable:
        return None
    return twin


def _twin_value(twin: Any, n: fx.Node) -> Any:
    """The twin's fake value on the write's inputs, or None where it is not the written
    tensor's shape and dtype: ``a.add_(b)`` keeps ``a``'s dtype where ``add`` promotes
    (float32 and a float64 tensor), and an out-of-place op may broadcast."""
    vals = pytree.tree_map(lambda x: x.meta.get("val") if isinstance(x, fx.Node) else x, (n.args, n.kwargs))
    written = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    fake_mode = detect_fake_mode(tuple(v for v in pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)))
    if fake_mode is None or not isinstance(written, torch.Tensor) or not _static(written):
        return None
    try:
        with fake_mode:
            out = twin(*vals[0], **vals[1])
    except Exception:  # noqa: BLE001 - whatever the twin cannot do, the re-trace does
        return None
    if not isinstance(out, torch.Tensor) or out.dtype != written.dtype or tuple(out.shape) != tuple(written.shape):
        return None
    return out


def _functionalize_fresh_writes(graph: fx.Graph) -> bool:
    """Each op that writes into a tensor the graph made and nothing views (MoE routers'
    ``weights /= weights.sum()``, experts' ``out.index_add_(...)`` into a zeros tensor) made
    out of place: the twin op computes the written value as a new node, and every reader
    after the write reads it. Where a write is not of that kind (into an input, a parameter,
    a buffer, a view or a tensor some view aliases, or an op with no twin) return False
    and leave the rest: the whole re-trace functionalizes it. What was rewritten computes
    what the graph did, so the re-trace may run on it."""
    for n in [n for n in graph.nodes if _writes(n)]:
        views = _part_write(n)
        if views is not None:
            if not _scatter_in_place(graph, n, views):
                return False
            continue
        op = n.target
        written = [i for i, a in enumerate(op._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        twin = _functional(op)
        a = n.args[0] if n.args else None
        if written != [0] or twin is None or torch.Tag.nondeterministic_seeded in op.tags \
                or not isinstance(a, fx.Node) or not _fresh(a):
            return False
        value = _twin_value(twin, n)
        if value is None or any(u.op == "output" for u in n.users):
            # (an output keeps its node's name, which the export's signature holds)
            return False
        after: set[fx.Node] = set()
        node = n.next
        while node.op != "root":
            after.add(node)
            node = node.next
        for u in a.users:
            if u is n:
                continue
            if u.op != "call_function" or not isinstance(u.target, torch._ops.OpOverload):
                return False  # the output, a higher-order op: what it does with it is unknown
            schema_args = u.target._schema.arguments
            flat = list(u.args) + [u.kwargs.get(x.name) for x in schema_args[len(u.args):]]
            for given, arg in zip(flat, schema_args):
                if given is a and arg.alias_info is not None and (not arg.alias_info.is_write
                                                                   or u not in after):
                    return False  # a view of the tensor, or a write before this one
            if any(isinstance(v, (list, tuple)) and a in v for v in flat):
                if _aliases(u.target, results=False):
                    return False
        with graph.inserting_before(n):
            new = graph.call_function(twin, n.args, n.kwargs)
        new.meta.update(n.meta)
        new.meta["val"] = value
        new.meta.pop("tensor_meta", None)
        for u in list(a.users):
            if u in after:
                u.replace_input_with(a, new)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
    return True


# a view of one part of a tensor -> the op that writes a value into that part of a copy
_SCATTERS: dict[Any, Any] = {aten.slice.Tensor: aten.slice_scatter.default,
                             aten.select.int: aten.select_scatter.default}


def _part_write(n: fx.Node) -> list[fx.Node] | None:
    """The views from a tensor the graph made down to the part ``n`` copies into, base
    side first, where ``n`` fills one part of such a tensor (DeepSeek-V3's ``q =
    k.new_empty(...); q[..., :d] = a; q[..., d:] = b``; Qwen3-Next's ``attn[..., i, :i] =
    ...``, a slice of a row): ``copy_(base[...][...], src)`` through slices and rows each
    read by nothing else, with ``src`` of the part's shape and dtype (no broadcast, no
    cast). None for any other write."""
    if n.target is not aten.copy_.default or n.users or len(n.args) != 2 or n.kwargs.get("non_blocking"):
        return None
    part, src = n.args
    views: list[fx.Node] = []
    v = part
    while isinstance(v, fx.Node) and v.target in _SCATTERS and len(v.users) == 1:
        views.append(v)
        v = v.args[0]
    if not views or not isinstance(v, fx.Node) or not _fresh(v) or not isinstance(src, fx.Node):
        return None
    sv, pv = src.meta.get("val"), views[0].meta.get("val")
    if not (isinstance(sv, torch.Tensor) and isinstance(pv, torch.Tensor) and _static(sv) and _static(pv)
            and sv.dtype == pv.dtype and tuple(sv.shape) == tuple(pv.shape)):
        return None
    return views[::-1]


def _pair(u: fx.Node) -> fx.Node | None:
    """The write of ``u`` when ``u`` is the first view of a part that a write of
    ``_part_write``'s kind copies into; None otherwise."""
    w = u
    while w.target in _SCATTERS and len(w.users) == 1:
        w = next(iter(w.users))
        if w.target is aten.copy_.default:
            views = _part_write(w)
            return w if views is not None and views[0] is u else None
    return None


def _read_before(u: fx.Node, limit: int, order: dict[fx.Node, int]) -> bool:
    """Is every reader of the view ``u`` (through further views) before ``limit``, and
    none of them a write?"""
    todo = list(u.users)
    while todo:
        w = todo.pop()
        if order.get(w, limit) >= limit or _writes(w) or w.op != "call_function":
            return False
        if _aliases(w.target, results=True):
            todo.extend(w.users)
    return True


def _scatter_in_place(graph: fx.Graph, n: fx.Node, views: list[fx.Node]) -> bool:
    """Rewrite the write ``n`` through ``views`` (``_part_write``) as scatters of its value
    into each view's input, innermost first (a ``slice_scatter`` into the row, then a
    ``select_scatter`` of the row into the base): readers of the base after the write
    read the result, readers before it the base. Another view of the base is taken where
    everything that reads it reads before the next write (a view read across a write
    would see it); a later write of the same kind through another part takes the result
    as its base and is rewritten in its turn. False (nothing changed) otherwise."""
    base, src = views[0].args[0], n.args[1]
    assert isinstance(base, fx.Node) and isinstance(src, fx.Node)
    order = {x: i for i, x in enumerate(graph.nodes)}
    later = [w for w in (_pair(u) for u in base.users if u is not views[0] and order[u] > order[n])
             if w is not None]
    writes = sorted([order[n], *(order[w] for w in later)])
    for u in base.users:
        if u is views[0] or (order[u] > order[n] and _pair(u) is not None):
            continue
        if u.op != "call_function" or not isinstance(u.target, torch._ops.OpOverload):
            return False
        if not _aliases(u.target, results=False):
            continue  # a plain reader: of the old value before the write, the new after
        if _writes(u) or not _aliases(u.target, results=True):
            return False  # another write into the base
        # a view read across a write would see it: its readers come before the next one
        if not _read_before(u, next((w for w in writes if w > order[u]), len(order)), order):
            return False
    fake_mode = detect_fake_mode((base.meta.get("val"), src.meta.get("val")))
    if fake_mode is None:
        return False
    values: list[Any] = []
    inner = src.meta["val"]
    try:
        with fake_mode:
            for v in reversed(views):
                into: Any = v.args[0]
                inner = _SCATTERS[v.target](into.meta["val"], inner, *v.args[1:])
                values.append(inner)
    except Exception:  # noqa: BLE001 - whatever a scatter cannot take, the re-trace does
        return False
    new: fx.Node = src
    with graph.inserting_before(n):
        for v, value in zip(reversed(views), values):
            op: Any = _SCATTERS[v.target]
            new = graph.call_function(op, (v.args[0], new, *v.args[1:]))
            new.meta.update({k: x for k, x in n.meta.items() if k not in ("val", "tensor_meta")})
            new.meta["val"] = value
    for u in list(base.users):
        if u is not views[0] and order.get(u, -1) > order[n]:
            u.replace_input_with(base, new)
    graph.erase_node(n)
    graph.erase_node(views[-1])
    return True


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
        # an op of the table, or one that decomposes as it is dispatched (its implicit
        # decomposition: Qwen3-Next's tensor_split), which make_fx records decomposed
        if not isinstance(t, torch._ops.OpOverload) or not (t in table or _implicit(t)) \
                or torch.Tag.nondeterministic_seeded in t.tags:
            return None
        flat, spec = pytree.tree_flatten((n.args, n.kwargs))
        vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in flat]
        where = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
        if any(not isinstance(vals[i], torch.Tensor) or not _static(vals[i]) for i in where) \
                or not all(_static(v) for v in pytree.tree_leaves(n.meta.get("val"))):
            return None
        # an op of no tensor (``eye(n)``): the mode its own value was made in
        fake_mode = detect_fake_mode(tuple(vals[i] for i in where) or
                                     tuple(pytree.tree_leaves(n.meta.get("val"))))
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
