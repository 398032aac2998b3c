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
import operator
from typing import Any, Callable

import pytest
import torch
from models import GPT, gpt2, llama

import shardc
from shardc.core.context import COMM, PARAM, CompileContext
from shardc.core.ir import DEFERRED, StepProgram, op_named
from shardc.passes import run_step_pipeline
from shardc.passes.aliases import view_of
from shardc.passes.joint import trace_joint
from shardc.passes.recompute import BLOCK, mark_blocks, repeated_blocks
from shardc.passes.remat import REMAT, remat_pass
from shardc.passes.reshard import REGATHER
from shardc.runtime import functional as F
from shardc.tools.models import lm_batch

aten = torch.ops.aten

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


def test_a_value_a_gemm_reads_in_backward_stays_saved() -> None:
    """forward: pre = x @ w1; g = gelu(pre); t = sin(pre); y = g @ w2. Backward reads g with
    a GEMM (the next layer's weight gradient) and t only with pointwise ops. t is
    recomputed from the saved pre (inductor fuses it into the kernel that reads it); g
    stays saved: recomputed, it would be one more buffer written in backward where
    forward's is there for free (torch.compile's partitioner keeps it too)."""
    def forward(g, op):
        x, w1, w2 = (_placeholder(g, n) for n in ("x", "w1", "w2"))
        w1.meta["val"] = w2.meta["val"] = torch.empty(8, 8)
        pre = op(aten.mm.default, x, w1)
        gl = op(aten.gelu.default, pre)
        t = op(aten.sin.default, pre)
        return (op(aten.sum.default, op(aten.mm.default, gl, w2)), pre, gl, t)

    def backward(g, op):
        pre, gl, t, tangent = (_placeholder(g, n) for n in ("pre", "g", "t", "tangent"))
        dw2 = op(aten.mm.default, op(aten.t.default, gl), tangent)
        dpre = op(aten.gelu_backward.default, op(aten.mul.Tensor, t, tangent), pre)
        return (dw2, dpre)

    fwd, bwd = _graph(forward), _graph(backward)
    jp = StepProgram(fwd, bwd, n_outputs=1, diff_outputs=[0], grad_of=[0, 1], joint=fwd)
    before = StepProgram(copy.deepcopy(fwd), copy.deepcopy(bwd), 1, [0], [0, 1], fwd)
    ctx = CompileContext(mesh=shardc.Mesh(), options=shardc.Options(backend="inductor"),
                         rt="remat-test")
    after = remat_pass(jp, ctx)
    saved = [str(n.target) for n in fwd_outputs(after.forward)[1:]]
    assert sorted(saved) == ["aten.gelu.default", "aten.mm.default"], saved
    assert _ops(after.backward, lambda n: n.target is aten.sin.default) == ["aten.sin.default"]
    assert after.forward.meta[REMAT].ops == 1
    args = [torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8)]
    tangent = torch.randn(4, 8)
    _, grads_b = _run(before, args, [tangent])
    _, grads_a = _run(after, args, [tangent])
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_a_selective_policy_keeps_gemms_draws_and_written_values() -> None:
    """The policy's own rules on a small block: a GEMM's output is saved and the ops after
    it are recomputed from it; nothing draws again, and what reads a value written in place
    (a draw is written into its buffer, as dropout's mask is) stays saved."""
    def forward(g, op):
        x, w = _placeholder(g, "x"), _placeholder(g, "w")
        w.meta["val"] = torch.empty(8, 8)
        m = op(aten.mm.default, x, w)               # kept by the policy
        r = op(aten.relu.default, m)                # recomputed from m
        b = op(aten.bernoulli_.float, op(aten.empty_like.default, x), 0.5)  # drawn in place
        d = op(aten.mul.Tensor, r, b)               # reads the draw's buffer: stays saved
        a = op(aten.mul.Tensor, x, 2.0)
        op(aten.mul_.Tensor, a, 3.0)                # a is written in place after s reads it
        s = op(aten.add.Tensor, a, 1.0)             # so s stays saved
        return (op(aten.sum.default, d), r, d, s)

    def backward(g, op):
        r, d, s, tangent = (_placeholder(g, n) for n in ("r", "d", "s", "tangent"))
        return (op(aten.mul.Tensor, op(aten.add.Tensor, op(aten.mul.Tensor, r, d), s), tangent),)

    fwd, bwd = _graph(forward), _graph(backward)
    for n in fwd.graph.nodes:
        if n.op == "call_function":
            n.meta[BLOCK] = "blocks.0"
    jp = StepProgram(fwd, bwd, n_outputs=1, diff_outputs=[0], grad_of=[0], joint=fwd)
    before = StepProgram(copy.deepcopy(fwd), copy.deepcopy(bwd), 1, [0], [0], fwd)
    ctx = CompileContext(mesh=shardc.Mesh(), rt="remat-test", options=shardc.Options(
        backend="inductor", activation_checkpoint="selective"))
    after = remat_pass(jp, ctx)
    saved = {str(n.target) for n in fwd_outputs(after.forward)[1:]}
    assert saved == {"aten.mm.default", "aten.mul.Tensor", "aten.add.Tensor"}, saved
    assert after.forward.meta[REMAT].blocks == 1  # the relu
    assert _ops(after.backward, _random) == [] and _ops(after.backward, lambda n: "mm" in str(n.target)) == []
    x, w, tangent = torch.randn(4, 8), torch.randn(8, 8), torch.randn(4, 8)
    _, grads_b = _run(before, [x.clone(), w], [tangent])
    _, grads_a = _run(after, [x.clone(), w], [tangent])
    assert torch.equal(grads_a[0], grads_b[0])


