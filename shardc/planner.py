"""``shardc.plan``: rank every 4D mesh of a world size by predicted communication time.

The model is the paper's (section V-B): each collective's bytes (equations 1-5 for a
GEMM, and whatever else the compiled program moves: norm statistics, embeddings, the
loss) divided by the bandwidth of the group that carries it (a measured intra-node
table, or equation 7 across nodes), summed. The bytes come from the compiled program's
own comm report, so the plan and the program never disagree.

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
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx

from shardc.context import GLOBAL_VAL, KIND, PLACEMENT, SOURCE
from shardc.errors import ShardcError
from shardc.machine import Machine
from shardc.mesh import AXES, Mesh
from shardc.report import SYMBOLS, comm_report

BYTES_PER_PARAMETER = 16  # fp32 weight, gradient and AdamW's two moments


@dataclass
class Candidate:
    mesh: Mesh
    predicted_comm_s: float
    per_axis_s: dict[str, float]
    memory_bytes_per_rank: float
    param_bytes_per_rank: float
    activation_bytes_per_rank: float
    bytes_per_axis: dict[str, float] = field(default_factory=dict)

    def __repr__(self) -> str:
        return (f"Candidate({self.mesh.spec()}, {self.predicted_comm_s:.4g} s, "
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
    """What one compile tells about every mesh with the same axes of size > 1."""

    bytes_fn: dict[str, Callable[..., float]]
    params_fn: Callable[..., float]
    act_fn: Callable[..., float]
    constraints: list[tuple[int, tuple[str, ...], str]]  # (dim size, axes, what)


def _pattern_of(mesh: Mesh) -> tuple[bool, ...]:
    return tuple(mesh.size(a) > 1 for a in AXES)


def _symbolic_local_bytes(n: fx.Node) -> Any:
    val, lay = n.meta.get(GLOBAL_VAL), n.meta.get(PLACEMENT)
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        return sympy.Integer(0)
    expr = sympy.Integer(val.element_size() if val.device.type != "meta" else
                         torch.empty((), dtype=val.dtype).element_size())
    for d, size in enumerate(val.shape):
        expr *= size
        if lay is not None and d < len(lay.dims):
            for a in lay.dims[d]:
                expr /= SYMBOLS[a]
    return expr


def _activation_expr(gm: fx.GraphModule, checkpointing: bool) -> Any:
    """Activation estimate: without checkpointing, every forward intermediate's local
    size (all autograd may keep; an upper bound). With checkpointing, the inputs of each
    repeated block (``blocks.3``, ``h.3``: a ModuleList entry) plus one block's
    intermediates, which is what recomputation keeps alive."""
    per_block: dict[str, Any] = defaultdict(lambda: sympy.Integer(0))
    outside = sympy.Integer(0)
    total = sympy.Integer(0)
    block_inputs = sympy.Integer(0)
    seen_inputs: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.meta.get(KIND) in ("collective", "wait"):
            continue
        b = _symbolic_local_bytes(n)
        total += b
        mod = getattr(n.meta.get(SOURCE), "module", "") or ""
        parts = mod.split(".")
        block = next((".".join(parts[:i + 1]) for i in range(len(parts)) if parts[i].isdigit()), None)
        if block is None:
            outside += b
            continue
        per_block[block] += b
        for a in n.all_input_nodes:
            amod = getattr(a.meta.get(SOURCE), "module", "") or ""
            if not amod.startswith(block) and a not in seen_inputs:
                seen_inputs.add(a)
                block_inputs += _symbolic_local_bytes(a)
    if not checkpointing or not per_block:
        return total
    biggest = max(per_block.values(), key=lambda e: float(e.subs({s: 2 for s in SYMBOLS.values()})))
    return outside + block_inputs + biggest


def _analyse(sm: Any, checkpointing: bool) -> _Pattern:
    rep = comm_report(sm)
    syms = [SYMBOLS[a] for a in AXES]
    bytes_fn = {}
    for a in AXES:
        expr = sum((r.formula for r in rep.rows if r.axis == a), sympy.Integer(0))
        bytes_fn[a] = sympy.lambdify(syms, expr, "math")
    pexpr = sympy.Integer(0)
    for name, layout in sm.param_layouts.items():
        shape = list(sm._global_shapes[name])
        e = sympy.Integer(math.prod(shape))
        for d in range(len(shape)):
            for a in layout.dims[d]:
                e /= SYMBOLS[a]
        pexpr += e
    act = _activation_expr(sm.graph_module, checkpointing)
    constraints: list[tuple[int, tuple[str, ...], str]] = []
    seen = set()
    for n in sm.graph_module.graph.nodes:
        val, lay = n.meta.get(GLOBAL_VAL), n.meta.get(PLACEMENT)
        if not isinstance(val, torch.Tensor) or lay is None or lay.ndim != val.dim():
            continue
        for d, axes in enumerate(lay.dims):
            if axes:
                key = (int(val.shape[d]) // lay.interleave[d], axes)
                if key not in seen:
                    seen.add(key)
                    constraints.append((key[0], axes, f"{n.name} dim {d}"))
    return _Pattern(bytes_fn, sympy.lambdify(syms, pexpr, "math"), sympy.lambdify(syms, act, "math"),
                    constraints)


def _compile_offline(model: torch.nn.Module, inputs: tuple, mesh: Mesh, **kw: Any) -> Any:
    from shardc.cli import compile_offline

    return compile_offline(model, inputs, mesh, **kw)


def plan(model: torch.nn.Module, world_size: int, machine: Machine | str,
         example_inputs: tuple, *, checkpointing: bool = False, verify: bool = True,
         **compile_kw: Any) -> Plan:
    """Every mesh of ``world_size`` ranks, ranked by predicted communication time; the
    ones the model or batch does not divide, or that do not fit in device memory, are in
    ``.dropped`` with their reason. Works offline: no process group, meta tensors welcome."""
    machine = resolve_machine(machine)
    if world_size < 1:
        raise ValueError(f"shardc.plan: world_size must be >= 1, got {world_size}.")
    batch = next((x.shape[0] for x in example_inputs if isinstance(x, torch.Tensor) and x.dim()), 1)
    by_pattern: dict[tuple[bool, ...], list[Mesh]] = defaultdict(list)
    for m in Mesh.all(world_size):
        by_pattern[_pattern_of(m)].append(m)
    cands: list[Candidate] = []
    dropped: list[Dropped] = []
    for pattern, meshes in by_pattern.items():
        meshes = sorted(meshes, key=lambda m: m.world_size and sum(m.size(a) for a in AXES))
        ok_batch = []
        for m in meshes:
            if batch % (m.data * m.z):
                dropped.append(Dropped(m, f"batch: {batch} sequences do not split over data x z = "
                                          f"{m.data * m.z}"))
            else:
                ok_batch.append(m)
        if not ok_batch:
            continue
        analysis = None
        reason = ""
        # the smallest mesh of the pattern stands for all of them (see the module docstring)
        rep_mesh = _smallest_of_pattern(pattern, batch)
        for m in ([rep_mesh] if rep_mesh is not None else []) + ok_batch[:2]:
            try:
                analysis = _analyse(_compile_offline(model, example_inputs, m, **compile_kw), checkpointing)
                break
            except ShardcError as e:
                reason = str(e).split(". ")[0]
        if analysis is None:
            for m in ok_batch:
                dropped.append(Dropped(m, f"divisibility: {reason}"))
            continue
        for m in ok_batch:
            sizes = [m.size(a) for a in AXES]
            bad = next(((n, axes, what) for n, axes, what in analysis.constraints
                        if n % math.prod(m.size(a) for a in axes)), None)
            if bad is not None:
                n, axes, what = bad
                dropped.append(Dropped(m, f"divisibility: {what} of size {n} is cut over "
                                          f"{'x'.join(axes)} = {math.prod(m.size(a) for a in axes)}"))
                continue
            pbytes = analysis.params_fn(*sizes) * BYTES_PER_PARAMETER / 4
            abytes = analysis.act_fn(*sizes)
            mem = pbytes + abytes
            if mem > machine.memory_bytes:
                dropped.append(Dropped(m, f"memory: {mem / 2**30:.1f} GiB per rank > "
                                          f"{machine.memory_bytes / 2**30:.1f} GiB"))
                continue
            per_axis_bytes = {a: float(analysis.bytes_fn[a](*sizes)) for a in AXES}
            try:
                per_axis = {a: (per_axis_bytes[a] / machine.axis_bandwidth(m, a)
                                if per_axis_bytes[a] else 0.0) for a in AXES}
            except ValueError as e:
                dropped.append(Dropped(m, f"machine: {e}"))
                continue
            cands.append(Candidate(m, sum(per_axis.values()), per_axis, mem, pbytes, abytes,
                                   per_axis_bytes))
    cands.sort(key=lambda c: (c.predicted_comm_s, c.memory_bytes_per_rank, c.mesh.spec()))
    if not cands:
        reasons = defaultdict(int)
        for d in dropped:
            reasons[d.reason.split(":")[0]] += 1
        raise ShardcError(
            f"shardc.plan: no mesh of {world_size} ranks fits this model on {machine.name!r} "
            f"(dropped: {dict(reasons)}). First reason: {dropped[0].reason if dropped else '-'}. "
            "Use more ranks, a larger memory, a batch that data x z divides, or activation "
            "checkpointing (checkpointing=True).")
    if verify:
        _verify(model, example_inputs, cands[0], compile_kw)
    return Plan(cands, dropped, world_size, machine)


def _smallest_of_pattern(pattern: tuple[bool, ...], batch: int) -> Mesh | None:
    sizes = {a: (2 if on else 1) for a, on in zip(AXES, pattern)}
    m = Mesh(**sizes)
    return m if batch % (m.data * m.z) == 0 else None


def _verify(model: torch.nn.Module, inputs: tuple, best: Candidate, compile_kw: dict) -> None:
    """Compile the winner for real: its report must equal the pattern's prediction."""
    rep = comm_report(_compile_offline(model, inputs, best.mesh, **compile_kw))
    for a in AXES:
        got, want = float(rep.total_bytes(axis=a)), best.bytes_per_axis[a]
        if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-6):
            raise AssertionError(f"shardc.plan: the prediction for {best.mesh} over {a} ({want}) "
                                 f"differs from its compiled program ({got})")


