"""The machinery of the rule sweep (issue 7): every op that has a sharding rule, on every
placement each of its inputs can arrive in, against one device in float64.

A *spec* is one op applied to one set of global inputs (``OpSpec``): a tiny module whose
forward applies the op, float64 inputs (OpInfo samples where they fit, hand-written where
not), the meshes to run it on. A *case* is a spec on one mesh with one layout per input
(``Case``). For each case every rank compiles the spec's module with
``shardc.compile(..., input_layouts=...)``, feeds its piece of every input, runs forward
and backward of ``(out * R).sum()`` (``R`` a fixed random tensor of the global output's
shape, cut to the rank's piece), and checks its piece of the output and of every input
gradient against the single-device float64 run:

- ``S(d)``: the rank's slice; its gradient is the slice of the full gradient.
- ``R``: the whole tensor; the whole gradient.
- ``P(sum)``: a random addend (never zero, so ``x * x`` on an unreduced partial shows);
  the addends over the axis sum to the global value; each addend's gradient is the full
  gradient (d(sum_r a_r)/d a_r = 1).
- ``P(avg)``: random values whose mean over the axis is the global value; gradient 1/G of
  the full one.
- ``P(max)``: one rank per element (at random) holds the global value, the others hold
  strictly smaller values; the gradient of the max goes to the holder only.

Mechanism: breadth runs in ONE process on torch's threaded process group
(``torch.testing._internal.distributed.multi_threaded_pg``, backend ``"threaded"``): one
thread per rank, each with its own thread-local default world, running shardc's real
runtime (``all_gather_into_tensor``, ``all_reduce``, ``reduce_scatter_tensor`` with
``async_op`` and the per-axis subgroups of ``runtime/groups.py``). Each case is its own
test, handed to the threads of its world size (``Worlds``: the threads live from a
family's first case of that size to its last, the cases ordered by world size); what its
spec's cases share, the trace and the single-device float64 run, is made by the first
of them that runs (``reference_of``), so ``-k`` of one case runs that case alone. ``LocalTensorMode``
does not fit: shardc compiles a different program per rank (``ctx.rank``) and its
runtime reads ``dist.get_rank()`` for the rank's coordinates, which one SPMD-simulating
thread cannot answer per rank. Dropout is the exception: its mask is drawn from the
process-wide default generator, which threads share (each rank would consume the stream
in turn and draw a different mask), so it runs on real gloo processes (``run_gloo``), as
does a representative subset of every family, one case at a time on the module's pool
of ranks (``run_gloo``).

Tiers: every case is ``sweep``; the fast tier keeps a slice of each family
(``in_fast_slice``), the rest is also ``slow``.

Traces are cached per module object and input shapes, so each spec keeps one module
object for all its placements and meshes, and is traced once on the main thread before
the rank threads compile it (torch.export is not meant to run in several threads at once).

Known failures live in ``KNOWN_FAILURES`` below, nowhere else: a case listed there is
``xfail(strict=True)``, so it must fail, and fixing it makes the suite say so.
"""
from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import time
import traceback
import types
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

import shardc
from shardc.core.mesh import Mesh
from shardc.core.placement import Layout, local_slice

aten = torch.ops.aten

# Tolerances, float64 against float64. The sharded program computes the same function in
# the same precision; what differs is the order of additions: an all-reduce of random
# addends of magnitude ~1..4 rounds the global value to within a few ulps (~1e-15
# relative), reductions over shards add in another order (~n ulps), and the op's condition
# number on OpInfo's sample domains (< ~1e4, e.g. reciprocal or tan near but not at a
# pole) amplifies that. 1e-9 leaves four orders of magnitude of room over that and is still
# six orders below the smallest real rule bug (a wrong shard or a doubly-counted addend is
# an O(1) error).
RTOL = 1e-9
ATOL = 1e-9
# Outputs computed in float32 from float64 inputs (a cast inside the op): inputs equal to a
# few float64 ulps round to float32 values that may differ by one float32 ulp (6e-8).
RTOL32 = 2e-7
ATOL32 = 2e-7

# set in gloo worker processes: the family modules then build no case list at import
IN_WORKER = False

AXIS_LETTER = {"x": "x", "y": "y", "z": "z", "data": "d"}


