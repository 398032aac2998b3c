"""How a model's loss adds up over micro-batches, read from its traced graph (a pipeline,
``pipe > 1``, runs a step's micro-batches one by one and must combine their losses into
the global batch's).

A loss that is a sum of terms, each a mean over the batch's rows (or each a sum over
them) of values computed row by row, adds up exactly: the global batch's mean is the mean
of equal micro-batches' means, its sum their sum. Any other loss does not. Examples are a
mixture of experts' load-balancing term (the product of two means over the rows), a
masked mean written as ``sum / count``, or a BatchNorm's batch statistics. Such a loss is
computed per micro-batch and averaged, as gradient accumulation does in any framework,
and ``compile`` says so.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

_aten = torch.ops.aten
# reductions that sum the rows (the rest of the reductions below take their mean)
_SUMS = {"sum", "nansum"}
_MEANS = {"mean", "nanmean"}
# reductions over the rows whose result no combination of micro-batches' gives
_OTHER_REDUCTIONS = {"amax", "amin", "max", "min", "var", "std", "var_mean", "std_mean", "logsumexp",
                     "norm", "linalg_vector_norm", "prod", "median", "cumsum", "cumprod", "logcumsumexp"}
_BATCH_STATS = {"batch_norm", "_native_batch_norm_legit_functional", "native_batch_norm",
                "_native_batch_norm_legit", "cudnn_batch_norm", "instance_norm"}
# ops linear in each floating input when the others do not depend on the batch
_LINEAR = {"add", "sub", "neg", "mul", "div", "alias", "clone", "view", "reshape", "_to_copy", "to",
           "contiguous", "squeeze", "unsqueeze", "expand", "detach", "stack", "cat", "select",
           "slice", "_unsafe_view", "t", "permute", "transpose", "flatten", "type_as"}


def _name(n: fx.Node) -> str:
    """The op's name without overload or in-place mark: ``add_.Tensor`` -> ``add``."""
    t = n.target
    return (t.__name__.split(".")[0] if hasattr(t, "__name__") else str(t)).rstrip("_") or str(t)


def _floating(n: Any) -> bool:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def _integral(n: fx.Node) -> bool:
    """An integer or boolean tensor: counts and indices (a mixture of experts' offsets),
    which say where rows go, not what the loss adds."""
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and not v.dtype.is_floating_point


def _arg(n: fx.Node, name: str, pos: int, default: Any) -> Any:
    if name in n.kwargs:
        return n.kwargs[name]
    return n.args[pos] if len(n.args) > pos else default


def _reduces_rows(n: fx.Node) -> str | None:
    """"sum", "mean" or "other" when ``n`` reduces over dim 0 of its first input (every
    dim when it names none), else None."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    name = _name(n)
    schema = getattr(n.target, "_schema", None)
    arg_names = [a.name for a in schema.arguments] if schema is not None else []
    if "reduction" in arg_names:  # a loss op: 0 none, 1 mean, 2 sum
        r = _arg(n, "reduction", arg_names.index("reduction"), 1)
        return None if r == 0 else "sum" if r == 2 else "mean"
    if name in _BATCH_STATS:
        training = _arg(n, "training", arg_names.index("training") if "training" in arg_names else 5, True)
        return "other" if training else None
    if name not in _SUMS | _MEANS | _OTHER_REDUCTIONS:
        return None
    x = n.args[0].meta.get("val")
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    dims = _arg(n, "dim", 1, None)
    if dims is None or dims == []:
        over_rows = True
    else:
        dims = [dims] if isinstance(dims, int) else list(dims)
        over_rows = any(d % x.dim() == 0 for d in dims if isinstance(d, int))
    if not over_rows:
        return None
    return "sum" if name in _SUMS else "mean" if name in _MEANS else "other"


def loss_terms(gm: fx.GraphModule) -> tuple[str, str | None]:
    """("sum" or "mean", None) when the loss is a sum of terms, each a sum (or each a
    mean) over the rows of values computed row by row; otherwise ("mean", why), ``why``
    naming the node where the loss stops adding up over micro-batches."""
    batched: set[fx.Node] = set()
    stats: dict[fx.Node, str] = {}  # a floating value computed from a reduction over rows
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            batched.add(n)
            continue
        ins = n.all_input_nodes
        if any(a in batched for a in ins):
            batched.add(n)
        seen = next((stats[a] for a in ins if a in stats), None)
        if seen is not None and not _integral(n):  # tuples too (a getitem reads them)
            stats[n] = seen
        elif n in batched and _floating(n) and _reduces_rows(n) is not None:
            stats[n] = f"{n.target} at {n.name} reduces over the batch's rows before the loss does"
    out = next(n for n in gm.graph.nodes if n.op == "output")
    root = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    kinds: set[str] = set()
    todo = [root] if isinstance(root, fx.Node) else []
    while todo:
        n = todo.pop()
        if n not in batched or not _floating(n):
            continue  # a constant term, or a factor that does not depend on the batch
        kind = _reduces_rows(n)
        if kind is not None:
            inner = next((stats[a] for a in n.all_input_nodes if a in stats), None)
            if kind == "other" or inner is not None:
                return "mean", inner or f"{n.target} at {n.name} takes a statistic of the rows other than a sum or mean"
            kinds.add(kind)
            continue
        floating = [a for a in n.all_input_nodes if a in batched and _floating(a)]
        if _name(n) not in _LINEAR or (_name(n) in ("mul", "div") and len(floating) > 1) or (
                _name(n) == "div" and len(n.args) > 1 and n.args[1] in floating):
            return "mean", stats.get(n) or f"{n.target} at {n.name} is not linear in the loss's terms"
        todo += floating
    if len(kinds) > 1:
        return "mean", "the loss adds a sum over the rows to a mean over them"
    return (kinds.pop() if kinds else "mean"), None
