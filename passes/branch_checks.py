"""(Not a pass.) The check of every branch on tensor values that ``draft_export`` fixed.

``torch.export.draft_export`` traces a branch on a tensor value (``if x.sum() > 0:``) by
taking the side the example inputs take, and reports each such guard as a failure with
its expression over the trace's unbacked symbols (``Eq(u0, 1)``) and the value it had.
Whether it also leaves a runtime check (``aten._assert_scalar``) in the graph depends on
the torch release: 2.13 does for every guard, 2.11 drops the one on a boolean ``.item()``
(the commonest branch of all), so a batch taking the other side silently returned the
example side's value. shardc therefore checks each reported guard itself:

- a guard that an ``_assert_scalar`` of the graph already states is left to it;
- otherwise the guard's expression is rebuilt from the graph's own values (a node whose
  traced value is one of the expression's symbols, or a sub-expression of it, or a
  tensor with that symbol as a size) as operator nodes feeding a new ``_assert_scalar``;
- a guard that neither covers is refused at compile: an unchecked branch computes the
  wrong side without a word.

The ``_assert_scalar`` nodes become per-step checks at lowering (``mark_branch_checks``
here, ``drop_rule`` in ``rules/common.py``).
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
import torch.utils._sympy.functions as functions

_ASSERT = torch.ops.aten._assert_scalar.default
_PREFIX = "Runtime assertion failed for expression "
_SYM_TYPES = (torch.SymInt, torch.SymBool, torch.SymFloat)


# node meta: an ``_assert_scalar`` that guards a branch draft_export fixed (its value: where)
KEEP_CHECK = "shardc_keep_check"
# node meta: a number such a check reads, which the step computes (never the trace's value)
CHECKED_NUMBER = "shardc_checked_number"


class Unchecked(Exception):
    """A guard shardc can neither find checked in the graph nor build a check for."""


def _namespace() -> dict[str, Any]:
    """The names torch prints guards with: sympy's, and torch's own integer functions
    (``FloorDiv``, ``PythonMod``, ...)."""
    return {k: v for k, v in vars(functions).items()
            if isinstance(v, type) and issubclass(v, sympy.Basic)}


def _parse(text: str, names: dict[str, Any]) -> sympy.Basic:
    return sympy.sympify(text, locals=names)


def _key(e: sympy.Basic) -> str:
    """One text for a relation however it is oriented (``0 < u0`` is ``u0 > 0``)."""
    if isinstance(e, sympy.core.relational.Relational):
        return min(str(e), str(e.reversed))
    return str(e)


def guard(expr: str, result: str, names: dict[str, Any]) -> sympy.Basic:
    """What must hold at every step for the example's side to be the right one: the
    expression itself, its negation, or its equality with the traced value."""
    e = _parse(expr, names)
    # (a bare symbol is a sympy Boolean too: u0 fixed to 4 is a number's guard)
    boolean = isinstance(e, (sympy.logic.boolalg.BooleanFunction, sympy.logic.boolalg.BooleanAtom,
                             sympy.core.relational.Relational))
    if boolean:
        truth = result.strip() in ("True", "true", "1")
        return e if truth else sympy.Not(e)
    return sympy.Eq(e, _parse(result, names))


def _stated(gm: fx.GraphModule, names: dict[str, Any]) -> set[str]:
    """The guards the graph's own ``_assert_scalar`` nodes check."""
    out = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is _ASSERT and len(n.args) > 1:
            text = str(n.args[1]).removeprefix(_PREFIX).split(" on node ")[0]
            try:
                out.add(_key(_parse(text, names)))
            except (sympy.SympifyError, SyntaxError, TypeError):
                continue
    return out


def _holder(n: fx.Node) -> Callable[[], fx.Node]:
    return lambda: n


def _known_values(gm: fx.GraphModule) -> dict[str, Callable[[], fx.Node]]:
    """Expression text -> how to get a node holding that value: a node whose traced value
    is symbolic, or a size of a tensor that is (inserted after the tensor on demand)."""
    known: dict[str, Callable[[], fx.Node]] = {}
    g = gm.graph
    for n in g.nodes:
        val = n.meta.get("val")
        if isinstance(val, _SYM_TYPES):
            known.setdefault(str(val.node.expr), _holder(n))
        elif isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and not isinstance(size.node.expr, sympy.Integer):
                    def size_node(n: fx.Node = n, d: int = d) -> fx.Node:
                        with g.inserting_after(n):
                            s = g.call_function(torch.ops.aten.sym_size.int, (n, d))
                        s.meta["val"] = n.meta["val"].shape[d]
                        return s
                    known.setdefault(str(size.node.expr), size_node)
    return known


