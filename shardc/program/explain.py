"""``shardc.explain``: the compiled program as a person reads it."""
from __future__ import annotations

from collections import Counter
from typing import Any, cast

import torch
import torch.fx as fx

from shardc.core.context import FALLBACK, GLOBAL_VAL, KIND, PLACEMENT
from shardc.core.mesh import CUT_AXES
from shardc.passes.bucket import BUCKET
from shardc.passes.coalesce import COALESCED, block_of
from shardc.passes.gemm_modes import GEMM, gemm_nodes
from shardc.passes.remat import REMAT
from shardc.passes.schedule import SCHEDULE
from shardc.passes.step_nodes import collective_nodes
from shardc.program.report import comm_report, fmt_bytes
from shardc.runtime import collectives as C
from shardc.runtime import functional as F
from shardc.runtime import ops as R

_NAMES = {
    C.all_gather_start: "all_gather.start",
    C.all_reduce_start: "all_reduce.start",
    C.reduce_scatter_start: "reduce_scatter.start",
    C.all_to_all_start: "all_to_all.start",
    C.wait: "wait",
    C.grad_all_reduce: "grad_all_reduce",
    C.local_chunk: "local_chunk",
    C.concat_gathered: "concat_gathered",
    C.concat_gathered_interleaved: "concat_gathered",
    C.restriped: "restriped",
    R.vocab_parallel_embedding: "vocab_parallel_embedding",
    R.global_dropout: "dropout",
    R.global_bernoulli: "bernoulli",
}


def _target_name(t: Any) -> str:
    if t in _NAMES:
        return _NAMES[t]
    if isinstance(t, torch._ops.OpOverload):
        name = t.name().replace("aten::", "")
        return name.replace(".default", "")
    return getattr(t, "__name__", str(t))


def _arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(x) for x in a) + "]"
    if isinstance(a, float):
        return f"{a:g}"
    return repr(a) if isinstance(a, str) else str(a)


def _format(n: fx.Node) -> str:
    t = n.target
    if t in (C.all_gather_start, C.all_reduce_start, C.grad_all_reduce, C.local_chunk,
             C.reduce_scatter_start, C.all_to_all_start, C.restriped):
        args = [_arg(n.args[0]), f"axis={n.args[2]}"]
        if t in (C.local_chunk, C.reduce_scatter_start, C.restriped):
            args.append(f"dim={n.args[3]}")
        if t is C.all_to_all_start and n.kwargs.get("stripes") is not None:
            # a re-cut of one dim into other stripes (core/placement.py's notation)
            ks = cast(tuple[int, int], n.kwargs["stripes"])
            a, b = (f"/{k}" if k > 1 else f"/{-k}m" if k < 0 else "" for k in ks)
            args.append(f"dim={n.args[3]}, stripes S({n.args[3]}{a}) -> S({n.args[3]}{b})")
        elif t is C.all_to_all_start:
            args.append(f"from dim={n.args[3]} to dim={n.args[4]}")
        if t is C.all_reduce_start and n.args[3] != "sum":
            args.append(f"op={n.args[3]}")
        if t is C.all_gather_start:
            args.append(f"backward={n.args[3]}")
            if n.kwargs.get("dtype") is not None:  # precision: the weight sent narrow
                # the gradient is reduce-scattered in reduce_dtype, else in the input's
                src = n.args[0]
                assert isinstance(src, fx.Node)
                red = n.kwargs.get("reduce_dtype") or src.meta[GLOBAL_VAL].dtype
                args.append(f"send={str(n.kwargs['dtype']).replace('torch.', '')}, "
                            f"reduce={str(red).replace('torch.', '')}")
        body = ", ".join(args)
    elif t is R.vocab_parallel_embedding:
        body = f"{_arg(n.args[0])}, {_arg(n.args[1])}, axis={n.args[3]}"
    elif t is R.global_dropout or t is R.global_bernoulli:
        body = f"{_arg(n.args[0])}, p={n.args[1]:g}"
    else:
        parts = [_arg(a) for a in n.args]
        parts += [f"{k}={_arg(v)}" for k, v in n.kwargs.items()]
        body = ", ".join(parts)
    return f"{n.name} = {_target_name(t)}({body})"


