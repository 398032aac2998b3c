"""Optimizer state sharded over ``data`` (ZeRO-1/2, ``compile(shard_optimizer=True)``).

A parameter the program keeps replicated over ``data`` (its gradient is summed over
``data`` after backward) is split in two tensors on each rank:

- the *program copy*: the stored shard the program reads, replicated over ``data`` as
  before. It is a leaf that requires grad, but not a registered parameter: no optimizer
  sees it;
- the *slice*: this rank's 1/G_data of the program copy along one dim, the registered
  ``nn.Parameter`` that ``sm.parameters()`` yields. The optimizer steps it, so its state
  (AdamW's two moments) is 1/G_data of what it would be.

After a synced backward, the program copy's gradient (summed over every other axis it
needs) is reduce-scattered over ``data`` into the slice's ``.grad`` and dropped (ZeRO-2:
no whole gradient outlives backward). Before the next forward, a slice the optimizer
(or a load) changed is all-gathered over ``data`` back into the program copy. Both are
phase "step" in the comm report and the runtime's counters; the sum of the two moves the
bytes of the all-reduce they replace (ring model).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from shardc.runtime.collectives import (all_gather_flat, get_runtime, guarded,
                                        reduce_scatter_flat)


@dataclass
class ZeroParam:
    """One parameter's program copy and optimizer slice."""

    name: str
    full: torch.Tensor  # the program copy (this rank's stored shard, whole over data)
    slice: nn.Parameter  # this rank's piece of it along ``dim``: what the optimizer steps
    dim: int
    # the slice's version counter when the program copy was last made from it (an
    # optimizer step or a load bumps it); the same on every rank, which run the same
    # optimizer over the same parameters, so every rank gathers together
    seen: int = field(default=-1)
    reduce_dtype: torch.dtype | None = None  # the precision policy's, when narrower


def slice_of(full: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    n = full.shape[dim] // parts
    return full.narrow(dim, index * n, n)


def reduce_grad(rt: str, zp: ZeroParam) -> None:
    """The program copy's gradient, summed over ``data`` into the slice's ``.grad``
    (added to what is there, as autograd accumulates)."""
    r = get_runtime(rt)
    g = zp.full.grad
    if g is None:
        return
    own = g.dtype
    front = g.movedim(zp.dim, 0).contiguous()
    if zp.reduce_dtype is not None:
        front = front.to(zp.reduce_dtype)
    out = front.new_empty((front.shape[0] // r.mesh.size("data"), *front.shape[1:]))
    r.count("reduce_scatter", "data", "step", front)
    with guarded(rt, "reduce_scatter", "data", "step"):
        reduce_scatter_flat(out, front, group=r.group("data"))
    piece = out.to(own).movedim(0, zp.dim)
    if zp.slice.grad is None:
        zp.slice.grad = piece.contiguous()
    else:
        zp.slice.grad.add_(piece)
    zp.full.grad = None


def refresh(rt: str, zp: ZeroParam) -> None:
    """Make the program copy from the slices of every rank of ``data`` if this rank's
    changed since the last time (collective over ``data``)."""
    if zp.slice._version == zp.seen:
        return
    r = get_runtime(rt)
    piece = zp.slice.detach().movedim(zp.dim, 0).contiguous()
    buf = piece.new_empty((piece.shape[0] * r.mesh.size("data"), *piece.shape[1:]))
    r.count("all_gather", "data", "step", piece)
    with guarded(rt, "all_gather", "data", "step"):
        all_gather_flat(buf, piece, group=r.group("data"))
    with torch.no_grad():
        zp.full.copy_(buf.movedim(0, zp.dim))
    zp.seen = zp.slice._version
