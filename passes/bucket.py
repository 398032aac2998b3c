"""Pack the post-backward gradient reductions into buckets.

Reads:  a part of the step program (``joint.py``); its step-phase all-reduces
        (``meta[COMM]["phase"] == "step"``: a parameter's gradient summed over data, or
        over any axis whose ranks saw different tokens) and ``ctx.options``' bucket caps
Writes: one all-reduce per bucket: the gradients packed into one buffer (under the
        eager backend each copied in by ``F.pack_into`` right after it is made, or right
        after the buffer is allocated for those made before it: ``_allocation_index``;
        under inductor one ``cat``), reduced once, and each gradient read back as a view
        of the result; ``meta[BUCKET]`` on the new collective (its parameters' count and
        bytes)
Keeps:  the bytes moved (the ring's volume is linear in the size, so a bucket moves
        exactly the sum of its members: measured == reported stays exact); which values
        are summed over which axis

Why: one all-reduce per parameter pays each collective's fixed cost (a ring's 2(G-1)
latency steps, a gloo or NCCL launch) once per parameter; DDP packs gradients into
25 MiB buckets for that reason. Buckets fill in the order backward produces the
gradients (the graph's order), one axis and dtype per bucket, and close once they hold
``bucket_mb`` or more, as DDP's reducer closes its own (the gradient that takes a bucket
past the size goes in it, so a bucket is at least that size but the last). With
``bucket_mb`` left unset the first bucket closes at 1 MiB already, as DDP's default does,
so that some reduction overlaps backward when the gradients are many; a size the user gives
closes the first bucket too, as DDP's ``bucket_cap_mb`` does (``Options.first_bucket_bytes``).
(Closing before the gradient that would pass the size, as shardc did, made two buckets of a
1.01 MiB model's gradients where DDP makes one, and a collective a step more.) The scheduling pass then
issues each bucket as soon as its last gradient exists, so the reduction of the last
layers overlaps the backward of the first.

Numerics: the sum of each element over the ranks is the same, but a reduction algorithm
may add the ranks' values in an order that depends on the element's offset in the
buffer (a ring starts each chunk at another rank), so with more than two ranks a packed
gradient can differ from the unpacked one in the last bits: at most the rounding of a
sum of G values, (G-1) units of the last place. Two values add the same way in either
order, so on two ranks the result is bitwise the same.
"""
from __future__ import annotations

from typing import cast

import torch
import torch.fx as fx

from shardc.core.context import COMM, CompileContext
from shardc.runtime import functional as F

aten = torch.ops.aten
BUCKET = "shardc_bucket"  # node.meta of a bucket's collective: {"members", "bytes"}
# node.meta of a pack_into that copies a gradient made before its bucket's buffer
# (``_allocation_index``): it sits after the buffer, far from the gradient's GEMM
LATE_PACK = "shardc_late_pack"


