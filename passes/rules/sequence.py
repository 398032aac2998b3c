"""Sequence parallelism (Megatron-LM's, Korthikanti et al. 2022) as a placement choice.

A GEMM whose contraction dim is cut over a tensor-parallel axis (x or y) leaves a partial
sum over that axis. Where everything downstream of it, up to the next GEMMs, works token
by token (bias and residual adds, dropout, activations, layer and RMS norms, views that
merge or split token dims), the sum is reduce-scattered onto a token dim instead of
all-reduced: those ops then run on, and keep for backward, 1/G of the tokens, and the
next GEMM's input rule gathers the tokens back (``gemm_rule`` replicates its input's
tokens over its own axes). A reduce-scatter and an all-gather of one tensor move the
bytes of the all-reduce they replace, in forward and, mirrored, in backward; what is
added is the sum over the axis of the gradients of the weights those ops apply (a norm's
scale and shift, the GEMM's bias), now used on a part of the tokens: O(hidden) a layer
against the O(tokens x hidden) of the activations.

``token_wise(graph, is_param, pointwise)`` answers, for every node of the global graph
at once, whether its value may arrive cut along a token dim: every path from it ends at
the input of a GEMM with a stored weight, through token-wise ops alone, and a norm lies
on one of them. A value that reaches anything else (an attention, a loss, the program's
output, a reduction across tokens) keeps the all-reduce, whose replicated result that
consumer expects. The output could gather the tokens back as a GEMM's input does, but
not for free: its gradient is whole on every rank, so backward pays nothing for the
all-reduce and an all-gather for the reduce-scatter. (So a pipeline stage, whose output
is its residual stream, keeps the all-reduce, its last stage excepted.) A stretch without
a norm (GEMM, activation, GEMM: Algorithm 1's chain) keeps it too: the next GEMM keeps
its gathered input for backward anyway, so cutting the activation would save little and
add a collective's latency.

Where the sum is cut: a GEMM with a bias cuts it before the bias add (``cut_tokens``,
from ``gemm_rule``); any other partial sum (a vocabulary-parallel embedding's, a bias-free
GEMM's) is carried by the ops that keep it partial (views, adds of two partial sums) and
cut just before the first op that would all-reduce it (``cut_inputs``, from the lowering
before each op), or before a dropout, which then draws 1/G of the mask.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from shardc.core.ir import Val, source_of
from shardc.passes.rules.common import RULES, aten, existing_ops
from shardc.passes.rules.pointwise import partial_ok
from shardc.passes.rules.view import whole_slice

if TYPE_CHECKING:  # the lowering calls the rules; they only name its type
    from shardc.passes.lower import Lowering

# the axes a GEMM's contraction dim is cut over, whose partial sums this applies to
TENSOR_AXES = ("x", "y")

# the ops of a GEMM rule with a stored weight: (target, index of the activation, index of
# the weight)
_GEMMS = {aten.linear.default: (0, 1), aten.mm.default: (0, 1), aten.matmul.default: (0, 1),
          aten.addmm.default: (1, 2)}
# ops that carry a weight to its GEMM unchanged in values (a transpose for mm, a cast at
# use under a precision policy)
_WEIGHT_CHAIN = {aten.t.default, aten.transpose.int, aten.permute.default, aten._to_copy.default,
                 aten.to.dtype, aten.alias.default, aten.detach.default}
_DROPOUT = {aten.dropout.default, aten.native_dropout.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_LAST_DIM_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList}
# users that read a value's metadata, not its elements (export's dtype/shape checks)
_READ_NOTHING = set(existing_ops("_assert_tensor_metadata.default"))


def _shape(n: object) -> list[int] | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return list(v.shape) if isinstance(v, torch.Tensor) else None


def _stored_weight(n: object, is_param: Callable[[fx.Node], bool]) -> bool:
    while isinstance(n, fx.Node):
        if n.op == "placeholder":
            return is_param(n)
        if n.op != "call_function" or n.target not in _WEIGHT_CHAIN:
            return False
        n = n.args[0]
    return False


def _gemm_input(user: fx.Node, n: fx.Node, is_param: Callable[[fx.Node], bool]) -> bool:
    """Is ``n`` the activation of ``user``, a GEMM with a stored weight?"""
    idx = _GEMMS.get(user.target)
    if idx is None or len(user.args) <= max(idx):
        return False
    x, w = user.args[idx[0]], user.args[idx[1]]
    shape = _shape(w)
    return x is n and w is not n and shape is not None and len(shape) == 2 and \
        _stored_weight(w, is_param)


def _keeps_tokens(user: fx.Node, n: fx.Node, pointwise: Callable[[fx.Node], bool]) -> bool:
    """Does ``user`` work on ``n`` token by token (a cut of n's token dims carries over to
    its output with no communication)?"""
    t = user.target
    if t is operator.getitem:
        return True
    if t in _DROPOUT:
        return user.args[0] is n
    if t is aten.layer_norm.default:
        # normalised over the features alone, so each token on its own
        shape = _shape(n)
        return user.args[0] is n and shape is not None and len(shape) >= 2 and len(user.args[1]) == 1
    if t in _LAST_DIM_REDUCTIONS:
        shape = _shape(n)
        dims = user.args[1] if len(user.args) > 1 else None
        if shape is None or not isinstance(dims, (list, tuple)) or not dims:
            return False
        return {d % len(shape) for d in dims} == {len(shape) - 1}
    if t is aten.slice.Tensor:
        return user.args[0] is n and whole_slice(user)  # ``h[:, -0:]``: all of it
    if t in _VIEWS:
        # merging or splitting the token dims; the features (last dim) untouched
        a, b = _shape(n), _shape(user)
        return a is not None and b is not None and len(a) >= 2 and len(b) >= 2 and a[-1] == b[-1]
    if pointwise(user):
        out, mine = _shape(user), _shape(n)
        # elementwise, and n not broadcast along a token dim it would be cut on (a norm's
        # statistics, one a token, broadcast along the features)
        return out is not None and mine is not None and len(out) == len(mine) and \
            out[:-1] == mine[:-1]
    return False


def _is_norm(n: fx.Node) -> bool:
    """A layer norm, or the mean of squares over the features an RMS norm is made of."""
    return n.target is aten.layer_norm.default or (
        n.target is aten.mean.dim and isinstance(n.args[0], fx.Node) and
        n.args[0].target is aten.pow.Tensor_Scalar)


def token_wise(graph: fx.Graph, is_param: Callable[[fx.Node], bool],
               pointwise: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """The nodes whose every path forward ends at a GEMM's activation through token-wise
    ops, one of them a norm (see the module's docstring). Users come after their inputs in
    a graph's order, so one walk backwards settles every node from its users'."""
    ok: set[fx.Node] = set()
    normed: set[fx.Node] = set()  # a norm lies ahead on some path
    for n in reversed(graph.nodes):
        if n.op != "call_function" or not n.users:
            continue
        if all(_gemm_input(u, n, is_param) or u.target in _READ_NOTHING or
               (u in ok and _keeps_tokens(u, n, pointwise)) for u in n.users):
            ok.add(n)
            if any(_is_norm(u) or (u in normed and not _gemm_input(u, n, is_param))
                   for u in n.users):
                normed.add(n)
    return ok & normed


def cut_tokens(L: Lowering, node: fx.Node, v: Val) -> Val:
    """``v`` (the value of ``node``, token-wise) with each partial sum over a tensor axis
    reduce-scattered onto a token dim: the outermost one whose piece on this rank the axis
    divides, as a contiguous cut of the flattened tokens would split (GPT-2's Conv1D
    multiplies ``[B*S, H]`` rows and views them back to ``[B, S, H]``: both forms then
    agree); a sum no token dim takes evenly stays partial, for its consumer to all-reduce
    as before."""
    for axis in TENSOR_AXES:
        lay = v.layout
        if lay is None or dict(lay.partial).get(axis) != "sum":
            continue
        shape = list(v.val.shape)
        local = lay.local_shape(shape, L.mesh)
        g = L.mesh.size(axis)
        for d in range(v.ndim - 1):
            if lay.interleave[d] != 1 or local[d] % g:
                continue
            want = lay.with_replicated(axis).with_shard(axis, d)
            v = Val(L.to_layout(v, want), want.clean(L.mesh), v.val)
            where = L.src.module or f"the model's {node.name}"
            L.decisions.append(
                f"{where}: sequence parallel: the partial sum over {axis} "
                f"reduce-scattered onto dim {d} (of {shape[d]}), not all-reduced; what follows "
                f"up to the next GEMMs runs on 1/{g} of the tokens")
            break
    return v


def _carries(L: Lowering, user: fx.Node, axis: str) -> bool:
    """Does ``user`` keep its input's partial sum over ``axis`` partial (so the reduction
    can wait for a later op)?"""
    t = user.target
    if t in _VIEWS or t is operator.getitem:
        return True
    if t in _DROPOUT:
        # it could carry the sum, but cut first it draws and keeps 1/G of the mask
        return False
    if L.rule_for(user) is not RULES["pointwise"]:
        return False
    args = [L.env[a] if isinstance(a, fx.Node) else a for a in user.args]
    out = user.meta.get("val")
    return partial_ok(t, args, axis, out.dtype if isinstance(out, torch.Tensor) else None)


def cut_inputs(L: Lowering, user: fx.Node) -> None:
    """Before ``user`` is lowered: each token-wise input holding a partial sum over a
    tensor axis that ``user`` would have to reduce is reduce-scattered onto its tokens
    instead, once; the input's later users see the cut value."""
    for n in user.all_input_nodes:
        v: Any = L.env.get(n)
        if not isinstance(v, Val) or v.layout is None or n not in L.token_wise():
            continue
        axes = [a for a in TENSOR_AXES if dict(v.layout.partial).get(a) == "sum"]
        if axes and not all(_carries(L, user, a) for a in axes):
            here, L.src = L.src, source_of(n)
            try:
                L.env[n] = cut_tokens(L, n, v)
            finally:
                L.src = here
