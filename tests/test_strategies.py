"""Each rule's layout decision on its own: a strategy is a pure function of the node's
static arguments and its inputs' layouts and shapes, so it is tested here without
tracing, compiling or any process group. (The sweep, tests/test_rules_*.py, runs every
rule end to end against one device.)"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

import shardc
from shardc.core.ir import Val
from shardc.core.placement import Layout
from shardc.passes.rules import STRATEGIES

pytestmark: list = []  # one process, fast: the fast tier

aten = torch.ops.aten
MESH = shardc.Mesh(x=2, y=2, z=2)


def _decide(target: Any, inputs: list[tuple[list[int], Layout]], args_after: tuple = (),
            out_shape: list[int] | None = None, out_dtype: torch.dtype = torch.float32,
            pass_inputs: list[Any] | None = None):
    """Build ``target(*inputs, *args_after)`` as a one-node graph and ask its strategy."""
    g = fx.Graph()
    nodes, vals = [], {}
    for i, (shape, lay) in enumerate(inputs):
        n = g.placeholder(f"a{i}")
        val = torch.empty(shape, device="meta")
        n.meta["val"] = val
        nodes.append(n)
        vals[n] = Val(None, lay, val)
    def arg(a: Any) -> Any:
        if isinstance(a, list):
            return [arg(b) for b in a]
        return nodes[a] if isinstance(a, int) else a.value
    args = tuple(nodes if pass_inputs is None else [arg(a) for a in pass_inputs]) + tuple(args_after)
    node = g.call_function(target, args)
    node.meta["val"] = torch.empty(out_shape or inputs[0][0], device="meta", dtype=out_dtype)
    s = STRATEGIES[target](node, vals, MESH)
    return [s.needs.get(n) for n in nodes], s.out


class C:  # a number argument, in pass_inputs
    def __init__(self, value: Any) -> None:
        self.value = value


P_Y = Layout.of(2, {"x": 1}, partial={"y": "sum"})  # a GEMM's output: cols over x, sum over y


def test_a_partial_sum_flows_only_through_linear_ops() -> None:
    needs, out = _decide(aten.add.Tensor, [([4, 8], P_Y), ([4, 8], P_Y)])
    assert out.partial == (("y", "sum"),) and needs == [P_Y, P_Y]
    # x * x is not linear in x: the one input is reduced first
    needs, out = _decide(aten.mul.Tensor, [([4, 8], P_Y)], pass_inputs=[0, 0])
    assert out.partial == () and needs[0].partial == ()
    # x + 1.0 would add the 1 once per rank of the sum
    needs, out = _decide(aten.add.Tensor, [([4, 8], P_Y)], pass_inputs=[0, C(1.0)])
    assert out.partial == ()
    # scaling by a number keeps it partial; gelu does not
    needs, out = _decide(aten.mul.Tensor, [([4, 8], P_Y)], pass_inputs=[0, C(0.5)])
    assert out.partial == (("y", "sum"),)
    needs, out = _decide(aten.gelu.default, [([4, 8], P_Y)])
    assert out.partial == () and needs[0] == Layout.of(2, {"x": 1})


def test_a_mean_may_take_a_constant_addend() -> None:
    avg = Layout.of(1, partial={"z": "avg"})
    _, out = _decide(aten.add.Tensor, [([4], avg)], pass_inputs=[0, C(1e-6)])
    assert out.partial == (("z", "avg"),)  # mean(a_r + c) = mean(a_r) + c


def test_reductions_over_a_cut_dim_leave_partials() -> None:
    x = Layout.of(2, {"z": 0, "x": 1})
    _, out = _decide(aten.sum.dim_IntList, [([4, 8], x)], ([1], False), out_shape=[4])
    assert out == Layout.of(1, {"z": 0}, partial={"x": "sum"})
    _, out = _decide(aten.mean.dim, [([4, 8], x)], ([0], True), out_shape=[1, 8])
    assert out == Layout.of(2, {"x": 1}, partial={"z": "avg"})
    # a max over a cut dim needs the dim whole (a partial max has no use downstream here)
    needs, out = _decide(aten.amax.default, [([4, 8], x)], ([1], False), out_shape=[4])
    assert needs[0] == Layout.of(2, {"z": 0}) and out == Layout.of(1, {"z": 0})


def test_views_permutes_and_along_dim_ops_move_cuts() -> None:
    x = Layout.of(2, {"x": 1})
    _, out = _decide(aten.permute.default, [([4, 8], x)], ([1, 0],), out_shape=[8, 4])
    assert out == Layout.of(2, {"x": 0})
    needs, out = _decide(aten._softmax.default, [([4, 8], x)], (1, False))
    assert needs[0] == Layout.replicate(2) and out == Layout.replicate(2)
    needs, out = _decide(aten._softmax.default, [([4, 8], x)], (0, False))
    assert needs[0] == x and out == x  # softmax over rows leaves the column cut alone
    a, b = Layout.of(2, {"z": 0}), Layout.of(2, {"z": 0})
    needs, out = _decide(aten.cat.default, [([4, 8], a), ([4, 8], b)], (1,), out_shape=[4, 16],
                         pass_inputs=[[0, 1]])
    assert needs == [a, b] and out == Layout.of(2, {"z": 0})
    # concatenating along the cut dim needs it whole
    needs, out = _decide(aten.cat.default, [([4, 8], a), ([4, 8], b)], (0,), out_shape=[8, 8],
                         pass_inputs=[[0, 1]])
    assert needs == [Layout.replicate(2)] * 2 and out == Layout.replicate(2)


def test_attention_keeps_heads_whole() -> None:
    q = Layout.of(4, {"z": 0, "x": 1, "y": 3})  # head dim cut over y: must be whole
    needs, out = _decide(aten.scaled_dot_product_attention.default,
                         [([2, 4, 8, 16], q), ([2, 4, 8, 16], q), ([2, 4, 8, 16], q)])
    assert needs[0] == Layout.of(4, {"z": 0, "x": 1})
    assert out == Layout.of(4, {"z": 0, "x": 1})


def test_convolution_and_pooling_keep_the_batch_cut() -> None:
    # batch over data, channels over z, width over x; the weight a stored shard over y
    x = Layout.of(4, {"data": 0, "z": 1, "x": 3})
    needs, out = _decide(aten.conv2d.default, [([8, 4, 6, 6], x), ([2, 4, 3, 3], Layout.of(4, {"y": 0}))],
                         out_shape=[8, 2, 4, 4])
    # each rank convolves its own samples over every channel and position, weight whole
    assert needs == [Layout.of(4, {"data": 0}), Layout.replicate(4)]
    assert out == Layout.of(4, {"data": 0})
    # an unbatched input (C, H, W) has no sample dim to keep
    needs, out = _decide(aten.conv2d.default, [([4, 6, 6], Layout.of(3, {"z": 0})),
                                                ([2, 4, 3, 3], Layout.replicate(4))], out_shape=[2, 4, 4])
    assert needs[0] == Layout.replicate(3) and out == Layout.replicate(3)
    # pooling keeps channels cut as well; a partial sum is reduced first (max is not linear)
    p = Layout.of(4, {"data": 0, "z": 1, "x": 3}, partial={"y": "sum"})
    needs, out = _decide(aten.max_pool2d_with_indices.default, [([8, 4, 6, 6], p)], ([2, 2],),
                         out_shape=[8, 4, 3, 3])
    assert needs[0] == Layout.of(4, {"data": 0, "z": 1}) and out == needs[0]
    needs, out = _decide(aten._adaptive_avg_pool2d.default, [([8, 4, 6, 6], x)], ([1, 1],),
                         out_shape=[8, 4, 1, 1])
    assert out == Layout.of(4, {"data": 0, "z": 1})
    # group norm mixes a sample's channels: only the batch cut stays
    needs, out = _decide(aten.group_norm.default, [([8, 4, 6, 6], x)], (2,))
    assert needs[0] == Layout.of(4, {"data": 0}) and out == needs[0]


def test_a_constant_like_its_input_is_made_where_the_input_is() -> None:
    p = Layout.of(2, {"data": 0}, partial={"x": "sum"})
    needs, out = _decide(aten.full_like.default, [([4, 8], p)], (1.0,))
    # the input's values are never read, so nothing moves; the constant is whole over x
    assert needs == [p] and out == Layout.of(2, {"data": 0})


def test_lookups_and_writes_keep_the_cut_either_side_has() -> None:
    whole, rows = Layout.replicate(2), Layout.of(2, {"data": 0})
    # gather along dim 1 from a whole table with a batch-cut index: the table is cut to
    # match (free), nothing gathered
    needs, out = _decide(aten.gather.default, [([4, 6], whole), ([4, 2], rows)],
                         pass_inputs=[0, C(1), 1], out_shape=[4, 2])
    assert needs == [rows, rows] and out == rows
    # the gathered dim itself must be whole, and dims whose sizes differ too
    needs, out = _decide(aten.gather.default, [([4, 6], Layout.of(2, {"x": 1})), ([2, 6], rows)],
                         pass_inputs=[0, C(1), 1], out_shape=[2, 6])
    assert needs == [whole, whole] and out == whole
    # a shifted copy written into a fresh (whole) tensor keeps the source's batch cut
    needs, out = _decide(aten.slice_scatter.default, [([4, 6], whole), ([4, 5], rows)],
                         (1, 1, 6), out_shape=[4, 6])
    assert needs == [rows, rows] and out == rows
    needs, out = _decide(aten.select_scatter.default, [([4, 6], whole), ([4], Layout.of(1, {"data": 0}))],
                         (1, 0), out_shape=[4, 6])
    assert needs == [rows, Layout.of(1, {"data": 0})] and out == rows
    # x.copy_(src) broadcasting a whole row into a batch-cut tensor
    needs, out = _decide(aten.copy.default, [([4, 6], rows), ([6], Layout.replicate(1))])
    assert needs == [rows, Layout.replicate(1)] and out == rows
    # torch.cat skips a 1-D empty tensor beside tensors of more dims (a DynamicCache's start)
    z = Layout.of(3, {"z": 0})
    needs, out = _decide(aten.cat.default, [([0], Layout.replicate(1)), ([4, 2, 6], z)], (-2,),
                         out_shape=[4, 2, 6], pass_inputs=[[0, 1]])
    assert needs == [Layout.replicate(1), z] and out == z


def _index_by_aranges(x_shape: list[int], x_lay: Layout, spans: list[tuple[int, list[int]]],
                      out_shape: list[int]):
    """``x[i0, i1, ...]`` where index j is ``arange(n_j)`` unsqueezed at the dims listed:
    the graph transformers' attention masks trace to."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(x_shape, device="meta")
    idx = []
    for n, unsqueeze_at in spans:
        t = g.call_function(aten.arange.default, (n,))
        t.meta["val"] = torch.empty([n], dtype=torch.long, device="meta")
        t = g.call_function(aten.add.Tensor, (t, 0))
        t.meta["val"] = torch.empty([n], dtype=torch.long, device="meta")
        shape = [n]
        for d in unsqueeze_at:
            t = g.call_function(aten.unsqueeze.default, (t, d))
            shape.insert(d, 1)
            t.meta["val"] = torch.empty(shape, dtype=torch.long, device="meta")
        idx.append(t)
    node = g.call_function(aten.index.Tensor, (x, idx))
    node.meta["val"] = torch.empty(out_shape, device="meta")
    return node, {x: Val(None, x_lay, x.meta["val"])}