_RELATIONS: dict[type, Callable[[Any, Any], Any]] = {
    sympy.Eq: operator.eq, sympy.Ne: operator.ne, sympy.Lt: operator.lt,
    sympy.Le: operator.le, sympy.Gt: operator.gt, sympy.Ge: operator.ge,
}


def _build(e: Any, known: dict[str, Callable[[], fx.Node]], g: fx.Graph,
           made: list[fx.Node]) -> Any:
    """``e`` as nodes of ``g`` over the known values (``made`` collects the nodes used or
    created, so that the check goes after all of them)."""
    if str(e) in known:
        node = known[str(e)]()
        made.append(node)
        return node
    if isinstance(e, (sympy.core.relational.Relational, sympy.logic.boolalg.BooleanFunction)) \
            and not isinstance(e, sympy.Not):
        negated = sympy.Not(e)  # Ne(u0, 1) of a boolean .item() the graph holds as Eq(u0, 1)
        if str(negated) in known:
            return _build(sympy.Not(negated, evaluate=False), known, g, made)
    if e is sympy.true or e is sympy.false:
        return bool(e)
    if isinstance(e, sympy.Integer):
        return int(e)
    if isinstance(e, sympy.Float):
        return float(e)

    def call(fn: Callable, *args: Any) -> fx.Node:
        node = g.call_function(fn, tuple(args))
        made.append(node)
        return node

    if isinstance(e, sympy.core.relational.Relational) and type(e) in _RELATIONS:
        return call(_RELATIONS[type(e)], _build(e.lhs, known, g, made),
                    _build(e.rhs, known, g, made))
    if isinstance(e, sympy.Not):
        return call(torch.sym_not, _build(e.args[0], known, g, made))
    folds: dict[type, Callable] = {sympy.And: operator.and_, sympy.Or: operator.or_,
                                   sympy.Add: operator.add, sympy.Mul: operator.mul}
    for kind, fn in folds.items():
        if isinstance(e, kind):
            parts = [_build(a, known, g, made) for a in e.args]  # type: ignore[attr-defined]
            out = parts[0]
            for p in parts[1:]:
                out = call(fn, out, p)
            return out
    raise Unchecked(str(e))


def add_branch_checks(gm: fx.GraphModule, failures: list[tuple[str, str, str]]) -> None:
    """Make the graph check every guard of ``failures`` ((expression, traced value, where
    in the model)) at run time; raises ``Unchecked`` naming the first it cannot."""
    names = _namespace()
    stated = _stated(gm, names)
    known = _known_values(gm)
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    for expr, result, where in failures:
        try:
            want = guard(expr, result, names)
        except (sympy.SympifyError, SyntaxError, TypeError) as e:
            raise Unchecked(f"{expr} at {where}") from e
        if _key(want) in stated:
            continue
        # built at the graph's end, then moved after the last value it reads
        out = next(n for n in g.nodes if n.op == "output")
        made: list[fx.Node] = []
        with g.inserting_before(out):
            try:
                cond = _build(want, known, g, made)
            except Unchecked:
                for n in reversed(made):
                    if n not in order and not n.users:
                        g.erase_node(n)
                raise Unchecked(f"{want} at {where}") from None
            if not isinstance(cond, fx.Node):
                continue  # a constant guard: nothing depends on the data
            check = g.call_function(_ASSERT, (cond, f"{_PREFIX}{want} on node '{cond.name}'"))
        new = [m for m in made if m not in order]
        reads = [m for m in made if m in order] + [a for m in new for a in m.all_input_nodes
                                                   if a in order]
        anchor = max(reads, key=order.__getitem__)
        for n in new + [check]:
            anchor.append(n)
            anchor = n
        stated.add(_key(want))
    g.lint()
    gm.recompile()


def mark_branch_checks(gm: fx.GraphModule, where: str) -> None:
    """Mark the graph's ``_assert_scalar`` nodes as the checks of the branches draft_export
    fixed (at ``where``), to be kept at lowering (the checks of an ordinary export are the
    model's own asserts, dropped there), and every number they read as the step's own.

    The trace may know such a number only because the check asserts it: torch 2.11 binds
    the ``.item()`` of ``if x.sum() > 0`` to True once its check is in the graph, and
    lowering, which folds a number the trace knows into a constant, would leave the check
    comparing constants."""
    todo = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _ASSERT]
    for n in todo:
        n.meta[KEEP_CHECK] = where
    while todo:
        for a in todo.pop().all_input_nodes:
            if not isinstance(a.meta.get("val"), torch.Tensor) and not a.meta.get(CHECKED_NUMBER):
                a.meta[CHECKED_NUMBER] = True
                todo.append(a)
