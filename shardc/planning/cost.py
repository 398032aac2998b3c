"""The step-time model: what one training step of a compiled program costs on a machine.

    t_step = t_compute + sum over axes of (bytes / beta + calls * alpha) - t_hidden

* ``bytes`` per axis: the comm report (exact; a formula in the axis sizes).
* ``calls`` per axis: the collectives the step program issues, after the bucketing
  and coalescing passes packed them (the comm report's rows, one per call, where the
  step program does not run: ``step_graph=False``, block recompute).
* ``beta`` and ``alpha``: the machine's bandwidth and latency of that axis's groups.
* ``t_compute``: the step's GEMM FLOPs on this rank over the machine's GEMM rate; the
  bytes its other ops write and read (element-wise ops, norms, softmax, copies: bound by
  memory, not arithmetic) and the optimizer's pass over the rank's parameters over its
  memory bandwidth; and its ops times the machine's per-op overhead.
* ``t_hidden``: of the collectives the schedule gave compute to overlap (compute between
  issue and wait), the share of their bandwidth and latency time the machine hides
  behind compute (``bandwidth_overlap``, ``latency_overlap``), at most ``t_compute``:
  what the OAR, ORS, bucketing and prefetch passes buy, as far as the machine lets them.

Every term but the bytes is counted on the program of one mesh and carried to the other
meshes of its pattern (the same axes of size > 1, the same program structure): calls,
ops and the overlapped share are taken as equal across them, FLOPs scale exactly (each
term is a global count over the axes that cut it).
"""
from __future__ import annotations

import math
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

from shardc.core.context import GLOBAL_VAL, PLACEMENT
from shardc.core.machine import Machine
from shardc.core.mesh import CUT_AXES, Mesh
from shardc.passes.rules.routing import grouped_gemms
from shardc.passes.schedule import SCHEDULE
from shardc.passes.step_nodes import collective_nodes
from shardc.planning.memory import alias_of
from shardc.program.report import comm_report, eager_calls
from shardc.runtime import functional as F
from shardc.runtime.volume import ring_factor

# A GEMM's backward runs two products of its forward's size (dI and dW); the same
# factor stands for attention's backward (flop_counter counts about 2.5x there) and for
# the bytes the backward of an element-wise op moves (its input's gradient, read and
# written, and the saved input read).
BACKWARD_FLOPS = 2.0
# bytes an op moves per byte of its output: it reads an input of about that size
READ_WRITE = 2
# AdamW reads the parameter, its gradient and two moments and writes three of them back
OPTIMIZER_PASSES = 7


@dataclass
class StepShape:
    """What one step of a pattern's program does, beyond its bytes."""

    calls: dict[str, int] = field(default_factory=dict)  # per axis
    overlapped_calls: dict[str, int] = field(default_factory=dict)
    overlapped_share: dict[str, float] = field(default_factory=dict)  # of the axis's bytes
    ops: int = 0
    flops: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)  # (global, divs)
    traffic: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)  # bytes, divs

    def flops_for(self, sizes: dict[str, int]) -> float:
        return per_rank(self.flops, sizes)

    def traffic_for(self, sizes: dict[str, int]) -> float:
        return per_rank(self.traffic, sizes)


def axis_sizes(mesh: Mesh) -> dict[str, int]:
    """Axis name -> size for every axis that cuts a tensor (the 4D grid and ``context``):
    what the planner's terms are divided by."""
    return {a: mesh.size(a) for a in CUT_AXES}


def per_rank(terms: Sequence[tuple[float, tuple[str, ...]]], sizes: dict[str, int]) -> float:
    """One rank's share of (global count, axes dividing it) terms on a mesh of ``sizes``."""
    return sum(f / math.prod(sizes[d] for d in divs) for f, divs in terms)


