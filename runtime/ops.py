"""Local pieces of sharded ops that a compiled graph calls between its collectives.

Each is plain, differentiable torch code on this rank's shards; the collectives between
them are separate graph nodes (runtime.collectives), so the comm report sees them.
"""
from __future__ import annotations

from typing import Any

import torch

from shardc.core.placement import Layout, local_slice
from shardc.runtime.collectives import get_runtime


@torch.library.custom_op("shardc::mesh_coord", mutates_args=())
def mesh_coord(like: torch.Tensor, rt: str, axis: str) -> torch.Tensor:
    """This rank's coordinate on ``axis``, a 0-d int64 tensor on ``like``'s device, read
    when the op runs. A traced step program that offsets by it stays the same program on
    every coordinate, so the ranks of a tensor-parallel group trace it once between them
    (``shardc/program/share.py``); a Python int read while tracing would be a constant of
    each rank's own program."""
    return torch.full((), get_runtime(rt).coord(axis), dtype=torch.int64, device=like.device)


@mesh_coord.register_fake
def _(like, rt, axis):  # type: ignore[no-untyped-def]
    return like.new_empty((), dtype=torch.int64)


MESH_COORD = torch.ops.shardc.mesh_coord.default  # the op as traced programs hold it


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, rt: str, axis: str,
                             padding_idx: int | None = -1) -> torch.Tensor:
    """Look up the ids that fall in this rank's rows of the table, zeros elsewhere: the
    result is a partial sum over ``axis`` (Megatron's vocabulary-parallel embedding)."""
    rows = weight.shape[0]
    start = mesh_coord(ids, rt, axis) * rows
    local = ids - start
    outside = (local < 0) | (local >= rows)
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    if padding_idx is not None and padding_idx >= 0:
        # nn.Embedding's padding row gets no gradient from the lookup (a tied head may
        # still train it): keep its value, cut its gradient
        pad = (ids == padding_idx).unsqueeze(-1)
        out = torch.where(pad, out.detach(), out)
    return out


