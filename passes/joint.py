"""The whole training step as one graph: forward and backward of the rank's program,
every collective of either a node with its own issue and wait.

Reads:  the rank's forward program (after ``grad_sync``: every backward collective is
        decided, as the adjoint of a forward node or a ``grad_all_reduce``), the
        parameters' post-backward reductions (``reduce_params``), this rank's inputs
Writes: a ``StepProgram``: the step program's graph split into the part that runs when the
        module is called (forward) and the part that runs in ``backward()``; every
        collective node calls a ``runtime.functional.run_*`` function that counts its
        bytes, and carries ``meta[COMM] = {collective, axis, phase}``
Keeps:  the arithmetic: the graph records exactly the ops eager autograd runs, in
        its order; the later passes only move nodes and pack collectives

How: each collective of the forward program is swapped for its traceable counterpart in
``runtime.functional`` (same signature), and ``make_fx`` traces, on fake tensors,
``outputs = program(*inputs); grads = autograd.grad(outputs, params, tangents)`` followed
by the parameters' step-phase reductions. Fake tensors draw no random numbers and move no
bytes, so tracing leaves the generator and the counters as they were.

The split: a node belongs to forward when a forward output depends on it; everything
else (what needs a tangent, and the gradients' reductions) is backward. Forward returns
its outputs and the values backward reads ("saved"); backward takes the saved values and
the tangents. This saves what autograd itself would save, give or take the views of it.
"""
from __future__ import annotations

import operator
import threading
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import make_fx

from shardc.core.context import (
    COMM,
    GLOBAL_VAL,
    PARAM,
    PLACEMENT,
    PROGRAM,
    SOURCE,
    CompileContext,
)
from shardc.core.ir import StepProgram
from shardc.core.placement import Layout
from shardc.core.precision import reduce_dtype
from shardc.passes.recompute import BLOCK
from shardc.passes.reshard import reshard_pass
from shardc.passes.step_nodes import (
    N_OUTPUTS,
    PART,
    forward_nodes,
    is_grad_use,
)
from shardc.runtime import collectives as C
from shardc.runtime import functional as F

SWAP = {
    C.all_gather_start: F.all_gather_start,
    C.all_reduce_start: F.all_reduce_start,
    C.reduce_scatter_start: F.reduce_scatter_start,
    C.all_to_all_start: F.all_to_all_start,
    C.wait: F.wait,
    C.grad_all_reduce: F.grad_all_reduce,
}

_TRACE_LOCK = threading.Lock()


class _NamingInterpreter(fx.Interpreter):
    """Runs the program node by node so each collective is logged with the program node
    that issued it (its backward's too: the autograd functions keep the name)."""

    def run_node(self, n: fx.Node) -> Any:
        F.STATE.node = n.name
        block = n.meta.get(BLOCK)
        graph = tracing_graph() if block is not None else None
        start = len(graph.nodes) if graph is not None else 0
        try:
            return super().run_node(n)
        finally:
            F.STATE.node = ""
            if graph is not None:
                # the ops this node became carry its block (a selective policy inside the
                # step program reads it: passes/remat.py)
                for m, _ in zip(reversed(graph.nodes), range(len(graph.nodes) - start)):
                    m.meta[BLOCK] = block


def tracing_graph() -> fx.Graph | None:
    """The graph make_fx is writing (older torch names the mode's getter differently)."""
    current: Any = getattr(proxy_tensor, "get_proxy_mode", None) or proxy_tensor.get_innermost_proxy_mode
    mode = current()
    return mode.tracer.graph if mode is not None else None


def trace_joint(program: fx.GraphModule, ctx: CompileContext, primals: Sequence[Any],
                needs_grad: Sequence[bool], param_names: Sequence[str | None],
                offline: bool = False) -> StepProgram:
    """Trace the joint step of ``program`` for inputs shaped like ``primals``.

    ``needs_grad[i]``: primal i gets a gradient (a trainable parameter or an input that
    asked for one); ``param_names[i]``: the parameter it holds, if any, whose
    post-backward reductions (``reduce_params``) the step applies. ``offline``: trace
    without process groups (for the comm report; the result is not for running)."""
    # the traced copy is only interpreted, never called: no Python code to generate
    prog = _graph_module(program, copy_graph(program.graph))
    for n in prog.graph.nodes:
        if n.op == "call_function" and n.target in SWAP:
            n.target = SWAP[n.target]
    # offline: no process group may be created (that would be a collective call)
    F.STATE.offline = offline
    try:
        # A tangent for every floating output, shaped from its layout: the trace itself
        # learns which outputs carry a gradient and drops the other tangents. Where the
        # layout cannot say (an output without one) or said wrong, run the program once
        # on fake tensors to see the outputs, and trace again.
        foreseen = _tangent_specs(program, ctx)
        try:
            if foreseen is None:
                raise _Unforeseen("an output without a layout")
            return _trace(prog, program, ctx, primals, needs_grad, param_names, foreseen)
        except _Unforeseen:
            with torch.enable_grad():
                probe = _probe_outputs(prog, primals, needs_grad)
            seen = [(i, tuple(d.shape), d.dtype) for i, d in enumerate(probe) if d is not None]
            return _trace(prog, program, ctx, primals, needs_grad, param_names, seen)
    finally:
        F.STATE.offline = False
        F.STATE.clear()


