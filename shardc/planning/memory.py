"""How many bytes a rank holds at the peak of a training step, from the compiled program.

``estimate(sm)`` adds what a rank keeps between steps (its parameter shards, the program
copies ``shard_optimizer`` keeps, the optimizer's state) to the peak of what one forward
and backward allocate on top of that. The peak is not a formula over the model: the
rank's training step is traced with ``make_fx`` on fake tensors (no communication, no
memory), exactly as it runs, and walked in execution order with every tensor alive from
the op that makes it to its last use (a view or in-place result shares its base's
storage; the gradients the step returns stay alive). So the estimate follows every
option the program follows:

- the collectives' buffers (gathered weights, reduced partial sums) and their dtypes,
  hence the precision policy;
- ``reshard_after_forward`` (the traced step program re-gathers in backward);
- block recompute: torch.utils.checkpoint is traced through, its recompute appears in
  backward where autograd runs it;
- selective recompute: the same trace, where each recomputed op the policy saves reads
  the forward's output instead (the ops are matched in order within each block, whose
  recompute replays its forward);
- under autograd's backward, the gradient buckets' buffers (``runtime/grad_buckets.py``):
  an all-reduce bucket's from its first gradient to the end of backward, a reduce-scatter
  bucket's until the next one is issued, and its result to the end; and a block's weights
  gathered together (``collectives.GatherGroup``): the group's buffer beside its members'
  copies, from its all-gather to its last member's wait, again where recompute re-gathers.

What it leaves out: the allocator's rounding and fragmentation; the step passes
(the trace is the step program before bucketing, coalescing and scheduling: packed
copies of gradients, at most ``bucket_mb`` at a time); buffers a backend allocates inside
a collective (gloo's coalesced reduce-scatter clones its inputs, 1.3 MiB at the
backward peak of the 8-block GPT on z2d2, and stages every all-gather through a flat
copy on its worker thread); optimizer temporaries (a foreach AdamW step allocates about
one parameter's worth while activations are gone). Against ``measured_peak``
(``benchmarks/memory.py``, 4 gloo ranks) it came to 0.88-1.00 of every option's
measured total, running low by about those missing buffers.
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from shardc.core.compat import checkpoint_whole
from shardc.core.ir import Selective, op_named
from shardc.passes.joint import SWAP, trace_joint, tracing_graph
from shardc.passes.recompute import Checkpointed
from shardc.runtime import functional as F
from shardc.runtime.collectives import get_runtime
from shardc.runtime.experts import EXPERT_REGION, EXPERT_REGION_BACKWARD, SEGMENTS, capacity_rows
from shardc.runtime.functional import ALIASES
from shardc.runtime.grad_buckets import REDUCE_SCATTER

# the output node's meta in a traced forward program's step: the parameter (or None) of
# each gradient the step returns, in order
GRAD_OF = "shardc_grad_of"
# optimizer name -> state tensors it keeps per parameter, each the parameter's size
STATE_PER_PARAMETER = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1, "adagrad": 1,
                       "rmsprop": 1}


@dataclass
class MemoryEstimate:
    """Bytes one rank holds (``total``): ``resident`` between steps (``parameters`` +
    ``optimizer``) and the ``step_peak`` a forward and backward add on top (activations,
    gathered weights, gradients)."""

    parameters: int
    optimizer: int
    step_peak: int

    @property
    def resident(self) -> int:
        return self.parameters + self.optimizer

    @property
    def total(self) -> int:
        return self.resident + self.step_peak


def estimate(sm: Any, optimizer: str | int = "adamw") -> MemoryEstimate:
    """The memory estimate of compiled module ``sm`` (no communication; traces one step
    on fake tensors). ``optimizer``: a name in ``STATE_PER_PARAMETER`` or the number of
    parameter-sized state tensors it keeps."""
    per = optimizer if isinstance(optimizer, int) else STATE_PER_PARAMETER.get(optimizer.lower())
    if per is None:
        raise ValueError(f"shardc.planning.memory.estimate: optimizer={optimizer!r} is not one of "
                         f"{sorted(STATE_PER_PARAMETER)} or a number of state tensors per parameter.")
    own = sum(_nbytes(p) for p in sm.parameters())
    copies = sum(_nbytes(zp.full) for zp in getattr(sm, "_zero", {}).values())
    trainable = sum(_nbytes(p) for p in sm.parameters() if p.requires_grad)
    graph, saved_as = traced_step(sm)
    held = _grad_bucket_buffers(sm, graph)
    for n, nbytes in [*_gather_group_buffers(sm, graph).items(), *_expert_buffers(graph).items()]:
        held[n] = held.get(n, 0) + nbytes
    return MemoryEstimate(own + copies, per * trainable, peak_bytes(graph, saved_as, held))


def _expert_buffers(graph: fx.Graph) -> dict[fx.Node, int]:
    """An expert segment (``runtime.experts``) is one op of the traced step: what it holds
    from its forward to its backward (the rows it received and every value of the experts'
    ops, which their backward reads) is beside the graph. Counted at uniform routing (a
    rank receives as many rows as it sends), by running the segment's ops on fake tensors
    of that many rows; under a capacity factor, at the padded rows it always receives."""
    out: dict[fx.Node, int] = {}
    made: dict[str, int] = {}
    for n in graph.nodes:
        if n.target is EXPERT_REGION:
            key, rows, capacity = n.args[6], int(n.args[0][0].meta["val"].shape[0]), n.args[7]
            if capacity:  # the padded runs, whatever the routing
                rows = n.args[3] * capacity_rows(capacity, rows, n.args[3])
            made[key] = _segment_bytes(SEGMENTS[key], rows)
            out[n] = out.get(n, 0) + made[key]
        elif n.target is EXPERT_REGION_BACKWARD and n.args[3] in made:
            out[n] = out.get(n, 0) - made[n.args[3]]
    return out


def _segment_bytes(seg: Any, rows: int) -> int:
    with FakeTensorMode():
        ins = [torch.empty((rows, *shape), dtype=dtype) for shape, dtype in seg.rows]
        others = [torch.empty(shape, dtype=dtype) for shape, dtype in seg.others]
        local = next((s[0] for s, _ in seg.others if len(s) == 3), 1)  # the local experts
        offs = torch.zeros(local, dtype=torch.int32)
        seen = 0

        class Count(fx.Interpreter):
            def run_node(self, node: fx.Node) -> Any:
                nonlocal seen
                v = super().run_node(node)
                if node.op == "call_function":
                    seen += sum(_tensor_bytes(t) for t in (v if isinstance(v, (list, tuple)) else [v]))
                return v

        Count(seg.fn).run(*ins, offs, *others)
    return seen + sum(_tensor_bytes(t) for t in ins)


def _grad_bucket_buffers(sm: Any, graph: fx.Graph) -> dict[fx.Node, int]:
    """Under autograd's backward, the gradient buckets' buffers (runtime/grad_buckets.py),
    as bytes made (or, negative, freed) right after a gradient's node: an all-reduce
    bucket's buffer from its first member's gradient to the end of backward; a
    reduce-scatter bucket's (its members' whole gradients) from its first member's
    gradient until the next reduce-scatter bucket is issued (its last member's gradient),
    and its result (the shards' sums) from its own issue to the end. (The traced
    step program is the step program's graph before bucketing: nothing to add there.)"""

    gb = getattr(sm, "_grad_buckets", None)
    if gb is None or not gb.buckets or (sm._recompute is None and sm.ctx.options.step_graph):
        return {}
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs, of = out_node.args[0], out_node.meta.get(GRAD_OF, [])
    by_param = {name: g for name, g in zip(of, outs[len(outs) - len(of):])
                if name is not None and isinstance(g, fx.Node)}
    where = {n: i for i, n in enumerate(graph.nodes)}
    extra: dict[fx.Node, int] = {}

    def add(n: fx.Node, nbytes: int) -> None:
        extra[n] = extra.get(n, 0) + nbytes

    scattering: list[tuple[int, fx.Node]] = []  # (buffer bytes, issued at) in issue order
    for b in gb.buckets:
        made = sorted((by_param[m.name] for m in b.members if m.name in by_param),
                      key=lambda n: where[n])
        if not made:
            continue
        add(made[0], b.nbytes)
        if b.collective == REDUCE_SCATTER:
            add(made[-1], b.nbytes // b.rows)
            scattering.append((b.nbytes, made[-1]))
    for (nbytes, _), (_, next_issue) in zip(scattering, scattering[1:]):
        add(next_issue, -nbytes)
    return extra


def _gather_group_buffers(sm: Any, graph: fx.Graph) -> dict[fx.Node, int]:
    """Under autograd's backward, each gather group's buffer (``collectives.GatherGroup``:
    a block's weights in one all-gather) beside its members' own gathered copies: made
    at the first member's all-gather of a round and freed at the round's last wait (a
    member's copy out of it), as bytes made or (negative) freed right after those nodes.
    A round ends when every member was served; recompute gathers the block again."""
    groups = getattr(sm, "_gather_groups", [])
    if not groups or (sm._recompute is None and sm.ctx.options.step_graph):
        return {}
    _fc = torch.ops._c10d_functional  # the ops functional collectives trace to

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(sm._feeds):
        return {}
    name_of = {id(sm._program_param(t)): t for role, t in sm._feeds if role == "param"}
    member: dict[str, tuple[Any, str]] = {}  # parameter name -> (its group, gather key)
    for g in groups:
        for key, p in g.members:
            if id(p) in name_of:
                member[name_of[id(p)]] = (g, key)
    param_at = {ph: t for ph, (role, t) in zip(placeholders, sm._feeds) if role == "param"}
    where = {n: i for i, n in enumerate(graph.nodes)}
    extra: dict[fx.Node, int] = {}

    def add(n: fx.Node, nbytes: int) -> None:
        extra[n] = extra.get(n, 0) + nbytes

    # per group this round: the members still to serve, the waits, the buffer's bytes
    pending: dict[int, set[str]] = {}
    waits: dict[int, list[fx.Node]] = {}
    size: dict[int, int] = {}
    for n in graph.nodes:
        if n.target is not _fc.all_gather_into_tensor.default:
            continue
        src = n.args[0]
        # the weight, through a cast or a reshape the gather made of it
        while isinstance(src, fx.Node) and src.op == "call_function" and \
                len(src.all_input_nodes) == 1:
            src = src.all_input_nodes[0]
        found = member.get(param_at.get(src, "")) if isinstance(src, fx.Node) else None
        wait = next((u for u in n.users if u.target is _fc.wait_tensor.default), None)
        if found is None or wait is None:
            continue
        g, key = found
        left = pending.get(id(g))
        if not left:  # the group's all-gather goes out
            size[id(g)] = get_runtime(g.rt).mesh.size(g.axis) * g.numel * \
                n.meta["val"].element_size()
            add(n, size[id(g)])
            waits[id(g)] = []
            left = pending[id(g)] = {k for k, _ in g.members}
        elif key not in left:
            # asked again before the others were served: sent again, the new buffer
            # replacing the old one (counted as the one buffer)
            left = pending[id(g)] = {k for k, _ in g.members}
        left.discard(key)
        waits[id(g)].append(wait)
        if not left:
            add(max(waits[id(g)], key=lambda w: where[w]), -size[id(g)])
    return extra


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ------------------------------------------------------------------- the measurement
def measured_peak(step: Callable[[], Any], device: torch.device | str | None = None) -> int:
    """The most bytes live at once, above what was live before, while ``step()`` runs
    on this process: what ``estimate(sm).step_peak`` predicts when ``step`` is one
    forward and backward of ``sm``.

    On CUDA it is the caching allocator's peak of allocated bytes. On CPU it is the
    running sum of torch's profiler's allocation records (each allocation and each
    free, on every thread, in time order). Do not use the profiler's per-op
    ``self_cpu_memory_usage`` for this. torch assigns each allocation record to every
    CPU op whose time span contains it, on any thread. gloo's worker threads allocate
    and free a staging buffer inside each collective, and their frees are lost or
    charged to other ops. Summing per-op figures then counts every staging buffer as
    never freed: 1.5-2 MiB too much by the end of a z2d2 backward, by an amount that
    varies with gloo's timing."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)
        start = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step()
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        step()
    # the raw records torch's own parser reads ("[memory]": one per allocation, with a
    # negative size per free), before it distributes them over ops
    records = [e for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
               if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


# ------------------------------------------------------------------------- the trace
def traced_step(sm: Any) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """One training step of ``sm`` as a graph of ATen ops and functional collectives in
    execution order, and (selective recompute) each recomputed node the policy saves ->
    the forward node whose output it reads instead."""

    args, needs = sm._example_args()
    names = [t if role == "param" else None for role, t in sm._feeds]
    if sm._recompute is None and sm.ctx.options.step_graph:
        jp = trace_joint(sm.graph_module, sm.ctx, args, needs, names, offline=True)
        return jp.joint.graph, {}
    return _trace_forward_program(sm, args, needs)


def _trace_forward_program(sm: Any, args: list[Any], needs: list[bool]
                           ) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """The forward program (recompute-wrapped where it is) and autograd's backward."""


    run = copy.deepcopy(sm._recompute if sm._recompute is not None else sm.graph_module)
    for m in run.modules():
        if isinstance(m, fx.GraphModule):
            for n in m.graph.nodes:
                if n.op == "call_function" and n.target in SWAP:
                    n.target = SWAP[n.target]
            m.recompile()
    spans: list[tuple[int, int, int]] = []  # (block, first node, end): forward, then recompute

    def recording(inner: Callable, block: int) -> Callable:
        def call(*a: Any) -> Any:
            graph = tracing_graph()
            assert graph is not None  # called under make_fx
            start = len(graph.nodes)
            out = inner(*a)
            spans.append((block, start, len(graph.nodes)))
            return out
        return call

    blocks = [m for m in run.modules() if isinstance(m, Checkpointed)]
    for i, m in enumerate(blocks):
        # plain checkpoint: its recompute is traced into backward (a selective policy's
        # saving is applied to the trace afterwards; under make_fx it would only tag)
        def fwd(*a: Any, _m: Checkpointed = m, _i: int = i) -> Any:
            return checkpoint_whole(recording(_m.inner, _i), *a)
        m.forward = fwd  # type: ignore[method-assign]
    grad_at = [i for i, w in enumerate(needs) if w]

    made: list[str | None] = []  # the parameter of each gradient the step returns

    def step(*flat: Any) -> Any:
        outs = run(*flat)
        outs = outs if isinstance(outs, (list, tuple)) else (outs,)
        diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        grads = torch.autograd.grad(diff, [flat[i] for i in grad_at],
                                    [torch.ones_like(o) for o in diff], allow_unused=True)
        made[:] = [sm._feeds[i][1] if sm._feeds[i][0] == "param" else None
                   for i, g in zip(grad_at, grads) if g is not None]
        return (*outs, *[g for g in grads if g is not None])

    inputs = [a.detach().requires_grad_(w) if isinstance(a, torch.Tensor) else a
              for a, w in zip(args, needs)]
    F.STATE.offline = True
    try:
        with torch.enable_grad():
            gm = make_fx(step, tracing_mode="fake")(*inputs)
    finally:
        F.STATE.offline = False
        F.STATE.clear()
    next(n for n in reversed(gm.graph.nodes) if n.op == "output").meta[GRAD_OF] = made
    saved_as: dict[fx.Node, fx.Node] = {}
    policy = sm.ctx.options.activation_checkpoint
    if isinstance(policy, Selective):
        saved_as = _saved_by(gm.graph, spans, policy)
    return gm.graph, saved_as


def _saved_by(graph: fx.Graph, spans: list[tuple[int, int, int]], policy: Any
              ) -> dict[fx.Node, fx.Node]:
    """Pair each block's recomputed ops with its forward ops (the recompute replays the
    forward in order) and keep the pairs whose op the policy saves."""

    keep = {op_named(n) for n in policy.save}
    nodes = list(graph.nodes)
    calls: dict[int, list[tuple[int, int]]] = {}
    for block, a, b in spans:
        calls.setdefault(block, []).append((a, b))
    out: dict[fx.Node, fx.Node] = {}
    for seen in calls.values():
        if len(seen) != 2:
            continue
        (fa, fb), (ra, rb) = seen
        # the recompute adds detaches (autograd's unpacking of what it saves; torch 2.15
        # adds aliases there too): not ops of the block
        fwd = [n for n in nodes[fa:fb] if n.op == "call_function" and n.target not in _UNPACKING]
        rec = [n for n in nodes[ra:rb] if n.op == "call_function" and n.target not in _UNPACKING]
        if [n.target for n in fwd] != [n.target for n in rec]:
            continue  # not a replay: leave this block fully recomputed
        for f, r in zip(fwd, rec):
            if getattr(f.target, "overloadpacket", None) in keep:
                out[r] = f
    return out


_UNPACKING = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


# ---------------------------------------------------------------------- liveness
def _tensor_bytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def alias_of(n: fx.Node) -> fx.Node | None:
    """The input whose storage ``n``'s output shares (a view, detach, an in-place op's
    result), or None when the op allocates."""
    if n.op != "call_function" or n.target is operator.getitem:
        return None  # each output of a multi-output op is its own tensor
    if n.target in ALIASES:  # a runtime function that returns one of its arguments
        arg = n.args[ALIASES[n.target]]
        return arg if isinstance(arg, fx.Node) else None
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    for arg, value in zip(schema.arguments, n.args):
        if arg.alias_info is not None and isinstance(value, fx.Node):
            return value
    return None


def peak_bytes(graph: fx.Graph, saved_as: dict[fx.Node, fx.Node] | None = None,
               held: dict[fx.Node, int] | None = None) -> int:
    """The most bytes alive at once while ``graph`` runs, beyond its inputs: each
    allocating node's output from its op to its last reader (through views), the
    outputs to the end. ``saved_as``: nodes that allocate nothing and read another's
    output instead (selective recompute). ``held``: bytes the runtime makes beside the
    graph right after a node and holds to the end, or (negative) frees there (gradient
    buckets)."""
    saved_as = saved_as or {}
    held = held or {}
    nodes = list(graph.nodes)
    where = {n: i for i, n in enumerate(nodes)}
    root: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        base = saved_as.get(n) or alias_of(n)
        root[n] = root.get(base, base) if base is not None else n
    last: dict[fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            r = root[a]
            last[r] = max(last.get(r, 0), where[n])
        last.setdefault(root[n], where[n])
    out = nodes[-1]
    for a in out.all_input_nodes:
        last[root[a]] = len(nodes)
    size = {n: _tensor_bytes(n.meta.get("val")) for n in nodes
            if n.op == "call_function" and root[n] is n}
    frees: dict[int, int] = {}
    for r, s in size.items():
        frees[last[r]] = frees.get(last[r], 0) + s
    live = peak = 0
    for i, n in enumerate(nodes):
        live += size.get(n, 0) + held.get(n, 0)
        peak = max(peak, live)
        live -= frees.get(i, 0)
    return peak