def mesh_of(short: str) -> Mesh:
    """'x2', 'x2y2', 'z2d2' -> the full Mesh (missing axes 1)."""
    sizes = {"x": 1, "y": 1, "z": 1, "d": 1}
    i = 0
    while i < len(short):
        a = short[i]
        j = i + 1
        while j < len(short) and short[j].isdigit():
            j += 1
        sizes[a] = int(short[i + 1:j])
        i = j
    return Mesh.parse(f"x{sizes['x']}y{sizes['y']}z{sizes['z']}d{sizes['d']}")


def mesh_axes(mesh: Mesh) -> list[str]:
    return [a for a in ("x", "y", "z", "data") if mesh.size(a) > 1]


# ------------------------------------------------------------------------- specs
@dataclass(eq=False)
class OpSpec:
    family: str
    name: str
    fn: Callable[..., Any]  # fn(module, *inputs) -> tensor or tuple of tensors
    inputs: tuple  # global example inputs (float64 where the op allows); requires_grad set
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    meshes: tuple[str, ...] = ("x2",)
    # per input: allowed placement kinds ("S", "R", "sum", "avg", "max"); None = by dtype
    kinds: dict[int, tuple[str, ...]] = field(default_factory=dict)
    joint: bool = True  # also every input in the same placement at once
    seed: int = 0  # dropout: the generator seed both sides use
    rtol: float = RTOL
    atol: float = ATOL
    _module: nn.Module | None = None
    targets: frozenset = frozenset()  # ATen ops of the traced graph (filled by prepare)

    @property
    def module(self) -> nn.Module:
        if self._module is None:
            self._module = OpModule(self)
        return self._module


class OpModule(nn.Module):
    def __init__(self, spec: OpSpec) -> None:
        super().__init__()
        self._fn = spec.fn
        for k, v in spec.params.items():
            self.register_parameter(k, nn.Parameter(v.detach().clone(), requires_grad=v.is_floating_point()))

    def forward(self, *xs: Any) -> Any:
        return self._fn(self, *xs)


@dataclass(eq=False)
class Case:
    spec: OpSpec
    mesh: str
    layouts: tuple[Layout | None, ...]  # per input (None: not a tensor)

    @property
    def id(self) -> str:
        lays = ",".join("-" if lay is None else str(lay).replace(" ", "") for lay in self.layouts)
        return f"{self.spec.name}|{self.mesh}|{lays}"


def _t(shape: Iterable[int], g: torch.Generator, lo: float = -2.0, hi: float = 2.0,
       requires_grad: bool = True) -> torch.Tensor:
    t = torch.rand(tuple(shape), generator=g, dtype=torch.float64) * (hi - lo) + lo
    return t.requires_grad_(requires_grad)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------- placement kinds
def _placements_1(x: torch.Tensor, axis: str, g: int, kinds: tuple[str, ...]) -> list[Layout]:
    nd = x.dim()
    out = []
    if "S" in kinds:
        for d in range(nd):
            if x.shape[d] % g == 0 and x.shape[d] >= g:
                out.append(Layout.of(nd, {axis: d}))
    if "R" in kinds:
        out.append(Layout.replicate(nd))
    for p in ("sum", "avg", "max"):
        if p in kinds:
            out.append(Layout.of(nd, partial={axis: p}))
    return out


def _placements_2(x: torch.Tensor, a: str, b: str, mesh: Mesh, kinds: tuple[str, ...]) -> list[Layout]:
    """A handful of two-axis layouts: both sharded (different dims, or one dim cut by
    both), sharded on one and partial on the other, partial on both."""
    nd = x.dim()
    ga, gb = mesh.size(a), mesh.size(b)
    out = [Layout.replicate(nd)] if "R" in kinds else []
    sh = [d for d in range(nd) if x.shape[d] % 2 == 0 and x.shape[d] >= 2] if "S" in kinds else []
    if len(sh) >= 2:
        out.append(Layout.of(nd, {a: sh[0], b: sh[-1]}))
        out.append(Layout.of(nd, {a: sh[-1], b: sh[0]}))
    for d in sh:
        if x.shape[d] % (ga * gb) == 0:
            out.append(Layout.of(nd, {a: d, b: d}))
            break
    if "sum" in kinds:
        if sh:
            out.append(Layout.of(nd, {a: sh[-1]}, partial={b: "sum"}))
            out.append(Layout.of(nd, {b: sh[0]}, partial={a: "sum"}))
        out.append(Layout.of(nd, partial={a: "sum", b: "sum"}))
    if "avg" in kinds:
        out.append(Layout.of(nd, partial={a: "avg", b: "sum"}))
    if "max" in kinds:
        out.append(Layout.of(nd, partial={a: "max"}))
    return out


