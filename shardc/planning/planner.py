"""``shardc.plan``: rank every 4D mesh of a world size by predicted step time.

The model is the paper's (section V-B): each collective's bytes (equations 1-5 for a
GEMM, and whatever else the compiled program moves: norm statistics, embeddings, the
loss) divided by the bandwidth of the group that carries it (a measured intra-node
table, or equation 7 across nodes), summed. The bytes come from the compiled program's
own comm report, so the plan and the program never disagree. On a machine that also
states a latency per collective call, a GEMM rate, a memory bandwidth, a per-op cost and
how much communication hides behind compute (what ``profile_machine`` measures; the
presets state none of them), the prediction is the whole step's (``shardc.planning.cost``): the
calls each axis makes after the passes packed them, the compute, and the communication
the schedule overlaps credited as far as the machine lets it.

Compiling for each of a large world size's hundreds of meshes would be slow, so the
planner compiles once per *pattern* (which axes have size > 1) on the smallest mesh of
that pattern, and evaluates every row's symbolic volume (``CommRow.formula``, a sympy
expression in the axis sizes) for the other meshes of the pattern. The divisibility
constraints of that program (every sharded dim against the product of the sizes of the
axes cutting it) are checked per mesh, and the best candidate is compiled for real and
its report compared with the prediction.
"""
from __future__ import annotations

import math
import os
import sys
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from rich.console import Console
from rich.table import Table

from shardc.core.context import GLOBAL_VAL, KIND, PLACEMENT, SOURCE
from shardc.core.errors import OptionError, ShardcError
from shardc.core.machine import Machine
from shardc.core.mesh import CONTEXT, CUT_AXES, GRID_AXES, Mesh
from shardc.core.options import EXPERT_AXES, Options
from shardc.passes.rules.routing import find_regions
from shardc.passes.trace import signature, trace
from shardc.planning.cost import StepShape, StepTime, axis_sizes, per_rank, predict, step_shape
from shardc.planning.memory import estimate
from shardc.planning.stages import StageShares, pipeline_terms, stage_shares
from shardc.program.offline import compile_offline
from shardc.program.pipeline import refuse_with_stages
from shardc.program.report import comm_report
from shardc.runtime.volume import ring_factor

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
# fp32 weight, gradient and AdamW's two moments; mixed precision with fp32 master weights
# also comes to 16 (2 + 2 + 4 + 4 + 4), the ZeRO paper's figure
BYTES_PER_PARAMETER = 16

# Each pattern's analysis (its comm terms, constraints and step shape) per model object:
# they do not depend on the machine, so planning the same model again (for another
# machine, or by ``shardc bench`` after ``plan``) compiles nothing twice. Keyed like the
# trace cache (``passes/trace.py``): a model object is taken to keep its structure.
_ANALYSES: "weakref.WeakKeyDictionary[torch.nn.Module, dict[Any, Any]]" = \
    weakref.WeakKeyDictionary()


@dataclass
class Candidate:
    """One mesh's prediction. ``per_axis_s``: each axis's communication (bytes over
    bandwidth, plus calls times latency where the machine has a latency table);
    ``predicted_comm_s`` their sum; ``predicted_step_s`` the step time candidates are
    ranked by: communication plus ``compute_s`` less ``hidden_s`` (what the passes
    overlap), equal to ``predicted_comm_s`` on a machine of bandwidth alone (the presets:
    the paper's model). ``step`` has the terms one by one (``shardc.planning.cost.StepTime``)."""

    mesh: Mesh
    predicted_comm_s: float
    per_axis_s: dict[str, float]
    memory_bytes_per_rank: float
    param_bytes_per_rank: float
    activation_bytes_per_rank: float
    bytes_per_axis: dict[str, float] = field(default_factory=dict)
    exact: bool = True  # False: a first estimate from another pattern's program
    step: StepTime | None = None
    # the experts of a mixture of experts cut over these axes (compile's expert_axes);
    # None: kept as any weight
    expert_axes: tuple[str, ...] | None = None
    # a mesh with pipeline stages: the micro-batches a step is planned with
    microbatches: int | None = None

    @property
    def options(self) -> dict[str, Any]:
        """The compile options this candidate was planned with, beyond the caller's."""
        out: dict[str, Any] = {"expert_axes": self.expert_axes} if self.expert_axes else {}
        if self.microbatches is not None:
            out["microbatches"] = self.microbatches
        return out

    @property
    def bubble_s(self) -> float:
        """A pipeline's predicted idle time a step (0 without stages)."""
        return self.step.bubble if self.step is not None else 0.0

    @property
    def predicted_step_s(self) -> float:
        return self.step.total if self.step is not None else self.predicted_comm_s

    @property
    def compute_s(self) -> float:
        return self.step.compute if self.step is not None else 0.0

    @property
    def hidden_s(self) -> float:
        return self.step.hidden if self.step is not None else 0.0

    def __repr__(self) -> str:
        experts = f", expert_axes={self.expert_axes}" if self.expert_axes else ""
        experts += f", microbatches={self.microbatches}" if self.microbatches else ""
        return (f"Candidate({self.mesh.spec()}{experts}, {self.predicted_step_s:.4g} s, "
                f"{self.memory_bytes_per_rank / 2**30:.2f} GiB/rank)")


