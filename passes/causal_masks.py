"""An attention mask the model builds from nothing but positions, and which is exactly the
causal mask, becomes ``is_causal=True``. Not a pass: ``trace.py`` runs it on the export,
so that every reader of the trace (the pipeline, the planner, the cost model) sees it.

Why: transformers builds its masks in Python and skips them (``is_causal``) only when it
is not being exported (``masking_utils._ignore_causal_mask_sdpa``), and under any trace it
also keeps the packed-sequence test on the positions (``find_packed_sequence_indices``).
So the export of a Llama, Qwen or Mistral computes a [B, 1, T, T] boolean mask at every
step from ``arange`` alone: T^2 bytes per op on every rank (a GiB each at 32k positions),
and an attention with an explicit mask takes no flash kernel, and no fused product on a
context ring (``runtime/ring.py`` runs masked blocks in the math form). The mask depends
on no input, parameter or buffer, so its value is known at compile time: it is computed
once here, and where it equals the causal mask (every row its lower triangle, for every
batch and head it is broadcast over) the attention takes ``is_causal=True`` and the
mask's subgraph is dropped. A mask that differs anywhere (padding from an
``attention_mask`` input, a sliding window, a document mask from real position ids) is
left as it is, and so is an attention with dropout (another kernel would draw another
dropout mask than the model's). Exact: the same attention, bit for bit in what it masks.

A mask larger than ``MOST_ELEMENTS`` is not computed (compiling would hold several such
tensors at once) and stays in the program as the model wrote it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

_METADATA_CHECK = getattr(aten, "_assert_tensor_metadata", None)
_METADATA_CHECK = getattr(_METADATA_CHECK, "default", None)

# 2^30 elements: a 32,768-position mask, a GiB of booleans (the compile holds a few)
MOST_ELEMENTS = 1 << 30


def _ancestors(node: fx.Node) -> list[fx.Node] | None:
    """``node`` and what it is computed from, in graph order, when that is ATen ops alone,
    none of them random or writing in place; None when anything reads an input, a
    parameter, a buffer or a constant of the export (a placeholder)."""
    seen: dict[fx.Node, None] = {}
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            return None
        if n.target._schema.is_mutable or torch.Tag.nondeterministic_seeded in n.target.tags:
            return None
        seen[n] = None
        todo.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _value(nodes: list[fx.Node]) -> torch.Tensor:
    """The last of ``nodes`` computed by running them (they read nothing else)."""
    env: dict[fx.Node, Any] = {}
    with torch.no_grad():
        for n in nodes:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            op: Any = n.target
            env[n] = op(*args, **kwargs)
    out = env[nodes[-1]]
    assert isinstance(out, torch.Tensor)
    return out


def _is_causal(mask: torch.Tensor, rows: int, cols: int) -> bool:
    """Does ``mask`` (broadcast to [..., rows, cols]) keep exactly each row's lower
    triangle: a boolean True there and False elsewhere, or a float 0 there and -inf
    elsewhere?"""
    if rows != cols or mask.dim() < 2 or tuple(mask.shape[-2:]) != (rows, cols):
        return False
    keep = torch.ones(rows, cols, dtype=torch.bool, device=mask.device).tril_()
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, keep.expand_as(mask)))
    if not mask.is_floating_point():
        return False
    return bool(((mask == 0) == keep).all()) and bool((mask[..., ~keep] == float("-inf")).all())


def fold_causal_masks(gm: fx.GraphModule) -> int:
    """Rewrite every ``scaled_dot_product_attention`` whose mask is computed from no
    input and equals the causal mask into ``is_causal=True`` without it; returns how many."""
    folded = 0
    verdicts: dict[tuple, bool] = {}  # a mask most often serves every layer
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.scaled_dot_product_attention.default:
            continue
        args = list(n.args) + [None] * (6 - len(n.args))
        mask = n.kwargs.get("attn_mask", args[3])
        causal = n.kwargs.get("is_causal", args[5])
        dropout = n.kwargs.get("dropout_p", args[4] if args[4] is not None else 0.0)
        # with dropout, another kernel would draw another mask than the model's (CUDA's
        # flash kernel draws its own way): left as the model wrote it
        if not isinstance(mask, fx.Node) or causal or dropout != 0.0:
            continue
        q, k = (a.meta.get("val") for a in n.args[:2])
        if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
            continue
        key = (mask, q.shape[-2], k.shape[-2])
        if key not in verdicts:
            val = mask.meta.get("val")
            nodes = _ancestors(mask)
            verdicts[key] = (isinstance(val, torch.Tensor) and val.numel() <= MOST_ELEMENTS
                             and nodes is not None and _is_causal(_value(nodes), *key[1:]))
        if not verdicts[key]:
            continue
        kwargs = {name: v for name, v in n.kwargs.items() if name not in ("attn_mask", "is_causal", "dropout_p")}
        n.args = (n.args[0], n.args[1], n.args[2], None, 0.0, True)
        n.kwargs = kwargs
        folded += 1
    if folded:
        for key in [k for k, causal in verdicts.items() if causal]:
            # the mask's subgraph, where nothing else reads it (export's checks of a
            # dropped value's dtype and device go with it)
            for m in reversed(_ancestors(key[0]) or []):
                for u in list(m.users):
                    if u.target is _METADATA_CHECK and not u.users:
                        gm.graph.erase_node(u)
                if not m.users:
                    gm.graph.erase_node(m)
        gm.recompile()
    return folded