class _Unforeseen(Exception):
    """An output's gradient needs a tangent the trace was not given."""


def _graph_module(root: Any, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule that writes its Python code at its first call, not at every
    ``recompile()``: the step passes rewrite each part several times and only the final
    parts run (codegen of a step program's graph is ~20% of building it). torch's lazy class is
    private (every torch shardc accepts has it)."""
    return _LazyGraphModule(root, graph)


def _lazy_graph_modules() -> Any:
    """make_fx's GraphModule lazy too (see ``_graph_module``)."""
    return _use_lazy_graph_module(True)


def _tangent_specs(program: fx.GraphModule, ctx: CompileContext
                   ) -> list[tuple[int, tuple[int, ...], torch.dtype]] | None:
    """(output index, local shape, dtype) of each floating tensor output of the rank's
    program, from the output's layout and global value; None when an output has none."""
    out = next(n for n in program.graph.nodes if n.op == "output")
    specs = []
    for i, o in enumerate(out.args[0]):
        if not isinstance(o, fx.Node):
            continue
        gval, lay = o.meta.get(GLOBAL_VAL), o.meta.get(PLACEMENT)
        if not isinstance(gval, torch.Tensor):
            return None
        if not gval.dtype.is_floating_point:
            continue
        if not isinstance(lay, Layout):
            return None
        specs.append((i, tuple(lay.local_shape(gval.shape, ctx.mesh)), gval.dtype))
    return specs


def _trace(prog: fx.GraphModule, program: fx.GraphModule, ctx: CompileContext,
           primals: Sequence[Any], needs_grad: Sequence[bool],
           param_names: Sequence[str | None],
           specs: list[tuple[int, tuple[int, ...], torch.dtype]]) -> StepProgram:
    reduce_params: dict[str, list[str]] = program.meta[PROGRAM].reduce_params
    grad_idx = [i for i, w in enumerate(needs_grad) if w]
    n_primals = len(primals)
    diff_outputs: list[int] = []
    n_outputs = 0
    unused: list[int] = []
    offered = [i for i, _, _ in specs]

    def joint(*flat: Any) -> Any:
        nonlocal n_outputs
        ins, tangents = flat[:n_primals], dict(zip(offered, flat[n_primals:]))
        with F.phase("forward"):
            outs = list(_NamingInterpreter(prog).run(*ins))
        n_outputs = len(outs)
        diff_outputs[:] = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)
                           and o.requires_grad and o.dtype.is_floating_point]
        for i in diff_outputs:
            t = tangents.get(i)
            if t is None or t.shape != outs[i].shape or t.dtype != outs[i].dtype:
                raise _Unforeseen(f"output {i}")
        diff = [outs[i] for i in diff_outputs]
        wrt = [ins[i] for i in grad_idx]
        with F.phase("backward"):
            grads = list(torch.autograd.grad(diff, wrt, [tangents[i] for i in diff_outputs],
                                             allow_unused=True))
        for k, (i, g) in enumerate(zip(grad_idx, grads)):
            if g is None:
                unused.append(i)
                continue
            for axis in reduce_params.get(param_names[i] or "", []):
                g = F.step_all_reduce(g, ctx.rt, axis, param_names[i] or "",
                                      reduce_dtype(g.dtype, ctx.options.precision))
            grads[k] = g
        return (*outs, *[g for g in grads if g is not None])

    device = next((p.device for p in primals if isinstance(p, torch.Tensor)), None)
    tangents = [torch.zeros(shape, dtype=dtype, device=device) for _, shape, dtype in specs]
    F.STATE.clear()
    args = [_as_input(p, w) for p, w in zip(primals, needs_grad)] + tangents
    # make_fx keeps global state (its patcher); with torch's threaded process group the
    # ranks are threads of one process and would trace at once. Tracing communicates
    # nothing, so one rank at a time cannot deadlock.
    with _TRACE_LOCK, torch.enable_grad(), _lazy_graph_modules():
        gm = make_fx(joint, tracing_mode="fake")(*args)
    log = list(F.STATE.log)
    restripes = set(F.STATE.restripes)
    # the tangents of outputs that turned out to carry no gradient are never read
    for (i, _, _), ph in zip(specs, [n for n in gm.graph.nodes if n.op == "placeholder"][n_primals:]):
        if i not in diff_outputs:
            assert not ph.users, ph
            gm.graph.erase_node(ph)
    modules = {n.name: getattr(n.meta.get(SOURCE), "module", "") or "" for n in program.graph.nodes}
    _point_at_runners(gm, log, ctx, modules, restripes)
    grad_of = [i for i in grad_idx if i not in unused]
    # which primals hold a parameter: a gather computed from those alone makes a weight,
    # one computed from the batch makes an activation (reshard_pass must tell them apart)
    for ph, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], param_names):
        if name is not None:
            ph.meta[PARAM] = name
    if ctx.options.reshard_after_forward or ctx.options.recompute_in_step:

        gm.meta[N_OUTPUTS] = (n_outputs, n_primals)
        gm = reshard_pass(gm, ctx)
    fwd, bwd = _split(gm, n_primals, n_outputs, len(diff_outputs))
    return StepProgram(fwd, bwd, n_outputs, list(diff_outputs), grad_of, gm)


