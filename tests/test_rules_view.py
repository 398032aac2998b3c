"""Rule sweep, shape family: view/reshape/flatten/unflatten/expand/squeeze/unsqueeze,
repeat, permute/transpose/t, split/chunk/unbind, cat/stack, slice/select/narrow, flip/roll, pad, Fourier transforms and complex views,
index_select and x[index] along one dim, x[i, j] by several index tensors, x[arange(n), index], gather, scatter, slice/select_scatter, masked writes (``x[mask] = v``), copy, and (values, indices)
ops along one dim (topk, sort, max/min over a dim, kthvalue, median, cummax).
See ``rules_sweep.py``."""
from __future__ import annotations

import itertools

import pytest
import rules_sweep as S
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.sweep  # and slow, but for the fast tier's slice (rules_sweep)

aten = torch.ops.aten
_SPECS: list[S.OpSpec] | None = None


def specs() -> list[S.OpSpec]:
    global _SPECS
    if _SPECS is not None:
        return _SPECS
    g = S.gen(3)
    x = lambda *s: S._t(s, g)  # noqa: E731
    idx = lambda *s, hi: torch.randint(0, hi, s, generator=g)  # noqa: E731
    rot = itertools.cycle(("x2", "y2", "z2", "d2"))

    def V(name, fn, *inputs, two=False):
        meshes = (next(rot),) + (("x2y2",) if two else ())
        return S.OpSpec("view", name, fn, tuple(inputs), meshes=meshes)

    _SPECS = [
        V("view.split_dim", lambda m, a: a.view(4, 2, 3) * 1.0, x(4, 6), two=True),
        V("view.merge", lambda m, a: a.view(4, 12), x(4, 2, 6), two=True),
        V("view.flat", lambda m, a: a.view(24), x(4, 6)),
        V("reshape", lambda m, a: a.reshape(2, 2, 6), x(4, 6)),
        V("_unsafe_view", lambda m, a: aten._unsafe_view.default(a * 1.0, [8, 3]), x(4, 6)),
        V("flatten", lambda m, a: torch.flatten(a, 1), x(4, 2, 6), two=True),
        V("unflatten", lambda m, a: a.unflatten(1, (2, 3)), x(4, 6)),
        V("expand.new_dim", lambda m, a: a.expand(4, 6) * 1.0, x(6)),
        V("expand.size1", lambda m, a: a.expand(4, 6) * 1.0, x(4, 1)),
        V("squeeze.dim", lambda m, a: a.squeeze(1), x(4, 1, 6)),
        V("squeeze.dims", lambda m, a: aten.squeeze.dims(a, [1]), x(4, 1, 6)),
        V("squeeze.default", lambda m, a: aten.squeeze.default(a), x(4, 1, 6)),
        V("unsqueeze", lambda m, a: a.unsqueeze(1), x(4, 6), two=True),
        V("permute", lambda m, a: a.permute(2, 0, 1), x(4, 2, 6), two=True),
        V("transpose", lambda m, a: a.transpose(0, 1), x(4, 6)),
        V("t", lambda m, a: a.t(), x(4, 6)),
        V("split", lambda m, a: torch.split(a, 3, dim=1), x(4, 6), two=True),
        V("split.dim0", lambda m, a: torch.split(a, 2, dim=0), x(4, 6)),
        V("split_with_sizes", lambda m, a: torch.split(a, [2, 4], dim=1), x(4, 6)),
        V("chunk", lambda m, a: torch.chunk(a, 2, dim=1), x(4, 6)),
        V("unbind", lambda m, a: torch.unbind(a, 1), x(4, 2, 6)),
        # into 0-d pieces (JetMoE's tokens per expert), which once failed to lower
        V("unbind.1d", lambda m, a: torch.unbind(a * 1.0), x(4)),
        V("cat.dim1", lambda m, a, b: torch.cat([a, b], 1), x(4, 6), x(4, 2), two=True),
        V("cat.dim0", lambda m, a, b: torch.cat([a, b], 0), x(4, 6), x(2, 6)),
        V("stack", lambda m, a, b: torch.stack([a, b], 1), x(4, 6), x(4, 6)),
        V("slice", lambda m, a: a[:, 1:5], x(4, 6), two=True),
        V("slice.dim0", lambda m, a: a[1:3], x(4, 6)),
        # the whole dim, as torch 2.6 traces ``mask[:, 0]`` (a slice of all of dim 0, then
        # the select): each rank's own shard, which once gathered the batch
        V("slice.whole_dim0", lambda m, a: aten.slice.Tensor(a, 0, 0, 2 ** 63 - 1) * 1.0, x(4, 6),
          two=True),
        V("slice.whole_dim0_negative_end", lambda m, a: aten.slice.Tensor(a, 0, 0, -1) * 1.0, x(4, 6)),
        V("select", lambda m, a: a[:, 2], x(4, 6)),
        V("select.dim0", lambda m, a: a[1], x(4, 6)),
        V("narrow", lambda m, a: a.narrow(1, 1, 4), x(4, 6)),
        # tiling keeps each shard and grows the interleave (DeBERTa-v2 tiles its
        # relative-position keys, cut by head, over the batch)
        V("repeat", lambda m, a: a.repeat(2, 3), x(4, 6), two=True),
        V("repeat.new_dims", lambda m, a: a.repeat(2, 1, 2), x(4, 6)),
        V("repeat.twice", lambda m, a: a.repeat(2, 1).repeat(3, 1) * 1.0, x(4, 6)),
        V("repeat.then_add", lambda m, a, b: a.repeat(2, 1) + b, x(4, 6), x(8, 6), two=True),
        V("repeat.then_sum", lambda m, a: a.repeat(3, 1).sum(0), x(4, 6)),
        # Fourier transforms over some dims: those whole, the rest keep their cuts (FNet)
        V("fft2.real", lambda m, a: torch.fft.fftn(a, dim=(1, 2)).real, x(4, 3, 6), two=True),
        V("rfft.irfft", lambda m, a: torch.fft.irfft(torch.fft.rfft(a, dim=1) * 0.5, n=6, dim=1),
          x(4, 6)),
        V("fft.abs", lambda m, a: torch.fft.fft(a, dim=0).abs(), x(4, 6)),
        V("view_as_real", lambda m, a: torch.view_as_real(torch.fft.fft(a, dim=1)) * 1.0, x(4, 6),
          two=True),
        V("view_as_complex", lambda m, a: torch.view_as_real(torch.view_as_complex(a) * 2.0),
          x(4, 3, 2)),
        V("flip", lambda m, a: torch.flip(a, [1]), x(4, 6)),
        V("roll", lambda m, a: torch.roll(a, 2, 1), x(4, 6)),
        V("roll.flat", lambda m, a: torch.roll(a, 3), x(4, 6)),
        V("constant_pad_nd", lambda m, a: F.pad(a, (1, 1), value=0.5), x(4, 6), two=True),
        V("constant_pad_nd.aten", lambda m, a: aten.constant_pad_nd.default(a, [1, 1], 0.5), x(4, 6)),
        V("pad", lambda m, a: aten.pad.default(a, [1, 2], "constant", 0.0), x(4, 6)),
        # torch.cat skips a 1-D empty tensor (transformers' DynamicCache starts from one)
        V("cat.legacy_empty", lambda m, a: torch.cat([a.new_zeros(0), a], 1), x(4, 6)),
        # x[mask] = v: a boolean mask over the leading dims, v over the trailing ones
        V("index_put.mask", lambda m, a, k, v: aten.index_put.default(a, [k], v), x(4, 2, 6),
          idx(4, 2, hi=2) > 0, x(6), two=True),
        V("index_put.mask_scalar", lambda m, a, k: aten.index_put.default(a, [k], a.new_tensor(0.5)),
          x(4, 6), idx(4, 6, hi=2) > 0),
        V("index_put.mask_accumulate", lambda m, a, k, v: aten.index_put.default(a, [k], v, True),
          x(4, 6, 2), idx(4, 6, hi=2) > 0, x(2)),
        # lookups along one dim (sinusoidal position tables, Falcon's x[..., [-2], :])
        V("index_select", lambda m, a, i: torch.index_select(a, 1, i), x(4, 6), idx(5, hi=6), two=True),
        V("index_select.dim0", lambda m, a, i: torch.index_select(a, 0, i), x(4, 6), idx(6, hi=4)),
        V("index.one", lambda m, a, i: a[:, i], x(4, 6), idx(3, hi=6), two=True),
        V("index.one_2d", lambda m, a, i: a[i], x(4, 6), idx(2, 3, hi=4)),
        V("index.one_middle", lambda m, a, i: a[:, i, :], x(4, 6, 2), idx(4, hi=6)),
        V("index.negative", lambda m, a: a[:, torch.tensor([-2, 0])], x(4, 6)),
        # one entry per row: a classifier's last token, CLIP's end-of-text position
        V("index.per_row", lambda m, a, i: a[torch.arange(4), i], x(4, 6), idx(4, hi=6), two=True),
        V("index.per_row_3d", lambda m, a, i: a[torch.arange(a.shape[0]), i], x(4, 6, 2),
          idx(4, hi=6)),
        # every index an arange of its whole dim, reshaped apart: transformers' attention
        # masks (padding_mask[b_arange[:, None, None, None], kv_arange[None, None, None, :]]),
        # a copy of x with its dims spread out, each keeping its cut; swapped, a transpose
        V("index.aranges_mask", lambda m, a: a[torch.arange(4)[:, None, None, None],
                                               (torch.arange(6) + 0)[None, None, None, :]],
          x(4, 6), two=True),
        V("index.aranges_swapped", lambda m, a: a[torch.arange(4)[None, :], torch.arange(6)[:, None]],
          x(4, 6), two=True),
        V("index.aranges_after_slice", lambda m, a: a[:, torch.arange(6)[:, None], torch.arange(2)],
          x(4, 6, 2)),
        # ... and what is not that: a diagonal, an arange of part of its dim (run whole)
        V("index.aranges_diagonal", lambda m, a: a[torch.arange(4), torch.arange(4)], x(4, 4, 2)),
        V("index.aranges_short", lambda m, a: a[torch.arange(2)[:, None], torch.arange(6)[None, :]],
          x(4, 6)),
        # several index tensors: the indexed dims whole, the others keep their cuts
        # (F.unfold's patches; adjacent, apart, and with a cut index)
        V("index.two_adjacent", lambda m, a, i, j: a[:, i, j], x(4, 6, 3), idx(2, 1, hi=6),
          idx(1, 3, hi=3), two=True),
        V("index.two_apart", lambda m, a, i, j: a[i, :, j], x(4, 6, 3), idx(5, hi=4), idx(5, hi=3)),
        V("index.two_cut_index", lambda m, a, i, j: a[:, i, j], x(4, 6, 2), idx(4, 3, hi=6),
          idx(4, 3, hi=2)),
        V("index.unfold", lambda m, a: F.unfold(a, 2, stride=2), x(2, 2, 4, 4), two=True),
        # writes by integer index tensors: the indexed dims whole, the rest keep their cuts
        V("index_add.dim1", lambda m, a, s_: a.index_add(1, torch.tensor([0, 2, 2]), s_), x(4, 6),
          x(4, 3), two=True),
        V("index_add.into_zeros", lambda m, s_: torch.zeros(4, 6, 2, dtype=s_.dtype).index_add(
            1, torch.tensor([5, 0, 5, 1]), s_), x(4, 4, 2), two=True),
        V("index_copy.dim0", lambda m, a, s_: a.index_copy(0, torch.tensor([3, 1]), s_), x(4, 6),
          x(2, 6)),
        V("index_put.pairs", lambda m, a, s_: a.index_put((torch.tensor([0, 2]), torch.tensor([1, 1])),
                                                          s_, accumulate=True), x(4, 6, 2), x(2, 2)),
        V("index_fill.dim2", lambda m, a: a.index_fill(2, torch.tensor([0, 3]), 0.5), x(4, 2, 6)),
        V("unfold.windows", lambda m, a: a.unfold(1, 3, 2) * 1.0, x(4, 7, 2), two=True),
        V("unfold.last", lambda m, a: a.unfold(-1, 2, 2) * 1.0, x(4, 6)),
        V("diagonal.batched", lambda m, a: torch.diagonal(a, dim1=1, dim2=2) * 1.0, x(4, 3, 3), two=True),
        V("diagonal.offset_first", lambda m, a: torch.diagonal(a, 1, 0, 2) * 1.0, x(3, 4, 3)),
        # a parameter looked up by a cut index (MoE experts' weights by token)
        S.OpSpec("view", "index.parameter_by_index", lambda m, i: m.table[i] * 1.0,
                 (idx(4, 3, hi=5),), meshes=("d2", "x2y2"), params={"table": x(5, 2, 3)}),
        V("gather", lambda m, a, i: torch.gather(a, 1, i), x(4, 6), idx(4, 6, hi=6), two=True),
        V("gather.smaller_index", lambda m, a, i: torch.gather(a, 1, i), x(4, 6), idx(4, 2, hi=6)),
        V("gather.dim0", lambda m, a, i: torch.gather(a, 0, i), x(4, 6), idx(2, 6, hi=4)),
        # writes along a dim: the other dims meet at the same coordinates in all three
        V("scatter_add", lambda m, a, s_, i: torch.scatter_add(a, 1, i, s_), x(4, 6), x(4, 6),
          idx(4, 6, hi=6), two=True),
        V("scatter_add.dim0_smaller", lambda m, a, s_, i: torch.scatter_add(a, 0, i, s_), x(4, 6),
          x(2, 6), idx(2, 6, hi=4)),
        V("scatter.src", lambda m, a, s_, i: torch.scatter(a, 1, i, s_), x(4, 6), x(4, 3),
          idx(4, 3, hi=6)),
        V("scatter.value", lambda m, a, i: torch.scatter(a, 1, i, 2.5), x(4, 6), idx(4, 2, hi=6)),
        V("scatter_reduce.amax", lambda m, a, s_, i: torch.scatter_reduce(a, 1, i, s_, "amax"),
          x(4, 6), x(4, 6), idx(4, 6, hi=6)),
        V("scatter_reduce.mean", lambda m, a, s_, i: torch.scatter_reduce(a, 1, i, s_, "mean",
                                                                          include_self=False),
          x(4, 6), x(4, 6), idx(4, 6, hi=6), two=True),
        V("slice_scatter", lambda m, a, b: torch.slice_scatter(a, b, 1, 2, 6), x(4, 6), x(4, 4),
          two=True),
        V("slice_scatter.dim0", lambda m, a, b: torch.slice_scatter(a, b, 0, 0, 2), x(4, 6), x(2, 6)),
        V("select_scatter", lambda m, a, b: torch.select_scatter(a, b, 1, 0), x(4, 6), x(4)),
        # functional x.copy_(src): T5 and BART shift their labels right this way
        V("copy", lambda m, a, b: (a * 1.0).copy_(b) * a, x(4, 6), x(4, 6)),
        V("copy.broadcast", lambda m, a, b: (a * 1.0).copy_(b) * a, x(4, 6), x(6)),
        V("setitem", lambda m, a, b: _setitem(a, b), x(4, 6), x(4, 5)),
        # along one dim, (values, indices)
        V("topk", lambda m, a: torch.topk(a, 3, dim=-1), x(4, 6), two=True),
        V("sort", lambda m, a: torch.sort(a, dim=0, descending=True), x(4, 6)),
        V("sort.stable", lambda m, a: torch.sort(a, dim=1, stable=True), x(4, 6)),
        V("max.dim", lambda m, a: torch.max(a, dim=1), x(4, 6), two=True),
        V("min.dim.keepdim", lambda m, a: torch.min(a, dim=0, keepdim=True), x(4, 6)),
        V("kthvalue", lambda m, a: torch.kthvalue(a, 2, dim=1), x(4, 6)),
        V("median.dim", lambda m, a: torch.median(a, dim=1), x(4, 6)),
        V("cummax", lambda m, a: torch.cummax(a, dim=1), x(4, 6)),
    ]
    return _SPECS


def _setitem(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Shift right as seq2seq models do with their labels: a new tensor, written in place."""
    out = a.new_zeros(a.shape)
    out[:, 1:] = b
    out[:, 0] = 0.5
    return out * a


CASES, sweep_world, test_rule = S.threaded_family("view", specs)