def default_kinds(x: Any) -> tuple[str, ...]:
    if not isinstance(x, torch.Tensor):
        return ()
    if x.is_floating_point():
        return ("S", "R", "sum", "avg", "max")
    return ("S", "R")


def placements_for(x: Any, mesh: Mesh, kinds: tuple[str, ...]) -> list[Layout]:
    if not isinstance(x, torch.Tensor):
        return []
    axes = mesh_axes(mesh)
    if x.dim() == 0:
        kinds = tuple(k for k in kinds if k != "S")
    if len(axes) == 1:
        return _placements_1(x, axes[0], mesh.size(axes[0]), kinds)
    return _placements_2(x, axes[0], axes[1], mesh, kinds)


def cases_of(spec: OpSpec) -> list[Case]:
    """Every placement of each input with the others replicated, and (``joint``) every
    input in the same placement at once where all can take it (S+S, P+P)."""
    out: list[Case] = []
    seen: set[str] = set()
    for ms in spec.meshes:
        mesh = mesh_of(ms)
        per = [placements_for(x, mesh, spec.kinds.get(i, default_kinds(x)))
               for i, x in enumerate(spec.inputs)]
        rep = tuple(Layout.replicate(x.dim()) if isinstance(x, torch.Tensor) else None
                    for x in spec.inputs)
        cands = []
        for i, opts in enumerate(per):
            for lay in opts:
                cands.append(rep[:i] + (lay,) + rep[i + 1:])
        tensor_ix = [i for i, x in enumerate(spec.inputs) if isinstance(x, torch.Tensor)]
        if spec.joint and len(tensor_ix) > 1:
            first = per[tensor_ix[0]]
            for lay in first:
                joint = list(rep)
                ok = True
                for i in tensor_ix:
                    m = [q for q in per[i] if q == lay]
                    if not m:
                        ok = False
                        break
                    joint[i] = m[0]
                if ok:
                    cands.append(tuple(joint))
        for lays in cands:
            c = Case(spec, ms, lays)
            if c.id not in seen:
                seen.add(c.id)
                out.append(c)
    return out


# ------------------------------------------------------------- pieces and checks
def _partial_axes_sorted(lay: Layout) -> list[tuple[str, str]]:
    return sorted(lay.partial)


def make_piece(x: torch.Tensor, lay: Layout, coords: dict[str, int], mesh: Mesh,
               seed: int) -> tuple[torch.Tensor, torch.Tensor | float]:
    """(this rank's piece of global ``x`` laid out as ``lay``, the factor by which the full
    gradient becomes this piece's gradient before slicing)."""
    t = x.detach()
    gscale: torch.Tensor | float = 1.0
    for k, (axis, op) in enumerate(_partial_axes_sorted(lay)):
        G = mesh.size(axis)
        c = coords[axis]
        g = gen(seed * 7919 + 101 * k + 13)
        noise = [torch.randn(t.shape, generator=g, dtype=torch.float64) + 1.5 for _ in range(G)]
        if op == "sum":
            # addends of magnitude ~1.5 that sum to the value: never zero
            t = noise[c] if c < G - 1 else t - sum(noise[:-1])
        elif op == "avg":
            mean = sum(noise) / G
            t = t + noise[c] - mean
            gscale = gscale / G
        elif op == "max":
            holder = torch.randint(0, G, t.shape, generator=g)
            below = t - noise[c].abs() - 0.25
            mask = holder == c
            t = torch.where(mask, t, below)
            gscale = gscale * mask.to(torch.float64)
        else:
            raise ValueError(op)
    if not x.is_floating_point():
        t = x.detach()
    return local_slice(t, lay, coords, mesh).clone(), gscale


def _flat_tensors(out: Any) -> list[Any]:
    return pytree.tree_flatten(out)[0]


