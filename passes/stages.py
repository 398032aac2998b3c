"""Pipeline stages cut from the model's graph: ``compile(mesh=Mesh(pipe=p, ...))``.

Reads:  the whole model's pre-dispatch export (``torch.export``, unlifted: parameters are
        ``get_attr`` nodes) traced on one micro-batch, each node's ``nn_module_stack`` and
        ``meta["val"]``; the model's repeated blocks (``recompute.repeated_blocks``)
Writes: nothing in the graph; returns one ``Stage`` a pipeline stage: a GraphModule of its
        nodes whose placeholders are the values it reads from the model's inputs or from
        earlier stages, and whose outputs are the values later stages (or the model's
        output) read
Keeps:  every rank cuts identically (the cut depends on the graph and the shapes only), so
        the stages' sends and receives pair up

Why here, before tracing a stage: each stage is then compiled by the existing compiler on
its own ranks (its x, y, z and data layout), exactly like a model of its own; what crosses
a stage boundary is a plain tensor the runtime sends point to point.

By default the cut falls between repeated blocks (a transformer's layers): the nodes
before the first block (embeddings) go with the first stage, those after the last block
(final norm, head, loss) with the last. With ``split_points`` (module names) the user says
where: stage i begins at the first op of the i-th named module, in the order forward runs
them, and every op from there to the next named module's first op is the stage's
(whatever module it belongs to), so any model whose forward is one graph can be cut.

Between repeated blocks, the blocks are spread over the stages by dynamic programming so
that the most expensive stage is as cheap as it can be: cost is the forward FLOPs of the
GEMMs and attention (the work a step repeats three times), then the parameter bytes (the
memory a stage holds) to break ties. A parameter read by two stages (a tied embedding and
head) is held by both; the runtime sums its gradient over them.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from shardc.core.errors import ShardcError, TraceError
from shardc.passes.causal_masks import fold_causal_masks
from shardc.passes.recompute import repeated_blocks
from shardc.passes.trace import explain_trace_failure

_aten = torch.ops.aten
# GEMM-like ops of the pre-dispatch graph: FLOPs = 2 * output elements * reduced dim
_GEMMS = {_aten.linear.default: 1, _aten.matmul.default: 1, _aten.mm.default: 1,
          _aten.bmm.default: 1, _aten.addmm.default: 2, _aten.baddbmm.default: 2,
          _aten.einsum.default: None}
_ATTENTION = {_aten.scaled_dot_product_attention.default}


@dataclass
class Stage:
    """One stage's program and where its inputs come from and its outputs go."""

    index: int
    module: fx.GraphModule
    # per placeholder: (source stage, index there): source -1 is the model's inputs (the
    # index is the input's position), else an earlier stage (the index is its output's)
    inputs: list[tuple[int, int]]
    # per placeholder: the value's global shape and dtype on one micro-batch, and whether
    # it carries a gradient back to where it came from
    input_vals: list[Any]
    # per output: the stages that read it; -1 marks the model's output (the loss)
    consumers: list[list[int]]
    output_vals: list[Any]
    blocks: list[str] = field(default_factory=list)
    flops: float = 0.0
    param_bytes: int = 0
    params: list[str] = field(default_factory=list)
    # split_points: the module that begins this stage (None: the first stage, or stages cut
    # between repeated blocks)
    begins: str | None = None


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def node_flops(n: fx.Node) -> float:
    """Forward FLOPs of a GEMM or attention node from its traced shapes (0 for the rest)."""
    out = _val(n)
    if n.op != "call_function" or not isinstance(out, torch.Tensor):
        return 0.0
    if n.target in _ATTENTION:
        q, k = _val(n.args[0]), _val(n.args[1])
        if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
            return 0.0
        # QK^T and PV: 2 * 2 * (batch, heads) * Tq * Tk * d
        return 4.0 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
    pos = _GEMMS.get(n.target)  # type: ignore[call-overload]
    if pos is not None:
        a = _val(n.args[pos])
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return 2.0 * out.numel() * a.shape[-1]
    return 0.0


def _grad_val(val: Any, grad: bool) -> Any:
    """The traced value as a meta tensor whose ``requires_grad`` says whether a gradient
    flows through it (the trace's fake values do not say)."""
    if not isinstance(val, torch.Tensor):
        return val
    out = torch.empty(val.shape, dtype=val.dtype, device="meta")
    return out.requires_grad_(grad and val.dtype.is_floating_point)