def _step_reductions(gm: fx.GraphModule) -> list[fx.Node]:
    """The step-phase sums whose result only leaves the graph (a gradient returned):
    reading it back from a bucket later than its own wait then changes nothing."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is F.run_all_reduce and \
                n.meta.get(COMM, {}).get("phase") == "step" and n.args[1] == "sum" and \
                len(n.users) == 1:
            (w,) = n.users
            if w.target is F.WAIT and all(u.op == "output" for u in w.users):
                out.append(n)
    return out


def _nbytes(n: fx.Node) -> int:
    v = n.meta["val"]
    return v.numel() * v.element_size()


def bucket_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    limit, first = ctx.options.bucket_bytes, ctx.options.first_bucket_bytes
    if limit <= 0:
        return gm
    groups: dict[tuple, list[list[fx.Node]]] = {}
    for n in _step_reductions(gm):
        key = (n.meta[COMM]["axis"], n.meta["val"].dtype, n.args[2])
        buckets = groups.setdefault(key, [[]])
        cur = buckets[-1]
        cap = first if len(buckets) == 1 else limit
        if cur and sum(_nbytes(m) for m in cur) >= cap:  # full: DDP's reducer's rule
            buckets.append(cur := [])
        cur.append(n)
    made = 0
    for buckets in groups.values():
        for b in buckets:
            if len(b) > 1:
                _pack(gm, b, ctx.options.backend == "eager")
                made += 1
    if made:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return gm


def _pack(gm: fx.GraphModule, members: list[fx.Node], eager: bool) -> None:
    g = gm.graph
    waits = [next(iter(n.users)) for n in members]
    # the bucket goes out where its last gradient is ready
    last = max(members, key=lambda n: _index(g, n))
    rt, axis, ph = last.args[-3:]
    gname = last.args[2]
    total = sum(n.meta["val"].numel() for n in members)
    val = members[0].meta["val"].new_empty(total)
    made = {n: n.args[0] for n in members}  # each member's gradient
    if eager and all(isinstance(x, fx.Node) and x.op == "call_function" for x in made.values()):
        # each gradient copied into the bucket right after it is made (F.pack_into),
        # not one cat of them all at the end, which reads every gradient back from
        # memory: the cat took 3.9 ms of a 2-rank TinyGPT step where DDP's copies took
        # 1.9. (Not under inductor, which compiles these pieces and knows no pack_into.)
        pos = {n: i for i, n in enumerate(g.nodes)}
        offsets, off = {}, 0
        for n in members:  # the bucket's layout: the members' order, as the cat's
            offsets[n] = off
            off += n.meta["val"].numel()
        order = sorted(members, key=lambda m: pos[made[m]])
        at = _allocation_index(order)
        prev = cast(fx.Node, made[order[at]])  # the gradient the last node went in after
        with g.inserting_after(prev):
            buf = g.call_function(aten.empty.memory_format, ([total],), {
                "dtype": val.dtype, "device": val.device})
            buf.meta["val"] = val
        for i, n in enumerate(order):
            x = cast(fx.Node, made[n])
            late = i < at  # made before the buffer: copied in right after it
            # right after its gradient, which is after the chain so far (that sits right
            # after an earlier gradient), unless the chain already follows this gradient
            with g.inserting_after(buf if x is prev or late else x):
                buf = g.call_function(F.pack_into, (buf, x, offsets[n]))
                buf.meta["val"] = val
                if late:
                    buf.meta[LATE_PACK] = True
            if not late:
                prev = x
        packed = buf
    else:
        with g.inserting_before(last):
            flats = []
            for n in members:
                f = g.call_function(aten.view.default, (n.args[0], [-1]))
                f.meta["val"] = n.meta["val"].reshape(-1)
                flats.append(f)
            packed = g.call_function(aten.cat.default, (flats,))
            packed.meta["val"] = val
    with g.inserting_before(last):
        # (inplace_pass then reduces the packed buffer itself: nothing else reads it)
        issue = g.call_function(F.run_all_reduce, (packed, "sum", gname, rt, axis, ph))
        issue.meta["val"] = val
        issue.meta[COMM] = dict(last.meta[COMM])
        issue.meta[BUCKET] = {"members": len(members), "bytes": sum(_nbytes(n) for n in members)}
        done = g.call_function(F.WAIT, (issue,))
        done.meta["val"] = val
        off = 0
        for n, w in zip(members, waits):
            numel = n.meta["val"].numel()
            piece = g.call_function(aten.slice.Tensor, (done, 0, off, off + numel))
            piece.meta["val"] = val[off:off + numel]
            view = g.call_function(aten.view.default, (piece, list(n.meta["val"].shape)))
            view.meta["val"] = n.meta["val"]
            w.replace_all_uses_with(view)
            off += numel
    for w, n in zip(waits, members):
        g.erase_node(w)
        g.erase_node(n)


def _allocation_index(order: list[fx.Node]) -> int:
    """Which member's gradient (by production order) the bucket's buffer is allocated
    after: the last one larger than every gradient before it together, 0 in the common
    case. A buffer allocated at the first gradient holds the bytes of every later member
    from then on, so a bucket whose largest gradient comes last (a replicated position
    embedding's, made at the very end of backward and larger than a few layers' worth)
    would hold that gradient's bytes through the whole backward, at its peak. Allocated
    at that gradient, it holds the earlier ones' bytes only, which exist anyway, and
    those (smaller than it, together) are copied in late."""
    sizes = [_nbytes(n) for n in order]
    return max((i for i in range(len(order)) if sizes[i] > sum(sizes[:i])), default=0)


def _index(g: fx.Graph, n: fx.Node) -> int:
    for i, m in enumerate(g.nodes):
        if m is n:
            return i
    raise KeyError(n)