@dataclass
class Reference:
    outs: list[Any]
    R: list[torch.Tensor | None]
    grads: list[torch.Tensor | None]
    pgrads: dict[str, torch.Tensor | None]


# One thread at a time in torch's RNG-state calls: the threaded world's rank threads
# seeding at once deadlocked a CI run (every rank thread inside get_rng_state,
# manual_seed or torch.cuda's lazy seeding, the main thread unable to time out). The
# lock covers only the calls, never a case, so ranks still meet in their collectives.
_RNG_LOCK = threading.Lock()


def _seeded(spec: OpSpec):
    class _Ctx:
        def __enter__(self):
            with _RNG_LOCK:
                self.f = torch.random.fork_rng(devices=[])
                self.f.__enter__()
                torch.manual_seed(spec.seed)

        def __exit__(self, *a):
            with _RNG_LOCK:
                return self.f.__exit__(*a)
    return _Ctx()


def reference(spec: OpSpec) -> Reference:
    """The single-device float64 run of ``spec`` and the gradient of ``(out * R).sum()``."""
    mod = spec.module
    xs = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
          for x in spec.inputs]
    with _seeded(spec):
        out = mod(*xs)
    outs = _flat_tensors(out)
    g = gen(991 + len(spec.name))
    Rs: list[torch.Tensor | None] = []
    loss = None
    for o in outs:
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            R = torch.randn(o.shape, generator=g, dtype=o.dtype)
            Rs.append(R)
            if o.requires_grad:
                term = (o * R).sum()
                loss = term if loss is None else loss + term
        else:
            Rs.append(None)
    want = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
    params = [p for p in mod.parameters() if p.requires_grad]
    grads: list[torch.Tensor | None] = [None] * len(xs)
    pgrads: dict[str, torch.Tensor | None] = {}
    if loss is not None and (want or params):
        gs = torch.autograd.grad(loss, want + params, allow_unused=True)
        it = iter(gs[:len(want)])
        for i, x in enumerate(xs):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                grads[i] = next(it)
        names = [n for n, p in mod.named_parameters() if p.requires_grad]
        pgrads = dict(zip(names, gs[len(want):]))
    return Reference([o.detach() if isinstance(o, torch.Tensor) else o for o in outs], Rs, grads, pgrads)


def _close(what: str, got: Any, want: Any, rtol: float, atol: float, errs: list[str]) -> None:
    if not isinstance(want, torch.Tensor):
        if got != want:
            errs.append(f"{what}: got {got!r}, want {want!r}")
        return
    if not isinstance(got, torch.Tensor):
        errs.append(f"{what}: got {type(got).__name__}, want a tensor {list(want.shape)}")
        return
    if list(got.shape) != list(want.shape):
        errs.append(f"{what}: shape {list(got.shape)}, want {list(want.shape)}")
        return
    if got.dtype != want.dtype:
        errs.append(f"{what}: dtype {got.dtype}, want {want.dtype}")
        return
    if not want.is_floating_point():
        if not torch.equal(got, want):
            errs.append(f"{what}: {(got != want).sum().item()} of {want.numel()} elements differ")
        return
    if want.dtype == torch.float32:
        rtol, atol = max(rtol, RTOL32), max(atol, ATOL32)
    if not torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
        diff = (got - want).abs()
        diff = torch.where(torch.isnan(diff), torch.zeros_like(diff), diff)
        errs.append(f"{what}: max abs error {diff.max().item():.3g} (|want| max "
                    f"{want.abs().max().item():.3g})")


def _output_layouts(sm: shardc.ShardedModule) -> list[Any]:
    out = next(n for n in sm.graph_module.graph.nodes if n.op == "output")
    return [a.meta.get("shardc_placement") if isinstance(a, torch.fx.Node) else None
            for a in out.args[0]]


