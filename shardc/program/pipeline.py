"""``shardc.compile`` on a mesh with ``pipe > 1``: the model cut into stages
(``passes/stages.py``), this rank's stage compiled by the ordinary compiler over the
stage's x, y, z and data axes, and a ``PipelineModule`` that runs a step's micro-batches
through the stages in the schedule's order (``runtime/pipeline.py``).

The training loop does not change: ``loss = sm(*local_inputs)`` runs the whole schedule
(forwards and, when gradients are enabled, backwards: 1F1B interleaves them) and returns
the single-device loss of the global batch on every rank; ``loss.backward()`` then sets
every ``.grad`` of this rank's stage to its shard of the single-device gradient (scaled by
the gradient ``backward`` is given, as one device would).

How the micro-batches' losses add up to the global batch's loss is read from the traced
loss: a mean cross-entropy (or NLL) weighs each micro-batch by the targets it counts (the
ones not ``ignore_index``, counted from the inputs before the step: exact with padding),
a summed one adds them; any other loss is taken as a mean over equal micro-batches.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import replace
from fractions import Fraction
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from shardc.core.errors import OptionError, ShardcError, ShardcWarning
from shardc.core.mesh import BATCH_AXES, CONTEXT, PIPE, SEQUENCE_DIM, Mesh
from shardc.core.options import Options
from shardc.core.placement import Layout, local_slice
from shardc.core.precision import CastAtUse
from shardc.passes.stages import Stage, cut_stages, local_casts, unlifted_graph
from shardc.program import validate
from shardc.program.build import build, check_batch
from shardc.program.draws import Draws, program_sites, stage_draws
from shardc.program.loss_terms import loss_terms
from shardc.program.module import ShardedModule
from shardc.program.report import ROUTED, CommReport, CommRow, comm_report
from shardc.runtime.groups import axis_groups, pipe_group
from shardc.runtime.pipeline import P2P, SplitBackward, bubble_fraction, chunk_actions
from shardc.runtime.volume import as_number

_aten = torch.ops.aten
_LOSSES = {_aten.cross_entropy_loss.default: (2, 3, 4), _aten.nll_loss.default: (2, 3, 4),
           _aten.nll_loss_nd.default: (2, 3, 4)}  # arg positions: weight, reduction, ignore_index
_CARRIERS = {_aten.alias.default, _aten.clone.default, _aten.view.default, _aten.reshape.default,
             _aten._to_copy.default, _aten.to.dtype, _aten.contiguous.default, _aten.squeeze.default}
# options the pipeline does not run yet, with what the stage program would have to do
_NOT_YET = {
    "reshard_after_forward": False, "gemm_modes": "default"}


def refuse_with_stages(options: Options, input_layouts: Any) -> None:
    """Raise ``OptionError`` for an option a pipeline does not run yet (also what the
    planner asks before it proposes stages)."""
    for name, default in _NOT_YET.items():
        if getattr(options, name) != default:
            raise OptionError(
                f"shardc.compile: {name}={getattr(options, name)!r} with pipe > 1 is not supported yet "
                "(docs/pipeline.md lists what a pipeline runs); leave it at its default.")
    if options.activation_checkpoint != "none" and options.schedule == "zero_bubble":
        raise OptionError(
            f"shardc.compile: activation_checkpoint={options.activation_checkpoint!r} with "
            "schedule='zero_bubble': its backward runs in two passes (input gradients, then weight "
            "gradients later), and each would recompute every block, its collectives too. Use "
            "schedule='1f1b' or 'gpipe' with recompute.")
    if options.expert_axes and options.schedule == "zero_bubble":
        raise OptionError(
            f"shardc.compile: expert_axes={options.expert_axes!r} with schedule='zero_bubble': an "
            "expert segment's backward is one op that makes its rows' and its experts' gradients "
            "together, so it cannot be split into the input pass and a later weight pass. Use "
            "schedule='1f1b' or 'gpipe' with expert parallelism.")
    if input_layouts:
        raise OptionError("shardc.compile: input_layouts with pipe > 1 is not supported yet: a "
                          "pipeline's inputs arrive as shard_batch cuts them (dim 0 over data and z).")


def _microbatch(x: Any, m: int, k: int) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() > 0:
        step = x.shape[0] // m
        # contiguous: a piece of a sequence block (a context axis) is strided in the batch
        return x[k * step:(k + 1) * step].contiguous()
    return x


def _loss_rule(gm: fx.GraphModule, terms: str) -> tuple[str, Callable[..., torch.Tensor] | None]:
    """How micro-batch losses add up: ("count", counter) for a mean cross-entropy whose
    targets come from the inputs alone (counter(*inputs) -> the rows it counts), ("sum",
    None) for a summed one, else (``terms``, None): ``loss_terms``' reading of the graph."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    node = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    while isinstance(node, fx.Node) and node.target in _CARRIERS:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target not in _LOSSES:
        # a sum of means (or of sums) over rows: ``terms``, read from the graph (loss_terms)
        return terms, None
    iw, ir, ii = _LOSSES[node.target]
    args = list(node.args) + [None] * 6
    weight = node.kwargs.get("weight", args[iw])
    reduction = node.kwargs.get("reduction", args[ir] if args[ir] is not None else 1)
    ignore = node.kwargs.get("ignore_index", args[ii] if args[ii] is not None else -100)
    if reduction == 2:
        return "sum", None
    if reduction != 1 or weight is not None:
        return "mean", None
    target = node.args[1]
    if not isinstance(target, fx.Node):
        return "mean", None
    # the target's own computation, from the inputs only (no parameter, no buffer)
    need: list[fx.Node] = []
    todo: list[fx.Node] = [target]
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr" or n.op == "call_module":
            return "mean", None
        need.append(n)
        todo += n.all_input_nodes
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = g.placeholder(n.name)
        elif n in seen:
            env[n] = g.node_copy(n, lambda a: env[a])
    counted = g.call_function(_aten.ne.Scalar, (env[target], ignore))
    g.output(g.call_function(_aten.sum.default, (counted,)))
    return "count", fx.GraphModule(gm, g)


