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

from shardc.runtime.collectives import get_runtime
from shardc.runtime.functional import (
    STATE,
    run_all_gather,
    run_reduce_scatter,
    run_wait,
)


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


class Buckets:
    """Every parameter split over data, packed into buckets that each move as one
    reduce-scatter after backward and one all-gather before the next forward.

    One collective per parameter was latency-bound: 45 reduce-scatters and 45 all-gathers
    a step for the TinyGPT on 8 gloo ranks took 6.4x DDP's step, which moves the same
    bytes in one bucketed all-reduce. A bucket's flat buffer holds, for each rank of
    ``data`` in turn, that rank's piece of every member (``[r0: p1 p2 ..][r1: p1 p2 ..]``),
    so the reduce-scatter leaves this rank every member's slice in one contiguous run, and
    the all-gather of the concatenated slices is the buffer again.

    Buckets are filled in reverse registration order (backward makes the last layers'
    gradients first, as DDP orders its buckets), up to ``cap`` bytes of the reduce dtype;
    a cap of 0 gives each parameter its own. Members share (dtype, reduce dtype, device).
    A bucket is issued (asynchronously) as soon as it and every bucket before it have all
    their gradients, so in autograd's backward it overlaps what backward still computes;
    the end of backward issues what is left and waits for all. Every rank of ``data`` runs
    the same program, so every rank issues the same buckets in the same order.
    """

    def __init__(self, rt: str, params: list[ZeroParam], cap: float) -> None:
        self.rt = rt
        self.buckets: list[list[ZeroParam]] = []
        filling: dict[tuple, tuple[list[ZeroParam], list[int]]] = {}
        for zp in reversed(params):
            red = zp.reduce_dtype or zp.full.dtype
            key = (zp.full.dtype, red, zp.full.device)
            nbytes = zp.full.numel() * torch.empty((), dtype=red).element_size()
            b = filling.get(key)
            if b is None or (b[0] and b[1][0] + nbytes > cap):
                b = ([], [0])
                filling[key] = b
                self.buckets.append(b[0])
            b[0].append(zp)
            b[1][0] += nbytes
        self.index = {zp.name: i for i, b in enumerate(self.buckets) for zp in b}
        self._arrived: set[str] = set()
        self._next = 0  # the first bucket not issued in this backward
        # (bucket, which members had a gradient, the reduce-scatter's output, its record)
        self._flying: list[tuple[list[ZeroParam], list[bool], torch.Tensor, tuple]] = []
        self._queued = False
        # set while a backward runs in parts (the zero-bubble schedule's weight passes,
        # a few parameters each): the end of a part must not issue the buckets whose
        # gradients a later part makes, only the end of the last one (``end_parts``)
        self.in_parts = False

    # ------------------------------------------------------------------ gradients
    def arrived(self, zp: ZeroParam) -> None:
        """``zp.full``'s gradient is complete for this backward (a post-accumulate hook)."""
        self._arrived.add(zp.name)
        if not self._queued:
            # runs once autograd's backward is done: issue what is left, wait for all
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._queued = True
        while (self._next < len(self.buckets)
               and all(m.name in self._arrived for m in self.buckets[self._next])):
            self._issue(self.buckets[self._next])
            self._next += 1

    def finish(self) -> None:
        if self.in_parts:
            self._queued = False  # the next part's first gradient queues this again
            return
        try:
            # a bucket some of whose members got no gradient in this backward: what
            # they hold from an earlier (no_sync) backward, or zeros
            for b in self.buckets[self._next:]:
                if any(m.full.grad is not None for m in b):
                    self._issue(b)
            for b, had, out, record in self._flying:
                STATE.flight[id(out)] = record
                run_wait(out)
                self._unpack_grads(b, had, out)
        finally:
            self._reset()

    def end_parts(self, ok: bool) -> None:
        """The last part of a backward run in parts is done: issue what is left and wait;
        or (``ok`` False: a part raised) wait for what was issued and start clean, as a
        failed backward does."""
        self.in_parts = False
        if ok:
            self.finish()
        else:
            self._drop_failed_backward()

    def _reset(self) -> None:
        self._arrived.clear()
        self._next = 0
        self._flying = []
        self._queued = False

    def _drop_failed_backward(self) -> None:
        """A backward that raised after a hook queued ``finish`` never runs it (autograd
        runs a graph task's callbacks only when it succeeds). Its half-reduced gradients
        are lost with it, as autograd's are; wait for what it issued (every rank of data
        issued the same, so the group stays in step) and start clean, or the next
        backward would queue no ``finish`` and reduce nothing."""
        try:
            for _, _, out, record in self._flying:
                STATE.flight[id(out)] = record
                run_wait(out)
        finally:
            self._reset()

    def _issue(self, b: list[ZeroParam]) -> None:
        r = get_runtime(self.rt)
        g = r.mesh.size("data")
        red = b[0].reduce_dtype or b[0].full.dtype
        sizes = [m.full.numel() // g for m in b]
        flat = b[0].full.new_empty((g, sum(sizes)), dtype=red)
        had = []
        off = 0
        for m, n in zip(b, sizes):
            dst = flat[:, off:off + n]
            grad = m.full.grad
            had.append(grad is not None)
            if grad is None:
                dst.zero_()
            else:
                front = grad.movedim(m.dim, 0)
                # one copy, cast included: rank i's piece of the gradient into row i
                dst.view(g, front.shape[0] // g, *front.shape[1:]).copy_(
                    front.unflatten(0, (g, front.shape[0] // g)))
                m.full.grad = None  # ZeRO-2: no whole gradient outlives backward
            off += n
        out = run_reduce_scatter(flat.view(-1), "sum", g, "", self.rt, "data", "step")
        r.unreduced.difference_update(f"zero:{m.name}" for m in b)
        # the wait may come on another thread (CUDA runs backward's hooks on a device
        # thread; the end-of-backward callback runs where the graph task ends), and the
        # runtime's records of collectives in flight are per thread: keep this one here
        self._flying.append((b, had, out, STATE.flight.pop(id(out))))

    def _unpack_grads(self, b: list[ZeroParam], had: list[bool], out: torch.Tensor) -> None:
        off = 0
        for m, got in zip(b, had):
            shape = list(m.slice.shape)
            shape.insert(0, shape.pop(m.dim))
            n = m.slice.numel()
            if got:
                piece = out[off:off + n].view(shape).movedim(0, m.dim).to(m.slice.dtype)
                if m.slice.grad is None:
                    m.slice.grad = piece.contiguous()
                else:
                    m.slice.grad.add_(piece)
            off += n

    # ----------------------------------------------------------------- parameters
    def refresh(self) -> None:
        """Make the program copies from the slices of every rank of ``data``, one
        all-gather per bucket any of whose slices changed since the last time (an
        optimizer step or a load). Every rank runs the same optimizer over the same
        parameters, so every rank gathers the same buckets."""
        if self._queued:
            self._drop_failed_backward()
        todo = [b for b in self.buckets if any(m.slice._version != m.seen for m in b)]
        if not todo:
            return
        g = get_runtime(self.rt).mesh.size("data")
        flying = []
        for b in todo:
            piece = b[0].slice.new_empty(sum(m.slice.numel() for m in b))
            off = 0
            for m in b:
                front = m.slice.detach().movedim(m.dim, 0)
                piece[off:off + m.slice.numel()].view(front.shape).copy_(front)
                off += m.slice.numel()
            flying.append((b, run_all_gather(piece, g, "", self.rt, "data", "step")))
        for b, out in flying:
            run_wait(out)
            rows = out.view(g, -1)
            off = 0
            with torch.no_grad():
                for m in b:
                    n = m.slice.numel()
                    front = m.full.movedim(m.dim, 0)
                    front.unflatten(0, (g, front.shape[0] // g)).copy_(
                        rows[:, off:off + n].view(g, front.shape[0] // g, *front.shape[1:]))
                    off += n
                    m.seen = m.slice._version
