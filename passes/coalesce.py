"""Gather a block's weights, and reduce-scatter its weight gradients, in one collective.

Reads:  a part of the step program (``joint.py``): its weight all-gathers (input
        computed from placeholders alone) and its backward reduce-scatters of weight
        gradients, with ``meta[COMM]["module"]`` (the module that issued each);
        ``ctx.options.bucket_mb`` (0 turns packing off)
Writes: per (block, axis, dtype, phase) one all-gather of the members' shards laid end
        to end, and one reduce-scatter of the members' gradients laid side by side so that
        rank r's chunk holds its block of every member; each member's result read back as
        a copy of its piece; ``meta[COALESCED]`` on the new collective (members, bytes)
Keeps:  the bytes moved (a ring's volume is linear in the size: measured == reported);
        what every rank receives

Why: on an FSDP-like mesh (z > 1) every weight is gathered in forward (and again in
backward with ``reshard_after_forward``) and every weight gradient reduce-scattered: a
block of a transformer has 8 to 12 of them, each paying a collective's fixed cost. FSDP2
groups a block's parameters into one all-gather and one reduce-scatter for that reason.
A block is the module path up to its first numeric part (``blocks.3``,
``model.layers.11``); modules outside a repeated block (embeddings, the head) form a
group each. (The forward program, which runs under autograd's backward, groups its
gathers the same way at run time: ``collectives.GatherGroup``.)

Where: a block's all-gather goes out where its first member did (the prefetch pass's
place) and is waited where the first member was, so the whole block is there at its
first use; a block's reduce-scatter goes out when its last gradient exists, and is
waited where the first member was.

Numerics: an all-gather copies, so the weights are bitwise the same. A reduce-scatter
sums each element over the ranks in an order that may depend on its offset in the
buffer, like a bucket's all-reduce (see ``bucket.py``): bitwise the same on two ranks,
one more summation order on more.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from shardc.core.context import COMM, CompileContext
from shardc.passes.reshard import ACTIVATION, REGATHER
from shardc.passes.step_nodes import RUN_FUNCTIONS, collective_nodes
from shardc.runtime import functional as F

aten = torch.ops.aten
COALESCED = "shardc_coalesced"  # node.meta of a packed collective: {"members", "bytes"}


def block_of(module: str) -> str:
    parts = module.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return module


def _from_placeholders(n: fx.Node) -> bool:
    stack, seen = [n.args[0]], set()
    while stack:
        a = stack.pop()
        if not isinstance(a, fx.Node) or a in seen or a.op == "placeholder":
            continue
        seen.add(a)
        if a.op != "call_function" or a.target is F.WAIT or a.target in RUN_FUNCTIONS:
            return False
        stack.extend(a.all_input_nodes)
    return True


def _wait_of(n: fx.Node) -> fx.Node | None:
    ws = [u for u in n.users if u.target is F.WAIT]
    return ws[0] if len(ws) == 1 and len(n.users) == 1 else None


def coalesce_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    if ctx.options.bucket_bytes <= 0:
        return gm
    g = gm.graph
    groups: dict[tuple, list[fx.Node]] = {}
    for n in collective_nodes(g):
        c = n.meta[COMM]
        if _wait_of(n) is None:
            continue
        if n.target is F.run_all_gather and _from_placeholders(n) and not n.meta.get(ACTIVATION):
            # (an activation gathered again in backward reads a saved value, which this
            # part sees as a placeholder; packing a block's would hold them all at once)
            kind = "all_gather"
        elif n.target is F.run_reduce_scatter and c["phase"] == "backward" and n.args[1] == "sum":
            kind = "reduce_scatter"
        else:
            continue
        key = (kind, block_of(c.get("module", "")), c["axis"], c["phase"],
               _val(n.args[0]).dtype, n.args[-4])  # -4: the group's name
        groups.setdefault(key, []).append(n)
    made = 0
    for key, members in groups.items():
        if len(members) < 2:
            continue
        if key[0] == "all_gather":
            _gather_together(g, members)
        else:
            if not _scatter_together(g, members):
                continue
        made += 1
    if made:
        g.eliminate_dead_code()
        g.lint()
        gm.recompile()
    return gm


def _as_list(v: Any) -> list:
    return [] if v is None else list(v) if isinstance(v, list) else [v]


def _val(a: Any) -> torch.Tensor:
    """The fake value of a node argument (the passes' nodes all carry one)."""
    assert isinstance(a, fx.Node), a
    return a.meta["val"]


def _order(g: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(g.nodes)}


def _ancestors(n: fx.Node) -> list[fx.Node]:
    """The non-placeholder nodes ``n``'s input is computed from, in graph order."""
    out: set[fx.Node] = set()
    stack = [a for a in n.all_input_nodes]
    while stack:
        a = stack.pop()
        if a.op == "placeholder" or a in out:
            continue
        out.add(a)
        stack.extend(a.all_input_nodes)
    pos = _order(n.graph)
    return sorted(out, key=pos.__getitem__)


def _gather_together(g: fx.Graph, members: list[fx.Node]) -> None:
    pos = _order(g)
    members.sort(key=pos.__getitem__)
    first = members[0]
    waits: list[Any] = [_wait_of(m) for m in members]
    first_wait = min(waits, key=lambda w: pos[w])
    # the shards are views of parameters: they can be made before the first issue
    for m in members[1:]:
        for a in _ancestors(m):
            if pos[a] > pos[first]:
                first.prepend(a)
    args: Any = first.args
    gsize, gname, rt, axis, ph = args[1:]
    with g.inserting_before(first):
        flats = []
        for m in members:
            f = g.call_function(aten.view.default, (m.args[0], [-1]))
            f.meta["val"] = _val(m.args[0]).reshape(-1)
            flats.append(f)
        cat = g.call_function(aten.cat.default, (flats,))
        n = sum(f.meta["val"].numel() for f in flats)
        cat.meta["val"] = flats[0].meta["val"].new_empty(n)
        issue = g.call_function(F.run_all_gather, (cat, gsize, gname, rt, axis, ph))
        issue.meta["val"] = cat.meta["val"].new_empty(gsize * n)
        issue.meta[COMM] = dict(first.meta[COMM])
        issue.meta[COALESCED] = {"members": len(members),
                                 "bytes": n * cat.meta["val"].element_size()}
        # the forward gathers that members repeat in backward (reshard_after_forward):
        # the comm report reads them from the program
        again = [a for m in members for a in _as_list(m.meta.get(REGATHER))]
        if again:
            issue.meta[REGATHER] = again
    with g.inserting_before(first_wait):
        done = g.call_function(F.WAIT, (issue,))
        done.meta["val"] = issue.meta["val"]
        rows = g.call_function(aten.view.default, (done, [gsize, n]))
        rows.meta["val"] = done.meta["val"].view(gsize, n)
        off = 0
        for w, f in zip(waits, flats):
            k = f.meta["val"].numel()
            piece = g.call_function(aten.slice.Tensor, (rows, 1, off, off + k))
            piece.meta["val"] = rows.meta["val"][:, off:off + k]
            # the member's own result: (G * d0, ...), each rank's shard in turn, copied
            # out contiguous as the member's own gather returned it: what follows was
            # traced on that, and its views (a gather along a later dim) need those
            # strides. A reshape would return a strided view where d0 is 1 (ConvNeXt-V2's
            # (1, 1, 1, C) scales gathered along C failed there).
            shape = list(w.meta["val"].shape)
            dense = g.call_function(aten.clone.default, (piece,),
                                    {"memory_format": torch.contiguous_format})
            dense.meta["val"] = piece.meta["val"].clone(memory_format=torch.contiguous_format)
            out = g.call_function(aten.view.default, (dense, shape))
            out.meta["val"] = dense.meta["val"].view(shape)
            w.replace_all_uses_with(out)
            off += k
    for m, w in zip(members, waits):
        g.erase_node(w)
        g.erase_node(m)


def _scatter_together(g: fx.Graph, members: list[fx.Node]) -> bool:
    pos = _order(g)
    members.sort(key=pos.__getitem__)
    waits: list[Any] = [_wait_of(m) for m in members]
    last = members[-1]
    # a gradient's reshape right after its wait can follow it; what reads it cannot
    # come before the last member's gradient exists
    views = [v for w in waits for v in _view_chain(w)]
    readers = [u for n in (*waits, *views) for u in n.users if u not in views]
    first_use = min(readers, key=pos.__getitem__)
    if pos[first_use] < pos[last]:
        return False
    args: Any = last.args
    op, gsize, gname, rt, axis, ph = args[1:]
    with g.inserting_before(last):
        cols = []
        for m in members:
            x = m.args[0]
            v = _val(x)
            c = g.call_function(aten.view.default, (x, [gsize, v.numel() // gsize]))
            c.meta["val"] = v.reshape(gsize, v.numel() // gsize)
            cols.append(c)
        side = g.call_function(aten.cat.default, (cols, 1))
        total = sum(c.meta["val"].shape[1] for c in cols)
        side.meta["val"] = cols[0].meta["val"].new_empty(gsize, total)
        flat = g.call_function(aten.view.default, (side, [-1]))
        flat.meta["val"] = side.meta["val"].reshape(-1)
        issue = g.call_function(F.run_reduce_scatter, (flat, op, gsize, gname, rt, axis, ph))
        issue.meta["val"] = flat.meta["val"].new_empty(total)
        issue.meta[COMM] = dict(last.meta[COMM])
        issue.meta[COALESCED] = {"members": len(members),
                                 "bytes": gsize * total * flat.meta["val"].element_size()}
    with g.inserting_before(first_use):
        done = g.call_function(F.WAIT, (issue,))
        done.meta["val"] = issue.meta["val"]
        off = 0
        for w, c in zip(waits, cols):
            k = c.meta["val"].shape[1]
            piece = g.call_function(aten.slice.Tensor, (done, 0, off, off + k))
            piece.meta["val"] = done.meta["val"][off:off + k]
            shape = list(w.meta["val"].shape)
            out = g.call_function(aten.view.default, (piece, shape))
            out.meta["val"] = piece.meta["val"].view(shape)
            w.replace_all_uses_with(out)
            off += k
    for view in sorted(views, key=pos.__getitem__):
        first_use.prepend(view)
    for m, w in zip(members, waits):
        g.erase_node(w)
        g.erase_node(m)
    return True


_VIEWS = ("view", "reshape", "_unsafe_view", "t", "permute", "transpose", "squeeze",
          "unsqueeze", "alias", "expand")


def _view_chain(n: fx.Node) -> list[fx.Node]:
    """The view-like ops applied to ``n`` (and to them) that read nothing else."""
    out, stack = [], list(n.users)
    while stack:
        u = stack.pop()
        name = getattr(u.target, "__name__", "").split(".")[0]
        if u.op == "call_function" and name in _VIEWS and len(u.all_input_nodes) == 1:
            out.append(u)
            stack.extend(u.users)
    return out
