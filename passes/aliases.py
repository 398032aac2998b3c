"""Which tensors an ATen op writes in place, and which input its result is a view of,
from the op's schema (``Tensor(a!)`` is written, ``Tensor(a)`` aliased). Not a pass:
what the passes that must respect in-place writes read (``schedule.py`` keeps a write
among the uses of its storage; ``shardc.compiler`` refuses a write into a user input)."""
from __future__ import annotations

import torch
import torch.fx as fx


def written(n: fx.Node) -> list[fx.Node]:
    """The nodes whose storage ``n`` writes in place (empty for anything but an ATen op
    with a mutable argument)."""
    op = n.target
    if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return []
    out = []
    for i, a in enumerate(op._schema.arguments):
        v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
        if a.alias_info is not None and a.alias_info.is_write and isinstance(v, fx.Node):
            out.append(v)
    return out


def view_of(n: fx.Node) -> fx.Node | None:
    """The input whose storage ``n``'s result shares (a view, or an in-place op's
    ``self``), else None."""
    op = n.target
    if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return None
    rets = op._schema.returns
    if rets and rets[0].alias_info is not None and n.args and isinstance(n.args[0], fx.Node):
        return n.args[0]
    return None