class _StepLoss(torch.autograd.Function):
    """The loss ``sm(...)`` returns during training. The schedule has already run every
    backward (1F1B must); this ``backward`` hands the gradients computed for a seed of 1
    to ``.grad``, scaled by the seed ``loss.backward()`` gives, as one device would."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor, owner: "PipelineModule") -> torch.Tensor:
        del anchor
        ctx.owner = owner
        ctx.grads = owner._step_grads
        return value.detach().clone()

    @staticmethod
    def backward(ctx: Any, seed: torch.Tensor) -> tuple[None, None, None]:
        ctx.owner._apply_grads(ctx.grads, seed)
        return None, None, None


class ChunkPrograms:
    """A pipeline rank's chunk programs read as one program (the interleaved schedule's
    rank holds several): their parameters, layouts and state keys together, each tensor
    the chunk's own, so what reads or writes through it (a checkpoint) reaches the
    chunks' tensors."""

    def __init__(self, programs: list[ShardedModule]) -> None:
        self.programs = programs
        self.mesh = programs[0].mesh
        self.ctx = programs[0].ctx
        self.param_layouts: dict[str, Layout] = {}
        self._global_shapes: dict[str, Any] = {}
        self._canonical: dict[str, str] = {}
        self._buffers_full: dict[str, torch.Tensor] = {}
        self._state_keys: list[str] = []
        for program in programs:
            self.param_layouts.update(program.param_layouts)
            self._global_shapes.update(program._global_shapes)
            self._canonical.update(program._canonical)
            self._buffers_full.update(program._buffers_full)
            self._state_keys += [k for k in program._state_keys if k not in self._state_keys]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for program in self.programs:
            yield from program.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def get_parameter(self, name: str) -> nn.Parameter:
        for program in self.programs:
            if name in program.param_layouts:
                return program.get_parameter(name)
        raise AttributeError(f"no chunk of this pipeline rank holds parameter {name!r}")