@dataclass
class Dropped:
    mesh: Mesh
    reason: str


class Plan(list):
    """Candidates best first; ``.dropped`` says why the other meshes were left out."""

    def __init__(self, cands: list[Candidate], dropped: list[Dropped], world_size: int,
                 machine: Machine) -> None:
        super().__init__(cands)
        self.dropped = dropped
        self.world_size = world_size
        self.machine = machine

    def drop_reasons(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for d in self.dropped:
            out[d.reason.split(":")[0]] += 1
        return dict(out)


def resolve_machine(machine: Machine | str) -> Machine:
    if isinstance(machine, Machine):
        return machine
    if isinstance(machine, str):
        if os.path.exists(machine):
            return Machine.load(machine)
        return Machine.preset(machine)
    raise TypeError(f"shardc.plan: machine must be a shardc.Machine, a preset name or a JSON path, "
                    f"got {type(machine).__name__}.")


@dataclass
class _Pattern:
    """What one compile tells about every mesh with the same axes of size > 1: each term
    is (global bytes, axes dividing them), evaluated per mesh without recompiling."""

    comm: list[tuple[str, str, int, tuple[str, ...], bool]]  # collective, axis, num, divs, times_axis
    params: list[tuple[int, tuple[str, ...]]]
    activations: list[tuple[int, tuple[str, ...]]]
    constraints: list[tuple[int, tuple[str, ...], str]]  # (dim size, axes, what)
    step: StepShape | None = None  # calls, ops, overlaps, FLOPs: machines that model them

    def bytes_per_axis(self, sizes: dict[str, int]) -> dict[str, float]:
        out = {a: 0.0 for a in CUT_AXES}
        for coll, axis, num, divs, times in self.comm:
            g = sizes[axis]
            v = num * (g if times else 1) / math.prod(sizes[d] for d in divs)
            out[axis] += float(ring_factor(coll, g)) * v
        return out


def _pattern_of(mesh: Mesh) -> tuple[bool, ...]:
    return tuple(mesh.size(a) > 1 for a in CUT_AXES)


def _local_terms(n: fx.Node) -> tuple[int, tuple[str, ...]] | None:
    val, lay = n.meta.get(GLOBAL_VAL), n.meta.get(PLACEMENT)
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        return None
    num = math.prod(val.shape) * torch.empty((), dtype=val.dtype).element_size()
    divs = tuple(a for axes in lay.dims for a in axes) if lay is not None and lay.ndim == val.dim() else ()
    return num, divs


def _activation_terms(gm: fx.GraphModule, checkpointing: bool) -> list[tuple[int, tuple[str, ...]]]:
    """Activation estimate: without checkpointing, every forward intermediate's local
    size (all autograd may keep; an upper bound). With checkpointing, the inputs of each
    repeated block (``blocks.3``, ``h.3``: a ModuleList entry) plus the largest block's
    intermediates, which is what recomputation keeps alive."""
    everything: list[tuple[int, tuple[str, ...]]] = []
    outside: list[tuple[int, tuple[str, ...]]] = []
    per_block: dict[str, list[tuple[int, tuple[str, ...]]]] = defaultdict(list)
    inputs: list[tuple[int, tuple[str, ...]]] = []
    seen: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.meta.get(KIND) in ("collective", "wait"):
            continue
        t = _local_terms(n)
        if t is None:
            continue
        everything.append(t)
        mod = getattr(n.meta.get(SOURCE), "module", "") or ""
        parts = mod.split(".")
        block = next((".".join(parts[:i + 1]) for i in range(len(parts)) if parts[i].isdigit()), None)
        if block is None:
            outside.append(t)
            continue
        per_block[block].append(t)
        for a in n.all_input_nodes:
            amod = getattr(a.meta.get(SOURCE), "module", "") or ""
            ta = _local_terms(a)
            if ta is not None and not amod.startswith(block) and a not in seen:
                seen.add(a)
                inputs.append(ta)
    if not checkpointing or not per_block:
        return everything
    two = {a: 2 for a in CUT_AXES}
    biggest = max(per_block.values(), key=lambda ts: per_rank(ts, two))
    return outside + inputs + biggest


def _analyse(sm: Any, checkpointing: bool, machine: Machine) -> _Pattern:
    rep = comm_report(sm)
    comm = [(r.collective, r.axis, r.numerator, r.divs, r.times_axis) for r in rep.rows]
    params = []
    for name, layout in sm.param_layouts.items():
        shape = list(sm._global_shapes[name])
        params.append((math.prod(shape), tuple(a for axes in layout.dims for a in axes)))
    constraints: list[tuple[int, tuple[str, ...], str]] = []
    seen = set()
    for n in sm.graph_module.graph.nodes:
        val, lay = n.meta.get(GLOBAL_VAL), n.meta.get(PLACEMENT)
        if not isinstance(val, torch.Tensor) or lay is None or lay.ndim != val.dim():
            continue
        for d, axes in enumerate(lay.dims):
            if axes:
                key = (int(val.shape[d]) // abs(lay.interleave[d]), axes)
                if key not in seen:
                    seen.add(key)
                    constraints.append((key[0], axes, f"{n.name} dim {d}"))
    return _Pattern(_merge5(comm), _merge2(params), _merge2(_activation_terms(sm.graph_module, checkpointing)),
                    constraints, step_shape(sm) if machine.models_step() else None)


def _merge2(terms: list[tuple[int, tuple[str, ...]]]) -> list[tuple[int, tuple[str, ...]]]:
    """Sum the numerators of terms with the same divisors: one term per shape of formula."""
    acc: dict[tuple[str, ...], int] = defaultdict(int)
    for n, divs in terms:
        acc[tuple(sorted(divs))] += n
    return [(n, d) for d, n in acc.items()]


def _merge5(terms: list[tuple[str, str, int, tuple[str, ...], bool]]
            ) -> list[tuple[str, str, int, tuple[str, ...], bool]]:
    acc: dict[tuple[str, str, tuple[str, ...], bool], int] = defaultdict(int)
    for coll, axis, n, divs, times in terms:
        acc[(coll, axis, tuple(sorted(divs)), times)] += n
    return [(c, a, n, d, t) for (c, a, d, t), n in acc.items()]


@dataclass(frozen=True)
class _Gemm:
    m: int
    k: int
    n: int
    param: str
    elsize: int


def _weight_gemms(ep: torch.export.ExportedProgram) -> list[_Gemm]:
    """Every GEMM whose one operand is a parameter (possibly transposed), global shapes."""
    params = {spec.arg.name: spec.target for spec in ep.graph_signature.input_specs
              if spec.kind.name == "PARAMETER"}
    aten = torch.ops.aten

    def param_of(node: Any) -> tuple[str, bool] | None:
        flip = False
        while isinstance(node, fx.Node) and node.op == "call_function" and node.target in (
                aten.t.default, aten.transpose.int, aten.permute.default, aten.alias.default,
                aten._to_copy.default, aten.to.dtype):
            if node.target is not aten.alias.default and node.target not in (aten._to_copy.default,
                                                                              aten.to.dtype):
                flip = not flip
            node = node.args[0]
        if isinstance(node, fx.Node) and node.op == "placeholder" and node.name in params:
            return params[node.name], flip
        return None

    out = []
    for node in ep.graph.nodes:
        t = node.target
        if t is aten.linear.default:
            x, w = node.args[0], node.args[1]
            p = param_of(w)
            swap = True
        elif t in (aten.mm.default, aten.matmul.default, aten.addmm.default):
            x, w = (node.args[1], node.args[2]) if t is aten.addmm.default else (node.args[0], node.args[1])
            p = param_of(w)
            swap = False
        else:
            continue
        if p is None or len(w.meta["val"].shape) != 2:
            continue
        a, b = w.meta["val"].shape
        k, n = (b, a) if swap else (a, b)
        m = math.prod(x.meta["val"].shape) // k
        out.append(_Gemm(int(m), int(k), int(n), p[0], w.meta["val"].element_size()))
    return out


def plan(model: torch.nn.Module, world_size: int, machine: Machine | str,
         example_inputs: tuple, *, checkpointing: bool = False, exact_top: int = 10,
         verify: bool = True, memory: str = "formula", optimizer: str | int = "adamw",
         pipeline: bool | None = None, context: bool | None = None, **compile_kw: Any) -> Plan:
    """Every mesh of ``world_size`` ranks, ranked by predicted step time (communication
    time on a machine of bandwidth alone: ``Candidate`` has the terms); the
    ones the model or batch does not divide, or that do not fit in device memory, are in
    ``.dropped`` with their reason. Works offline: no process group, meta tensors welcome.

    One compile with every axis in use gives each mesh a first estimate (axes of size 1
    contribute nothing to its terms); then the pattern of every mesh in the current top
    ``exact_top`` is compiled for itself and its meshes re-evaluated exactly, until the
    top ``exact_top`` are all exact. Candidates past them may keep their first estimate
    (``Candidate.exact`` says which).

    Memory: ``memory="formula"`` (fast, for any world size) counts 16 bytes per parameter
    element and a bound on the activations (every forward intermediate; with
    ``checkpointing``, the blocks' inputs and the largest block). ``memory="traced"``
    replaces that, for the top ``exact_top`` candidates, with ``shardc.planning.memory.estimate``
    of each one's compiled program (its traced step's peak plus its resident state,
    ``optimizer`` saying how much state per parameter), under the same ``compile_kw``
    (``activation_checkpoint``, ``precision``, ``shard_optimizer``): what the program
    will hold, within ~10% of the measured peak on the GPT of ``benchmarks/memory.py``.
    A candidate that then does not fit is dropped.

    Pipeline stages (``pipeline``): ``True`` ranks the meshes with ``pipe > 1`` beside
    the 4D ones, each predicted from its stage mesh's 4D prediction and the compiler's
    stage cut, with the bubble and the sends between stages as terms of their own
    (``shardc.planning.stages``); ``None`` (the default) ranks them too where the world
    spans nodes on a machine that states its compute (the bubble is idle compute: a
    machine of bandwidth alone cannot price it, and ``True`` there is an error), or when
    no 4D mesh fits in memory; ``False`` never. A pipeline candidate's ``options`` carry its
    ``microbatches`` (``compile``'s, else ``pipe``); its memory is the formula's even
    with ``memory="traced"``, and ``verify`` checks 4D winners only.

    Context parallelism (``context``): ``True`` ranks the meshes with ``context > 1`` (the
    sequence cut, attention by a ring: ``docs/long_sequences.md``) beside the others, each
    compiled for its pattern like a 4D mesh, the ring's sends in its ``context`` terms;
    ``None`` (the default) ranks them where the model attends and no mesh without them
    fits in memory (a sequence whose activations one rank cannot hold); ``False`` never.
    """
    if memory not in ("formula", "traced"):
        raise ValueError(f"shardc.plan: memory must be 'formula' or 'traced', got {memory!r}.")
    checkpointing = checkpointing or compile_kw.get("activation_checkpoint", "none") != "none"

    machine = resolve_machine(machine)
    if world_size < 1:
        raise ValueError(f"shardc.plan: world_size must be >= 1, got {world_size}.")
    inputs = tuple(example_inputs)
    batch = next((x.shape[0] for x in inputs if isinstance(x, torch.Tensor) and x.dim()), 1)
    traced = trace(model, inputs)
    gemms = _weight_gemms(traced)
    routed = any(n.target in r.gemms for r in find_regions(traced.graph_module.graph) for n in r.kinds)
    weight_elements = sum({g.param: g.k * g.n for g in gemms}.values())
    dropped: list[Dropped] = []

    def admitted(members: list[Mesh]) -> list[Mesh]:
        out = []
        for m in members:
            if batch % (m.data * m.z):
                dropped.append(Dropped(m, f"batch: {batch} sequences do not split over data x z = "
                                          f"{m.data * m.z}"))
                continue
            # parameters, gradients and AdamW state of the GEMM weights alone, cut at most
            # over x, y and z: a lower bound of the memory a rank needs
            mem_lb = BYTES_PER_PARAMETER * weight_elements / (m.x * m.y * m.z)
            if mem_lb > machine.memory_bytes:
                dropped.append(Dropped(m, f"memory: at least {mem_lb / 2**30:.1f} GiB per rank of "
                                          f"weights and optimizer state > {machine.memory_bytes / 2**30:.1f} GiB"))
                continue
            out.append(m)
        return out

    meshes = admitted(Mesh.all(world_size))
    if not meshes and pipeline is not None and not pipeline:
        _nothing_fits(world_size, machine, dropped)


    cache = _ANALYSES.setdefault(model, {})

    def rank(kw: dict[str, Any], members: list[Mesh], fits: bool = True) -> tuple[list[Candidate], list[Dropped]]:
        """Every mesh of ``members`` under the compile options ``kw`` (``fits=False``: none
        dropped for memory, for a stage mesh whose stages hold a part of the model)."""
        on = machine if fits else replace(machine, memory_bytes=sys.float_info.max)
        stem = (signature(inputs), model.training, world_size, checkpointing, machine.models_step(),
                repr(sorted(kw.items())))
        experts = kw.get("expert_axes")

        def analysis_for(pattern: tuple[bool, ...], members: list[Mesh]) -> _Pattern | str:
            key = (stem, pattern)
            if key not in cache:
                reason = ""
                tries = [_smallest_of_pattern(pattern, batch)] + sorted(members, key=Mesh.spec)[:2]
                for m in [t for t in tries if t is not None]:
                    try:
                        cache[key] = _analyse(compile_offline(model, inputs, m, refuse_indivisible=True,
                                                              **kw),
                                              checkpointing, machine)
                        break
                    except ShardcError as e:
                        reason = str(e).split(". ")[0]
                else:
                    cache[key] = reason or "no mesh of this pattern compiles"
            return cache[key]

        by_pattern: dict[tuple[bool, ...], list[Mesh]] = defaultdict(list)
        for m in members:
            by_pattern[_pattern_of(m)].append(m)
        if not by_pattern:
            return [], []
        # the first estimate: every axis in use, so every term of every pattern is present
        full = tuple(any(p[i] for p in by_pattern) for i in range(len(CUT_AXES)))
        first = analysis_for(full, by_pattern.get(full, []))
        evaluated: dict[Mesh, Candidate | Dropped] = {}
        exact_patterns: set[tuple[bool, ...]] = set()

        def evaluate(pattern: tuple[bool, ...], a: _Pattern | str, exact: bool) -> None:
            for m in by_pattern[pattern]:
                evaluated[m] = (_evaluate(m, a, on, exact, experts) if isinstance(a, _Pattern)
                                else Dropped(m, f"divisibility: {a}"))

        if isinstance(first, _Pattern):
            for pattern in by_pattern:
                evaluate(pattern, first, pattern == full)
            exact_patterns.add(full)
        while True:
            ranked = sorted((c for c in evaluated.values() if isinstance(c, Candidate)), key=_key)
            todo = {_pattern_of(c.mesh) for c in ranked[:exact_top]} - exact_patterns
            if not isinstance(first, _Pattern):  # no estimate: compile every pattern
                todo = set(by_pattern) - exact_patterns
            if not todo:
                break
            for pattern in sorted(todo):
                evaluate(pattern, analysis_for(pattern, by_pattern[pattern]), True)
                exact_patterns.add(pattern)
        return ([c for c in evaluated.values() if isinstance(c, Candidate)],
                [d for d in evaluated.values() if isinstance(d, Dropped)])

    cands, lost = rank(compile_kw, meshes)
    dropped += lost
    # a mixture of experts whose experts can be cut: the same meshes with them cut over
    # data or over z (where that axis has ranks) are candidates too, ranked with the rest
    for axes in _expert_axes_to_try(routed, compile_kw):
        more, lost = rank({**compile_kw, "expert_axes": axes},
                          [m for m in meshes if all(m.size(a) > 1 for a in axes)])
        cands += more
        dropped += [replace(d, reason=f"expert_axes={axes}: {d.reason}") for d in lost]
    attends = any(n.target is _SDPA for n in traced.graph_module.graph.nodes)
    if context or (context is None and attends and not cands):
        # the sequence cut over context: its ring's sends are the comm report's context
        # rows, and every activation is cut, so a sequence too long for 4D meshes fits
        more, lost = rank(compile_kw, admitted(
            [m for m in Mesh.all(world_size, GRID_AXES + (CONTEXT,)) if m.context > 1]))
        cands += more
        dropped += lost
    spans_nodes = world_size > machine.gpus_per_node and bool(machine.gemm_flops)
    if pipeline or (pipeline is None and (not cands or spans_nodes)):
        more, lost = _staged_candidates(model, inputs, world_size, machine, batch, weight_elements,
                                        compile_kw, rank, explicit=bool(pipeline))
        cands += more
        dropped += lost
    cands.sort(key=_key)
    if memory == "traced":
        cands = _traced_memory(model, inputs, cands, exact_top, machine, dropped, optimizer,
                               compile_kw)
    if not cands:
        _nothing_fits(world_size, machine, dropped)
    if verify and cands[0].mesh.pipe == 1:
        _verify(model, inputs, cands[0], compile_kw)
    return Plan(cands, dropped, world_size, machine)


def _staged_candidates(model: torch.nn.Module, inputs: tuple, world_size: int, machine: Machine,
                       batch: int, weight_elements: int, compile_kw: dict, rank: Any,
                       explicit: bool) -> tuple[list[Candidate], list[Dropped]]:
    """Every mesh with ``pipe > 1`` stages of ``world_size`` ranks, from its stage mesh's
    4D candidate (``rank`` over the meshes of ``world_size / pipe`` ranks)."""
    try:
        refuse_with_stages(Options(**{k: v for k, v in compile_kw.items()
                                      if k not in ("microbatches", "schedule", "virtual_stages")}), None)
    except OptionError:
        if explicit:
            raise
        return [], []
    if not machine.gemm_flops:
        # the bubble is idle compute: a machine of bandwidth alone would price a pipeline's
        # stages at their sends only and rank the deepest first
        if explicit:
            raise ShardcError(
                f"shardc.plan: pipeline=True needs a machine that states its compute "
                f"(gemm_flops), and {machine.name!r} states bandwidth alone: a pipeline's bubble "
                "is idle compute it cannot price. Measure one (shardc profile-machine) or give "
                "Machine(..., gemm_flops=...).")
        return [], []
    schedule = compile_kw.get("schedule", "1f1b")
    chunks = Options(schedule=schedule, virtual_stages=compile_kw.get("virtual_stages")).chunks
    kw = {k: v for k, v in compile_kw.items() if k not in ("microbatches", "schedule", "virtual_stages")}
    ps = [p for p in range(2, world_size + 1) if world_size % p == 0]
    shares = stage_shares(model, inputs, ps, chunks)
    out: list[Candidate] = []
    dropped: list[Dropped] = []
    for p in ps:
        s = shares[p]
        m = compile_kw.get("microbatches") or p
        if chunks > 1 and m % p:
            dropped.append(Dropped(Mesh(pipe=p, data=world_size // p),
                                   f"schedule: the interleaved schedule needs micro-batches ({m}) a multiple of {p}"))
            continue
        if isinstance(s, str):
            dropped.append(Dropped(Mesh(pipe=p, data=world_size // p), f"stages: {s}"))
            continue
        inner: list[Mesh] = []
        for im in Mesh.all(world_size // p):
            whole = _with_stages(im, p)
            if batch % (m * im.data * im.z):
                dropped.append(Dropped(whole, f"batch: {batch} sequences do not split into {m} "
                                              f"micro-batches over data x z = {im.data * im.z}"))
            elif BYTES_PER_PARAMETER * weight_elements * s.params / (im.x * im.y * im.z) > machine.memory_bytes:
                dropped.append(Dropped(whole, "memory: the largest stage's weights and optimizer state "
                                              "alone exceed a rank's memory"))
            else:
                inner.append(im)
        got, lost = rank(kw, inner, fits=False)
        dropped += [Dropped(_with_stages(d.mesh, p), d.reason) for d in lost]
        for c in got:
            staged = _staged(c, p, m, schedule, s, machine, chunks)
            if staged.memory_bytes_per_rank > machine.memory_bytes:
                dropped.append(Dropped(staged.mesh, f"memory: {staged.memory_bytes_per_rank / 2**30:.1f} GiB "
                                                    f"per rank > {machine.memory_bytes / 2**30:.1f} GiB"))
            else:
                out.append(staged)
    return out, dropped


def _with_stages(m: Mesh, p: int) -> Mesh:
    return Mesh(pipe=p, data=m.data, z=m.z, y=m.y, x=m.x)


def _staged(c: Candidate, p: int, m: int, schedule: str, shares: StageShares, machine: Machine,
            chunks: int = 1) -> Candidate:
    mesh = _with_stages(c.mesh, p)
    st = c.step
    zeros = {a: 0.0 for a in CUT_AXES}
    t = pipeline_terms(shares, m, schedule, mesh, machine,
                       st.bandwidth if st is not None else c.per_axis_s,
                       st.latency if st is not None else zeros,
                       st.compute if st is not None else 0.0, st.hidden if st is not None else 0.0,
                       c.bytes_per_axis, c.param_bytes_per_rank, c.activation_bytes_per_rank, chunks)
    step = StepTime(t.compute, t.bandwidth, t.latency, min(t.hidden, t.compute), t.bubble)
    per_axis = {a: t.bandwidth[a] + t.latency[a] for a in t.bandwidth}
    return Candidate(mesh, step.comm, per_axis, t.param_bytes + t.activation_bytes, t.param_bytes,
                     t.activation_bytes, t.bytes_per_axis, c.exact, step, c.expert_axes, m)


def _key(c: Candidate) -> tuple:
    return (c.predicted_step_s, c.memory_bytes_per_rank, c.mesh.spec(), c.expert_axes or ())


def _expert_axes_to_try(routed: bool, compile_kw: dict) -> list[tuple[str, ...]]:
    """The ways to cut a mixture of experts' experts, as extra candidates (over data, over
    z, over both): none when the model has no routing region or the caller fixed
    ``expert_axes``."""
    if not routed or "expert_axes" in compile_kw:
        return []
    return [(a,) for a in EXPERT_AXES] + [("z", "data")]


def _evaluate(m: Mesh, a: _Pattern, machine: Machine, exact: bool,
              experts: tuple[str, ...] | None = None) -> Candidate | Dropped:
    sizes = axis_sizes(m)
    bad = next(((n, axes, what) for n, axes, what in a.constraints
                if n % math.prod(sizes[x] for x in axes)), None)
    if bad is not None:
        n, axes, what = bad
        return Dropped(m, f"divisibility: {what} of size {n} is cut over {'x'.join(axes)} = "
                          f"{math.prod(sizes[x] for x in axes)}")
    pbytes = per_rank(a.params, sizes) * BYTES_PER_PARAMETER
    abytes = per_rank(a.activations, sizes)
    mem = pbytes + abytes
    if mem > machine.memory_bytes:
        return Dropped(m, f"memory: {mem / 2**30:.1f} GiB per rank > "
                          f"{machine.memory_bytes / 2**30:.1f} GiB")
    per_axis_bytes = a.bytes_per_axis(sizes)
    try:
        step = predict(a.step, per_axis_bytes, m, machine)
    except ValueError as e:
        return Dropped(m, f"machine: {e}")
    per_axis = {x: step.bandwidth[x] + step.latency[x] for x in CUT_AXES}
    return Candidate(m, step.comm, per_axis, mem, pbytes, abytes, per_axis_bytes, exact,
                     step if a.step is not None else None, experts)


def _nothing_fits(world_size: int, machine: Machine, dropped: list[Dropped]) -> None:
    reasons: dict[str, int] = defaultdict(int)
    for d in dropped:
        reasons[d.reason.split(":")[0]] += 1
    raise ShardcError(
        f"shardc.plan: no mesh of {world_size} ranks fits this model on {machine.name!r} "
        f"(dropped: {dict(reasons)}). First reason: {dropped[0].reason if dropped else '-'}. "
        "Use more ranks, more memory per rank, a batch that data x z divides, or activation "
        "checkpointing (checkpointing=True).")


def _smallest_of_pattern(pattern: tuple[bool, ...], batch: int) -> Mesh | None:
    sizes = {a: (2 if on else 1) for a, on in zip(CUT_AXES, pattern)}
    m = Mesh(**sizes)
    return m if batch % (m.data * m.z) == 0 else None


def _traced_memory(model: torch.nn.Module, inputs: tuple, cands: list[Candidate], top: int,
                   machine: Machine, dropped: list[Dropped], optimizer: str | int,
                   compile_kw: dict) -> list[Candidate]:
    """The top candidates' memory from their compiled programs (shardc.planning.memory)."""

    out: list[Candidate] = []
    for i, c in enumerate(cands):
        if i < top and c.mesh.pipe == 1:  # a pipeline's stages keep the formula's figure
            est = estimate(compile_offline(model, inputs, c.mesh, refuse_indivisible=True,
                                           **compile_kw, **c.options), optimizer)
            c.memory_bytes_per_rank = float(est.total)
            c.param_bytes_per_rank = float(est.resident)
            c.activation_bytes_per_rank = float(est.step_peak)
            if est.total > machine.memory_bytes:
                dropped.append(Dropped(c.mesh, f"memory: {est.total / 2**30:.1f} GiB per rank "
                                               f"(traced) > {machine.memory_bytes / 2**30:.1f} GiB"))
                continue
        out.append(c)
    return out


def _verify(model: torch.nn.Module, inputs: tuple, best: Candidate, compile_kw: dict) -> None:
    """Compile the winner for real: its report must equal the pattern's prediction."""
    rep = comm_report(compile_offline(model, inputs, best.mesh, refuse_indivisible=True,
                                      **compile_kw, **best.options))
    for a in CUT_AXES:
        got, want = float(rep.total_bytes(axis=a)), best.bytes_per_axis[a]
        if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-6):
            raise AssertionError(f"shardc.plan: the prediction for {best.mesh} over {a} ({want}) "
                                 f"differs from its compiled program ({got})")


def print_plan(model: torch.nn.Module, inputs: tuple, world_size: int, machine: str, top: int = 10,
               checkpointing: bool = False, pipeline: bool | None = None,
               context: bool | None = None) -> Plan:


    t0 = time.perf_counter()
    p = plan(model, world_size, machine, inputs, checkpointing=checkpointing, exact_top=max(top, 1),
             pipeline=pipeline, context=context)
    took = time.perf_counter() - t0
    t = Table(title=f"top {min(top, len(p))} of {len(p)} meshes for {world_size} ranks on "
                    f"{p.machine.name} (planned in {took:.1f} s)")
    step = p.machine.models_step()
    staged = any(c.mesh.pipe > 1 for c in p[:top])
    axes = [a for a in CUT_AXES if a != CONTEXT or any(c.mesh.context > 1 for c in p[:top])]
    axes += ["pipe"] if staged else []
    cols = ["rank", "mesh"] + [f"t_{a} (s)" for a in axes] + ["comm (s)"]
    cols += ["compute (s)", "hidden (s)"] + (["bubble (s)"] if staged else []) + ["step (s)"] if step else []
    for col in cols + ["memory/rank"]:
        t.add_column(col, justify="right" if col not in ("mesh",) else "left")
    for i, c in enumerate(p[:top]):
        extra = [f"{c.compute_s:.4g}", f"{c.hidden_s:.4g}"] + ([f"{c.bubble_s:.4g}"] if staged else []) \
            + [f"{c.predicted_step_s:.4g}"] if step else []
        spec = c.mesh.spec() + (f" experts/{','.join(c.expert_axes)}" if c.expert_axes else "") \
            + (f" m={c.microbatches}" if c.microbatches else "")
        t.add_row(str(i + 1), spec, *(f"{c.per_axis_s.get(a, 0.0):.4g}" for a in axes),
                  f"{c.predicted_comm_s:.4g}", *extra, f"{c.memory_bytes_per_rank / 2**30:.2f} GiB")
    console = Console(width=max(Console().width, 110))
    console.print(t)
    if p.dropped:
        console.print("dropped: " + ", ".join(f"{n} ({r})" for r, n in sorted(p.drop_reasons().items())))
    return p
