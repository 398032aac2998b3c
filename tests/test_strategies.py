"""Each rule's layout decision on its own: a strategy is a pure function of the node's
static arguments and its inputs' layouts and shapes, so it is tested here without
tracing, compiling or any process group. (The sweep, tests/test_rules_*.py, runs every
rule end to end against one device.)"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

import shardc
from shardc.passes.lower import Val
from shardc.passes.rules import STRATEGIES
from shardc.placement import Layout

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