class PipelineModule(nn.Module):
    """This rank's stage of a pipeline, run over a step's micro-batches.

    ``named_parameters()`` are the stage's parameters, with the model's names and each one
    the shard of its stage's layout; an optimizer over them steps this rank's part.
    ``stages`` are every stage of the model; this rank runs ``mine`` (one, or under the
    interleaved schedule one a chunk: chunk c of pipe rank r is stage c * pipe + r), each
    compiled into the program ``programs[c]``; ``stage`` and ``program`` are the one
    stage's and program where a rank holds one."""

    stages: list[Stage]
    mine: list[Stage]
    programs: list[ShardedModule]

    def __init__(self, programs: list[ShardedModule], stages: list[Stage], mesh: Mesh, rank: int,
                 options: Options, microbatches: int, loss_rule: tuple[str, Any],
                 model: nn.Module, draws: Draws | None = None, seq: int | None = None) -> None:
        super().__init__()
        # the model's names: its parameters in order, each state-dict key's tensor (a tied
        # parameter's second name reads the first's) and what no stage holds
        canonical = {id(p): name for name, p in model.named_parameters()}
        self._param_order = list(canonical.values())
        self._state_names = {k: canonical.get(id(v), k) for k, v in model.state_dict(keep_vars=True).items()}
        held = {n for st in stages for n in st.params} | {
            str(node.target) for st in stages for node in st.module.graph.nodes if node.op == "get_attr"}
        self._unheld = {k: v.detach().clone() for k, v in model.state_dict().items()
                        if self._state_names[k] not in held}
        # each stage program answers for the model's keys it holds, a tied parameter's
        # second name included, so its state dict and checkpoints use the model's keys
        for program in programs:
            held_here = set(program.param_layouts) | set(program._buffers_full)
            program._state_keys = [k for k, name in self._state_names.items() if name in held_here]
            program._canonical = {k: name for k, name in self._state_names.items()
                                  if name in program.param_layouts}
            # expert segments run once a micro-batch: the step's routed rows add up
            program.runtime.routed_adds = True
        # registered as submodules (parameters, train/eval, .to follow them), read as a list
        self.chunk = nn.ModuleList(programs)
        object.__setattr__(self, "programs", list(programs))
        object.__setattr__(self, "stages", stages)
        self.mesh = mesh
        self.rank = rank
        self.index = mesh.coords(rank)[PIPE]
        self.chunks = len(programs)
        object.__setattr__(self, "mine", rank_stages(stages, mesh.pipe, self.index))
        self.options = options
        self.microbatches = microbatches
        self.schedule = options.schedule
        self._split = options.schedule == "zero_bubble"  # backward as B then W
        self._loss_rule = loss_rule
        self.p2p = P2P(mesh, rank)
        # one device's dropout masks, handed to this stage micro-batch by micro-batch
        # (shardc/program/draws.py); None: each micro-batch draws its own
        self._draws = draws
        # the model's sequence length where a context axis cuts it (None: none does)
        self._seq = seq
        self._step_grads: dict[str, torch.Tensor | None] = {}
        # parameters read by several stages (a tied embedding and head): which pipe ranks
        # (compile_pipeline refuses one read by two chunks of a rank)
        holders: dict[str, list[int]] = {}
        for st in stages:
            for name in st.params:
                holders.setdefault(name, []).append(st.index % mesh.pipe)
        self.shared = {n: h for n, h in holders.items() if len(h) > 1 and self.index in h}
        self._owner = {n: c for c, program in enumerate(programs) for n, _ in program.named_parameters()}
        # the last training step's actions: (kind, micro-batch, start, end, seconds of it
        # spent waiting for another stage, chunk), from the step's start
        self.last_timeline: list[tuple[str, int, float, float, float, int]] = []
        self._plans: dict[bool, dict[int, list[tuple[Any, tuple[int, ...], torch.dtype]]]] = {}

    @property
    def stage(self) -> Stage:
        """This rank's stage (a rank that holds one)."""
        return self._one(self.mine)

    @property
    def program(self) -> ShardedModule:
        """This rank's stage program (a rank that holds one; ``programs`` has every chunk's)."""
        return self._one(self.programs)

    def held(self) -> ShardedModule | ChunkPrograms:
        """What this rank holds, as one program (checkpoints save and load through it)."""
        return self.programs[0] if self.chunks == 1 else ChunkPrograms(list(self.programs))

    def _one(self, items: list[Any]) -> Any:
        if len(items) != 1:
            raise ShardcError(f"this pipeline rank holds {len(items)} chunks (schedule='interleaved'): "
                              "read .mine and .programs, one per chunk")
        return items[0]

    # ------------------------------------------------------------------ module API
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        # in the model's order (a stage program lists a tied weight where a later
        # stage first reads it), so an optimizer's groups list them as one device's do
        rank = {n: i for i, n in enumerate(self._param_order)}
        items = [item for program in self.programs
                 for item in program.named_parameters("", recurse, remove_duplicate)]
        items.sort(key=lambda item: rank.get(item[0], len(rank)))
        for name, p in items:
            yield (f"{prefix}.{name}" if prefix else name), p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        # the model's names, as named_parameters() gives them (each stage holds its own)
        seen: set[str] = set()
        for program in self.programs:
            for name, t in program.named_buffers("", recurse, remove_duplicate):
                if name not in seen:
                    seen.add(name)
                    yield (f"{prefix}.{name}" if prefix else name), t

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation over calls, as ``ShardedModule.no_sync`` takes it: the
        gradients of steps run inside add up to one device's, exactly. A pipeline reduces
        each step's gradients at its end (its last backward), so this defers nothing and
        saves no communication: to accumulate cheaply, raise ``microbatches`` instead (a
        step's micro-batches are reduced once)."""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        for program in self.programs:
            program.zero_grad(set_to_none)

    @property
    def ctx(self) -> Any:
        return self.programs[0].ctx

    def extra_repr(self) -> str:
        blocks = "; ".join(", ".join(st.blocks) for st in self.mine)
        return (f"mesh={self.mesh}, stage={self.index} of {self.mesh.pipe} ({blocks}), "
                f"microbatches={self.microbatches}, schedule={self.schedule!r}")

    # ------------------------------------------------------------------ the step
    def forward(self, *inputs: Any) -> torch.Tensor:
        m = self.microbatches
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] % m:
                raise ShardcError(
                    f"shardc pipeline: input {i} has {x.shape[0]} rows on this rank, which "
                    f"{m} micro-batches do not divide; pass a batch of a multiple of {m} rows a rank.")
        chunks = [[_microbatch(x, m, k) for x in inputs] for k in range(m)]
        params = [p for p in self.parameters()]
        training = torch.is_grad_enabled() and any(p.requires_grad for p in params)
        weights = self._weights(chunks) if self.index == self.mesh.pipe - 1 else None
        for program in self.programs:
            program.runtime.routed.clear()  # this step's routing, micro-batch by micro-batch
            program.runtime.expert_load.clear()
        self.p2p.expect(self._plan(training))
        with self._one_devices_draws():
            return self._step(chunks, params, training, weights)

    @contextlib.contextmanager
    def _one_devices_draws(self) -> Iterator[None]:
        """The step's draws made as one device makes them, up front, and handed to this
        stage's program for the whole step (shardc/program/draws.py)."""
        if self._draws is None:
            yield
            return
        self._draws.replay(_device_of(self.programs[0]))
        for program in self.programs:
            program.runtime.draws = self._draws.site
        try:
            yield
        finally:
            for program in self.programs:
                program.runtime.draws = None
            self._draws.release()

    def _at(self, k: int, c: int) -> None:
        """Micro-batch ``k`` runs next on chunk ``c``: its rows of the chunk's draws."""
        if self._draws is not None:
            self._draws.at(self.mine[c].index, k)

    def _step(self, chunks: list[list[Any]], params: list[nn.Parameter], training: bool,
              weights: Any) -> torch.Tensor:
        m = self.microbatches
        if not training:
            evaluated: list[Any] = []
            with torch.no_grad():
                for k, c in self._eval_order():
                    self._at(k, c)
                    loss = self._forward(k, c, chunks[k], keep=False)[2]
                    if loss is not None:
                        evaluated.append(loss)
            self.p2p.finish()
            return self._share_loss(evaluated, weights)
        old = {n: p.grad for n, p in self.named_parameters()}
        for p in params:
            p.grad = None
        saved: dict[tuple[int, int], Any] = {}
        losses: list[Any] = [None] * m
        order = self.order()
        # the action that makes a chunk's last parameter gradients reduces them all
        last_b = {c: max(i for i, (kind, _, c2) in enumerate(order)
                         if c2 == c and kind == ("W" if self._split else "B"))
                  for c in range(self.chunks)}
        pending_w: dict[tuple[int, int], SplitBackward] = {}
        timeline = []
        t0 = _now()
        try:
            for i, (kind, k, c) in enumerate(order):
                start = _now() - t0
                self.p2p.waited = 0.0
                # a profiler range per action: shardc trace draws the schedule as it ran
                with torch.profiler.record_function(f"shardc.pipe {self.label(kind, k, c)}"):
                    self._at(k, c)  # a block recomputed in backward draws what its forward drew
                    if kind == "F":
                        saved[k, c] = self._forward(k, c, chunks[k], keep=True)
                        if saved[k, c][2] is not None:
                            losses[k] = saved[k, c][2]
                    elif kind == "B":
                        split = self._backward(k, c, saved.pop((k, c)), weights, sync=(i == last_b[c]))
                        if split is not None:
                            pending_w[k, c] = split
                    else:
                        program = self.programs[c]
                        with program.backward_in_parts() if i == last_b[c] else program.no_sync():
                            pending_w.pop((k, c)).weights_grad()
                timeline.append((kind, k, start, _now() - t0, self.p2p.waited, c))
            self.p2p.finish()
            self._sum_shared()
        finally:
            new = {n: p.grad for n, p in self.named_parameters()}
            for n, p in self.named_parameters():
                p.grad = old[n]
        self.last_timeline = timeline
        value = self._share_loss(losses, weights)
        self._step_grads = new
        anchor = torch.zeros((), requires_grad=True)
        return _StepLoss.apply(anchor, value, self)

    def _local_shape(self, val: torch.Tensor) -> tuple[int, ...]:
        n = self.mesh.size("data") * self.mesh.size("z")
        shape = list(val.shape)
        if _cut(val, n):
            shape[0] //= n
        if _per_token(val, self._seq, self.mesh.size(CONTEXT)):
            shape[SEQUENCE_DIM] //= self.mesh.size(CONTEXT)
        return tuple(shape)

    # ------------------------------------------------------------------ the schedule
    def order(self) -> list[tuple[str, int, int]]:
        """This rank's actions in a training step: (kind, micro-batch, chunk)."""
        return chunk_actions(self.schedule, self.mesh.pipe, self.index, self.microbatches, self.chunks)

    def label(self, kind: str, k: int, c: int) -> str:
        """An action's name: ``F3`` (micro-batch 3's forward), ``F3c1`` on chunk 1."""
        return f"{kind}{k}" if self.chunks == 1 else f"{kind}{k}c{c}"

    def _eval_order(self) -> list[tuple[int, int]]:
        """Forwards only (no gradients): micro-batch by micro-batch, each through the chunks."""
        return [(k, c) for k in range(self.microbatches) for c in range(self.chunks)]

    def _sends(self, st: Stage, kind: str, k: int) -> list[tuple[int, Any, Any]]:
        """What stage ``st`` sends in its action ``kind`` of micro-batch ``k``, in order:
        (the stage it goes to, the message's key, the boundary value). Forward: each
        output to each later stage that reads it; backward: each input's gradient to the
        stage that made it. The key names the producing stage's output, so both ends
        name a message alike: (kind, from, to, micro-batch, producer's output index)."""
        out: list[tuple[int, Any, Any]] = []
        if kind == "F":
            for j, (cons, val) in enumerate(zip(st.consumers, st.output_vals)):
                out += [(c, ("F", st.index, c, k, j), val) for c in sorted(cons) if c >= 0]
        elif kind == "B":
            for i in sorted(range(len(st.inputs)), key=lambda i: st.inputs[i]):
                src, j = st.inputs[i]
                if src >= 0 and _carries_grad(st.input_vals[i]):
                    out.append((src, ("B", st.index, src, k, j), st.input_vals[i]))
        return out

    def _plan(self, training: bool) -> dict[int, list[tuple[Any, tuple[int, ...], torch.dtype]]]:
        """Per other pipe rank, the messages it sends this rank in a step, in its order."""
        if training not in self._plans:
            p = self.mesh.pipe
            plan: dict[int, list[tuple[Any, tuple[int, ...], torch.dtype]]] = {}
            for q in range(p):
                if q == self.index:
                    continue
                acts = chunk_actions(self.schedule, p, q, self.microbatches, self.chunks) if training \
                    else [("F", k, c) for k, c in self._eval_order()]
                plan[q] = [(key, self._local_shape(val), val.dtype)
                           for kind, k, c in acts
                           for dest, key, val in self._sends(self.stages[c * p + q], kind, k)
                           if dest % p == self.index]
            self._plans[training] = plan
        return self._plans[training]

    def _forward(self, k: int, c: int, inputs: list[Any], keep: bool) -> Any:
        st, program = self.mine[c], self.programs[c]
        p = self.mesh.pipe
        dev = _device_of(program)
        args: list[Any] = [None] * len(st.inputs)
        for i, ((src, j), val) in enumerate(zip(st.inputs, st.input_vals)):
            if src < 0:
                args[i] = inputs[j]
                continue
            a = self.p2p.take(("F", src, st.index, k, j), src % p, dev, "forward")
            if keep and _carries_grad(val):
                a.requires_grad_(True)
            args[i] = a
        with program.no_sync():
            outs = program(*args)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        loss = next((o for o, cons in zip(outs, st.consumers) if -1 in cons), None)
        n = self.mesh.size("data") * self.mesh.size("z")
        for dest, key, val in self._sends(st, "F", k):
            self.p2p.send(self._as_cut(outs[key[4]], val, n), dest % p, "forward", key)
        return args, outs, loss

    def _as_cut(self, o: torch.Tensor, val: torch.Tensor, n: int) -> torch.Tensor:
        """A boundary value whose dim 0 data x z divides travels as this rank's rows of
        it; a stage that returned it whole (it does not depend on the batch) is cut here.
        With a context axis, a per-token value travels as this rank's block of the
        sequence (``shard_batch``'s cut), cut here if the stage returned it whole."""
        c = self.mesh.coords(self.rank)
        if _cut(val, n) and o.shape[0] == val.shape[0]:
            i = c["data"] * self.mesh.size("z") + c["z"]
            step = o.shape[0] // n
            o = o[i * step:(i + 1) * step]
        g = self.mesh.size(CONTEXT)
        if _per_token(val, self._seq, g) and o.shape[SEQUENCE_DIM] == val.shape[SEQUENCE_DIM]:
            step = o.shape[SEQUENCE_DIM] // g
            o = o.narrow(SEQUENCE_DIM, c[CONTEXT] * step, step)
        return o

    def _backward(self, k: int, c: int, saved: Any, weights: Any, sync: bool) -> SplitBackward | None:
        st, program = self.mine[c], self.programs[c]
        p = self.mesh.pipe
        args, outs, loss = saved
        dev = _device_of(program)
        n = self.mesh.size("data") * self.mesh.size("z")
        roots, seeds = [], []
        for j, (o, cons, val) in enumerate(zip(outs, st.consumers, st.output_vals)):
            if loss is o and -1 in cons:
                roots.append(o)
                seeds.append(weights[k].to(o.dtype))
            if not _carries_grad(val):
                continue
            g = None
            for reader in sorted(r for r in cons if r >= 0):
                r = self.p2p.take(("B", reader, st.index, k, j), reader % p, dev, "backward")
                g = r if g is None else g + r
            if g is None:
                continue
            if _per_token(val, self._seq, self.mesh.size(CONTEXT)) and \
                    o.shape[SEQUENCE_DIM] == val.shape[SEQUENCE_DIM]:
                g = self._gather(g, (CONTEXT,), SEQUENCE_DIM)
            if _cut(val, n) and o.shape[0] == val.shape[0]:
                g = self._gather(g, ("z", "data"), 0)
            if o.requires_grad:
                roots.append(o)
                seeds.append(g)
        sent = [i for i in range(len(st.inputs))
                if st.inputs[i][0] >= 0 and _carries_grad(st.input_vals[i])]
        split = None
        if self._split:
            # B: the inputs' gradients only; W (a later action) the parameters'
            # the tensors the program reads: under shard_optimizer a parameter is this
            # rank's slice over data, and its gradient arrives through the program copy
            params = [program.read_param(name) for name, q in program.named_parameters() if q.requires_grad]
            grad_in = [i for i in sent if args[i].requires_grad]
            split = SplitBackward(roots, seeds, [args[i] for i in grad_in], params)
            with program.no_sync():
                got = split.inputs_grad() if roots else [None] * len(grad_in)
            for i, g in zip(grad_in, got):
                args[i].grad = g
        else:
            ctx = contextlib.nullcontext() if sync else program.no_sync()
            with ctx:
                if roots:
                    torch.autograd.backward(roots, seeds)
        index = {(src, j): i for i, (src, j) in enumerate(st.inputs)}
        for dest, key, _ in self._sends(st, "B", k):
            a = args[index[dest, key[4]]]
            self.p2p.send(a.grad if a.grad is not None else torch.zeros_like(a), dest % p, "backward", key)
        return split

    def _gather(self, g: torch.Tensor, axes: tuple[str, ...], dim: int) -> torch.Tensor:
        """The whole gradient of a value the stage returned whole, from every piece of
        ``dim`` over ``axes`` (innermost first: z then data for the batch shards'
        rows, ``shard_batch``'s order; context for the sequence's blocks)."""
        groups = axis_groups(self.mesh)
        for axis in axes:
            size = self.mesh.size(axis)
            if size == 1:
                continue
            parts = [torch.empty_like(g) for _ in range(size)]
            dist.all_gather(parts, g.contiguous(), group=groups[axis])
            g = torch.cat(parts, dim)
        return g

    def _weights(self, chunks: list[list[Any]]) -> list[torch.Tensor]:
        m = self.microbatches
        kind, counter = self._loss_rule
        if kind == "sum":
            return [torch.ones((), dtype=torch.float64)] * m
        if kind == "mean" or counter is None:
            return [torch.full((), 1.0 / m, dtype=torch.float64)] * m
        counts = torch.stack([counter(*c).to(torch.float64) for c in chunks])
        groups = axis_groups(self.mesh)
        # the counts of the whole micro-batch, not this shard's (nor this sequence block's)
        for axis in (CONTEXT, "z", "data"):
            if self.mesh.size(axis) > 1:
                dist.all_reduce(counts, group=groups[axis])
        total = counts.sum()
        if total == 0:  # every target ignored: the loss is nan on one device too
            return [torch.full((), float("nan"), dtype=torch.float64)] * m
        return list(counts / total)

    def _share_loss(self, losses: list[Any], weights: Any) -> torch.Tensor:
        """The global batch's loss, on every rank: the last stage combines the micro-batch
        losses and sends the value to the other stages."""
        last = self.mesh.pipe - 1
        if self.index == last:
            value = sum((w.to(torch.float64) * _read(x).detach().to(torch.float64) for w, x in zip(weights, losses)),
                        torch.zeros((), dtype=torch.float64))
            value = value.to(_read(losses[0]).dtype)
            for s in range(last):
                self.p2p.send(value.to(_device_of(self.programs[0])), s, "forward")
            self.p2p.finish()
            return value
        dtype = self.stages[-1].output_vals[-1].dtype
        return self.p2p.recv((), dtype, _device_of(self.programs[0]), last, "forward")

    def _sum_shared(self) -> None:
        """A parameter two stages read (a tied embedding and head): each stage computed its
        part of the gradient; both get the sum, added in stage order so they agree bitwise."""
        for name, holders in sorted(self.shared.items()):
            program = self.programs[self._owner[name]]
            p = program.get_parameter(name)
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            full = program._gather_full(name, g)
            parts: dict[int, torch.Tensor] = {self.index: full}
            for s in holders:
                if s != self.index:
                    self.p2p.send(full, s, "backward")
            for s in holders:
                if s != self.index:
                    parts[s] = self.p2p.recv(tuple(full.shape), full.dtype, full.device, s, "backward")
            total = parts[holders[0]].clone()
            for s in holders[1:]:
                total += parts[s]
            layout = program.param_layouts[name]
            p.grad = local_slice(total, layout, self.mesh.coords(self.rank), self.mesh).clone()
        self.p2p.finish()

    def _apply_grads(self, grads: dict[str, torch.Tensor | None], seed: torch.Tensor) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters():
                g = grads.get(name)
                if g is None:
                    continue
                g = g if bool(seed == 1) else g * seed.to(g.dtype)
                p.grad = g if p.grad is None else p.grad + g

    # ------------------------------------------------------------------ readouts
    @property
    def fallbacks(self) -> list[Any]:
        return [f for program in self.programs for f in program.fallbacks]

    def _from_every_stage(self, mine: dict[str, Any]) -> dict[str, Any]:
        """Merge a per-stage dict over the stages (collective over ``pipe``)."""
        got: list[Any] = [None] * self.mesh.pipe
        cpu = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in mine.items()}
        dist.all_gather_object(got, cpu, group=pipe_group(self.mesh))
        out: dict[str, Any] = {}
        for part in got:
            for k, v in part.items():
                if out.get(k) is None:
                    out[k] = v
        return out

    def _merged(self, read: Callable[[ShardedModule], dict[str, Any]]) -> dict[str, Any]:
        """``read`` of every chunk's program (each collective over its stage's ranks), merged."""
        out: dict[str, Any] = {}
        for program in self.programs:
            out.update(read(program))
        return out

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Every parameter of the model (every stage's) -> its full gradient, by the
        model's names (collective: every rank)."""
        merged = self._from_every_stage(self._merged(lambda program: program.full_grads()))
        return {n: merged.get(n) for n in self._param_order}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict, full tensors, the model's keys (collective)."""
        merged = self._from_every_stage(self._merged(lambda program: program.full_state_dict()))
        return {k: self._unheld[k] if k in self._unheld else merged[k] for k in self._state_names}

    def state_keys(self) -> list[str]:
        """The whole model's state-dict keys (every stage's), as ``full_state_dict`` has them."""
        return list(self._state_names)

    def group_names(self, names: list[str]) -> list[str]:
        """An optimizer group's parameter names over every stage (each stage's optimizer
        holds its own), in the model's order (collective over ``pipe``)."""
        got: list[Any] = [None] * self.mesh.pipe
        dist.all_gather_object(got, names, group=pipe_group(self.mesh))
        every = {n for part in got for n in part}
        return [n for n in self._param_order if n in every]

    def measured_comm(self) -> dict[tuple[str, str, str], int | float]:
        """Bytes this rank handed to torch.distributed since the last reset: the stage
        program's collectives (ring model) and the pipeline's sends (``pipe`` rows)."""
        out: dict[tuple[str, str, str], int | float] = {}
        for program in self.programs:
            for k, v in program.measured_comm().items():
                out[k] = out.get(k, 0) + v
        for k, v in self.p2p.sent.items():
            out[k] = out.get(k, 0) + v
        return out

    def reset_measured_comm(self) -> None:
        for program in self.programs:
            program.reset_measured_comm()
        self.p2p.reset()

    def _pipe_rows(self) -> list[CommRow]:
        """The bytes this rank sends to other stages in one training step, from the
        stages' boundary values: what ``measured_comm``'s ``pipe`` rows must equal (a
        value for another chunk of this rank moves nothing)."""
        n = self.mesh.size("data") * self.mesh.size("z")
        m = self.microbatches
        p = self.mesh.pipe
        rows: list[CommRow] = []
        g = self.mesh.size(CONTEXT)

        def row(st: Stage, what: str, phase: str, val: Any, times: int, batched: bool = True) -> CommRow:
            whole = _nbytes(tuple(val.shape), val.dtype) * times
            cut = batched and _cut(val, n)
            tok = batched and _per_token(val, self._seq, g)
            local = whole // (n if cut else 1) // (g if tok else 1)
            divs = (("data", "z") if cut else ()) + ((CONTEXT,) if tok else ())
            return CommRow(f"stage{st.index}", what, ", ".join(st.blocks), None, "send", PIPE, phase, local,
                           whole, divs)

        for st in self.mine:
            for j, (cons, val) in enumerate(zip(st.consumers, st.output_vals)):
                for c in sorted(c for c in cons if c >= 0 and c % p != self.index):
                    rows.append(row(st, f"output {j} to stage {c}", "forward", val, m))
            for i, ((src, j), val) in enumerate(zip(st.inputs, st.input_vals)):
                if src >= 0 and src % p != self.index and _carries_grad(val):
                    rows.append(row(st, f"gradient of input {i} (stage {src}'s output {j})", "backward", val, m))
        for name, holders in sorted(self.shared.items()):
            c = self._owner[name]
            program = self.programs[c]
            full = torch.empty(program._global_shapes[name], dtype=program.get_parameter(name).dtype,
                               device="meta")
            rows.append(row(self.mine[c], f"gradient of {name} (shared by pipe ranks {holders})", "backward",
                            full, len(holders) - 1, batched=False))
        if self.index == p - 1:
            st = self.stages[-1]
            loss = torch.empty((), dtype=st.output_vals[-1].dtype, device="meta")
            rows.append(row(st, "the loss, to every other stage", "forward", loss, p - 1, batched=False))
        return rows

    def pipeline_report(self) -> CommReport:
        """``shardc.comm_report`` of a pipeline rank: its stage programs' collectives for
        one step (a forward and a backward row once a micro-batch, a gradient reduction
        once a step) and its sends to other stages."""
        m = self.microbatches
        rows = [replace(r, bytes=as_number(Fraction(r.bytes) * m), numerator=r.numerator * m)
                if _per_microbatch(r) else r for program in self.programs for r in comm_report(program).rows]
        return CommReport(rows + self._pipe_rows(), self.mesh,
                          title=f"stage {self.index} of {self.mesh.pipe}, {m} micro-batches")

    def idle_fraction(self) -> float:
        """The share of the last training step this rank spent waiting for other stages
        (blocked in a receive), the bubble as it happened."""
        if not self.last_timeline:
            return 0.0
        span = self.last_timeline[-1][3]
        return sum(a[4] for a in self.last_timeline) / span if span > 0 else 0.0

    def bubble_formula(self) -> float:
        """The schedule's idle share with equal stages (``runtime.pipeline.bubble_fraction``)."""
        return bubble_fraction(self.schedule, self.mesh.pipe, self.microbatches, self.chunks)

    def explain(self) -> str:
        """The stages, this rank's schedule and its last step's timeline."""
        how = {"zero_bubble": "simulated with F = B = W", "interleaved": "simulated, (p-1)/(v*m+p-1)"}.get(
            self.schedule, "(p-1)/(m+p-1)")
        chunked = f", {self.chunks} chunks a rank" if self.chunks > 1 else ""
        lines = [f"shardc pipeline on {self.mesh}: {len(self.stages)} stages{chunked}, {self.microbatches} "
                 f"micro-batches, schedule {self.schedule!r} (bubble with equal stages, {how}: "
                 f"{self.bubble_formula():.1%})"]
        for st in self.stages:
            here = "  <- this rank" if st.index % self.mesh.pipe == self.index else ""
            held = f"{len(st.blocks)} blocks ({st.blocks[0]} .. {st.blocks[-1]})" if st.blocks else "no repeated block"
            if self.options.split_points is not None:
                held = f"from {st.begins or 'the inputs'}, {held}"
            lines.append(f"  stage {st.index}: {held}, "
                         f"{st.flops / 1e6:.1f} MFLOP forward, {st.param_bytes / 2**20:.2f} MiB of "
                         f"parameters, {len(st.inputs)} inputs{here}")
        lines.append("  this rank runs: " + " ".join(self.label(*a) for a in self.order()))
        for r in self._pipe_rows():
            lines.append(f"  sends {r.op} ({r.phase}): {r.bytes} bytes a step")
        if self.last_timeline:
            lines.append(f"  last step: {self.last_timeline[-1][3] * 1e3:.1f} ms, idle {self.idle_fraction():.1%} "
                         "of it (waiting for other stages)")
            lines.append("  timeline (ms: start-end, waited): " + ", ".join(
                f"{self.label(kind, k, c)} {s * 1e3:.1f}-{e * 1e3:.1f} ({w * 1e3:.1f})"
                for kind, k, s, e, w, c in self.last_timeline))
        return "\n".join(lines)


def _per_microbatch(r: CommRow) -> bool:
    """Does the stage program issue this collective once a micro-batch? Forward and
    backward activation collectives, yes; a weight gradient's reduction (a step row, or
    the reduce-scatter behind a weight's all-gather) is deferred by ``no_sync`` and issued
    once, on the step's last backward. An expert row the routing sized holds the whole
    last step's rows already (the stage adds up its micro-batches': ``Runtime.routed_adds``)."""
    if ROUTED in r.op:
        return False
    if r.phase == "forward":
        return True
    return r.phase == "backward" and not (r.param is not None and r.collective == "reduce_scatter")


def _micro_rows(micro: tuple) -> int:
    """One micro-batch's rows (the batch dim of the inputs, cut into micro-batches)."""
    return next((x.shape[0] for x in micro if isinstance(x, torch.Tensor) and x.dim() > 0), 1)


def _now() -> float:
    return time.perf_counter()


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def _cut(val: Any, n: int) -> bool:
    return isinstance(val, torch.Tensor) and val.dim() > 0 and n > 1 and val.shape[0] % n == 0


def _per_token(val: Any, seq: int | None, g: int) -> bool:
    """Is this boundary value cut along the sequence over ``g`` context ranks? A value
    whose dim 1 is the model's sequence (``seq`` tokens), as ``shard_batch`` cuts the
    inputs; anything else (a mask of one row a head, a pooled vector) travels whole."""
    return (g > 1 and seq is not None and isinstance(val, torch.Tensor) and val.dim() > SEQUENCE_DIM
            and val.shape[SEQUENCE_DIM] == seq and seq % g == 0)


def _boundary_layout(val: Any, n: int, g: int, seq: int | None) -> Layout | None:
    """The layout a stage's program takes a boundary value in, where the inputs' default
    (dim 0 over data x z, dim 1 over context) is not how it travels; None where it is."""
    rows, tok = _cut(val, n), _per_token(val, seq, g)
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    if (rows or n == 1) and (tok or g == 1 or val.dim() <= SEQUENCE_DIM):
        return None
    lay = Layout.of(val.dim(), {a: 0 for a in BATCH_AXES}, order=("data", "z")) if rows else \
        Layout.replicate(val.dim())
    return lay.with_shard(CONTEXT, SEQUENCE_DIM) if tok else lay


def _sequence(micro: tuple) -> int | None:
    """The model's sequence length: dim 1 of its first input with one."""
    return next((int(x.shape[SEQUENCE_DIM]) for x in micro
                 if isinstance(x, torch.Tensor) and x.dim() > SEQUENCE_DIM), None)


def _carries_grad(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and val.requires_grad and val.dtype.is_floating_point


def _read(t: Any) -> torch.Tensor:
    return t.value() if hasattr(t, "value") and not isinstance(t, torch.Tensor) else t


def _device_of(sm: ShardedModule) -> torch.device:
    for p in sm.parameters():
        return p.device
    return torch.device("cpu")


def rank_stages(stages: list[Stage], p: int, index: int) -> list[Stage]:
    """The stages pipe rank ``index`` runs, chunk by chunk: stage c * p + index."""
    return stages[index::p]


def _compile_stage(st: Stage, micro: tuple, mesh: Mesh, options: Options, rank: int, n: int,
                   seq: int | None, training: bool) -> ShardedModule:
    """Stage ``st``'s program on this rank: its inputs from the model's or from earlier
    stages (as they travel: ``_boundary_layout``), compiled by the ordinary compiler."""
    stage_inputs: list[Any] = []
    layouts: dict[int, Layout] = {}
    for i, ((src, j), val) in enumerate(zip(st.inputs, st.input_vals)):
        if src < 0:
            stage_inputs.append(micro[j])
            continue
        x = torch.zeros(tuple(val.shape), dtype=val.dtype)
        if _carries_grad(val):
            x.requires_grad_(True)
        stage_inputs.append(x)
        lay = _boundary_layout(val, n, mesh.size(CONTEXT), seq)
        if lay is not None:
            layouts[i] = lay
    check_batch(tuple(stage_inputs), mesh, layouts)
    st.module.train(training)  # the stage was traced in the model's mode
    program = build(st.module, mesh, tuple(stage_inputs), options, rank, layouts or None,
                    blocks=st.blocks, cast_at_use=False)
    validate.after_compile(program, st.module, tuple(stage_inputs))
    return program


def _refuse_shared_in_rank(stages: list[Stage], p: int) -> None:
    """A parameter read by two chunks of one rank would be two parameters of the rank's
    optimizer; refused until the chunks share it."""
    seen: dict[tuple[str, int], int] = {}
    for st in stages:
        for name in st.params:
            other = seen.setdefault((name, st.index % p), st.index)
            if other != st.index:
                raise ShardcError(
                    f"shardc.compile: schedule='interleaved' puts stages {other} and {st.index} on pipe rank "
                    f"{st.index % p}, and both read parameter {name!r}; a parameter shared by two chunks "
                    "of one rank is not supported yet. Use fewer virtual_stages, or schedule='1f1b'.")


def compile_pipeline(model: nn.Module, mesh: Mesh, example_inputs: tuple, options: Options,
                     input_layouts: Any) -> PipelineModule:
    """Cut, compile this rank's stage, and settle with the other ranks (collective)."""
    refuse_with_stages(options, input_layouts)
    if options.schedule == "zero_bubble":
        # W passes run parameter group by parameter group (runtime.pipeline.SplitBackward):
        # a gradient bucket would be flushed, mostly empty, by each of them
        if options.bucket_mb:
            raise OptionError(f"shardc.compile: bucket_mb={options.bucket_mb} with schedule='zero_bubble': "
                              "its weight-gradient passes run a few parameters at a time, which buckets "
                              "do not fit; leave bucket_mb unset (each gradient reduced on its own).")
        options = replace(options, bucket_mb=0)
    m = options.microbatches or mesh.pipe
    n = mesh.size("data") * mesh.size("z")
    v = options.chunks
    if options.schedule == "interleaved" and m % mesh.pipe:
        raise OptionError(
            f"shardc.compile: schedule='interleaved' runs micro-batches in groups of pipe = {mesh.pipe} "
            f"(each group through every chunk in turn), and microbatches={m} is not a multiple of it. "
            f"Use microbatches={(m // mesh.pipe + 1) * mesh.pipe} or schedule='1f1b'.")
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] % (m * n):
            raise ShardcError(
                f"shardc.compile: example input {i} has batch size {x.shape[0]}, which {m} micro-batches "
                f"of data x z = {n} shards each do not divide; use a multiple of {m * n}.")
    rank = dist.get_rank()
    failure: Exception | None = None
    why: str | None = None  # why one device's draws cannot be handed to this stage
    module: PipelineModule | None = None
    try:
        micro = tuple(_microbatch(x, m, 0) for x in example_inputs)
        seq = _sequence(micro) if mesh.size(CONTEXT) > 1 else None
        compute = options.precision.compute
        if compute == torch.float32:
            gm = unlifted_graph(model, micro)
        else:
            # traced as one device runs the policy, before the cut: each stage's program
            # holds its casts, its boundary values carry the policy's dtypes, and its own
            # trace must not cast its inputs again (a value one device keeps in fp32 stays so)
            gm = local_casts(unlifted_graph(CastAtUse(model, compute), micro))
        stages = cut_stages(model, gm, mesh.pipe * v, per_rank=v, split_points=options.split_points)
        mine = rank_stages(stages, mesh.pipe, mesh.coords(rank)[PIPE])
        _refuse_shared_in_rank(stages, mesh.pipe)
        programs = [_compile_stage(st, micro, mesh, options, rank, n, seq, model.training) for st in mine]
        terms, coupled = loss_terms(gm)
        if coupled is not None:
            warnings.warn(
                "shardc.compile: with pipe > 1 the loss is computed micro-batch by micro-batch and "
                f"the micro-batches' losses averaged, but this loss does not add up over micro-batches "
                f"({coupled}), so the step's loss and gradients differ from one device's on the "
                "global batch, as under gradient accumulation (docs/pipeline.md).",
                ShardcWarning, stacklevel=3)
        every = stage_draws(stages, _micro_rows(micro), n)
        if isinstance(every, list):
            why = next((w for st, program in zip(mine, programs)
                        if (w := program_sites(program, [d for d in every if d.stage == st.index])) is not None),
                       None)
        else:
            why = every
        draws = Draws(every, [st.index for st in mine], m, n) \
            if isinstance(every, list) and every and why is None else None
        module = PipelineModule(programs, stages, mesh, rank, options, m, _loss_rule(gm, terms), model, draws, seq)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then it is raised
        failure = e
    # a rank whose stage failed to compile must not leave the others waiting in a send
    got: list[Any] = [None] * dist.get_world_size()
    outcome = (None if failure is None else f"{type(failure).__name__}: {failure}", why)
    dist.all_gather_object(got, outcome)
    if failure is not None:
        raise failure
    bad = [(r, msg) for r, (msg, _) in enumerate(got) if msg is not None]
    if bad:
        r, msg = bad[0]
        raise ShardcError(f"shardc.compile: rank {r} failed to compile its pipeline stage: {msg}")
    # one device's draws only if every stage can take them: the replay moves every rank's
    # generator, and a stage that drew on its own would move it otherwise
    unmatched = [(r, w) for r, (_, w) in enumerate(got) if w is not None]
    assert module is not None
    if unmatched and model.training:
        module._draws = None
        r, w = unmatched[0]
        warnings.warn(
            "shardc.compile: with pipe > 1 each stage draws its random numbers (dropout masks) "
            f"micro-batch by micro-batch, not as one device draws them for the whole batch ({w}, "
            f"rank {r}): the same distribution, not the same values (docs/pipeline.md).",
            ShardcWarning, stacklevel=3)
    elif unmatched:
        module._draws = None
    # every rank makes the mesh's groups here (new groups are collective over the world):
    # made lazily, at a stage's first forward, they hung the step, since the later
    # stages' ranks are then waiting in a receive, not in the group's creation
    axis_groups(mesh)
    return module