def test_indexing_by_whole_aranges_keeps_every_cut() -> None:
    # padding_mask[b[:, None, None, None], kv[None, None, None, :]]: (B, S) -> (B, 1, 1, S)
    from shardc.passes.rules.view import _by_aranges

    lay = Layout.of(2, {"data": 0, "x": 1})
    node, vals = _index_by_aranges([4, 6], lay, [(4, [1, 2, 3]), (6, [0, 0, 0])], [4, 1, 1, 6])
    s = STRATEGIES[aten.index.Tensor](node, vals, MESH)
    assert s.out == Layout.of(4, {"data": 0, "x": 3}) and s.needs[node.args[0]] == lay
    # swapped: a transpose, the cuts swap with the dims
    node, vals = _index_by_aranges([4, 6], lay, [(4, [0]), (6, [1])], [6, 4])
    assert STRATEGIES[aten.index.Tensor](node, vals, MESH).out == Layout.of(2, {"data": 1, "x": 0})
    # an arange of part of its dim is a lookup, two along one dim a diagonal: not this
    # (the fallback runs them whole)
    assert _by_aranges(*_index_by_aranges([4, 6], lay, [(2, [1]), (6, [0])], [2, 6])) is None
    assert _by_aranges(*_index_by_aranges([4, 4], lay, [(4, []), (4, [])], [4])) is None


