"""Let a view of the step program meet the strides its input really has.

Reads:  a part of the step program (``joint.py``): its ``aten.view`` nodes
Writes: ``aten.reshape`` in their place
Keeps:  every value, and every alias a view made: ``reshape`` returns the same view
        wherever ``view`` could make one, and copies only where ``view`` would raise

Why: the step program is traced on fake tensors, whose strides come from each op's
shape function; a view in it assumes those strides. Where a CPU or CUDA kernel lays its
result out otherwise than its shape function says, the view fails at run time although
the values are right. Seen on Qwen3-Next: ``softplus_backward`` of a transposed gradient
and a contiguous input returns the gradient's layout on CPU and a contiguous one under
fake tensors; the ``cat`` after it keeps that layout, and the ``view`` of the cat, which
merges two dims, raised. autograd's own backward never traces, so it never met this.
Only where the view would have raised does anything change (a copy then, which nothing
writes through: the views that are written through, into gradient buckets, are of the
buckets' own contiguous memory).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from shardc.core.context import CompileContext

aten = torch.ops.aten


def strides_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.view.default:
            n.target = aten.reshape.default
            changed = True
    if changed:
        gm.recompile()
    return gm
