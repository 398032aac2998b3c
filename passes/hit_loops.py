"""A Python loop over the entries a mask holds (``for e in hit.nonzero(): ...``), traced as
a loop over every entry the mask could hold, each iteration's picks cut to nothing where
its entry is not held. Not a pass: ``trace.py`` exports under ``loops_over_hits`` where the
plain export fails on a size the data decides, then runs ``mask_hit_loops`` on the export.

Why: a mixture of experts written as a loop over the experts the batch hit (transformers'
``eager`` experts kernel, DBRX's and Switch Transformers' experts) runs as many iterations
as the data decides. ``torch.export`` cannot trace that (``unbind`` of a tensor of unknown
length), so such a model failed to trace on every mesh, a mesh of one included.

The loop over the hit entries is the loop over all of them, in the same (increasing)
order, with the entries not held skipped. So the export iterates every entry ``k`` of the
mask ``B`` (``B.numel()`` iterations, at most ``MAX_ITERATIONS``), each iteration's start
marked in the graph (an always-true ``_assert_async`` that export keeps in program order,
reading the predicate ``B[k] != 0``). ``mask_hit_loops`` then ANDs every row pick an
iteration makes (``torch.where``, ``nonzero``, a boolean index) with that predicate, so an
iteration whose entry is not held picks no rows. It refuses the loop unless everything the
iteration computes leaves it only through a write of those rows (``index_add_``,
``index_put_``, ``index_copy_``, ``scatter_add_``; a write of no rows leaves its
destination as it was): then an iteration not held is exactly nothing. The nodes are the
iteration's by their place between two marks, not by what they read, so a value the model
burns in from the entry (``self.bias[int(e)]``) is the iteration's too. The picked rows
are then padded to their bound by ``data_sized.py``, as for a loop over a fixed range.

Each entry is first a constant (``torch.tensor([k])``: a model may branch on it, ``if
expert_idx == self.num_experts: continue``, or look a module up by it,
``self[f"expert_{idx}"]``). A loop whose body cannot take an entry the mask never holds
(DBRX indexes its weights by every entry of a one-hot over ``E + 1`` classes, the last
never hit) is exported again with the entry as data: the ``j``-th entry held
(``nonzero_static``, entry 0 past the last), iteration ``j`` held when ``j`` is below the
count.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import numpy as np
import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from shardc.core.errors import TraceError
from shardc.core.ir import source_of, where
from shardc.passes.data_sized import erase_tree, fake_val

aten = torch.ops.aten

# a loop over more entries than this is left to fail as it did (a loop over tokens, not
# experts, would make a program of thousands of copies of its body)
MAX_ITERATIONS = 512


@torch.library.custom_op("shardc::hit_row", mutates_args=())
def hit_row(hits: torch.Tensor, j: int, flat: bool) -> torch.Tensor:
    """The ``j``-th entry ``hits`` holds (``hits.nonzero()[j]``; entry 0 past the last)."""
    rows = torch.nonzero_static(hits, size=hits.numel(), fill_value=0)[j]
    return rows[0] if flat else rows


@hit_row.register_fake
def _(hits: torch.Tensor, j: int, flat: bool) -> torch.Tensor:
    return hits.new_empty(() if flat else (hits.dim(),), dtype=torch.int64)


# an iteration's start (and a loop's end) in the export: an always-true check that export
# keeps in program order, reading ``held``, the predicate that the iteration's entry is held
_MARK = "shardc.hit_loops"


class _Loops(TorchFunctionMode):
    """Records what ``nonzero`` returns during the export (and its flat views); iterating
    one (``Tensor.__iter__``, patched while the mode is on) gives every entry the mask
    could hold, each iteration's start marked in the graph."""

    _PICKS = {torch.Tensor.nonzero, torch.nonzero, torch.argwhere, torch.Tensor.argwhere}
    _FLATTEN = {torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten,
                torch.Tensor.squeeze, torch.reshape, torch.flatten, torch.squeeze}

    def __init__(self, by_value: bool) -> None:
        super().__init__()
        self.by_value = by_value
        self.entries: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}
        self.loops = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self._PICKS and not kwargs.get("as_tuple") and len(args) == 1:
            self._record(out, args[0], False)
        elif func is torch.where and len(args) == 1 and isinstance(out, tuple) and len(out) == 1:
            self._record(out[0], args[0], True)
        elif func is torch.Tensor.nonzero and kwargs.get("as_tuple") and len(out) == 1:
            self._record(out[0], args[0], True)
        elif func in self._FLATTEN and args and isinstance(out, torch.Tensor) and out.dim() == 1:
            seen = self.entries.get(id(args[0]))
            if seen is not None and seen[0] is args[0] and seen[1].dim() == 1 and not seen[2]:
                self._record(out, seen[1], True)
        return out

    def _record(self, out: Any, hits: torch.Tensor, flat: bool) -> None:
        if not (isinstance(out, torch.Tensor) and isinstance(hits, torch.Tensor)):
            return
        if not all(isinstance(s, int) for s in hits.shape) or not 0 < hits.numel() <= MAX_ITERATIONS:
            return
        if isinstance(out.shape[0], int):
            return  # a size the export knows: its own loop traces
        self.entries[id(out)] = (out, hits, flat)

    def iterate(self, t: torch.Tensor) -> Iterator[torch.Tensor] | None:
        seen = self.entries.get(id(t))
        if seen is None or seen[0] is not t:
            return None
        self.loops += 1
        return self._iterations(self.loops, seen[1], seen[2])

    def _iterations(self, loop: int, hits: torch.Tensor, flat: bool) -> Iterator[torch.Tensor]:
        # every predicate before the first mark, so that an iteration's nodes are its body's
        count = hits.ne(0).sum()
        flat_hits = hits.reshape(-1)
        helds = [count.gt(k) if self.by_value else flat_hits[k].ne(0) for k in range(hits.numel())]
        trues = [torch.logical_or(h, h.logical_not()) for h in helds]
        done = count.ge(0)
        k = 0
        try:
            for k, true in enumerate(trues):
                torch.ops.aten._assert_async.msg(true, f"{_MARK}:{loop}:{k}")
                if self.by_value:
                    yield torch.ops.shardc.hit_row(hits, k, flat)
                else:
                    coords = [int(c) for c in np.unravel_index(k, tuple(hits.shape))]
                    yield torch.tensor(coords[0] if flat else coords, dtype=torch.int64,
                                       device=hits.device)
            k = len(helds)
        finally:  # the loop's end, also where it breaks (k below the count)
            torch.ops.aten._assert_async.msg(done, f"{_MARK}:{loop}:end:{k}:{len(helds)}")


