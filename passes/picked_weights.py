"""GEMMs of each row against a weight picked by the row's key become grouped GEMMs over
the rows sorted by key. Not a pass: ``trace.py`` runs it on the export, so that the
routing analysis, the expert placement, the planner and the cost model all see the
sorted form.

Why: transformers' ``batched_mm`` experts kernel (and any mixture of experts written the
same way) looks each token-expert pair's weight up by index and multiplies pair by pair:
``bmm(w[keys], x.unsqueeze(-1))``. That copies an expert's whole weight for every pair
(S x out x in elements per GEMM, forward and again in backward), and it leaves no sort
and no grouped GEMM to cut the experts around, so ``expert_axes`` could not take it. The
product is the one the sorted form computes: row ``i`` meets ``w[keys[i]]`` either way.
So the pairs are sorted by key once (``sort``), each GEMM runs over the sorted rows with
the experts' offsets (``histc`` of the sorted keys, its ``cumsum``), and the inverse
permutation puts the rows back: the shape ``passes/rules/routing.py`` recognises as a
routing region (transformers' default ``grouped_mm`` kernel has it), run by shardc's
grouped GEMM (``runtime/grouped_gemm.py``).

Where the values between two such GEMMs are computed row by row (the gate's activation,
a bias looked up by the keys), that stretch is computed in the sorted order too, so the
rows stay sorted from the first GEMM to the last and the experts are one segment (one
trip to the experts' ranks and one back under ``expert_axes``); a row value that enters
it from outside is looked up by the permutation (a table looked up by the keys, by the
sorted keys), and one read outside it is put back by the inverse permutation. Where the
routing analysis does not accept that stretch (an op that reads the row order, a random
draw), each GEMM is sorted and put back on its own; where it accepts neither, nothing
changes.

Taken only where every key is known to lie in ``[0, E)`` (the indices of a ``topk`` or
arg-max over a dim of at most E, ``routing.index_bound``), so that the histogram over E
bins counts every row. Exact up to the order of the sums: each output row is one row of
one GEMM against its expert's weight; an expert's weight gradient is one GEMM over its
rows instead of a sum of per-pair products.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from shardc.passes.data_sized import fake_val
from shardc.passes.rules.routing import IGNORED, index_bound, region_at
from shardc.runtime.grouped_gemm import GROUPED_MM

aten = torch.ops.aten

# metadata a new node takes from the GEMM it stands for: where it came from
_ORIGIN = ("nn_module_stack", "stack_trace", "source_fn_stack", "torch_fn")


@dataclass
class _Picked:
    bmm: fx.Node
    out: fx.Node  # the (S, out) result the model reads: a squeeze or view of the bmm
    x: fx.Node  # the (S, in) rows
    pick: fx.Node  # w[keys]
    weight: fx.Node  # w: (E, in, out) when ``transposed``, else (E, out, in)
    keys: fx.Node
    transposed: bool


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _users(n: fx.Node) -> list[fx.Node]:
    return [u for u in n.users if u.target not in IGNORED]


def _unsqueezed(n: Any, dims: tuple[int, ...]) -> fx.Node | None:
    """``x`` of ``n = x.unsqueeze(d)``, ``d`` in ``dims``, x of shape (S, k)."""
    if isinstance(n, fx.Node) and n.target is aten.unsqueeze.default and n.args[1] in dims:
        x: Any = n.args[0]
        v = _val(x)
        if isinstance(v, torch.Tensor) and v.dim() == 2:
            return x
    return None


def _picked(n: Any, rows: int) -> tuple[fx.Node, fx.Node] | None:
    """(w, keys) of ``n = w[keys]``: w of 3 dims, keys ``rows`` integers."""
    args: Any = n.args if isinstance(n, fx.Node) else None
    if not (isinstance(n, fx.Node) and n.target is aten.index.Tensor and len(args[1]) == 1):
        return None
    w, keys = args[0], args[1][0]
    wv, kv = _val(w), _val(keys)
    if not (isinstance(wv, torch.Tensor) and wv.dim() == 3 and isinstance(kv, torch.Tensor)
            and kv.dim() == 1 and not kv.dtype.is_floating_point and kv.dtype != torch.bool
            and kv.shape[0] == rows):
        return None
    return w, keys


def _match(n: fx.Node) -> _Picked | None:
    """``n`` as ``bmm(x.unsqueeze(1), w[keys]).squeeze(1)`` (x @ w[k]) or
    ``bmm(w[keys], x.unsqueeze(-1)).squeeze(-1)`` (w[k] @ x), None otherwise."""
    if n.target is not aten.bmm.default:
        return None
    a, b = n.args[:2]
    users = _users(n)
    pick: Any
    v = _val(n)
    if len(users) != 1 or not isinstance(v, torch.Tensor) or not isinstance(v.shape[0], int):
        return None
    rows = int(v.shape[0])
    out = users[0]
    for transposed, unsq, pick, dims, sq in ((True, a, b, (1, -2), (1, -2)),
                                             (False, b, a, (2, -1), (2, -1))):
        x = _unsqueezed(unsq, dims)
        found = _picked(pick, rows)
        if x is None or found is None or _val(x).shape[0] != rows:
            continue
        if out.target is aten.squeeze.dim and out.args[1] in sq:
            pass
        elif out.target in (aten.view.default, aten.reshape.default) and \
                list(_val(out).shape) == [rows, v.shape[2 if transposed else 1]]:
            pass
        else:
            return None
        return _Picked(n, out, x, pick, found[0], found[1], transposed)
    return None


def _copy(gm: fx.GraphModule) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    g = fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    g._codegen = gm.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    copied: Any = g.graph_copy(gm.graph, env, return_output_node=True)
    rv, old = copied
    out = g.output(rv, type_expr=old.type)
    out.meta.update(old.meta)
    return g, env


def _reached(starts: list[fx.Node], step: Any) -> set[fx.Node]:
    """``starts`` and every node ``step`` (a node's users, or its inputs) leads to."""
    seen: set[fx.Node] = set()
    todo = list(starts)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(step(n))
    return seen


def _chain(picks: list[_Picked]) -> set[fx.Node]:
    """The values on a path from one GEMM's result to another's rows (both included)."""
    after = _reached([p.out for p in picks], lambda n: n.users)
    before = _reached([p.x for p in picks], lambda n: n.all_input_nodes)
    chain = after & before
    for n in chain:
        t = n.target
        if isinstance(t, torch._ops.OpOverload) and (
                t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags):
            return set()  # a write or a draw keeps the model's order: each GEMM alone
    return chain


class _Rewrite:
    def __init__(self, g: fx.Graph, picks: list[_Picked], experts: int, chained: bool) -> None:
        self.g = g
        self.picks = picks
        self.keys = picks[0].keys
        self.rows = int(_val(self.keys).shape[0])
        self.experts = experts
        self.chain = _chain(picks) if chained else set()
        self.looked_up: dict[fx.Node, fx.Node] = {}

    def node(self, target: Any, args: tuple, kwargs: dict | None = None, like: fx.Node | None = None
             ) -> fx.Node:
        n = self.g.call_function(target, args, kwargs or {})
        src = like or self.picks[0].bmm
        n.meta.update({k: src.meta[k] for k in _ORIGIN if k in src.meta})
        if n.all_input_nodes:
            fake_val(n)
        else:  # (the arange) in the export's fake mode, as its other values are
            with detect_fake_mode([_val(self.keys)]) or contextlib.nullcontext():
                n.meta["val"] = target(*args, **(kwargs or {}))
        return n

    def run(self) -> list[fx.Node]:
        """The grouped GEMMs, in the picks' order."""
        g, keys = self.g, self.keys
        device = _val(keys).device
        anchor = keys

        def add(target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
            # the sort, the offsets and the inverse, in this order, right after the keys
            nonlocal anchor
            with g.inserting_after(anchor):
                anchor = self.node(target, args, kwargs)
            return anchor

        sort = add(aten.sort.stable, (keys,), {"stable": True})
        self.sorted_keys = add(operator.getitem, (sort, 0))
        self.perm = add(operator.getitem, (sort, 1))
        # histc counts floats on CPU and integers on CUDA (deterministic kernels of each)
        counted = add(aten._to_copy.default, (self.sorted_keys,),
                      {"dtype": torch.float32 if device.type in ("cpu", "mps") else torch.int32})
        counts = add(aten.histc.default, (counted, self.experts, 0, self.experts - 1))
        self.offs = add(aten.cumsum.default, (counts, 0), {"dtype": torch.int32})
        empty = add(aten.empty_like.default, (self.perm,))
        ar = add(aten.arange.default, (self.rows,),
                 {"dtype": _val(self.perm).dtype, "device": device, "pin_memory": False})
        self.inv = add(aten.index_put.default, (empty, [self.perm], ar))

        gemms = {p.out: p for p in self.picks}
        grouped: dict[fx.Node, fx.Node] = {}
        for n in list(g.nodes):
            if n in gemms:
                grouped[n] = self._gemm(gemms[n])
            elif n in self.chain:
                self._inputs(n, grouped)
        # what reads a GEMM's result outside the stretch reads it put back
        for out, made in grouped.items():
            if out.users:
                self._put_back(made, list(out.users), out)
        for p in self.picks:
            self._erase(p)
        # and so does what reads a value of the stretch outside it
        inside = self.chain | set(grouped.values())
        for n in self.chain - set(grouped):
            outside = [u for u in n.users if u not in inside and u.target not in IGNORED]
            if outside:
                self._put_back(n, outside, n)
        return list(grouped.values())

    def _put_back(self, sorted_n: fx.Node, readers: list[fx.Node], old: fx.Node) -> None:
        with self.g.inserting_after(sorted_n):
            back = self.node(aten.index.Tensor, (sorted_n, [self.inv]), like=old)
        for u in readers:
            u.replace_input_with(old, back)

    def _lookup(self, a: fx.Node, before: fx.Node) -> fx.Node:
        """The rows of ``a`` (the model's order) in the sorted order."""
        if a not in self.looked_up:
            args: Any = a.args
            with self.g.inserting_before(before):
                if a.target is aten.index.Tensor and list(args[1]) == [self.keys]:
                    # a table looked up by the keys: by the sorted keys instead
                    self.looked_up[a] = self.node(aten.index.Tensor, (args[0], [self.sorted_keys]), like=a)
                else:
                    self.looked_up[a] = self.node(aten.index.Tensor, (a, [self.perm]), like=a)
        return self.looked_up[a]

    def _inputs(self, n: fx.Node, grouped: dict[fx.Node, fx.Node]) -> None:
        """``n`` computes in the sorted order: its row inputs are sorted."""
        nd = _val(n).dim() if isinstance(_val(n), torch.Tensor) else None
        for a in list(n.all_input_nodes):
            if a in grouped:
                n.replace_input_with(a, grouped[a])
            elif a in self.chain:
                continue
            else:
                v = _val(a)
                if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.dim() == nd \
                        and v.shape[0] == self.rows and self.rows > 1:
                    n.replace_input_with(a, self._lookup(a, n))

    def _gemm(self, p: _Picked) -> fx.Node:
        g = self.g
        with g.inserting_before(p.bmm):
            x = p.x if p.x in self.chain else self._lookup(p.x, p.bmm)
            w = p.weight if p.transposed else self.node(aten.transpose.int, (p.weight, 1, 2))
            return self.node(GROUPED_MM, (x, w, self.offs))

    def _erase(self, p: _Picked) -> None:
        for n in (p.out, p.bmm, *p.bmm.args[:2]):
            if isinstance(n, fx.Node) and not getattr(n, "_erased", False) \
                    and all(u.target in IGNORED for u in n.users):
                for u in list(n.users):
                    self.g.erase_node(u)
                self.g.erase_node(n)


def _taken(sort: fx.Node, gemms: list[fx.Node]) -> bool:
    """Does ``sort`` begin a routing region that holds every one of ``gemms``? (That
    sort's alone: the other layers' are judged in their own turn.)"""
    region = region_at(sort)
    return region is not None and all(x in region.kinds for x in gemms)


def _groups(g: fx.Graph) -> dict[str, list[_Picked]]:
    """The picked-weight GEMMs of ``g`` by the name of their keys."""
    out: dict[str, list[_Picked]] = {}
    for n in g.nodes:
        p = _match(n)
        if p is not None:
            out.setdefault(p.keys.name, []).append(p)
    return out


def group_picked_gemms(gm: fx.GraphModule) -> int:
    """Rewrite every set of picked-weight GEMMs that share their keys into the sorted form
    (see the module's docstring); returns how many GEMMs were rewritten."""
    done = 0
    for name in list(_groups(gm.graph)):
        picks = _groups(gm.graph).get(name, [])
        experts = {int(_val(p.weight).shape[0]) for p in picks}
        bound = index_bound(picks[0].keys) if picks else None
        if len(experts) != 1 or bound is None or bound > min(experts):
            continue
        if any(u.op == "output" for p in picks for u in p.out.users):
            continue  # an output keeps its node's name, which the export's signature holds
        for chained in (True, False):
            g, env = _copy(gm)
            mapped = [_Picked(env[p.bmm], env[p.out], env[p.x], env[p.pick], env[p.weight],
                              env[p.keys], p.transposed) for p in picks]
            rw = _Rewrite(g, mapped, min(experts), chained)
            gemms = rw.run()
            sort: Any = rw.perm.args[0]
            if not _taken(sort, gemms):
                continue
            g.lint()
            gm.graph = g
            gm.recompile()
            done += len(gemms)
            break
    return done
