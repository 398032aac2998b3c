"""Embeddings: vocabulary-parallel over x, feature-parallel over y."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.fx as fx

from shardc.core.ir import Val
from shardc.core.placement import Layout
from shardc.passes.rules.common import (
    aten,
    local_args,
    no_partial,
    register_rule,
    replicate_dims,
)
from shardc.runtime import ops as R

if TYPE_CHECKING:  # the lowering calls the rules; they only name its type
    from shardc.passes.lower import Lowering


# ------------------------------------------------------------------- embeddings
@register_rule(aten.embedding.default)
def embedding_rule(L: Lowering, node: fx.Node) -> Any:
    w, ids = L.env[node.args[0]], L.env[node.args[1]]
    val = node.meta["val"]
    mesh = L.mesh
    V, D = w.shape
    if w.layout is None:
        # Vocabulary over x and features over y: the embedding is the transposed GEMM
        # (one-hot @ table), so the hidden state comes out cut over y like Algorithm 1's
        # input, and a tied LM head (the normal GEMM) wants this very layout.
        wl = Layout(2)
        if mesh.size("x") > 1 and V % mesh.size("x") == 0:
            wl = wl.with_shard("x", 0)
        if mesh.size("y") > 1 and D % mesh.size("y") == 0:
            wl = wl.with_shard("y", 1)
    else:
        wl = no_partial(w.layout.clean(mesh))
        if len(wl.dims[0]) > 1:
            wl = replicate_dims(wl, [0])
    vocab_axes = wl.dims[0]
    il = ids.layout.clean(mesh) if ids.layout is not None else Layout.replicate(ids.ndim)
    for a in wl.sharded_axes():
        il = il.with_replicated(a)
    il = no_partial(il)
    out = Layout(val.dim(), il.dims + (wl.dims[1],), (), il.interleave + (wl.interleave[1],))
    wn = L.to_layout(w, wl)
    idn = L.to_layout(ids, il)
    if vocab_axes:
        axis = vocab_axes[0]
        out = out.with_partial(axis, "sum")
        padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
        n = L.emit(R.vocab_parallel_embedding, (wn, idn, L.rt, axis, padding_idx), layout=out, val=val)
    else:
        args, kwargs = local_args(L, node, {node.args[0]: wn, node.args[1]: idn})
        n = L.emit(aten.embedding.default, args, kwargs, layout=out, val=val)
    return Val(n, out.clean(mesh), val)