@dataclass
class StepTime:
    """One mesh's predicted step, term by term (seconds)."""

    compute: float
    bandwidth: dict[str, float]
    latency: dict[str, float]
    hidden: float
    # a pipeline's idle time (shardc/planning/stages.py); 0 without stages
    bubble: float = 0.0

    @property
    def comm(self) -> float:
        return sum(self.bandwidth.values()) + sum(self.latency.values())

    @property
    def total(self) -> float:
        return self.compute + self.comm - self.hidden + self.bubble


def work(gm: fx.GraphModule, recompute: bool
         ) -> tuple[list[tuple[float, tuple[str, ...]]], list[tuple[float, tuple[str, ...]]]]:
    """The FLOPs and the memory traffic of one step of the rank's forward program ``gm``,
    as (global count, axes dividing it on a rank) terms.

    FLOPs: per ATen op that torch's flop counter counts (GEMMs, attention; composite
    ops such as ``linear`` through what they decompose to), run on the global fake
    values; the axes dividing them are those cutting the op's output and those its
    output is a partial sum over (the contraction's). Traffic: every other op that
    allocates its output (views move nothing), ``READ_WRITE`` times its output's bytes,
    divided by the axes cutting the output. Backward counts ``BACKWARD_FLOPS`` times
    forward for both; recompute once more."""


    factor = 1.0 + BACKWARD_FLOPS + (1.0 if recompute else 0.0)
    _count_grouped_gemms()

    def glob(a: Any) -> Any:
        return a.meta.get(GLOBAL_VAL) if isinstance(a, fx.Node) else a

    flops_out: list[tuple[float, tuple[str, ...]]] = []
    traffic: list[tuple[float, tuple[str, ...]]] = []
    for n in gm.graph.nodes:
        lay, val = n.meta.get(PLACEMENT), n.meta.get(GLOBAL_VAL)
        if (n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload)
                or lay is None or not isinstance(val, torch.Tensor)
                or not val.dtype.is_floating_point or alias_of(n) is not None):
            continue
        divs = tuple(a for axes in lay.dims for a in axes)
        flops = 0
        # run on global values: the ops with a FLOP formula, and composites that may
        # decompose into them (linear, matmul). Other ops do no arithmetic the counter
        # knows, and their arguments may be local sizes the lowering baked in (a
        # reshape's), wrong for global values. A composite failing on such sizes is a
        # reshape-like op (no arithmetic); an op with a formula failing is a bug: raise
        direct = n.target.overloadpacket in flop_registry
        if direct or _composite(n.target):
            counter = FlopCounterMode(display=False)
            try:
                with counter:
                    n.target(*torch.utils._pytree.tree_map(glob, n.args),
                             **torch.utils._pytree.tree_map(glob, n.kwargs))
            except RuntimeError:
                if direct:
                    raise
            flops = counter.get_total_flops()
        if flops:
            flops_out.append((factor * flops, divs + tuple(a for a, _ in lay.partial)))
        else:
            traffic.append((factor * READ_WRITE * val.numel() * val.element_size(), divs))
    return flops_out, traffic