def _step_program(sm: shardc.ShardedModule, ctx: CompileContext, primals: list) -> StepProgram:
    """The step program ``build`` makes for ``primals`` under ``ctx`` (not compiled)."""
    needs = [isinstance(a, torch.Tensor) and a.requires_grad for a in primals]
    names = [t if role == "param" else None for role, t in sm._feeds]
    return remat_pass(run_step_pipeline(trace_joint(sm.graph_module, ctx, primals, needs, names), ctx), ctx)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_selective_policy_recomputes_every_block_op_it_does_not_save(fake_world, name: str) -> None:
    """``activation_checkpoint="selective"`` under inductor is this pass with a policy: of
    what forward saves, a block keeps its GEMM and attention outputs, what a draw made,
    what came from outside the block, its output (what the next block reads), and what a
    collective made, except the activations it all-gathers (sequence parallelism's GEMM
    inputs), which backward gathers again; the rest is recomputed in backward, bit for bit (on x2 z2: all-reduces, reduce-scatters,
    activation and weight gathers inside every block)."""
    fake_world(4)
    torch.manual_seed(0)
    model = MODELS[name]()
    batch = lm_batch(4, 16, 64)
    sm = shardc.compile(model, shardc.Mesh(x=2, z=2), batch)  # eager: the pass leaves it alone
    mark_blocks(sm.graph_module, repeated_blocks(model))  # what compile does for the policy
    jp, primals, tangents = _recorded_step(sm, tuple(shardc.shard_batch(t, sm.mesh) for t in batch))
    inductor = dataclasses.replace(sm.ctx.options, backend="inductor")
    cheap = _step_program(sm, dataclasses.replace(sm.ctx, options=inductor), primals)
    policy = shardc.Selective()
    after = _step_program(sm, dataclasses.replace(sm.ctx, options=dataclasses.replace(
        inductor, activation_checkpoint=policy)), primals)
    before = jp

    remat = after.forward.meta[REMAT]
    # less storage than the bytes-driven pass keeps (which already recomputes the small
    # GPTs' cheap ops between their GEMMs): the gathered activations are gone
    assert remat.blocks > 0 and remat.after < cheap.forward.meta[REMAT].after, \
        (remat.describe(), cheap.forward.meta[REMAT].describe())
    keep = {op_named(n) for n in policy.save}

    def kept(n: torch.fx.Node) -> bool:
        """Made by what the policy saves: a GEMM or attention (an element of its tuple
        too), a collective, a draw or in-place write, or a function outside ATen."""
        while n.target is operator.getitem:
            n = n.args[0]
        t = n.target
        if not isinstance(t, torch._ops.OpOverload) or t.namespace != "aten" or COMM in n.meta:
            return True
        return (t.overloadpacket in keep or t._schema.is_mutable
                or torch.Tag.nondeterministic_seeded in t.tags)

    def reads_a_write(n: torch.fx.Node) -> bool:
        # a dropout's mask is scaled in place after its draw: never re-read by a recompute
        return any(isinstance(a.target, torch._ops.OpOverload) and a.target._schema.is_mutable
                   for a in n.all_input_nodes)

    saved = fwd_outputs(after.forward)[after.n_outputs:]
    in_blocks = [s for s in saved if isinstance(s, torch.fx.Node) and s.meta.get(BLOCK)]
    assert in_blocks, "the trace lost the blocks' marks"
    def block_output(n: torch.fx.Node) -> bool:
        # read by another block or after the blocks: kept, as a checkpoint keeps its
        # block's input (recomputed, every block's recompute would run at the start of
        # backward, the next block's needing it)
        return any(u.op != "output" and u.meta.get(BLOCK) != n.meta.get(BLOCK) for u in n.users)

    left = [s for s in in_blocks if not kept(s) and not reads_a_write(s) and not block_output(s)]
    # a value the policy would recompute stays saved only where its recompute would keep
    # more storage than it frees (GPT's residual sum on x2: the all-reduced projection
    # plus its gathered bias, for the sum alone): so never one whose inputs are all saved
    have = set(saved)
    free = [s.format_node() for s in left
            if all(a in have or a.op == "placeholder" for a in s.all_input_nodes)]
    assert free == [], free
    if name == "llama":
        # RMSNorm and SwiGLU between the GEMMs: all of it is recomputed
        assert left == [], [s.format_node() for s in left]
    # no activation all-gather's output is saved: backward gathers each again
    gathered = [s.format_node() for s in in_blocks if _made_by_activation_gather(s)]
    assert gathered == [], gathered
    again = [n for n in after.backward.graph.nodes if n.meta.get(REGATHER)]
    assert again and all(n.meta[COMM]["collective"] == "all_gather" and n.meta[COMM]["phase"] == "backward"
                         for n in again)
    # forward's collectives do not move; backward has the re-gathers besides its own (as
    # inductor's program packs them: it buckets gradients differently from eager's)
    comm = lambda n: COMM in n.meta  # noqa: E731
    assert _ops(after.forward, comm) == _ops(cheap.forward, comm)
    assert sorted(_ops(after.backward, lambda n: comm(n) and not n.meta.get(REGATHER))) == \
        sorted(_ops(cheap.backward, comm))
    assert _ops(after.backward, _random) == []
    # nothing the policy saves is computed again: backward runs the GEMMs it ran before
    gemm = lambda n: getattr(n.target, "overloadpacket", None) in keep  # noqa: E731
    assert len(_ops(after.backward, gemm)) == len(_ops(cheap.backward, gemm))

    outs_b, grads_b = _run(before, primals, tangents)
    outs_a, grads_a = _run(after, primals, tangents)
    for x, y in zip(outs_a + grads_a, outs_b + grads_b):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)


def _made_by_activation_gather(n: torch.fx.Node) -> bool:
    """Is ``n`` (through views) the wait of an all-gather whose input is not a weight?"""
    while view_of(n) is not None:
        n = view_of(n)
    if n.target is not F.WAIT:
        return False
    issue = n.args[0]
    return issue.meta[COMM]["collective"] == "all_gather" and not _from_params(issue.args[0])


def _from_params(n: Any) -> bool:
    if not isinstance(n, torch.fx.Node):
        return True
    if n.op == "placeholder":
        return PARAM in n.meta
    if n.target is F.WAIT or COMM in n.meta:
        return False
    return all(_from_params(a) for a in n.all_input_nodes)