def copy_into(x: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy(x, src)``, the functional ``x.copy_(src)`` that torch.export writes for
    ``out[:, 1:] = src``: src's values cast and broadcast to x's dtype, shape and strides.
    ``aten.copy`` itself has no derivative, so autograd's backward over a program that
    calls it fails; this is the same value through ``copy_``, whose gradient is src's
    (summed over the broadcast) and none for x, whose values are dropped."""
    return torch.empty_like(x).copy_(src, non_blocking)


def pick_per_row(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[arange(rows), index]`` on this rank's rows: the row numbers are local, the
    index (cut with the rows) says which entry of its own row each one takes."""
    return x[torch.arange(x.shape[0], device=x.device), index]


def row_max(x: torch.Tensor) -> torch.Tensor:
    """Max over the class dim (1) of the local logits, detached: it is only a shift that
    keeps exp() finite, and log-sum-exp does not depend on it."""
    return x.detach().amax(dim=1)


def take_by_aranges(x: torch.Tensor, first: int, positions: list[int], width: int) -> torch.Tensor:
    """``x[..., arange(n0) at positions[0], arange(n1) at positions[1], ...]`` on this
    rank's piece: the indexed dims ``first, first+1, ...`` moved to ``first + positions[j]``
    among ``width`` dims, the rest of size 1 (``passes/rules/view.py: _by_aranges``). Each
    dim keeps its local length, so a cut dim stays cut. A copy, as indexing returns."""
    n = len(positions)
    order = sorted(range(n), key=positions.__getitem__)
    perm = list(range(first)) + [first + j for j in order] + list(range(first + n, x.dim()))
    shape = list(x.shape[:first]) + [1] * width + list(x.shape[first + n:])
    for j, k in enumerate(positions):
        shape[first + k] = x.shape[first + j]
    return x.permute(perm).reshape(shape).clone(memory_format=torch.contiguous_format)


def target_logit(x: torch.Tensor, target: torch.Tensor, rt: str, axis: str) -> torch.Tensor:
    """The entry of each row's target class (dim 1) if this rank holds that class, else
    0: a partial sum over ``axis``. ``target`` has ``x``'s shape without dim 1."""
    classes = x.shape[1]
    local = target - mesh_coord(target, rt, axis) * classes
    inside = (local >= 0) & (local < classes)
    picked = x.gather(1, local.masked_fill(~inside, 0).unsqueeze(1)).squeeze(1)
    # a select, not a multiply by the mask: the stand-in class 0 read for rows whose
    # target is elsewhere may hold -inf (a masked vocabulary), and -inf * 0 is nan
    return torch.where(inside, picked, torch.zeros((), dtype=x.dtype, device=x.device))


def _per_class(weight: torch.Tensor, ndim: int) -> torch.Tensor:
    """Class weights shaped to broadcast against logits whose class dim is 1."""
    return weight.view([1, -1] + [1] * (ndim - 2))


def class_partials(x: torch.Tensor, shift: torch.Tensor, target: torch.Tensor,
                   weight: torch.Tensor | None, rt: str, axis: str, smoothing: float,
                   n_classes: int, probs: bool) -> torch.Tensor:
    """What cross-entropy needs from this rank's classes (dim 1 of ``x``, cut over
    ``axis``), one value a row each, stacked on a new dim 0: partial sums over ``axis``,
    so one all-reduce settles them all. ``shift`` is the row's max over every class, so
    ``xs = x - shift`` is at most 0 and nothing below cancels.

    - always: sum of exp(xs), the log-sum-exp less the shift;
    - class-index targets: xs at the target class, and with label smoothing the sum of
      ``weight * xs`` over classes (``weight``: this rank's classes of it);
    - probability targets (``probs``; smoothing already mixed in here): the sum of
      ``weight * target`` and of ``weight * target * xs``.

    ``ce_rows`` turns them into each row's loss."""
    xs = x - shift.unsqueeze(1)
    parts = [torch.exp(xs).sum(1)]
    w = None if weight is None else _per_class(weight, x.dim())
    if probs:
        t = target if not smoothing else target * (1 - smoothing) + smoothing / n_classes
        wt = t if w is None else t * w
        parts += [wt.sum(1), (wt * xs).sum(1)]
    else:
        parts.append(target_logit(xs, target, rt, axis))
        if smoothing:
            parts.append((xs if w is None else xs * w).sum(1))
    return torch.stack(parts)


def target_weights(target: torch.Tensor, weight: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Each row's class weight ``weight[target]`` (``weight`` whole), 0 where ignored."""
    ignored = target == ignore_index
    w = weight.gather(0, target.masked_fill(ignored, 0).flatten()).view(target.shape)
    return w.masked_fill(ignored, 0)


def ce_rows(parts: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
            ignore_index: int, smoothing: float, n_classes: int, probs: bool) -> torch.Tensor:
    """Each row's cross-entropy, as ``F.cross_entropy(reduction="none")`` gives it, from
    ``class_partials`` summed over the class axis. ``weight`` is whole here."""
    log_se = torch.log(parts[0])  # log-sum-exp less the shift
    if probs:
        return parts[1] * log_se - parts[2]
    nll = log_se - parts[1]
    if weight is not None:
        nll = nll * target_weights(target, weight, ignore_index)
    if smoothing:
        total = n_classes if weight is None else weight.sum()
        nll = (1 - smoothing) * nll + (smoothing / n_classes) * (total * log_se - parts[2])
    return nll.masked_fill(target == ignore_index, 0.0)


def cross_entropy_sum(x: torch.Tensor, target: torch.Tensor, ignore_index: int,
                      weight: torch.Tensor | None = None, smoothing: float = 0.0) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(x, target, weight=weight, ignore_index=ignore_index,
                                             reduction="sum", label_smoothing=smoothing)


def valid_count(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Number of targets that count towards a mean loss, as a float tensor."""
    return (target != ignore_index).sum().to(torch.float32)


def target_weight_total(target: torch.Tensor, weight: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """What a mean cross-entropy with class weights divides by (on this rank's rows): the
    sum of the counted targets' weights."""
    return target_weights(target, weight, ignore_index).sum()


def mean_of_rows(local_sum: torch.Tensor, rows: int, shards: int) -> torch.Tensor:
    """``local_sum * shards / rows`` for a mean over a known number of rows (probability
    targets count every row): averaging this over the batch shards gives the mean."""
    return local_sum * (shards / rows)


def sum_and_count(local_sum: torch.Tensor, count: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[local_sum, count]`` as one tensor of ``dtype`` (the rule's choice), so that one
    all-reduce sums both over the batch shards."""
    return torch.stack([local_sum.to(dtype), count.to(dtype)])


def mean_of_sums(sums: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The global mean from ``sum_and_count``'s all-reduced pair: every rank's loss is
    then the whole batch's, with no reduction left for the output."""
    return (sums[0] / sums[1]).to(dtype)


def _provided(rt: str, site: int | None, global_shape: list[int]) -> torch.Tensor | None:
    """The whole draw numbered ``site`` when someone else drew it (a pipeline stage is
    handed its micro-batch's rows of the mask one device drew for the whole batch:
    ``Runtime.draws``), else None: draw it here."""
    source = get_runtime(rt).draws
    if source is None or site is None:
        return None
    whole = source(site)
    if list(whole.shape) != list(global_shape):
        raise RuntimeError(f"shardc: draw {site} was handed a tensor of shape {list(whole.shape)}, "
                           f"not the {list(global_shape)} the program draws")
    return whole


def global_bernoulli(x: torch.Tensor, p: float, global_shape: list[int], rt: str,
                     dims: tuple[tuple[str, ...], ...], interleave: tuple[int, ...],
                     site: int | None = None) -> torch.Tensor:
    """``torch.bernoulli(x, p)`` as one device draws it for the global tensor, cut to this
    rank's piece. ``x``'s values are never read (only its dtype and device): in-place
    dropout decomposes into ``bernoulli(empty_like(h), 1 - p)``, and drawing on a gathered
    uninitialised tensor, as the replicated fallback did, moved the whole tensor for
    nothing. The draw is the same op on the same global shape and dtype, so it consumes
    the default generator as one device does."""
    whole = _provided(rt, site, global_shape)
    if whole is None:
        whole = torch.bernoulli(torch.empty(global_shape, dtype=x.dtype, device=x.device), p)
    return _this_ranks_piece(whole, rt, dims, interleave).contiguous()


def global_draw_like(x: torch.Tensor, op: Any, args: list, kwargs: dict, global_shape: list[int],
                     rt: str, dims: tuple[tuple[str, ...], ...],
                     interleave: tuple[int, ...], site: int | None = None) -> torch.Tensor:
    """``op(x, *args, **kwargs)``, a draw that reads only ``x``'s shape, dtype and device
    (``randn_like``, ``exponential``, ...), as one device draws it for the global tensor,
    cut to this rank's piece (``passes/rules/random.py``)."""
    whole = _provided(rt, site, global_shape)
    if whole is None:
        whole = op(torch.empty(global_shape, dtype=x.dtype, device=x.device), *args, **kwargs)
    return _this_ranks_piece(whole, rt, dims, interleave).contiguous()


def _this_ranks_piece(whole: torch.Tensor, rt: str, dims: tuple[tuple[str, ...], ...],
                      interleave: tuple[int, ...]) -> torch.Tensor:

    r = get_runtime(rt)
    layout = Layout(whole.dim(), dims, (), interleave)
    # only the cut axes' coordinates: what a trace bakes in (shardc/program/share.py)
    coords = {a: r.coord(a) for axes in dims for a in axes}
    return local_slice(whole, layout, coords, r.mesh)


def global_dropout(x: torch.Tensor, p: float, train: bool, global_shape: list[int],
                   rt: str, dims: tuple[tuple[str, ...], ...], interleave: tuple[int, ...],
                   site: int | None = None) -> torch.Tensor:
    """Dropout whose mask is drawn for the whole global tensor from the default generator,
    exactly as a single device would draw it, then cut to this rank's shard: replicas
    draw the same mask and training matches the single-device run.

    The draw is torch's own dropout on a tensor of ones of the global shape, dtype and
    device, not a hand-written ``bernoulli_``: each device type has its own dropout kernel
    (CPU draws a Bernoulli mask; CUDA a fused Philox kernel that consumes the generator
    differently), and only the same call consumes the generator the same way. The result
    is the mask already scaled by 1/(1-p), as one device multiplies it in."""
    if not train or p == 0.0:
        return x.clone()
    scaled_mask = _provided(rt, site, global_shape)
    if scaled_mask is None:
        ones = torch.ones(global_shape, dtype=x.dtype, device=x.device)
        scaled_mask = torch.nn.functional.dropout(ones, p, True)
    return x * _this_ranks_piece(scaled_mask, rt, dims, interleave)


def check_branch(cond: bool, expression: str, where: str) -> None:
    """A check draft_export put on a branch it fixed to the one the example inputs took
    (passes/trace.py): ``cond`` is false when this batch takes another one. Every rank
    computes ``cond`` from the same replicated value, so every rank stops, none waits."""
    if not cond:
        raise RuntimeError(
            f"shardc: this batch takes a branch the compiled program does not have. The model "
            f"branches on tensor values at {where}; compile traced the branch its example "
            f"inputs took, and this batch fails that branch's condition ({expression}). "
            "Compile with an example batch that takes this branch, or make the branch depend "
            "on shapes or use torch.cond.")


def as_strided_on_traced_storage(x: torch.Tensor, base_size: list[int], base_stride: list[int],
                                 base_offset: int, size: list[int], stride: list[int],
                                 storage_offset: int | None) -> torch.Tensor:
    """``as_strided`` as the trace recorded it, on a copy of ``x`` laid out in storage as the
    traced input was (``base_*``): the recorded strides address that storage, and ``x`` (a
    gathered or re-laid-out tensor with the traced input's elements) may be laid out
    otherwise. Storage the traced input did not cover is zero."""
    def extent(sz: list[int], st: list[int], off: int) -> int:
        return off + sum((n - 1) * s for n, s in zip(sz, st) if n > 0) + 1

    off = base_offset if storage_offset is None else storage_offset
    buf = x.new_zeros(max(extent(base_size, base_stride, base_offset), extent(size, stride, off)))
    base = buf.as_strided(base_size, base_stride, base_offset)
    dst, src = base, x
    for d, (n, s) in enumerate(zip(base_size, base_stride)):
        if s == 0 and n > 1:  # an expanded dim: one storage element holds all its values
            dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
    dst.copy_(src)
    # read through the view that was written (the step program's trace follows a write
    # through a view to the reads of that view)
    return base.as_strided(size, stride, off)