def run_case_on_rank(case: Case, ref: Reference, rank: int, step_graph: bool = True) -> None:
    """One rank's part of ``case`` (collective); raises AssertionError listing every
    mismatch of this rank's pieces. All collectives run before any check, so a mismatch on
    one rank never leaves the others waiting. ``step_graph``: compile's option (see
    ``Worlds`` for why the breadth runs without the step program)."""
    spec = case.spec
    mesh = mesh_of(case.mesh)
    coords = mesh.coords(rank)
    layouts = {i: lay for i, lay in enumerate(case.layouts) if lay is not None}
    sm = shardc.compile(spec.module, mesh, example_inputs=spec.inputs, input_layouts=layouts,
                        step_graph=step_graph)
    pieces: list[Any] = []
    scales: list[Any] = []
    for i, x in enumerate(spec.inputs):
        if not isinstance(x, torch.Tensor):
            pieces.append(x)
            scales.append(None)
            continue
        p, s = make_piece(x, case.layouts[i], coords, mesh, seed=zlib.crc32(case.id.encode()) % 100003 + i)
        pieces.append(p.requires_grad_(x.requires_grad))
        scales.append(s)
    with _seeded(spec):
        out = sm(*pieces)
    outs = _flat_tensors(out)
    olays = _output_layouts(sm)
    errs: list[str] = []
    loss = None
    if len(outs) != len(ref.outs):
        raise AssertionError(f"{len(outs)} outputs, want {len(ref.outs)}")
    for k, (o, lay, R) in enumerate(zip(outs, olays, ref.R)):
        if isinstance(o, torch.Tensor) and R is not None and o.requires_grad:
            Rl = local_slice(R, lay, coords, mesh) if isinstance(lay, Layout) else R
            if list(Rl.shape) == list(o.shape):
                term = (o * Rl).sum()
                loss = term if loss is None else loss + term
    if loss is not None:
        loss.backward()
    pgrads = sm.full_grads() if spec.params else {}
    # ---- checks (no collectives below)
    for k, (o, lay, want) in enumerate(zip(outs, olays, ref.outs)):
        if isinstance(lay, Layout) and lay.partial:
            errs.append(f"output {k} came back partial {lay}")
            continue
        w = local_slice(want, lay, coords, mesh) if isinstance(lay, Layout) else want
        _close(f"output {k} (layout {lay})", o.detach() if isinstance(o, torch.Tensor) else o, w,
               spec.rtol, spec.atol, errs)
    for i, x in enumerate(spec.inputs):
        if not (isinstance(x, torch.Tensor) and x.requires_grad):
            continue
        full = ref.grads[i]
        if full is None:
            full = torch.zeros_like(x.detach())
        want = local_slice(full * scales[i], case.layouts[i], coords, mesh)
        got = pieces[i].grad
        if got is None:
            got = torch.zeros_like(pieces[i].detach())
        _close(f"grad of input {i} ({case.layouts[i]})", got, want, spec.rtol, spec.atol, errs)
    for name, want in ref.pgrads.items():
        got = pgrads.get(name)
        if want is None:
            want = torch.zeros_like(spec.params[name])
        if got is None:
            got = torch.zeros_like(want)
        _close(f"grad of parameter {name}", got, want, spec.rtol, spec.atol, errs)
    if errs:
        raise CheckFailed(f"rank {rank}: " + "; ".join(errs))


class CheckFailed(AssertionError):
    """A rank's results differ from one device's: raised after every collective of the
    case has completed, so the other ranks are not left waiting and the world goes on."""