def test_value_index_pairs_need_their_dim_whole() -> None:
    x = Layout.of(2, {"data": 0, "x": 1})
    needs, out = _decide(aten.topk.default, [([4, 8], x)], (3, -1), out_shape=[4, 3])
    assert needs[0] == Layout.of(2, {"data": 0}) and out == needs[0]
    # a max over dim 1 drops it (its indices too); over dim 0 with keepdim it stays
    needs, out = _decide(aten.max.dim, [([4, 8], x)], (1,), out_shape=[4])
    assert out == Layout.of(1, {"data": 0})
    needs, out = _decide(aten.min.dim, [([4, 8], x)], (0, True), out_shape=[1, 8])
    assert needs[0] == Layout.of(2, {"x": 1}) and out == needs[0]


def test_lookups_and_writes_by_several_indices_keep_the_other_dims_cut() -> None:
    lay = Layout.of(3, {"data": 0, "x": 2})
    whole = Layout.replicate(2)
    # x[:, i, j] (adjacent): the indices' broadcast dims replace the indexed ones
    needs, out = _decide(aten.index.Tensor, [([4, 6, 3], lay), ([2, 1], whole), ([1, 3], whole)],
                         pass_inputs=[0, [C(None), 1, 2]], out_shape=[4, 2, 3])
    assert needs[0] == Layout.of(3, {"data": 0}) and out == Layout.of(3, {"data": 0})
    assert needs[1] == whole and needs[2] == whole
    # x[i, :, j] (apart): the broadcast dims go first, the middle dim keeps its cut
    needs, out = _decide(aten.index.Tensor, [([4, 6, 3], Layout.of(3, {"data": 0, "x": 1})),
                                             ([5], Layout(1)), ([5], Layout(1))],
                         pass_inputs=[0, [1, C(None), 2]], out_shape=[5, 6])
    assert out == Layout.of(2, {"x": 1})
    # x[:, i] += v: v is cut as x[:, i] is; a whole target takes the values' cuts
    cut = Layout.of(2, {"data": 0})
    needs, out = _decide(aten.index_put.default, [([4, 6], cut), ([3], Layout(1)), ([4, 3], whole)],
                         pass_inputs=[0, [C(None), 1], 2, C(True)])
    assert out == cut and needs[2] == cut
    needs, out = _decide(aten.index_put.default, [([4, 6], whole), ([3], Layout(1)), ([4, 3], cut)],
                         pass_inputs=[0, [C(None), 1], 2, C(True)])
    assert out == cut and needs[0] == cut


