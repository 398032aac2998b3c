"""The eager backend's runner (``shardc.program.backend.direct_calls``): a copy of the step
program that calls each ATen op through torch's Python binding when that binding runs
the same overload. It must change no value, and must refuse a binding that would pick
another overload."""
from __future__ import annotations

import torch
import torch.fx as fx

import shardc
from shardc.program.backend import direct_calls
from shardc.tools.models import GPT

pytestmark: list = []  # one process, fast: the fast tier

aten = torch.ops.aten


def _node(g: fx.Graph, target, *args, **kwargs) -> fx.Node:
    n = g.call_function(target, args, kwargs)
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    n.meta["val"] = target(*vals, **kwargs)
    return n


def _graph() -> tuple[fx.GraphModule, list[fx.Node]]:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 6, device="meta")
    w = g.placeholder("w")
    w.meta["val"] = torch.empty(5, 6, device="meta")
    nodes = [
        _node(g, aten.t.default, w),
        _node(g, aten.add.Tensor, x, 2.0),            # a Python number: add.Tensor either way
        _node(g, aten.add.Scalar, x, 2.0),            # torch.add(x, 2.0) is add.Tensor: refused
        _node(g, aten.view.default, x, [6, 4]),
        _node(g, aten.empty.memory_format, [3], device=torch.device("meta")),  # a factory
    ]
    mm = _node(g, aten.mm.default, x, nodes[0])
    s = _node(g, aten.add.Tensor, mm, 1)
    g.output((s, nodes[1], nodes[2], nodes[3]))
    return fx.GraphModule(torch.nn.Module(), g), [*nodes, mm]


def test_bindings_run_the_same_overload_and_others_are_refused() -> None:
    gm, (t, add_t, add_s, view, empty, mm) = _graph()
    fast = direct_calls(gm)
    by_name = {n.name: n.target for n in fast.graph.nodes if n.op == "call_function"}
    assert by_name[t.name] is torch.t
    assert by_name[mm.name] is torch.mm
    assert by_name[add_t.name] is torch.add
    assert by_name[view.name] is torch.Tensor.view
    assert by_name[add_s.name] is aten.add.Scalar  # its binding dispatches add.Tensor
    assert by_name[empty.name] is aten.empty.memory_format  # not probed: it would allocate
    # the program the passes read is untouched
    assert all(isinstance(n.target, torch._ops.OpOverload)
               for n in gm.graph.nodes if n.op == "call_function")
    x, w = torch.randn(4, 6), torch.randn(5, 6)
    for a, b in zip(gm(x, w), fast(x, w)):
        assert torch.equal(a, b)


def test_a_step_is_the_same_bit_for_bit_with_and_without_the_bindings(fake_world) -> None:
    """One training step of a GPT on x2 (a fake group: its collectives copy this rank's
    input, which both runs see alike): loss and every gradient equal bitwise."""
    fake_world(2)
    torch.manual_seed(0)
    model = GPT(dropout=0.1)
    tokens = torch.randint(0, 64, (4, 16))
    results = []
    for direct in (True, False):
        sm = shardc.compile(model, shardc.Mesh(x=2), example_inputs=(tokens, tokens))
        torch.manual_seed(1)  # the same dropout masks in both runs
        sm(tokens, tokens).backward()  # builds the step program
        sm.zero_grad(set_to_none=True)
        jp = next(iter(sm._joint.values()))
        if direct:
            # most of the program's ATen calls go through their bindings
            ops = [n for n in jp.run_backward.graph.nodes if n.op == "call_function"]
            bound = [n for n in ops if not isinstance(n.target, torch._ops.OpOverload)]
            assert jp.run_backward is not jp.backward and len(bound) > len(ops) // 2
        else:
            jp.run_forward, jp.run_backward = jp.forward, jp.backward
        torch.manual_seed(2)
        loss = sm(tokens, tokens)
        loss.backward()
        results.append((float(loss.detach()), {k: p.grad.clone() for k, p in sm.named_parameters()}))
    (l1, g1), (l2, g2) = results
    assert l1 == l2
    assert g1.keys() == g2.keys() and all(torch.equal(g1[k], g2[k]) for k in g1)
