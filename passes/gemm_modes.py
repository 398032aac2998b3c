"""Run each GEMM of the step program in a chosen form: NN, NT or TN.

Reads:  a part of the step program (``joint.py``); each ``aten.mm``, ``aten.bmm``
        and ``aten.addmm`` node and its operands' values (``meta["val"]``: shape,
        strides, dtype, device); ``ctx.options.gemm_modes``
Writes: before a GEMM whose operands are not stored as its form asks, a copy of the
        operand into that layout (a contiguous clone, between two transposes for a "T"
        operand); ``meta[GEMM] = {"traced", "mode", "key"}`` on every GEMM it looked at. With
        ``"auto"`` the pass only times (``gm.meta[GEMM_TIMES]``); ``settle`` rewrites once
        every rank's timings are in
Keeps:  every value an op reads (a copy holds the same numbers) and every collective

The form of a product is the layout of its operands (``runtime/gemm.py``). ``"NN"``,
``"NT"``, ``"TN"`` put every GEMM in that form; ``"auto"`` times, on the first batch,
each GEMM as traced and in the two or three forms it is not in, the copies included,
sums the times over all ranks, and keeps the fastest (AxoNN's BLAS tuning, the paper's
section V-C). The choice is kept per GEMM key (op, shapes, traced layouts, dtype,
device) for the process, so a later step program with the same GEMMs times nothing.

Numerics: the copies change no value, but a BLAS kernel of another form may add a
product's K terms in another order: each entry of the result can differ in the last
bits (the rounding of a K-term sum), as between two BLAS libraries. ``"default"`` and a
form that is already the traced one change nothing.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from shardc.core.context import CompileContext
from shardc.passes.schedule import SCHEDULE, overlaps
from shardc.runtime import functional as F
from shardc.runtime import gemm as G
from shardc.runtime.collectives import get_runtime

aten = torch.ops.aten
GEMM = "shardc_gemm"  # node.meta of a GEMM: {"traced": form, "mode": form run, "key"}
GEMM_TIMES = "shardc_gemm_times"  # gm.meta (auto, before settle): key -> form -> seconds

# target -> index of the (A, B) operands among its args; ``F.mm_into`` is an mm whose
# result goes into a bucket (``into_bucket.py``): the same product, timed as mm
_OPERANDS: dict[Any, tuple[int, int]] = {aten.mm.default: (0, 1), aten.bmm.default: (0, 1),
                                         aten.addmm.default: (1, 2), F.mm_into: (1, 2)}
_AS_OP: dict[Any, Any] = {F.mm_into: aten.mm.default}


def _op(n: fx.Node) -> Any:
    return _AS_OP.get(n.target, n.target)


def gemm_nodes(g: fx.Graph) -> list[fx.Node]:
    out = []
    for n in g.nodes:
        idx = _OPERANDS.get(n.target) if n.op == "call_function" else None
        if idx is None:
            continue
        if all(isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
               for a in (n.args[i] for i in idx)):
            out.append(n)
    return out


def _val(n: fx.Node, i: int) -> torch.Tensor:
    a = n.args[i]
    assert isinstance(a, fx.Node)
    return a.meta["val"]


def _vals(n: fx.Node) -> list[torch.Tensor]:
    """What ``time_forms`` needs: (bias,) A, B."""
    i, j = _OPERANDS[n.target]
    head = [_val(n, 0)] if n.target is aten.addmm.default else []
    return [*head, _val(n, i), _val(n, j)]


def key(n: fx.Node) -> tuple:
    vals = _vals(n)
    a, b = vals[-2], vals[-1]
    return (str(_op(n)), tuple(tuple(v.shape) for v in vals), G.form(a, b), str(a.dtype),
            a.device.type)


def gemm_modes_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    mode = ctx.options.gemm_modes
    if mode == "default":
        return gm
    nodes = gemm_nodes(gm.graph)
    if mode == "auto":
        times: dict[tuple, dict[str, float]] = {}
        for n in nodes:
            k = key(n)
            if k not in get_runtime(ctx.rt).gemm_forms and k not in times:
                vals = _vals(n)
                times[k] = G.time_forms(_op(n), vals, vals[-1].device)
        gm.meta[GEMM_TIMES] = times
        return gm
    return _rewrite(gm, {n: mode for n in nodes})


def settle(parts: list[fx.GraphModule], ctx: CompileContext) -> None:
    """``gemm_modes="auto"``: agree with every rank on the form of each GEMM timed by the
    pass, then rewrite ``parts``. Every rank calls it once per step program built, after
    every rank built one (it communicates)."""
    if ctx.options.gemm_modes != "auto":
        return
    local: dict[tuple, dict[str, float]] = {}
    for gm in parts:
        local.update(gm.meta.pop(GEMM_TIMES, {}))
    chosen = get_runtime(ctx.rt).gemm_forms
    chosen.update(G.agree(local))
    for gm in parts:
        _rewrite(gm, {n: chosen.get(key(n), "traced") for n in gemm_nodes(gm.graph)})

        if SCHEDULE in gm.meta:
            gm.meta[SCHEDULE] = overlaps(gm.graph)


def _rewrite(gm: fx.GraphModule, choice: dict[fx.Node, str]) -> fx.GraphModule:
    g = gm.graph
    changed = False
    for n, mode in choice.items():
        i, j = _OPERANDS[n.target]
        traced = G.form(_val(n, i), _val(n, j))
        n.meta[GEMM] = {"traced": traced, "mode": traced if mode == "traced" else mode,
                        "key": key(n)}
        if mode == "traced" or mode == traced:
            continue
        args = list(n.args)
        for idx, want in zip((i, j), G.WANT[mode]):
            x = args[idx]
            assert isinstance(x, fx.Node)
            if G.layout(x.meta["val"]) != want:
                with g.inserting_before(n):
                    args[idx] = _copy_as(g, x, want)
                changed = True
        n.args = tuple(args)
    if changed:
        g.lint()
        gm.recompile()
    return gm


def _copy_as(g: fx.Graph, x: fx.Node, want: str) -> fx.Node:
    def call(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        node = g.call_function(target, args, kwargs)
        vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        node.meta["val"] = target(*vals, **kwargs)
        return node

    if want == "N":
        return call(aten.clone.default, x, memory_format=torch.contiguous_format)
    t = call(aten.transpose.int, x, -2, -1)
    c = call(aten.clone.default, t, memory_format=torch.contiguous_format)
    return call(aten.transpose.int, c, -2, -1)
