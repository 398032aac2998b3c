"""Rows the data picks, each rank its own.

``passes/data_sized.py`` traced a region of picked rows (``torch.where(mask)``, ``x[mask]``
written back by ``index_add_`` or ``y[mask] = ...``: an ``index_put``) at its bound. Op by op, its
``nonzero_static`` would gather a batch-cut mask and every rank would pick, and compute,
the whole batch's rows. The region as a whole is row-local: each picked row is read from
where the mask marks it and written back to the same place. So when the mask arrives cut,
every rank runs ``nonzero_static`` on its own block of the mask, at its own bound (the
block's elements): the positions it gets are the block's, and every tensor the region
reads or writes by them is laid out with those dims cut as the mask's (a size equal to the
mask dim's, else the region is not taken). As in a routing region, a row value then
stands for the rows of every rank, one rank's after another, so the row-wise ops between
keep their ordinary rules; the padding's scratch slot is one per rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from shardc.core.ir import Val
from shardc.core.placement import Layout
from shardc.passes.data_sized import PICKED, Picked

if TYPE_CHECKING:  # the lowering calls the rules; they only name its type
    from shardc.passes.lower import Lowering

aten = torch.ops.aten

Rule = Callable[["Lowering", fx.Node], Any]


@dataclass
class _Taken:
    rec: Picked
    mask: Layout | None = None  # the mask's layout, once the region is taken
    axes: tuple[str, ...] = ()  # every axis the mask is cut over, in its dims' order

    @property
    def pads(self) -> set[fx.Node]:
        return {p for p, _, _, _ in self.rec.writes}


def picked_rules(graph: fx.Graph) -> dict[fx.Node, Rule]:
    """The rules of the nodes of every padded region of ``graph`` that the region itself
    decides: the pick, the lookups by its positions and the writes back."""
    out: dict[fx.Node, Rule] = {}
    for n in graph.nodes:
        rec = n.meta.get(PICKED)
        if not isinstance(rec, Picked):
            continue
        st = _Taken(rec)
        out[n] = _pick_rule(st)
        for s in rec.sources:
            out[s] = _source_rule(st)
        for pad, w, cut, dim in rec.writes:
            out[pad] = _pad_rule(st, w)
            out[w] = _write_rule(st)
            out[cut] = _cut_rule(st, w, dim)
    return out


def _ordinary(L: Lowering, node: fx.Node) -> Any:
    return L.rule_for(node)(L, node)


def _indexed(st: _Taken, node: fx.Node) -> dict[int, int]:
    """For a lookup or a write by the region's positions: dim of the tensor -> the mask dim
    whose positions index it."""
    return {d: st.rec.cols[i] for d, i in enumerate(node.args[1]) if i is not None}


def _fits(st: _Taken, node: fx.Node, mask_shape: list[int], cut: list[bool]) -> bool:
    """Does every dim indexed by a cut mask dim have that dim's size (so a rank's block of
    it is the same rows as its block of the mask)?"""
    x = node.args[0]
    if x in st.pads:  # a write: the tensor before its scratch slot
        x = x.args[0]
    x = x.meta["val"]
    return all(not cut[j] or int(x.shape[d]) == mask_shape[j] for d, j in _indexed(st, node).items())


def _laid_like_mask(st: _Taken, lay: Layout | None, ndim: int, indexed: dict[int, int]) -> Layout:
    """``lay`` with its indexed dims cut as their mask dims, and the region's axes taken off
    every other dim (no partial: the region computes on values)."""
    assert st.mask is not None
    dims = [tuple(a for a in d if a not in st.axes) for d in (lay.dims if lay else [()] * ndim)]
    il = list(lay.interleave) if lay else [1] * ndim
    for d, j in indexed.items():
        dims[d], il[d] = st.mask.dims[j], 1
    il = [k if dims[d] else 1 for d, k in enumerate(il)]
    return Layout(ndim, tuple(dims), (), tuple(il))


def _rows_of(st: _Taken, base: Layout, indexed: dict[int, int]) -> Layout:
    """The layout of ``x[..., cols, ...]`` for ``x`` laid out as ``base``: the positions'
    dim (where torch puts it) cut over the region's axes, x's other dims as they are."""
    at = sorted(indexed)
    rest = [d for d in range(base.ndim) if d not in indexed]
    front = at == list(range(at[0], at[0] + len(at)))
    before = [d for d in rest if front and d < at[0]]
    order: list[int | None] = before + [None] + [d for d in rest if d not in before]
    dims = tuple(st.axes if d is None else base.dims[d] for d in order)
    il = tuple(1 if d is None else base.interleave[d] for d in order)
    return Layout(len(order), dims, (), il)


def _local_cols(L: Lowering, st: _Taken, idx: list) -> list:
    return [None if i is None else L.to_layout(L.env[i], Layout(1, (st.axes,))) for i in idx]


def _pick_rule(st: _Taken) -> Rule:
    def rule(L: Lowering, node: fx.Node) -> Any:
        mask = L.env[node.args[0]]
        lay = mask.layout.clean(L.mesh) if isinstance(mask, Val) and mask.layout is not None else None
        if lay is None:
            return _ordinary(L, node)
        shape = [int(s) for s in mask.shape]
        lay = _like_written(L, st, lay, shape)
        if not any(lay.dims) or any(k != 1 for k in lay.interleave):
            return _ordinary(L, node)  # a whole mask: every rank picks the same rows
        ways = [math.prod(L.mesh.size(a) for a in d) for d in lay.dims]
        cut = [w > 1 for w in ways]
        rec = st.rec
        if any(s % w for s, w in zip(shape, ways)) or \
                not all(_fits(st, n, shape, cut) for n in [*rec.sources, *(w for _, w, _, _ in rec.writes)]):
            return _ordinary(L, node)
        st.mask, st.axes = lay, tuple(a for d in lay.dims for a in d)
        out = Layout(2, (st.axes, ()))
        bound = math.prod(shape) // math.prod(ways)
        n = L.emit(node.target, (L.to_layout(mask, lay),), {"size": bound, "fill_value": -1},
                   layout=out, val=node.meta["val"])
        L.decisions.append(
            f"{node.name} ({L.src.module}:{L.src.line}): each rank picks the rows of its own "
            f"block of the mask over {' and '.join(st.axes)} (up to {bound} of "
            f"{math.prod(shape)}), and computes and writes back only those")
        return Val(n, out.clean(L.mesh), node.meta["val"])
    return rule


def _like_written(L: Lowering, st: _Taken, lay: Layout, shape: list[int]) -> Layout:
    """The mask's layout for the region: each dim cut as the dim it indexes of the first
    tensor written back (else of the first looked up) is cut there, where that tensor is
    cut evenly and its other dims leave those axes free; else as the mask is. Cutting the
    mask finer costs nothing (each rank keeps a block of what it holds); moving the
    written tensor would cost a gather in forward and a reduction in backward."""
    dims = [tuple(d) for d in lay.dims]
    writes = [w for _, w, _, _ in st.rec.writes]
    for n in [*writes, *st.rec.sources]:
        x = n.args[0].args[0] if n in writes else n.args[0]
        v = L.env.get(x)
        if not isinstance(v, Val) or v.layout is None:
            continue
        xl = v.layout.clean(L.mesh)
        indexed = _indexed(st, n)
        for d, j in indexed.items():
            axes = xl.dims[d]
            others = {a for e, ax in enumerate(xl.dims) if e != d for a in ax}
            ways = math.prod(L.mesh.size(a) for a in axes)
            if axes and xl.interleave[d] == 1 and not others & set(axes) and shape[j] % ways == 0 \
                    and int(v.shape[d]) == shape[j] and not any(set(axes) & set(dims[k])
                                                                for k in range(len(dims)) if k != j):
                dims[j] = axes
        break
    return Layout(lay.ndim, tuple(dims), (), tuple(1 for _ in dims))


def _source_rule(st: _Taken) -> Rule:
    def rule(L: Lowering, node: fx.Node) -> Any:
        if st.mask is None:
            return _ordinary(L, node)
        x = L.env[node.args[0]]
        indexed = _indexed(st, node)
        need = _laid_like_mask(st, x.layout.clean(L.mesh) if x.layout is not None else None, x.ndim, indexed)
        out = _rows_of(st, need, indexed)
        n = L.emit(node.target, (L.to_layout(x, need), _local_cols(L, st, list(node.args[1]))), {},
                   layout=out, val=node.meta["val"])
        return Val(n, out.clean(L.mesh), node.meta["val"])
    return rule


def _dest_layout(L: Lowering, st: _Taken, w: fx.Node) -> Layout:
    """The layout a write's target takes (before its scratch slot is added)."""
    dest = L.env[w.args[0].args[0]]
    return _laid_like_mask(st, dest.layout.clean(L.mesh) if dest.layout is not None else None,
                           dest.ndim, _indexed(st, w))