# ------------------------------------------------------------- threaded world
class ThreadedWorld:
    """``world_size`` threads, each one rank of torch's threaded process group, that run
    jobs (``fn(rank)``) handed to them one at a time. A job that raises on one rank
    terminates the collectives the others wait in (``ProcessLocalGroup.exception_handle``)
    and the group is reset before the next job; the first error is the job's result."""

    def __init__(self, world_size: int) -> None:
        from torch.testing._internal.distributed import multi_threaded_pg as mtpg

        self.mtpg = mtpg
        self.world_size = world_size
        self.broken = False
        # the process-group registry is process-global unless told otherwise: every
        # thread registers its own group "0"
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        mtpg._install_threaded_pg()
        self.store = dist.HashStore()
        self.inbox = [queue.Queue() for _ in range(world_size)]
        self.outbox: queue.Queue = queue.Queue()
        self.threads = [threading.Thread(target=self._loop, args=(r,), daemon=True)
                        for r in range(world_size)]
        for t in self.threads:
            t.start()
        for _ in range(world_size):  # init done
            r, err = self.outbox.get(timeout=120)
            if err:
                raise RuntimeError(err)

    def _loop(self, rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=self.world_size, store=self.store)
            torch.set_num_threads(1)
        except BaseException:  # noqa: BLE001
            self.outbox.put((rank, traceback.format_exc()))
            return
        self.outbox.put((rank, None))
        while True:
            job = self.inbox[rank].get()
            if job is None:
                break
            try:
                job(rank)
                self.outbox.put((rank, None))
            except SystemExit:
                self.outbox.put((rank, "aborted"))
            except CheckFailed as e:
                # not a failure of the group: telling it (exception_handle) would abort
                # the threads of ranks that are done, and a slow restart follow
                self.outbox.put((rank, _short_error(e)))
            except BaseException as e:  # noqa: BLE001
                msg = "".join(traceback.format_exception_only(type(e), e)).strip()
                if "Test termination event" in msg:
                    self.outbox.put((rank, "aborted"))
                else:
                    self.outbox.put((rank, _short_error(e)))
                    self.mtpg.ProcessLocalGroup.exception_handle(e)
        try:
            dist.destroy_process_group()
        except AttributeError:
            # torch 2.11's destroy_process_group walks ``_world.comms``, which the
            # threaded group's thread-local world does not have (seen on the GPU machine;
            # 2.13 has no such walk): the group goes with its thread either way
            pass
        finally:
            self.outbox.put((rank, None))

    def run(self, job: Callable[[int], None], timeout: float = 60.0) -> str | None:
        for q in self.inbox:
            q.put(job)
        errors: list[str] = []
        got = 0
        deadline = time.monotonic() + timeout
        kicked = False
        while got < self.world_size:
            try:
                r, err = self.outbox.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                if kicked:  # blocked outside a collective (a store barrier): give up the world
                    self.broken = True
                    return errors[0]
                errors.append(f"timeout after {timeout}s (ranks waiting in a collective others never issued)")
                self.mtpg.ProcessLocalGroup.exception_handle(RuntimeError("timeout"))
                kicked = True
                deadline = time.monotonic() + 30
                continue
            got += 1
            if err is not None and err != "aborted":
                errors.append(err)
            elif err == "aborted" and not errors:
                errors.append("aborted")
        if errors or kicked:
            self.mtpg.ProcessLocalGroup.reset()
        return errors[0] if errors else None

    def close(self) -> None:
        from shardc.runtime import groups

        for q in self.inbox:
            q.put(None)
        for _ in range(self.world_size):
            self.outbox.get(timeout=60)
        for t in self.threads:
            t.join(timeout=10)
        self.mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        # runtime/groups.py keys its cache by id(dist.group.WORLD); the threads' worlds are
        # gone, and a later world may reuse their ids
        groups.clear_cache()


