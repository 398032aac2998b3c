"""Write a weight gradient made by a GEMM straight into its bucket.

Reads:  a part of the step program after ``bucket.py``: each ``F.pack_into`` (a
        gradient copied into its bucket) whose gradient is an ``aten.mm`` seen through
        views that only it reads (the dW GEMM, then autograd's transposes)
Writes: ``F.mm_into(buf, a, b, offset, shape)`` in the copy's place: the same product,
        its result written into the bucket's slice; the GEMM and its views are gone
Keeps:  every value: the slice holds the GEMM's result in the order the copy would have
        put it (the gradient is contiguous and starts where the GEMM's result starts, so
        its flat order is the result's); the bucket's layout, its bytes and its collective

Why: a data-parallel step moves every weight gradient through a bucket, and packing it
is a copy of the whole model's gradients each step: 3 ms of CPU a rank on the peers'
TinyGPT on ``x1y1z1d8`` (23 MiB), against ~40 ms of backward. DDP pays the same copy
(autograd gives it a fresh gradient); a compiler that sees the GEMM making the gradient
can give the GEMM the bucket as its output instead.

Numerics: a GEMM writing into a given output computes the same sums as one allocating
its own; BLAS libraries may pick kernels by the output's alignment, so only slices that
start on a 64-byte boundary of the bucket (whose allocation is aligned at least that
much) are written this way; the others keep the copy.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from shardc.core.context import CompileContext
from shardc.passes.bucket import LATE_PACK
from shardc.runtime import functional as F

aten = torch.ops.aten

# ops that only reinterpret their input's memory (never copy it)
_VIEWS = (aten.t.default, aten.transpose.int, aten.view.default, aten._unsafe_view.default,
          aten.permute.default)
_ALIGN = 64  # bytes


def _gemm_behind(x: fx.Node) -> fx.Node | None:
    """The ``aten.mm`` whose result ``x`` is, element for element in flat order, through
    views nothing else reads; None when there is none."""
    cur = x
    while cur.op == "call_function" and cur.target in _VIEWS and len(cur.users) == 1:
        src = cur.args[0]
        if not isinstance(src, fx.Node):
            return None
        cur = src
    if cur.op != "call_function" or cur.target is not aten.mm.default or len(cur.users) != 1:
        return None
    mv, xv = cur.meta.get("val"), x.meta.get("val")
    if not isinstance(mv, torch.Tensor) or not isinstance(xv, torch.Tensor):
        return None
    # both contiguous from the same first element: the same flat order
    same = (mv.is_contiguous() and xv.is_contiguous() and xv.storage_offset() == mv.storage_offset()
            and xv.numel() == mv.numel() and xv.dtype == mv.dtype and mv.dim() == 2)
    return cur if same else None


def into_bucket_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    g = gm.graph
    changed = False
    for pack in [n for n in g.nodes if n.op == "call_function" and n.target is F.pack_into]:
        buf, x, offset = pack.args
        # a late copy (bucket.py: the gradient was made before its bucket's buffer): the
        # GEMM moved to it would keep its operands alive until there
        if not isinstance(x, fx.Node) or not isinstance(buf, fx.Node) or pack.meta.get(LATE_PACK):
            continue
        mm = _gemm_behind(x)
        val = buf.meta.get("val")
        if mm is None or not isinstance(val, torch.Tensor) or val.dtype != mm.meta["val"].dtype \
                or (offset * val.element_size()) % _ALIGN:
            continue
        a, b = mm.args[0], mm.args[1]
        # in the copy's place: after the gradient and the bucket so far, as the copy was
        with g.inserting_before(pack):
            into = g.call_function(F.mm_into, (buf, a, b, offset, list(mm.meta["val"].shape)))
        into.meta.update(pack.meta)
        pack.replace_all_uses_with(into)
        g.erase_node(pack)
        # the GEMM and its views now have no reader
        cur: fx.Node | None = x
        while cur is not None and not cur.users:
            src = cur.args[0] if cur is not mm else None
            g.erase_node(cur)
            cur = src if isinstance(src, fx.Node) else None
        changed = True
    if changed:
        g.lint()
        gm.recompile()
    return gm