def _carries_grad(gm: fx.GraphModule, params: Mapping[str, torch.Tensor]) -> set[fx.Node]:
    """The nodes whose value a gradient flows through: made (with gradients enabled) from
    a trainable parameter, by a floating-point op. A region under ``torch.no_grad()`` shows
    in the pre-dispatch graph as ``_set_grad_enabled`` calls around it."""
    out: set[fx.Node] = set()
    enabled = True
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            enabled = bool(n.args[0])
            continue
        if n.op == "get_attr":
            p = params.get(str(n.target))
            if p is not None and p.requires_grad:
                out.add(n)
            continue
        val = _val(n)
        floating = any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point
                       for v in (val if isinstance(val, (tuple, list)) else [val]))
        if enabled and floating and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _block_index(n: fx.Node, blocks: list[str]) -> int | None:
    for path, _ in (n.meta.get("nn_module_stack") or {}).values():
        for i, b in enumerate(blocks):
            if path == b or path.startswith(b + "."):
                return i
    return None


def balance(flops: list[float], nbytes: list[int], stages: int) -> list[int]:
    """Contiguous split of the units into ``stages`` non-empty groups minimising the most
    expensive group (FLOPs, then bytes); returns each group's first unit."""
    n = len(flops)
    inf = (math.inf, math.inf)
    # best[s][i]: the best (max cost) of the first i units in s groups; cut[s][i] the
    # first unit of the last group
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf:
                    continue
                here = (sum(flops[j:i]), float(sum(nbytes[j:i])))
                cand = (max(best[s - 1][j][0], here[0]), max(best[s - 1][j][1], here[1]))
                if cand < best[s][i]:
                    best[s][i], cut[s][i] = cand, j
    starts, i = [], n
    for s in range(stages, 0, -1):
        starts.append(cut[s][i])
        i = cut[s][i]
    return starts[::-1]


def unlifted_graph(model: nn.Module, example_inputs: tuple) -> fx.GraphModule:
    """The model's pre-dispatch export with its parameters as ``get_attr`` nodes (every
    parameter and buffer keeps its qualified name) and no input guard call."""
    try:
        ep = torch.export.export(model, tuple(example_inputs), strict=False)
    except Exception as e:  # noqa: BLE001 - re-raised with the cause named
        # the stages cut the plain export (no draft export of a branch on values, no
        # retry of a loop over the entries a mask holds): where it fails, what the
        # model does that the export cannot take, as compile says it for one stage
        raise TraceError(explain_trace_failure(model, e)) from e
    gm = ep.module()
    for n in list(gm.graph.nodes):
        # torch >= 2.9 checks the input shapes in a submodule call; a stage has none of
        # the model's inputs to check (its own trace guards its own)
        if n.op == "call_module" and not n.users:
            gm.graph.erase_node(n)
    # a tied parameter has several names; every stage reads it by the model's first one
    # (named_parameters()'), so a stage's names are the model's
    canonical = {id(p): name for name, p in model.named_parameters()}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                obj = gm.get_parameter(str(n.target))
            except AttributeError:
                continue
            name = canonical.get(id(obj))
            if name is not None and name != n.target:
                try:
                    gm.get_parameter(name)
                except AttributeError:
                    continue
                n.target = name
    # before the cut: a causal mask made from positions would otherwise be made by the
    # first stage and sent to every later one, which could not fold it (causal_masks.py)
    fold_causal_masks(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


_CASTS = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout}