@contextlib.contextmanager
def loops_over_hits(by_value: bool) -> Iterator[_Loops]:
    """While the model is exported: a loop over ``nonzero``'s rows iterates every entry
    the mask could hold (a constant each, or, ``by_value``, the ``j``-th entry held)."""
    native = torch.Tensor.__iter__

    def iterate(self: torch.Tensor) -> Any:
        return mode.iterate(self) or native(self)
    with _Loops(by_value) as mode:
        torch.Tensor.__iter__ = iterate  # type: ignore[method-assign]
        try:
            yield mode
        finally:
            torch.Tensor.__iter__ = native  # type: ignore[method-assign]


# writes that leave their destination as it was when their index holds no entries
_WRITES = {aten.index_add.default, aten.index_put.default, aten.index_copy.default,
           aten.scatter_add.default, aten.index_add_.default, aten.index_put_.default,
           aten.index_copy_.default, aten.scatter_add_.default}
_PUTS = {aten.index_put.default, aten.index_put_.default}
_PICK_OPS = {aten.nonzero.default, aten.argwhere.default}
_WHERE = aten.where.default
_ASSERT = aten._assert_async.msg


def _arg(n: fx.Node, i: int) -> Any:
    return n.args[i]


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _syms(v: Any) -> set:
    """The sizes of ``v`` the data decides (the export fixes every other size)."""
    vals = v if isinstance(v, (tuple, list)) else [v]
    dims: list[Any] = [d for t in vals if isinstance(t, torch.Tensor) for d in t.shape]
    return {d.node.expr for d in dims if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol}