def explain(sm: Any) -> str:
    """The transformed program: each node's placement, every collective's axis and
    bytes forward and backward, the choices the compiler made, and every op that had no
    sharding rule (run replicated)."""
    if hasattr(sm, "stages"):  # a pipeline rank: the pipeline, then its stage's program
        return "\n\n".join([sm.explain()] + [explain(program) for program in sm.programs])
    gm: fx.GraphModule = sm.graph_module
    mesh = sm.mesh
    rep = comm_report(sm)
    per_node: dict[str, list[str]] = {}
    for r in rep.rows:
        # an expert segment's all-to-alls say which they are (counts, dispatch, combine)
        what = f" ({r.op})" if r.op.startswith("expert ") else ""
        per_node.setdefault(r.node, []).append(f"{r.phase} {r.collective}@{r.axis} {fmt_bytes(r.bytes)}{what}")
    lines = [f"shardc program for {mesh} ({mesh.world_size} ranks; byte counts are per rank)", ""]
    policy = sm.ctx.options.precision
    if policy.mixed:
        lines[-1:-1] = [f"precision: {policy}; parameters and optimizer state in their own "
                        "dtype (weights cast before their all-gather)"]
    lines.append("parameters: global shape -> stored shard [placement]")
    for name, gshape, lshape, lay in sm.parameter_report():
        extra = ""
        if name in sm.grad_reductions:
            extra = "  grad summed over " + ", ".join(sm.grad_reductions[name]) + " after backward"
        zp = getattr(sm, "_zero", {}).get(name)
        if zp is not None:
            # shard_optimizer: the program reads the copy whole over data; the optimizer
            # steps this rank's slice of it
            extra += (f"  optimizer slice over data (dim {zp.dim}; program copy "
                      f"{list(zp.full.shape)} {sm._program_layouts[name]}): grad "
                      "reduce-scattered over data after backward, slices all-gathered "
                      f"before the next forward, in bucket {sm._zero_buckets.index[name]}")
        lines.append(f"  {name}: {gshape} -> {lshape} {lay}{extra}")
    zero = getattr(sm, "_zero_buckets", None)
    if zero is not None and zero.buckets:
        sizes = ", ".join(f"{len(b)}" for b in zero.buckets)
        lines.append(f"  optimizer slices in {len(zero.buckets)} bucket(s) of at most "
                     f"{sm.ctx.options.bucket_bytes / 2 ** 20:g} MiB (members: {sizes}), each one "
                     "reduce-scatter and one all-gather over data a step")
    lines.append("")
    lines.append("program (forward; backward collectives are listed on the node that issues them):")
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n.meta.get(KIND) != "param":
                lines.append(f"  {n.name} = input {n.meta.get(PLACEMENT) or ''}".rstrip())
            continue
        if n.op == "output":
            lines.append(f"  return {_arg(n.args[0])}")
            continue
        lay = n.meta.get(PLACEMENT)
        text = f"  {_format(n)}"
        if lay is not None and n.meta.get(KIND) not in ("collective", "wait"):
            text += f"  {lay}"
        comm = per_node.get(n.name)
        if comm:
            text += "  | " + "; ".join(comm)
        fb = n.meta.get(FALLBACK)
        if fb is not None:
            text += "  | no rule: ran replicated"
        lines.append(text)
    step_rows = [r for r in rep.rows if r.phase == "step"]
    if step_rows:
        lines.append("  after backward: " + "; ".join(
            f"all_reduce@{r.axis} {r.param} {fmt_bytes(r.bytes)}" for r in step_rows))
    lines.append("")
    if sm.decisions:
        lines.append("decisions:")
        lines += [f"  {d}" for d in sm.decisions]
        lines.append("")
    unused = getattr(sm, "unused_parameters", [])
    if unused:  # they work (no gradient, the optimizer skips them), as on one device
        lines.append("parameters forward never reads (no gradient; kept, sharded, unchanged):")
        lines += [f"  {n}" for n in unused]
        lines.append("")
    lines.append("ops without a sharding rule (inputs gathered, run replicated):")
    if sm.fallbacks:
        lines += [f"  {f}" for f in sm.fallbacks]
    else:
        lines.append("  none")
    lines.append("")
    lines += _step_section(sm)
    lines.append("communication per step (bytes one rank sends, ring model):")
    for phase in ("forward", "backward", "step"):
        per_axis = [f"{a} {fmt_bytes(rep.total_bytes(axis=a, phase=phase))}"
                    for a in CUT_AXES if rep.total_bytes(axis=a, phase=phase)]
        lines.append(f"  {phase:8s} {fmt_bytes(rep.total_bytes(phase=phase))}"
                     + (f"  ({', '.join(per_axis)})" if per_axis else ""))
    return "\n".join(lines) + "\n"