def local_casts(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``, the unlifted graph of ``shardc.CastAtUse(model, dtype)``, with each cast of a
    parameter or of an input moved to the ops that read it: ``CastAtUse`` casts every weight
    before the model runs, so the trace casts them all at its start, where the stage cut
    would leave them to the first stage and send every later stage its cast weights. A
    copy of the cast goes just before each reader, in the reader's module, so each stage
    casts the weights it reads itself."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or len(n.all_input_nodes) != 1:
            continue
        src = n.all_input_nodes[0]
        if not (src.op == "placeholder" or (src.op == "get_attr" and str(src.target) in params)):
            continue
        if n.target is torch.ops.aten._assert_tensor_metadata.default:
            # the cast's check of the weight's own dtype: left there, it would make the
            # first stage read (and hold) every weight; each stage's trace checks its own
            g.erase_node(n)
            continue
        if n.target not in _CASTS:
            continue
        for u in list(n.users):
            if u.op == "output":
                continue
            with g.inserting_before(u):
                c = g.node_copy(n)
            for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                if key in u.meta:
                    c.meta[key] = u.meta[key]
            u.replace_input_with(n, c)
        if not n.users:
            g.erase_node(n)
    gm.recompile()
    return gm


def _in_module(n: fx.Node, name: str) -> bool:
    return any(path == name or path.startswith(name + ".")
               for path, _ in (n.meta.get("nn_module_stack") or {}).values())


def _split_units(model: nn.Module, nodes: list[fx.Node], points: tuple[str, ...], n_stages: int,
                 ask: str) -> dict[fx.Node, int]:
    """Each computing node's stage when the user names where the stages begin: stage i
    begins at the first op of module ``points[i-1]``, in the order forward runs them."""
    if len(points) != n_stages - 1:
        raise ShardcError(
            f"shardc.compile: split_points names {len(points)} module(s), which begin "
            f"{len(points) + 1} stages, and {ask} needs {n_stages}: name {n_stages - 1}.")
    names = dict(model.named_modules())
    computing = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")]
    firsts = []
    for q in points:
        if q not in names:
            close = difflib.get_close_matches(q, list(names), n=3)
            hint = "; did you mean " + ", ".join(map(repr, close)) + "?" if close else "."
            raise ShardcError(
                f"shardc.compile: split_points: {q!r} is not a module of {type(model).__name__} "
                f"(a name of model.named_modules()){hint}")
        at = next((i for i, n in enumerate(computing) if _in_module(n, q)), None)
        if at is None:
            raise ShardcError(f"shardc.compile: split_points: module {q!r} runs no op in the "
                              "model's forward, so no stage can begin there.")
        firsts.append(at)
    if firsts[0] == 0:
        raise ShardcError(f"shardc.compile: split_points: nothing runs before {points[0]!r}, so the "
                          "first stage would be empty; name the module that begins the second stage.")
    for (a, i), (b, j) in zip(zip(points, firsts), zip(points[1:], firsts[1:])):
        if j <= i:
            raise ShardcError(
                f"shardc.compile: split_points must follow the order forward runs them, and "
                f"{b!r} starts {'with' if i == j else 'before'} {a!r}: each begins a later stage.")
    unit: dict[fx.Node, int] = {}
    for i, n in enumerate(computing):
        unit[n] = sum(1 for f in firsts if f <= i)
    return unit


def cut_stages(model: nn.Module, gm: fx.GraphModule, n_stages: int, per_rank: int = 1,
               split_points: tuple[str, ...] | None = None) -> list[Stage]:
    """Cut ``gm`` (``unlifted_graph`` of ``model``) into ``n_stages`` stages (``per_rank``
    of them a pipe rank: the interleaved schedule's chunks, for the error's words): between
    the repeated blocks, balanced, or where ``split_points`` say."""
    blocks = repeated_blocks(model)
    ask = f"pipe={n_stages // per_rank} x virtual_stages={per_rank} = {n_stages} stages" \
        if per_rank > 1 else f"pipe={n_stages}"
    if split_points is not None:
        return _cut(model, gm, n_stages, blocks, split_points, ask)
    if len(blocks) < n_stages:
        raise ShardcError(
            f"shardc.compile: {ask} cuts the model between its repeated blocks (the "
            f"children of a ModuleList or Sequential of one class), and it has {len(blocks)}"
            f"{' (' + ', '.join(blocks[:4]) + ')' if blocks else ''}: at most {len(blocks)} stages. "
            f"Use a smaller pipe axis{' or fewer virtual_stages' if per_rank > 1 else ''}, or name "
            "where the stages begin (split_points).")
    return _cut(model, gm, n_stages, blocks, None, ask)


def _cut(model: nn.Module, gm: fx.GraphModule, n_stages: int, blocks: list[str],
         split_points: tuple[str, ...] | None, ask: str) -> list[Stage]:
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = nodes[-1]
    unit: dict[fx.Node, int] = {}
    if split_points is not None:  # a unit a stage
        unit = _split_units(model, nodes, split_points, n_stages, ask)
        units = n_stages
    else:  # a unit a repeated block
        cur = 0
        for n in nodes:
            if n.op in ("call_function", "call_method", "call_module"):
                b = _block_index(n, blocks)
                cur = max(cur, b if b is not None else cur)  # a stage never reads a later one
                unit[n] = cur
        units = len(blocks)
    params = dict(gm.named_parameters(remove_duplicate=False))
    grads = _carries_grad(gm, params)
    unit_flops = [0.0] * units
    unit_bytes = [0] * units
    counted: set[str] = set()
    for n in nodes:
        if n in unit:
            unit_flops[unit[n]] += node_flops(n)
        if n.op == "get_attr" and n.target in params and n.target not in counted and n.users:
            counted.add(str(n.target))
            first = min(unit[u] for u in n.users if u in unit)
            unit_bytes[first] += params[str(n.target)].numel() * params[str(n.target)].element_size()
    starts = balance(unit_flops, unit_bytes, n_stages) if split_points is None else list(range(n_stages))
    stage_of_unit = [max(s for s in range(n_stages) if starts[s] <= u) for u in range(units)]
    stage: dict[fx.Node, int] = {n: stage_of_unit[u] for n, u in unit.items()}

    outputs = list(out_node.args[0]) if isinstance(out_node.args[0], (tuple, list)) else [out_node.args[0]]
    vals = [_val(o) for o in outputs]
    if len(vals) != 1 or not isinstance(vals[0], torch.Tensor) or vals[0].dim() != 0 \
            or not vals[0].dtype.is_floating_point:
        what = ", ".join(f"a tensor of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor)
                         else type(v).__name__ for v in vals)
        raise ShardcError(
            "shardc.compile: a pipeline (pipe > 1) needs a model that returns its loss, one "
            "floating-point scalar: each micro-batch's backward starts from it on the last stage; "
            f"it returns {what}. Wrap the model so that forward returns the loss, or use a mesh "
            "without stages.")
    loss = outputs[0]
    if loss not in stage:
        raise ShardcError("shardc.compile: the model's loss does not depend on any computation; "
                          "there is nothing to pipeline.")
    # every value a stage makes that another stage (or the output) reads
    sends: list[list[fx.Node]] = [[] for _ in range(n_stages)]
    readers: dict[fx.Node, list[int]] = {}
    for n in nodes:
        if n not in stage:
            continue
        for a in n.all_input_nodes:
            if a in stage and stage[a] != stage[n]:
                if a not in readers:
                    readers[a] = []
                    sends[stage[a]].append(a)
                if stage[n] not in readers[a]:
                    readers[a].append(stage[n])
    if loss not in readers:
        readers[loss] = []
        sends[stage[loss]].append(loss)
    readers[loss].append(-1)
    if stage[loss] != n_stages - 1:
        raise ShardcError("shardc.compile: the model's loss is computed before its last repeated "
                          "block; a pipeline needs the loss at the end of the model.")

    out: list[Stage] = []
    for s in range(n_stages):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        inputs: list[tuple[int, int]] = []
        input_vals: list[Any] = []
        used_params: list[str] = []

        def load(a: fx.Node, s: int = s, g: fx.Graph = g, env: dict = env, inputs: list = inputs,
                 input_vals: list = input_vals, used_params: list = used_params) -> fx.Node:
            if a in env:
                return env[a]
            if a.op == "get_attr":
                new = g.get_attr(str(a.target))
                new.meta = dict(a.meta)
                if str(a.target) in params:
                    used_params.append(str(a.target))
            else:
                if a.op == "placeholder":
                    inputs.append((-1, placeholders.index(a)))
                else:
                    inputs.append((stage[a], sends[stage[a]].index(a)))
                new = g.placeholder(f"in{len(inputs) - 1}_{a.name}")
                new.meta = dict(a.meta)
                input_vals.append(_grad_val(_val(a), a in grads))
            env[a] = new
            return new

        mine = [n for n in nodes if stage.get(n) == s]
        for n in mine:
            for a in n.all_input_nodes:
                if stage.get(a) != s:
                    load(a)
            env[n] = g.node_copy(n, lambda a: env[a])
        g.output(tuple(env[v] for v in sends[s]))
        module = fx.GraphModule(gm, g)
        first = starts[s]
        last = starts[s + 1] if s + 1 < n_stages else units
        if split_points is None:
            held = blocks[first:last]
        else:  # the repeated blocks wholly inside the stage (each recomputes on its own)
            held = [b for b in blocks if {stage[n] for n in stage if _in_module(n, b)} == {s}]
        st = Stage(index=s, module=module, inputs=inputs, input_vals=input_vals,
                   consumers=[readers[v] for v in sends[s]],
                   output_vals=[_grad_val(_val(v), v in grads) for v in sends[s]],
                   blocks=held, flops=sum(unit_flops[first:last]),
                   param_bytes=sum(unit_bytes[first:last]), params=sorted(set(used_params)),
                   begins=(split_points[s - 1] if s else None) if split_points is not None else None)
        out.append(st)
    return out