def _empty_when(index: Any, zero: set) -> bool:
    """Does ``index`` (a tensor or a list of them) hold no entries when the symbols
    ``zero`` are 0?"""
    parts = index if isinstance(index, (list, tuple)) else [index]
    for p in parts:
        v = _val(p)
        if not isinstance(v, torch.Tensor):
            continue
        for d in v.shape:
            if isinstance(d, torch.SymInt) and d.node.expr.subs({s: 0 for s in zero}) == 0:
                return True
    return False


def _bool_index(n: fx.Node) -> list[int]:
    """Positions of ``n``'s boolean index tensors."""
    if n.target not in (aten.index.Tensor, *_PUTS):
        return []
    return [i for i, a in enumerate(_arg(n, 1)) if isinstance(_val(a), torch.Tensor)
            and _val(a).dtype in (torch.bool, torch.uint8)]


def _written(n: fx.Node) -> list[Any]:
    """The inputs ``n`` writes in place."""
    if not isinstance(n.target, torch._ops.OpOverload) or not n.target._schema.is_mutable:
        return []
    return [a for a, s in zip(n.args, n.target._schema.arguments)
            if s.alias_info is not None and s.alias_info.is_write]


def _refusal(n: fx.Node) -> TraceError:
    return TraceError(
        f"shardc.compile: the loop over the entries of a mask {where(source_of(n))} cannot be "
        "traced: what an iteration computes reaches the model's result other than through a "
        "write of the rows it picks (index_add_, index_put_, x[rows] = ...), so iterating an "
        "entry the mask does not hold would change it. Loop over a fixed range instead "
        "(`for e in range(num_experts):`), or use a sorted grouped-GEMM experts kernel "
        "(transformers' default `grouped_mm`).")


def _iteration(body: list[fx.Node]) -> tuple[list[fx.Node], list[tuple[fx.Node, int]]]:
    """The picks and boolean indices of one iteration (the nodes ``body``), or a TraceError
    where what it computes is read after it other than through a write of its picked rows
    (such a write of no rows leaves its destination as it was)."""
    inside = set(body)
    zero: set = set()
    picks: list[fx.Node] = []
    masks: list[tuple[fx.Node, int]] = []
    for n in body:
        if n.target in _PICK_OPS or (n.target is _WHERE and len(n.args) == 1):
            picks.append(n)
            zero |= _syms(_val(n))
            continue
        for i in _bool_index(n):
            masks.append((n, i))
            if n.target is aten.index.Tensor:
                zero |= _syms(_val(n))
    for n in body:
        if n.target in _WRITES and n.args[0] not in inside:
            index = n.args[1] if n.target in _PUTS else n.args[2]
            if _empty_when(index, zero) or any(m is n for m, _ in masks):
                continue  # no rows written when not held: the destination as it was
        if any(u not in inside for u in n.users) or any(a not in inside for a in _written(n)):
            raise _refusal(n)
    return picks, masks


def _marks(graph: fx.Graph) -> list[tuple[fx.Node, str, str]]:
    out = []
    for n in graph.nodes:
        if n.target is _ASSERT and isinstance(n.args[1], str) and n.args[1].startswith(_MARK + ":"):
            _, loop, k, *_ = n.args[1].split(":")
            out.append((n, loop, k))
    return out


def _masked(graph: fx.Graph, user: fx.Node, a: fx.Node, held: fx.Node) -> fx.Node:
    """``a & held``, for ``user`` (after both: ``held`` precedes the iteration)."""
    with graph.inserting_before(user):
        n = graph.call_function(aten.logical_and.default, (a, held))
    n.meta.update({k: v for k, v in a.meta.items() if k not in ("val", "unbacked_bindings")})
    fake_val(n)
    return n