def _eager_buckets(sm: Any) -> list[str]:
    """Under autograd's backward: the weights gathered together (collectives.GatherGroup)
    and the gradient buckets (runtime/grad_buckets.py)."""
    out = []
    together = getattr(sm, "_gather_groups", [])
    if together:
        out.append(f"  weight all-gathers: {len(together)} group(s) of a block's weights, one "
                   "all-gather each: " + ", ".join(
                       f"{g.label} ({len(g.members)} over {g.axis})" for g in together))
    gb = getattr(sm, "_grad_buckets", None)
    if gb is None or not gb.buckets:
        return out + ["  gradient sums: one collective per parameter"]
    out += [f"  gradient sums in {len(gb.buckets)} bucket(s), each one collective issued as soon "
           "as backward has filled it and every bucket before it, waited at the end of backward "
           "(a reduce-scatter: when the next one is issued):"]
    for i, b in enumerate(gb.buckets):
        what = f"{b.collective.replace('_', '-')} over {b.axis}"
        if b.then is not None:
            what += f", then all-reduce over {b.then}"
        out.append(f"    bucket {i} ({what}, {str(b.dtype).replace('torch.', '')}, "
                   f"{b.nbytes} B): " + ", ".join(m.name for m in b.members))
    return out


def _written_by_gemm(link: Any) -> int:
    """How many of a bucket's members their GEMM wrote into it (``passes/into_bucket.py``):
    the links of the chain that fills the buffer."""

    count = 0
    while isinstance(link, fx.Node) and link.target in (F.pack_into, F.mm_into):
        count += link.target is F.mm_into
        link = link.args[0]
    return count