def test_scatter_diagonal_and_grid_sample_keep_the_batch_cut() -> None:
    cut = Layout.of(2, {"data": 0, "x": 1})
    needs, out = _decide(aten.scatter_add.default, [([4, 6], cut), ([4, 6], Layout(2)), ([4, 6], Layout(2))],
                         pass_inputs=[0, C(1), 1, 2])
    assert out == Layout.of(2, {"data": 0}) and needs == [out, out, out]
    _, out = _decide(aten.diagonal.default, [([4, 3, 3], Layout.of(3, {"data": 0, "x": 1}))],
                     (0, 1, 2), out_shape=[4, 3])
    assert out == Layout.of(2, {"data": 0})
    needs, out = _decide(aten.grid_sampler_2d.default,
                         [([4, 8, 5, 5], Layout.of(4, {"data": 0, "x": 1})), ([4, 3, 3, 2], Layout(4))],
                         (0, 0, False), out_shape=[4, 8, 3, 3])
    assert out == Layout.of(4, {"data": 0, "x": 1}) and needs[1] == Layout.of(4, {"data": 0})


def test_variance_needs_its_dims_whole_and_any_leaves_a_partial_max() -> None:
    lay = Layout.of(2, {"data": 0, "x": 1})
    needs, out = _decide(aten.var.correction, [([4, 6], lay)], ([1],), out_shape=[4])
    assert needs[0] == Layout.of(2, {"data": 0}) and out == Layout.of(1, {"data": 0})
    needs, out = _decide(aten.any.dim, [([4, 6], lay)], (1,), out_shape=[4], out_dtype=torch.bool)
    assert needs[0] == lay and out == Layout.of(1, {"data": 0}, partial={"x": "max"})
    _, out = _decide(aten.all.dim, [([4, 6], lay)], (0,), out_shape=[6], out_dtype=torch.bool)
    assert out == Layout.of(1, {"x": 0}, partial={"data": "min"})