def _entry_value(graph: fx.Graph, node: fx.Node, rows: dict[fx.Node, fx.Node]) -> fx.Node:
    """``hit_row(hits, j, flat)`` as ATen: ``nonzero_static(hits, numel, fill 0)[j]``."""
    hits, j, flat = (_arg(node, i) for i in range(3))
    if hits not in rows:
        with graph.inserting_after(hits):
            rows[hits] = graph.call_function(aten.nonzero_static.default, (hits,),
                                             {"size": math.prod(_val(hits).shape), "fill_value": 0})
        rows[hits].meta.update({k: v for k, v in node.meta.items() if k not in ("val", "unbacked_bindings")})
        fake_val(rows[hits])
    with graph.inserting_before(node):
        v = graph.call_function(aten.select.int, (rows[hits], 0, j))
        if flat:
            v = graph.call_function(aten.select.int, (v, 0, 0))
    for n in ((_arg(v, 0), v) if flat else (v,)):
        n.meta.update({k: x for k, x in node.meta.items() if k not in ("val", "unbacked_bindings")})
        fake_val(n)
    return v


def _checks_only(n: fx.Node) -> bool:
    """Is ``n`` read only by export's checks of its sizes (directly or through views)?"""
    return all(u.target in _CHECKS or (u.target in _SIZES or not isinstance(u.target, torch._ops.OpOverload))
               and _checks_only(u) for u in n.users)


_SIZES = {aten.sym_size.int, aten.unbind.int, aten.view.default, aten.squeeze.dim,
          aten.squeeze.default, aten.reshape.default}
_CHECKS = {aten._assert_scalar.default, _ASSERT}


def mask_hit_loops(gm: fx.GraphModule) -> None:
    """Mask every iteration of the loops ``loops_over_hits`` traced (see the module's doc)."""
    graph = gm.graph
    marks = _marks(graph)
    if not marks:
        return
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    plans = []
    for mark, _, k in marks:
        parts = _arg(mark, 1).split(":")
        if k == "end" and parts[3] != parts[4]:
            # the model's loop stops at an entry the batch may not hold, and would then
            # go on to the next one held: which entries run is the data's
            raise TraceError(
                f"shardc.compile: the loop over the entries of a mask {where(source_of(mark))} "
                "leaves early (break or return): shardc traces such a loop over every entry "
                "the mask could hold, and cannot tell where the model's loop would stop. "
                "Loop over a fixed range instead, or compute what the break decides as a mask.")
    for (mark, loop, k), (end, loop2, _) in zip(marks, marks[1:]):
        if k == "end":
            continue
        if loop2 != loop:
            raise TraceError(f"shardc.compile: a loop over the entries of a mask inside another "
                             f"{where(source_of(end))}: shardc traces one such loop at a time")
        body = [n for n in nodes[order[mark] + 1:order[end]] if n.op == "call_function"]
        held = _arg(_arg(mark, 0), 0)  # the mark checks logical_or(held, not held)
        plans.append((held, *_iteration(body)))  # every check before any change
    for held, picks, masks in plans:
        for p in picks:
            p.replace_input_with(_arg(p, 0), _masked(graph, p, _arg(p, 0), held))
        for n, i in masks:
            idx = list(_arg(n, 1))
            idx[i] = _masked(graph, n, idx[i], held)
            n.args = (n.args[0], idx, *n.args[2:])
    rows: dict[fx.Node, fx.Node] = {}
    for n in list(graph.nodes):
        if n.target is torch.ops.shardc.hit_row.default:
            n.replace_all_uses_with(_entry_value(graph, n, rows))
            graph.erase_node(n)
    for mark, _, _ in marks:
        graph.erase_node(mark)
    # what only the marks read (the predicates of iterations that pick nothing), and the
    # model's own nonzero of each mask, now read by export's checks of its size only
    for n in reversed(list(graph.nodes)):
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and not n.users and not n.target._schema.is_mutable and n.target not in _CHECKS:
            graph.erase_node(n)
    for n in [n for n in graph.nodes if (n.target in _PICK_OPS or n.target is _WHERE and len(n.args) == 1)
              and n.users and _checks_only(n)]:
        erase_tree(graph, n)
    graph.lint()
    gm.recompile()