def copy_graph(g: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(g, {})
    new.output(out)
    return new


def _as_input(p: Any, needs_grad: bool) -> Any:
    if isinstance(p, torch.Tensor):
        t = p.detach()
        return t.requires_grad_(needs_grad)
    return p


def _probe_outputs(prog: fx.GraphModule, primals: Sequence[Any], needs_grad: Sequence[bool]
                   ) -> list[torch.Tensor | None]:
    """Run the program on fake tensors to learn which outputs carry a gradient (and
    their local shapes), with the collectives' log kept clean."""

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        ins = [mode.from_tensor(p).requires_grad_(w) if isinstance(p, torch.Tensor) else p
               for p, w in zip(primals, needs_grad)]
        outs = list(prog(*ins))
    F.STATE.clear()
    res: list[torch.Tensor | None] = []
    for o in outs:
        if isinstance(o, torch.Tensor) and o.requires_grad and o.dtype.is_floating_point:
            res.append(torch.empty(o.shape, dtype=o.dtype, device=o.device))
        else:
            res.append(None)
    return res


def _point_at_runners(gm: fx.GraphModule, log: list[tuple[str, str, str, str]],
                      ctx: CompileContext, modules: dict[str, str], restripes: set[int]) -> None:
    """``restripes``: positions in ``log`` of the re-cuts' all-to-alls (F.STATE.restripes)."""
    nodes = _collective_nodes_raw(gm.graph)
    if len(nodes) != len(log):
        raise RuntimeError(f"joint trace: {len(nodes)} collective nodes but {len(log)} issued")
    for i, (n, (collective, axis, ph, origin)) in enumerate(zip(nodes, log)):
        fn, name = F.RUNNERS[n.target]
        assert name == collective, (name, collective)
        if i in restripes:
            fn = F.run_restripe
        n.target = fn
        n.args = (*n.args, ctx.rt, axis, ph)
        # origin: the forward program's node that issued it, or "grad:<param>"
        n.meta[COMM] = {"collective": collective, "axis": axis, "phase": ph, "origin": origin,
                        "module": modules.get(origin, origin[5:].rsplit(".", 1)[0]
                                              if origin.startswith("grad:") else "")}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is F.TRACED_WAIT:
            n.target = F.WAIT
    gm.recompile()


def _collective_nodes_raw(g: fx.Graph) -> list[fx.Node]:
    return [n for n in g.nodes if n.op == "call_function" and n.target in F.RUNNERS]


def _split(gm: fx.GraphModule, n_primals: int, n_outputs: int, n_tangents: int
           ) -> tuple[fx.GraphModule, fx.GraphModule]:
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    tangents = placeholders[n_primals:]
    assert len(tangents) == n_tangents
    out_node = next(n for n in g.nodes if n.op == "output")
    outs = list(out_node.args[0])
    fwd_outs, grads = outs[:n_outputs], outs[n_outputs:]
    fwd = forward_nodes(g, n_outputs, n_primals)
    # a tuple-valued forward node (dropout's (out, mask), a split) is saved through its
    # elements: taking an element is free, and only tensors can be saved for backward
    for n in list(fwd):
        for u in n.users:
            if u.op == "call_function" and u.target is operator.getitem:
                fwd.add(u)
    for n in g.nodes:
        if n.op not in ("placeholder", "output"):
            n.meta[PART] = "forward" if n in fwd else "backward"
    saved = [n for n in g.nodes if n in fwd and any(u not in fwd and u.op != "output" or
                                                    (u.op == "output" and is_grad_use(u, n, n_outputs))
                                                    for u in n.users)]
    # forward graph
    fg = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in g.nodes:
        if n in fwd:
            env[n] = fg.node_copy(n, lambda a: env[a])
    fg.output(tuple(_arg(o, env) for o in fwd_outs) + tuple(env[s] for s in saved))
    # backward graph
    bg = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for s in saved:
        ph = bg.placeholder(f"saved_{s.name}")
        ph.meta.update(s.meta)
        benv[s] = ph
    for t in tangents:
        benv[t] = bg.node_copy(t)
    for n in g.nodes:
        if n.op in ("placeholder", "output") or n in fwd:
            continue
        benv[n] = bg.node_copy(n, lambda a: benv[a])
    bg.output(tuple(_arg(o, benv) for o in grads))
    fwd_gm = _graph_module(gm, fg)
    bwd_gm = _graph_module(gm, bg)
    # what a step pass needs to know of a part: which it is, and (forward) which of its
    # outputs are the user's and which are saved for backward
    fwd_gm.meta.update({PART: "forward", N_OUTPUTS: (n_outputs, n_primals)})
    bwd_gm.meta[PART] = "backward"
    return fwd_gm, bwd_gm


def _arg(o: Any, env: dict[fx.Node, fx.Node]) -> Any:
    return env[o] if isinstance(o, fx.Node) else o