def _pad_rule(st: _Taken, w: fx.Node) -> Rule:
    def rule(L: Lowering, node: fx.Node) -> Any:
        if st.mask is None:
            return _ordinary(L, node)
        dest = L.env[node.args[0]]
        need = _dest_layout(L, st, w)
        # each rank's block gains its own scratch slot: the whole is as many rows longer
        # as the dim has blocks (what the reports count a tensor of it as)
        dim = _scratch_dim(node)
        val = node.meta["val"]
        shape = list(val.shape)
        shape[dim] += math.prod(L.mesh.size(a) for a in need.dims[dim]) - 1
        val = val.new_empty(shape)
        n = L.emit(node.target, (L.to_layout(dest, need), *node.args[1:]), dict(node.kwargs),
                   layout=need, val=val)
        return Val(n, need.clean(L.mesh), val)
    return rule


def _scratch_dim(pad: fx.Node) -> int:
    """The dim ``constant_pad_nd`` lengthens by one (its pad list runs from the last dim)."""
    widths = list(pad.args[1])
    k = next(i for i, w in enumerate(widths) if w)
    return pad.args[0].meta["val"].dim() - 1 - k // 2


def _write_rule(st: _Taken) -> Rule:
    def rule(L: Lowering, node: fx.Node) -> Any:
        if st.mask is None:
            return _ordinary(L, node)
        padded = L.env[node.args[0]]
        need = padded.layout
        indexed = _indexed(st, node)
        v = L.env[node.args[2]]
        rows = _rows_of(st, need, indexed)
        if isinstance(v, Val) and v.ndim == rows.ndim:
            vn = L.to_layout(v, rows)
        else:  # a value of fixed shape, broadcast (``out[rows] = 0``)
            vn = L.to_layout(v, Layout.replicate(v.ndim)) if isinstance(v, Val) else v
        args = (padded.node, _local_cols(L, st, list(node.args[1])), vn, *node.args[3:])
        n = L.emit(node.target, args, dict(node.kwargs), layout=need, val=padded.val)
        return Val(n, need.clean(L.mesh), padded.val)
    return rule


def _cut_rule(st: _Taken, w: fx.Node, dim: int) -> Rule:
    def rule(L: Lowering, node: fx.Node) -> Any:
        if st.mask is None:
            return _ordinary(L, node)
        written = L.env[w]
        lay = written.layout
        size = int(node.meta["val"].shape[dim]) // math.prod(L.mesh.size(a) for a in lay.dims[dim])
        n = L.emit(node.target, (written.node, dim, 0, size), {}, layout=lay, val=node.meta["val"])
        return Val(n, lay.clean(L.mesh), node.meta["val"])
    return rule