def _short_error(e: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    lines = text.splitlines()
    return " ".join(ln.strip() for ln in lines)[:600]


# ------------------------------------------------------------- one case at a time
def prepare(spec: OpSpec) -> None:
    """Trace once on the main thread (the rank threads then hit shardc's trace cache)."""
    from shardc.passes.trace import trace

    ep = trace(spec.module, spec.inputs)
    spec.targets = frozenset(n.target for n in ep.graph.nodes if n.op == "call_function")


# What the cases of one spec share: its trace and its single-device float64 run, made by
# the first of its cases that runs (any one: ``-k`` may pick a single case) and kept for
# the others; or why the spec cannot run at all.
_REFS: dict[OpSpec, Reference | str] = {}


def reference_of(spec: OpSpec) -> Reference | str:
    got = _REFS.get(spec)
    if got is None:
        try:
            prepare(spec)
            got = reference(spec)
        except Exception as e:  # noqa: BLE001 - a spec that cannot run at all
            got = "reference/trace failed: " + _short_error(e)
        _REFS[spec] = got
    return got


_RESULTS: dict[str, str | None] = {}
_TIMES: dict[str, float] = {}


class Worlds:
    """The threaded world a case of the breadth runs in, one world size at a time (a
    family's cases are ordered by world size, so each starts once; a family module
    holds one ``Worlds`` as its module-scoped fixture and closes it at the end).

    The breadth runs each rank's program under autograd's own backward
    (``step_graph=False``): what is tested here is the rank program a rule writes and the
    adjoint of each op and collective in it, which both runtimes execute alike. The
    step program traces that same backward once more (``make_fx``, about 30 ms a
    rank for a one-op program), which made the breadth 3.8x slower (the reduction family:
    27 s against 7 s) for no rule the autograd run does not already check. The gloo subset
    (``test_rules_random``) runs the default step program, and
    ``test_step_graph_gloo`` holds it bitwise equal to autograd's on real models."""

    def __init__(self) -> None:
        self.world: ThreadedWorld | None = None

    def run(self, case: Case) -> str | None:
        """Run ``case``: None (passed) or the first rank's error."""
        t0 = time.monotonic()
        ref = reference_of(case.spec)
        if isinstance(ref, str):
            _RESULTS[case.id] = ref
            return ref
        ws = mesh_of(case.mesh).world_size
        if self.world is not None and self.world.world_size != ws:
            self.world.close()
            self.world = None
        if self.world is None:
            self.world = ThreadedWorld(ws)
        err = self.world.run(lambda r: run_case_on_rank(case, ref, r, False))
        _TIMES[case.id] = time.monotonic() - t0
        if self.world.broken:  # its threads stay blocked (daemons); start afresh
            self.world.mtpg._uninstall_threaded_pg()
            self.world = None
        _RESULTS[case.id] = err
        return err

    def close(self) -> None:
        if self.world is not None:
            self.world.close()
            self.world = None
        _REFS.clear()
        _record_failures()


FAILURES_FILE = os.environ.get("SHARDC_RULE_FAILURES", "/tmp/rule_failures.txt")


def _record_failures() -> None:
    bad = sorted((k, v) for k, v in _RESULTS.items() if v is not None)
    try:
        with open(FAILURES_FILE, "w") as f:
            f.write(f"# {len(bad)} failing (op|mesh|input layouts) cases of {len(_RESULTS)} run\n")
            for k, v in bad:
                f.write(f"{k}\t{v}\n")
    except OSError:
        pass


# ------------------------------------------------------------- gloo processes
_WORKER_CASES: dict[tuple, dict[str, Case]] = {}


def gloo_case(rank: int, world_size: int, family_fns: tuple[tuple[str, str], ...], case_id: str
              ) -> str | None:
    """One rank's part of one case on real gloo processes (a rank of the ``ranks`` pool):
    None, or this rank's error. The rank rebuilds the specs once, by calling
    ``module.fn()`` for each (module, fn) in ``family_fns``; every rank reaches the same
    collectives, and a barrier after the case keeps them in step when it failed on some
    ranks only."""
    import importlib

    global IN_WORKER
    IN_WORKER = True
    torch.set_num_threads(1)
    cases = _WORKER_CASES.get(family_fns)
    if cases is None:
        specs: list[OpSpec] = []
        for mod_name, fn_name in family_fns:
            specs += getattr(importlib.import_module(mod_name), fn_name)()
        cases = _WORKER_CASES[family_fns] = {c.id: c for s in specs for c in cases_of(s)}
    case = cases[case_id]
    try:
        ref = reference_of(case.spec)
        if isinstance(ref, str):
            raise RuntimeError(ref)
        run_case_on_rank(case, ref, rank)
        result = None
    except Exception as e:  # noqa: BLE001 - every rank reaches the same collectives
        result = _short_error(e)
    dist.barrier()
    return result


def run_gloo(ranks: Any, family_fns: tuple[tuple[str, str], ...], case: Case) -> str | None:
    """Run ``case`` on the gloo ranks of ``ranks`` (the module's pool, conftest.py): None
    (passed) or the first failing rank's error."""
    per_rank = ranks.run(gloo_case, mesh_of(case.mesh).world_size, tuple(family_fns), case.id)
    err = None
    for r, v in enumerate(per_rank):
        if v is not None:
            err = f"rank {r}: {v}" if not v.startswith("rank") else v
            break
    _RESULTS["gloo:" + case.id] = err
    if err is not None:
        _record_failures()
    return err


# ------------------------------------------------------------- pytest glue
# KNOWN_FAILURES: case id -> reason. The ONLY place a sweep case may be expected to fail;
# each is xfail(strict=True). Empty it as the rules are fixed. (Generated from
# /tmp/rule_failures.txt; ids are "op|mesh|layout of each input".)
KNOWN_FAILURES: dict[str, str] = {
}


# A case's pytest id is its id in the characters ``-k`` reads (no "|", "@", ",", "(", ")",
# "*"): ``linear|x2|[S(0)@x],[R]`` is ``linear/x2/[S0:x]+[R]``, so ``-k
# "linear/x2/[S0:x]"`` picks it (and the cases it begins; end with "]" for just one).
_K_SAFE = str.maketrans({"|": "/", "(": None, ")": None, "@": ":", ",": "+", "*": ".times."})


def pytest_id(case_id: str) -> str:
    return case_id.translate(_K_SAFE)


# The fast tier's slice of each family (``pytest -m "not slow"``): every op sample (every
# ``spec_every``-th, for a family that repeats another's samples), in every sixth of its
# cases (over all its meshes and placements), starting at an offset that moves from one
# sample to the next, so that each placement kind and mesh comes up across the family;
# a sample with fewer cases than that still has one. Every other case is also ``slow``;
# ``sweep`` marks them all.
FAST_EVERY = 6


def in_fast_slice(cases: list[Case], spec_every: int = 1) -> set[str]:
    per_spec: dict[int, list[Case]] = {}
    for c in cases:
        per_spec.setdefault(id(c.spec), []).append(c)
    out = set()
    for i, mine in enumerate(per_spec.values()):
        if i % spec_every:
            continue
        picked = [c for j, c in enumerate(mine) if j % FAST_EVERY == i % FAST_EVERY] \
            or [mine[i % len(mine)]]
        out.update(c.id for c in picked)
    return out


def params(cases: list[Case], prefix: str = "", fast: set[str] | frozenset = frozenset()) -> list[Any]:
    """The cases as pytest params, world size by world size (each threaded world or pool
    of ranks then starts once), each ``sweep``, and ``slow`` unless its id is in ``fast``;
    a case in ``KNOWN_FAILURES`` is ``xfail(strict=True)``."""
    out = []
    ids: set[str] = set()
    for c in sorted(cases, key=lambda c: mesh_of(c.mesh).world_size):
        marks: list[Any] = [pytest.mark.sweep]
        if c.id not in fast:
            marks.append(pytest.mark.slow)
        reason = KNOWN_FAILURES.get(prefix + c.id)
        if reason is not None:
            marks.append(pytest.mark.xfail(strict=True, reason=reason))
        pid = pytest_id(c.id)
        assert pid not in ids, f"two cases with the pytest id {pid}"
        ids.add(pid)
        out.append(pytest.param(c, id=pid, marks=marks))
    return out


def report_count(family: str, cases: list[Case]) -> None:
    if IN_WORKER:
        return
    n_specs = len({id(c.spec) for c in cases})
    msg = f"rule sweep [{family}]: {len(cases)} (op, placement, mesh) cases over {n_specs} op samples"
    print(msg, file=sys.stderr)
    COUNTS[family] = len(cases)


COUNTS: dict[str, int] = {}


def all_ops_of(specs: Iterable[OpSpec]) -> set:
    out = set()
    for s in specs:
        for t in s.targets:
            out.add(t)
            if isinstance(t, torch._ops.OpOverload):
                out.add(t.overloadpacket)
    return out


def unused(*a: Any) -> None:  # keep flake quiet about helpers used by some families only
    return None


_ = (itertools, types)


def threaded_family(family: str, specs: Callable[[], list[OpSpec]], fast_spec_every: int = 1
                    ) -> tuple[list[Case], Any, Any]:
    """One op family's cases, plus the module-scoped fixture holding the threaded world
    they run in and the test that runs and checks each (one case a test: ``-k`` of one
    runs that one, sharing only its spec's reference with the others run): a family file
    binds the three to ``CASES, sweep_world, test_rule`` so pytest collects them there.
    ``fast_spec_every``: the fast tier's slice takes every n-th op sample (``in_fast_slice``)."""
    cases = [] if IN_WORKER else [c for s in specs() for c in cases_of(s)]
    report_count(family, cases)

    @pytest.fixture(scope="module")
    def sweep_world() -> Iterator[Worlds]:
        worlds = Worlds()
        yield worlds
        worlds.close()

    @pytest.mark.parametrize("case", params(cases, fast=in_fast_slice(cases, fast_spec_every)))
    def test_rule(case: Case, sweep_world: Worlds) -> None:
        err = sweep_world.run(case)
        if err is not None:
            raise AssertionError(f"{case.id}: {err}")

    return cases, sweep_world, test_rule
