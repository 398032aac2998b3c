"""Gradient sums in buckets under autograd's backward (``step_graph=False``, block or
selective recompute, or a step program that could not be built).

There the forward program runs alone and autograd walks its backward; each parameter's
gradient is summed over the axes whose ranks saw different tokens in a hook on the
parameter. One blocking all-reduce per parameter in that hook was latency-bound: the
TinyGPT on 8 gloo ranks (``x1y1z1d8``) took 3.5x DDP's step, where DDP moves the same
bytes as one bucket. Here, as in DDP's reducer, each gradient is copied into its bucket
as backward makes it, a bucket is all-reduced (asynchronously) as soon as it and every
bucket before it are full, and the end of backward waits for them all and hands each
parameter its sum.

Buckets follow ``compile``'s caps (``Options.bucket_bytes`` and ``first_bucket_bytes``:
DDP's) and fill in reverse registration order, the order backward roughly makes the
gradients, per (axis, gradient dtype, reduce dtype, device). A parameter summed over
more than one axis keeps the per-parameter hooks (each sum needs the one before it), as
does every parameter when ``bucket_mb=0``.

What the hook returns is what autograd accumulates or hands to ``torch.autograd.grad``:

- ``.grad`` empty before this backward: the local gradient itself; the end of backward
  overwrites ``.grad`` (a post-accumulate hook says which tensor that is) with the sum;
- ``.grad`` already holding a sum (two synced backwards without zeroing): zeros, so
  autograd leaves ``.grad`` as it was, and the end of backward adds the sum to it: the
  same ``old + sum`` the per-parameter hook gave;
- ``torch.autograd.grad`` (no accumulation, no post-accumulate hook): the returned tensor
  is overwritten with the sum before ``grad`` returns (autograd runs the end-of-backward
  callback first).

After ``no_sync``, the first synced backward reduces the accumulated ``.grad`` as a whole,
per parameter, as before (``collectives.grad_reduce_after_accumulate``): that backward's
buckets stand aside (a parameter that got no gradient under ``no_sync`` is summed by the
per-parameter hook), so no byte moves twice.

Numerics: each element is summed over the same ranks; a reduction may add the ranks'
values in an order that depends on the element's offset in the buffer (``passes/bucket.py``
says the same of the step program's buckets), so with more than two ranks a sum can differ
from the per-parameter one in the last bits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from shardc.runtime.collectives import get_runtime, grad_reduce_hook
from shardc.runtime.functional import STATE, run_all_reduce, run_wait


@dataclass
class Member:
    name: str
    param: torch.Tensor  # the tensor the program reads (a leaf that requires grad)
    axis: str
    reduce_dtype: torch.dtype
    bucket: int = -1
    offset: int = 0  # in elements of the bucket's buffer
    # this backward: what the hook returned, whether .grad held a sum before it, and
    # whether autograd accumulated it into .grad
    returned: torch.Tensor | None = field(default=None, repr=False)
    had_grad: bool = False
    accumulated: bool = False


@dataclass
class Bucket:
    axis: str
    dtype: torch.dtype  # the reduce dtype: what the buffer holds and the group sums
    members: list[Member] = field(default_factory=list)
    numel: int = 0
    buffer: torch.Tensor | None = None  # this backward's, made when its first gradient comes


class GradBuckets:
    """The buckets of one module's single-axis gradient sums, and their state in the
    backward under way."""

    def __init__(self, rt: str, params: list[tuple[str, torch.Tensor, str, torch.dtype]],
                 cap: int, first_cap: int) -> None:
        self.rt = rt
        self.buckets: list[Bucket] = []
        self.members: dict[str, Member] = {}
        # the backward under way
        self._arrived: set[str] = set()
        self._next = 0  # the first bucket not issued
        self._flying: list[tuple[int, torch.Tensor, Any]] = []  # (bucket, output, record)
        self._queued = False  # a finish is queued on autograd's engine
        self._standing_aside: bool | None = None  # None: no synced hook has run yet
        if cap <= 0:
            return
        filling: dict[tuple, Bucket] = {}
        per_key: dict[tuple, int] = {}  # buckets made per key, for the first one's cap
        for name, t, axis, red in reversed(params):
            key = (axis, t.dtype, red, t.device)
            size = torch.empty((), dtype=red).element_size()
            nbytes = t.numel() * size
            b = filling.get(key)
            limit = first_cap if per_key.get(key, 0) <= 1 else cap
            if b is None or (b.members and b.numel * size + nbytes > limit):
                b = Bucket(axis, red)
                filling[key] = b
                per_key[key] = per_key.get(key, 0) + 1
                self.buckets.append(b)
            m = Member(name, t, axis, red, bucket=len(self.buckets) - 1, offset=b.numel)
            b.members.append(m)
            b.numel += t.numel()
            self.members[name] = m

    def __contains__(self, name: object) -> bool:
        return name in self.members

    def calls(self) -> dict[str, int]:
        """All-reduces a synced backward issues, per axis."""
        out: dict[str, int] = {}
        for b in self.buckets:
            out[b.axis] = out.get(b.axis, 0) + 1
        return out

    # ------------------------------------------------------------------ hooks
    def grad_hook(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The hook on the parameter's tensor: the gradient this backward made."""
        m = self.members[name]
        r = get_runtime(self.rt)
        # what a backward that stands aside runs: the per-parameter sum (a no-op for a
        # parameter whose .grad is reduced whole after no_sync)
        legacy = grad_reduce_hook(self.rt, m.axis, name,
                                  None if m.reduce_dtype == m.param.dtype else m.reduce_dtype)

        def hook(g: torch.Tensor) -> torch.Tensor:
            if not r.sync:  # no_sync: .grad accumulates the local gradient
                r.unreduced.add(name)
                return g
            if self._standing_aside is None:
                # the first hook of a synced backward: after no_sync the accumulated
                # .grad of these parameters is reduced whole, per parameter
                self._standing_aside = any(n in r.unreduced for n in self.members)
                if not self._standing_aside:
                    torch.autograd.Variable._execution_engine.queue_callback(self.finish)
                    self._queued = True
            if self._standing_aside:
                return legacy(g)
            b = self.buckets[m.bucket]
            if b.buffer is None:
                b.buffer = g.new_empty(b.numel, dtype=b.dtype)
            # one copy, cast to the reduce dtype included, while the gradient is in cache
            b.buffer[m.offset:m.offset + g.numel()].view(g.shape).copy_(g)
            m.had_grad = m.param.grad is not None
            m.returned = torch.zeros_like(g) if m.had_grad else g
            self._arrived.add(name)
            self._issue_ready()
            return m.returned

        return hook

    def accumulated_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        """The post-accumulate hook: autograd put the hook's return into ``.grad``."""
        m = self.members[name]

        def hook(_: torch.Tensor) -> None:
            if m.returned is not None:
                m.accumulated = True
        return hook

    # ---------------------------------------------------------------- buckets
    def _issue_ready(self, everything: bool = False) -> None:
        """Issue, in order, each bucket whose members have all arrived and every bucket
        before it (``everything``: the rest too, at the end of backward)."""
        while self._next < len(self.buckets) and (everything or all(
                x.name in self._arrived for x in self.buckets[self._next].members)):
            self._issue(self._next)
            self._next += 1

    def _issue(self, i: int) -> None:
        b = self.buckets[i]
        if b.buffer is None:  # none of its members got a gradient: nothing to sum
            return
        for x in b.members:
            if x.name not in self._arrived:  # no gradient in this backward: add nothing
                b.buffer[x.offset:x.offset + x.param.numel()].zero_()
        out = run_all_reduce(b.buffer, "sum", "", self.rt, b.axis, "step", inplace=True)
        # the wait may come on another thread (CUDA runs backward's hooks on a device
        # thread): keep the runtime's per-thread record of the collective with the bucket
        self._flying.append((i, out, STATE.flight.pop(id(out))))

    def finish(self) -> None:
        """End of a synced backward: issue what is left, wait for all, hand out the sums."""
        try:
            self._issue_ready(everything=True)
            for i, out, record in self._flying:
                STATE.flight[id(out)] = record
                run_wait(out)
                self._unpack(self.buckets[i], out)
        finally:
            self._reset()

    def _unpack(self, b: Bucket, out: torch.Tensor) -> None:
        with torch.no_grad():
            for m in b.members:
                if m.returned is None:
                    continue
                total = out[m.offset:m.offset + m.param.numel()].view(m.param.shape)
                if not m.accumulated:  # torch.autograd.grad: it returns m.returned
                    m.returned.copy_(total)
                elif m.had_grad:
                    assert m.param.grad is not None
                    m.param.grad.add_(total)
                else:
                    assert m.param.grad is not None
                    m.param.grad.copy_(total)

    def _reset(self) -> None:
        for b in self.buckets:
            b.buffer = None
        for m in self.members.values():
            m.returned, m.had_grad, m.accumulated = None, False, False
        self._arrived = set()
        self._next = 0
        self._flying = []
        self._queued = False
        self._standing_aside = None

    def new_step(self) -> None:
        """Before a forward: a backward that raised after its first hook never ran its
        queued ``finish`` (autograd runs a graph task's callbacks only when it succeeds),
        and one that stood aside queued none. Wait for what a failed one issued (every
        rank issued the same) and start clean, or the next backward would neither queue
        a ``finish`` nor hand out sums."""
        if self._queued:
            try:
                for _, out, record in self._flying:
                    STATE.flight[id(out)] = record
                    run_wait(out)
            finally:
                self._reset()
        else:
            self._standing_aside = None
