"""``passes/remat.py``: under ``backend="inductor"`` the step program saves fewer bytes for
backward and recomputes there what it no longer saves, with the same arithmetic.

The check is exact: the rewritten parts, run op by op (not compiled), give the same
outputs and the same gradients bit for bit as the parts before the pass, on the same
primals and tangents, dropout included (a draw is never recomputed; a value a draw's
in-place scaling writes is never re-read). One process, a fake group of 2 on ``x2``
(collectives not executed; both programs see the same values): the fast tier. The gloo
suite's inductor cases train the rewritten program against float64.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import pytest
import torch
from models import GPT, gpt2, llama

import shardc
from shardc.core.context import COMM, CompileContext
from shardc.core.ir import DEFERRED, StepProgram
from shardc.passes.remat import REMAT, remat_pass
from shardc.tools.models import lm_batch

pytestmark: list = []  # one process, fake group: the fast tier

MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt-dropout": lambda: GPT(vocab=64, dim=32, layers=2, heads=4, seq=16, dropout=0.1),
    "gpt2": lambda: gpt2(vocab=64, dim=32, layers=2, heads=4, seq=16),
    "llama": lambda: llama(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, seq=16),
}


def _recorded_step(sm: shardc.ShardedModule, batch: tuple) -> tuple[StepProgram, list, list]:
    """The step program ``sm`` built, with the primals and tangents of one step of it."""
    sm(*batch).backward()  # builds the step program
    (jp,) = sm._joint.values()
    seen: dict[str, Any] = {}
    fwd, bwd = jp.runners()

    def forward(*primals: Any) -> Any:
        seen["primals"] = primals
        return fwd(*primals)

    def backward(*args: Any) -> Any:
        seen["backward"] = args
        return bwd(*args)

    jp.run_forward, jp.run_backward = forward, backward
    sm(*batch).backward()
    jp.run_forward, jp.run_backward = fwd, bwd
    extra = sum(d.n_inputs for d in jp.forward.meta.get(DEFERRED, []))
    n_saved = len(fwd_outputs(jp.forward)) - jp.n_outputs - extra
    return jp, list(seen["primals"]), list(seen["backward"][n_saved:])


def fwd_outputs(gm: torch.fx.GraphModule) -> list:
    return list(next(n for n in gm.graph.nodes if n.op == "output").args[0])


@torch.no_grad()  # as StepRunner runs them: inside an autograd.Function, grad mode off
def _run(jp: StepProgram, primals: list, tangents: list) -> tuple[list, list]:
    torch.manual_seed(1)  # the same dropout masks for both programs
    out = list(jp.forward(*primals))
    extra = sum(d.n_inputs for d in jp.forward.meta.get(DEFERRED, []))
    saved = out[jp.n_outputs:len(out) - extra]
    grads = list(jp.backward(*saved, *tangents))
    return out[:jp.n_outputs] + out[len(out) - extra:], grads


def _ops(gm: torch.fx.GraphModule, test: Callable[[torch.fx.Node], bool]) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and test(n)]


def _random(n: torch.fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


@pytest.mark.parametrize("name", list(MODELS))
def test_remat_saves_less_and_computes_the_same_bits(fake_world, name: str) -> None:
    fake_world(2)
    torch.manual_seed(0)
    model = MODELS[name]()
    batch = lm_batch(4, 16, 64)
    sm = shardc.compile(model, shardc.Mesh(x=2), batch)  # eager: the pass leaves it alone
    jp, primals, tangents = _recorded_step(sm, batch)
    assert REMAT not in jp.forward.meta
    before = StepProgram(copy.deepcopy(jp.forward), copy.deepcopy(jp.backward), jp.n_outputs,
                         jp.diff_outputs, jp.grad_of, jp.joint)
    after = StepProgram(copy.deepcopy(jp.forward), copy.deepcopy(jp.backward), jp.n_outputs,
                        jp.diff_outputs, jp.grad_of, jp.joint)
    ctx = dataclasses.replace(sm.ctx, options=dataclasses.replace(sm.ctx.options, backend="inductor"))
    after = remat_pass(after, ctx)

    remat = after.forward.meta[REMAT]
    assert remat.after < remat.before and remat.ops > 0, remat.describe()
    assert len(fwd_outputs(after.forward)) < len(fwd_outputs(before.forward))
    # only compute moved: the same collectives in each part, and no draw in backward
    for part in ("forward", "backward"):
        a, b = getattr(after, part), getattr(before, part)
        assert _ops(a, lambda n: COMM in n.meta) == _ops(b, lambda n: COMM in n.meta)
    assert _ops(after.backward, _random) == _ops(before.backward, _random) == []
    assert _ops(after.forward, _random) == _ops(before.forward, _random)

    outs_b, grads_b = _run(before, primals, tangents)
    outs_a, grads_a = _run(after, primals, tangents)
    # the same ops on the same values, run op by op: equal to the bit
    for x, y in zip(outs_a + grads_a, outs_b + grads_b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)


def _graph(build: Callable[[torch.fx.Graph, Callable[..., torch.fx.Node]], tuple]) -> torch.fx.GraphModule:
    """A graph from ``build(g, op)``, every node with its ``meta["val"]`` (what the pass reads)."""
    g = torch.fx.Graph()

    def op(target: Any, *args: Any) -> torch.fx.Node:
        n = g.call_function(target, args)
        n.meta["val"] = target(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args])
        return n

    g.output(build(g, op))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _placeholder(g: torch.fx.Graph, name: str) -> torch.fx.Node:
    p = g.placeholder(name)
    p.meta["val"] = torch.empty(4, 8)
    return p


def test_a_value_written_in_place_is_never_read_by_a_recompute() -> None:
    """forward: a = 2x; s = a + 1; a *= 3 (in place); backward reads a and s. Recomputing s
    from the saved a would read 6x, not 2x: s stays saved. A saved value backward never
    reads is dropped; one recomputed from a primal alone is recomputed."""
    aten = torch.ops.aten

    def forward(g, op):
        x = _placeholder(g, "x")
        a = op(aten.mul.Tensor, x, 2.0)
        s = op(aten.add.Tensor, a, 1.0)
        t = op(aten.sin.default, x)                 # cheap, from a primal: recomputed
        unused = op(aten.cos.default, x)            # backward never reads it: dropped
        op(aten.mul_.Tensor, a, 3.0)
        return (op(aten.sum.default, a), a, s, t, unused)

    def backward(g, op):
        a, s, t, _unused, tangent = (_placeholder(g, n) for n in ("a", "s", "t", "unused", "tangent"))
        return (op(aten.mul.Tensor, op(aten.add.Tensor, op(aten.add.Tensor, a, s), t), tangent),)

    fwd, bwd = _graph(forward), _graph(backward)
    jp = StepProgram(fwd, bwd, n_outputs=1, diff_outputs=[0], grad_of=[0], joint=fwd)
    before = StepProgram(copy.deepcopy(fwd), copy.deepcopy(bwd), 1, [0], [0], fwd)
    ctx = CompileContext(mesh=shardc.Mesh(), options=shardc.Options(backend="inductor"),
                         rt="remat-test")
    after = remat_pass(jp, ctx)
    saved = [n.name for n in fwd_outputs(after.forward)[1:]]
    # a, s, and the primal that sin is recomputed from
    assert saved == ["mul_tensor", "add_tensor", "x"], saved
    assert after.forward.meta[REMAT].ops == 1
    x, tangent = torch.randn(4, 8), torch.randn(4, 8)
    _, grads_b = _run(before, [x.clone()], [tangent])
    _, grads_a = _run(after, [x.clone()], [tangent])
    assert torch.equal(grads_a[0], grads_b[0])