def _grouped_flops(x_shape: Any, w_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """A grouped GEMM's FLOPs: each output element is a dot product over the weight's
    input dim (``x @ w[e]`` row by row: torch's, transformers' and shardc's forms, whose
    weight is [E, in, out]; torch's 2-D by 2-D form cuts the contraction instead)."""
    if len(w_shape) == 2:
        return 2 * math.prod(out_shape[1:]) * w_shape[0]
    return 2 * math.prod(out_shape) * w_shape[-2]


def _count_grouped_gemms() -> None:
    """Give torch's flop counter the grouped GEMMs (a mixture of experts' expert GEMMs),
    which it has no formula for: without it the cost model counted them as memory
    traffic. Lazily, since transformers registers its own when it is imported."""
    for op in grouped_gemms():
        if op.overloadpacket not in flop_registry:
            register_flop_formula(op.overloadpacket)(_grouped_flops)


def _composite(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` decomposes at dispatch (CompositeImplicitAutograd), so that its
    FLOPs are those of the ops it becomes."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def step_shape(sm: Any) -> StepShape:
    """Count ``sm``'s calls, ops and overlaps (no communication: the step program is
    traced offline), and its FLOPs."""

    opts = sm.ctx.options
    flops, traffic = work(sm.graph_module, opts.recompute)
    # the optimizer's pass over the rank's parameters (and gradients, moments), fp32
    # under every precision policy (master weights)
    traffic += [(float(OPTIMIZER_PASSES * 4 * math.prod(sm._global_shapes[name])),
                 tuple(a for axes in lay.dims for a in axes))
                for name, lay in sm.param_layouts.items()]
    shape = StepShape(flops=flops, traffic=traffic)
    calls: dict[str, int] = defaultdict(int)
    over_calls: dict[str, int] = defaultdict(int)
    nbytes: dict[str, float] = defaultdict(float)
    over_bytes: dict[str, float] = defaultdict(float)
    if opts.step_graph and not opts.recompute:
        jp = sm.offline_step()
        for part in (jp.forward, jp.backward):
            overlapped = {s["node"]: s["overlapped"] > 0 or s.get("deferred", False)
                          for s in part.meta.get(SCHEDULE, [])}
            for n in collective_nodes(part.graph):
                c = n.meta["shardc_comm"]
                axis = c["axis"]
                x = n.args[0].meta["val"]
                b = float(ring_factor(c["collective"], sm.mesh.size(axis))) * x.numel() * x.element_size()
                calls[axis] += 1
                nbytes[axis] += b
                if overlapped.get(n.name, False):
                    over_calls[axis] += 1
                    over_bytes[axis] += b
            shape.ops += sum(1 for n in part.graph.nodes if n.op == "call_function"
                             and n.target is not operator.getitem and n.target is not F.WAIT)
    else:
        # autograd's backward: nothing is credited (its gradient buckets overlap what
        # backward still computes, but the model does not count on it); a gradient
        # reduction in a bucket is one call of its bucket's (runtime/grad_buckets.py)
        for (_, axis, _), n in eager_calls(sm, comm_report(sm).rows).items():
            calls[axis] += n
        ops = sum(1 for n in sm.graph_module.graph.nodes if n.op == "call_function")
        shape.ops = int(ops * (1 + BACKWARD_FLOPS + (1 if opts.recompute else 0)))
    shape.calls = dict(calls)
    shape.overlapped_calls = dict(over_calls)
    shape.overlapped_share = {a: over_bytes[a] / nbytes[a] for a in nbytes if nbytes[a]}
    return shape


def predict(shape: StepShape | None, bytes_per_axis: dict[str, float], mesh: Mesh,
            machine: Machine) -> StepTime:
    """The step time of ``mesh`` (a member of ``shape``'s pattern) on ``machine``;
    without a shape (a machine of bandwidth alone), its communication time."""
    bw = {a: (bytes_per_axis[a] / machine.axis_bandwidth(mesh, a) if bytes_per_axis.get(a) else 0.0)
          for a in CUT_AXES}
    if shape is None:
        return StepTime(0.0, bw, {a: 0.0 for a in CUT_AXES}, 0.0)
    lat = {a: shape.calls.get(a, 0) * machine.axis_latency(mesh, a) for a in CUT_AXES}
    sizes = axis_sizes(mesh)
    compute = (shape.flops_for(sizes) / machine.gemm_flops if machine.gemm_flops else 0.0) \
        + (shape.traffic_for(sizes) / machine.memory_bandwidth if machine.memory_bandwidth else 0.0) \
        + shape.ops * machine.op_overhead
    hideable = sum(machine.bandwidth_overlap * bw[a] * shape.overlapped_share.get(a, 0.0)
                   + machine.latency_overlap * shape.overlapped_calls.get(a, 0)
                   * machine.axis_latency(mesh, a) for a in CUT_AXES)
    return StepTime(compute, bw, lat, min(hideable, compute))