def _step_section(sm: Any) -> list[str]:
    """The step program's collectives in the order they run, with what the step
    passes did: each collective's compute overlap and each bucket's members."""
    o = sm.ctx.options
    buckets = f"{o.bucket_bytes / 2 ** 20:g}"
    if o.first_bucket_bytes != o.bucket_bytes:
        buckets += f", first {o.first_bucket_bytes / 2 ** 20:g}"
    head = (f"step program (step_graph={o.step_graph}, overlap={o.overlap}, "
            f"bucket_mb={buckets}):")
    if not o.step_graph:
        return [head, "  off: backward is autograd's walk over the forward program",
                *_eager_buckets(sm), *_segment_lines(sm._recompute_programs), ""]
    built = list(sm._joint.values())
    if sm._joint_failed is not None:
        return [head, f"  could not be built ({sm._joint_failed}); autograd's backward runs",
                *_eager_buckets(sm), ""]
    if sm._recompute is not None:
        return [head, "  not used: block or selective recompute runs autograd's backward over "
                "the forward program", *_eager_buckets(sm), *_segment_lines(sm._recompute_programs), ""]
    if not built:
        return [head, "  built on the first call that needs gradients (it needs the process "
                "groups); call explain again after a training step", ""]
    jp = built[-1]
    lines = [head]
    for part in ("forward", "backward"):
        gm = getattr(jp, part)
        overlap = {i["node"]: i for i in gm.meta.get(SCHEDULE, [])}
        nodes = collective_nodes(gm.graph)
        lines.append(f"  {part}: {len(nodes)} collectives, {len(gm.graph.nodes)} nodes")
        for n in nodes:
            c = n.meta["shardc_comm"]
            val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
            size = val.numel() * val.element_size() if val is not None else 0
            text = f"    {n.name}: {c['collective']}@{c['axis']} {c['phase']} input {fmt_bytes(size)}"
            b = n.meta.get(BUCKET)
            if b:
                text += f"  bucket of {b['members']} gradients"
                into = _written_by_gemm(n.args[0])
                if into:
                    text += f" ({into} written there by the GEMM that makes them)"
            cz = n.meta.get(COALESCED)
            if cz:
                text += f"  {cz['members']} tensors of {block_of(c.get('module', '')) or 'the root'}"
            info = overlap.get(n.name)
            if info is not None:
                if info.get("deferred"):
                    text += "  overlaps backward: waited when the output is first read"
                else:
                    text += f"  overlaps {info['overlapped']} ops"
                if info["gemms"]:
                    text += f" incl. {len(info['gemms'])} GEMM(s)"
            lines.append(text)
        lines += _gemm_lines(gm, o.gemm_modes)
    if o.backend == "inductor":
        lines.append("  backend inductor:")
        lines += [f"    {r.describe()}" for r in jp.runners() if hasattr(r, "describe")]
        remat = jp.forward.meta.get(REMAT)
        if remat is not None:
            lines.append(f"    {remat.describe()}")
        if o.recompute_in_step and o.activation_checkpoint == "blocks":
            lines.append("    block recompute is applied here: each block's ops are recomputed in "
                         "backward from its inputs, its weights' and activations' all-gathers are "
                         "issued again there, its other collectives' outputs and its random draws "
                         "stay saved; a call that runs the forward program (under no_sync) "
                         "recomputes under autograd's checkpoint instead")
        elif o.recompute_in_step:
            lines.append(f"    selective recompute (save {', '.join(o.activation_checkpoint.save)}) "
                         "is applied here: each block's other ops are recomputed in backward, its "
                         "activations' all-gathers are issued again there, its other collectives' "
                         "outputs and its random draws stay saved; a call that runs the forward "
                         "program (under no_sync) recomputes under autograd's checkpoint instead")
    lines.append("")
    return lines


def _segment_lines(programs: list[Any]) -> list[str]:
    """Under backend="inductor" with block recompute: how the segments run (compiled
    between their collectives, shardc.program.backend.compile_segments)."""
    if not programs:
        return []
    pieces = sum(p.pieces for p in programs)
    eager = sum(p.eager_nodes for p in programs)
    lines = [f"  backend inductor: the recompute's {len(programs)} segments run compiled between "
             f"their collectives ({pieces} compiled pieces, {eager} nodes eager: collectives, "
             "random draws, in-place writes)"]
    lines += [f"    runs eagerly: segment {i} {f}" for i, p in enumerate(programs) for f in p.fallbacks]
    return lines


def _gemm_lines(gm: Any, modes: str) -> list[str]:
    """How many GEMMs of a part run in which form, and which the pass changed."""


    nodes = gemm_nodes(gm.graph)
    if modes == "default" or not nodes:
        return []
    moved = Counter((m["traced"], m["mode"]) for n in nodes if (m := n.meta.get(GEMM)))
    kept = sum(c for (t, r), c in moved.items() if t == r)
    changed = ", ".join(f"{c} {t}->{r}" for (t, r), c in sorted(moved.items()) if t != r)
    return [f"    GEMM forms (gemm_modes={modes}): {len(nodes)} GEMMs, {kept} as traced"
            + (f", {changed}" if changed else "")]