def print_plan(model: torch.nn.Module, inputs: tuple, world_size: int, machine: str, top: int = 10,
               checkpointing: bool = False) -> Plan:
    import time

    from rich.console import Console
    from rich.table import Table

    t0 = time.perf_counter()
    p = plan(model, world_size, machine, inputs, checkpointing=checkpointing)
    took = time.perf_counter() - t0
    t = Table(title=f"top {min(top, len(p))} of {len(p)} meshes for {world_size} ranks on "
                    f"{p.machine.name} (planned in {took:.1f} s)")
    for col in ("rank", "mesh", "t_x (s)", "t_y (s)", "t_z (s)", "t_data (s)", "total (s)",
                "memory/rank"):
        t.add_column(col, justify="right" if col not in ("mesh",) else "left")
    for i, c in enumerate(p[:top]):
        t.add_row(str(i + 1), c.mesh.spec(), *(f"{c.per_axis_s[a]:.4g}" for a in AXES),
                  f"{c.predicted_comm_s:.4g}", f"{c.memory_bytes_per_rank / 2**30:.2f} GiB")
    console = Console()
    console.print(t)
    if p.dropped:
        console.print("dropped: " + ", ".join(f"{n} ({r})" for r, n in sorted(p.drop_reasons().items())))
    return p
