"""Gradient reductions in buckets under autograd's backward (``step_graph=False``, block or
selective recompute, or a step program that could not be built).

There the forward program runs alone and autograd walks its backward. Two kinds of
reduction finish a parameter's gradient:

- an **all-reduce** over an axis whose ranks saw different tokens (a replicated
  parameter: data parallelism, or a norm's weight under FSDP), in a hook on the
  parameter;
- a **reduce-scatter** over the axis a weight is stored sharded on (FSDP, the ``z`` axis
  of the paper), in the backward of the weight's all-gather
  (``collectives._AllGather``).

One blocking collective per parameter was latency-bound: the TinyGPT on 8 gloo ranks
took 3.5x DDP's step on ``x1y1z1d8`` and 2x FSDP2's on ``x1y1z8d1``, where the peers move
the same bytes in a few buckets. Here, as in DDP's reducer and FSDP2's grouped
reduce-scatter, each gradient is copied into its bucket as backward makes it, a bucket is
issued (asynchronously) as soon as it and every bucket before it are full, and the end
of backward waits for them all and hands each parameter its sum.

Buckets follow ``compile``'s caps (``Options.bucket_bytes`` and ``first_bucket_bytes``:
DDP's), counted in the bytes the collective sends (a reduce-scatter bucket holds its
members' whole gradients), and fill in reverse registration order, the order backward
roughly makes the gradients, per (collective, axis, gradient dtype, reduce dtype,
device). They are issued in the order that reverse registration order completes them,
so a bucket of small gradients spread over the whole model (norms) does not hold back
the buckets behind it. A reduce-scatter bucket's buffer holds whole gradients (G times
its members' shards), so before the next one is issued the one before is waited and its
buffer dropped, as FSDP2 does: at most two such buffers are alive at once, not the whole
model's gradient. Kept per parameter: a gradient summed over more than one axis (each
sum reads the one before; HSDP's reduce-scatter then all-reduce), a weight gathered by
more than one all-gather, and everything when ``bucket_mb=0``.

What autograd accumulates or hands to ``torch.autograd.grad``:

- all-reduce, ``.grad`` empty before this backward: the local gradient itself; the end
  of backward overwrites ``.grad`` (a post-accumulate hook says which tensor that is)
  with the sum;
- all-reduce, ``.grad`` already holding a sum (two synced backwards without zeroing):
  zeros, so autograd leaves ``.grad`` as it was, and the end of backward adds the sum:
  the same ``old + sum`` the per-parameter hook gave;
- reduce-scatter: the all-gather's backward returns zeros of the shard's shape, and the
  end of backward adds the sum to whatever the parameter received (``0 + sum`` is the
  sum bit for bit; ``old + 0 + sum`` is ``old + sum``), so other uses of the parameter add
  up as autograd would have added them;
- a second gradient of a weight in one backward (forward called twice before one
  backward: each call's all-gather brings its own): reduce-scattered alone at once and
  returned as the shard's sum, which autograd adds to the rest (the first one's bucket may
  be gone already);
- ``torch.autograd.grad`` (no accumulation, no post-accumulate hook): the returned tensor
  (the hook on the parameter sees it) is overwritten with, or has added to it, the sum
  before ``grad`` returns (autograd runs the end-of-backward callback first).

After ``no_sync``, the first synced backward reduces the accumulated ``.grad`` of
all-reduced parameters as a whole, per parameter, as before
(``collectives.grad_reduce_after_accumulate``): the all-reduce buckets stand aside for
that backward (a parameter that got no gradient under ``no_sync`` is summed by the
per-parameter hook), so no byte moves twice. A reduce-scatter's held gradient
(``Runtime.deferred``) is added to the synced one before it goes into the bucket, so the
reduce-scatter buckets work after ``no_sync`` too.

Numerics: each element is summed over the same ranks; a reduction may add the ranks'
values in an order that depends on the element's offset in the buffer (``passes/bucket.py``
says the same of the step program's buckets), so with more than two ranks a sum can differ
from the per-parameter one in the last bits.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from shardc.runtime.collectives import get_runtime, grad_reduce_hook
from shardc.runtime.functional import (
    STATE,
    run_all_reduce,
    run_reduce_scatter,
    run_wait,
)

ALL_REDUCE, REDUCE_SCATTER = "all_reduce", "reduce_scatter"


@dataclass
class Spec:
    """A reduction to bucket, in the order the module registers its parameters."""
    name: str
    param: torch.Tensor  # the tensor the program reads (a leaf that requires grad)
    collective: str  # ALL_REDUCE or REDUCE_SCATTER
    axis: str
    reduce_dtype: torch.dtype
    key: str | None = None  # REDUCE_SCATTER: the all-gather node whose backward reduces
    then: str | None = None  # REDUCE_SCATTER: an axis to all-reduce the shard's sum over (HSDP)


@dataclass
class Member:
    spec: Spec
    bucket: int = -1
    offset: int = 0  # in elements of the bucket's buffer (of a row of it: reduce-scatter)
    # this backward: whether its gradient arrived, what the parameter received, whether
    # .grad held a sum before it, and whether autograd accumulated it into .grad
    arrived: bool = False
    returned: torch.Tensor | None = field(default=None, repr=False)
    had_grad: bool = False
    accumulated: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def param(self) -> torch.Tensor:
        return self.spec.param

    @property
    def axis(self) -> str:
        return self.spec.axis


@dataclass
class Bucket:
    collective: str
    axis: str
    dtype: torch.dtype  # the reduce dtype: what the buffer holds and the group sums
    rows: int  # a reduce-scatter's buffer is (G, numel): row r goes to rank r
    then: str | None = None  # a reduce-scatter's result is then all-reduced over this axis
    members: list[Member] = field(default_factory=list)
    numel: int = 0  # elements of a row: a reduce-scatter bucket's result
    buffer: torch.Tensor | None = None  # this backward's, made when its first gradient comes
    result: torch.Tensor | None = None  # this backward's, once waited

    @property
    def nbytes(self) -> int:
        """What the collective sends: the whole buffer."""
        return self.rows * self.numel * torch.empty((), dtype=self.dtype).element_size()

    def issues(self) -> list[tuple[str, str, str]]:
        """The (collective, axis, phase) of each collective a synced backward issues for it."""
        if self.collective == ALL_REDUCE:
            return [(ALL_REDUCE, self.axis, "step")]
        out = [(REDUCE_SCATTER, self.axis, "backward")]
        return out + [(ALL_REDUCE, self.then, "step")] if self.then is not None else out


class GradBuckets:
    """The buckets of one module's single-stage gradient reductions, and their state in
    the backward under way."""

    def __init__(self, rt: str, specs: list[Spec], cap: int, first_cap: int) -> None:
        self.rt = rt
        self.buckets: list[Bucket] = []
        self.members: dict[str, Member] = {}
        self.by_key: dict[str, Member] = {}  # a reduce-scatter's all-gather node -> member
        # the backward under way
        self._next = 0  # the first bucket not issued
        # (bucket, output, the runtime's record of it, collective) in issue order
        self._flying: list[tuple[int, torch.Tensor, Any, str]] = []
        self._queued = False  # a finish is queued on autograd's engine
        self._standing_aside: bool | None = None  # None: no synced hook has run yet
        if cap <= 0:
            return
        mesh = get_runtime(rt).mesh
        filling: dict[tuple, Bucket] = {}
        per_key: dict[tuple, int] = {}  # buckets made per key, for the first one's cap
        done_at: dict[int, int] = {}  # id(bucket) -> position of its last member
        for pos, s in enumerate(reversed(specs)):
            key = (s.collective, s.axis, s.then, s.param.dtype, s.reduce_dtype, s.param.device)
            rows = mesh.size(s.axis) if s.collective == REDUCE_SCATTER else 1
            b = filling.get(key)
            limit = first_cap if per_key.get(key, 0) <= 1 else cap
            if b is None or (b.members and b.nbytes >= limit):  # full, as DDP's reducer has it
                b = Bucket(s.collective, s.axis, s.reduce_dtype, rows, s.then)
                filling[key] = b
                per_key[key] = per_key.get(key, 0) + 1
                self.buckets.append(b)
            m = Member(s, offset=b.numel)
            b.members.append(m)
            b.numel += s.param.numel()
            done_at[id(b)] = pos
            self.members[s.name] = m
            if s.key is not None:
                self.by_key[s.key] = m
        # issued in the order they complete (every rank sorts the same way)
        self.buckets.sort(key=lambda b: done_at[id(b)])
        for i, b in enumerate(self.buckets):
            for m in b.members:
                m.bucket = i

    def __contains__(self, name: object) -> bool:
        return name in self.members

    def rebind(self, name: str, param: torch.Tensor) -> None:
        """Parameter ``name`` is now ``param`` (the user replaced it, same shape and dtype):
        its sums go to that tensor's ``.grad``."""
        m = self.members.get(name)
        if m is not None:
            m.spec = replace(m.spec, param=param)

    def covers(self, collective: str, axis: str, phase: str, param: str | None, node: str
               ) -> bool:
        """Whether a row of the comm report (its collective, axis, phase, parameter and
        node) is a reduction that goes into a bucket."""
        if collective == REDUCE_SCATTER:
            return phase == "backward" and node in self.by_key
        m = self.members.get(param or "")
        return collective == ALL_REDUCE and phase == "step" and m is not None and \
            axis in (m.spec.axis if m.spec.collective == ALL_REDUCE else None, m.spec.then)

    def calls(self) -> dict[str, int]:
        """Collectives a synced backward issues, per axis."""
        out: dict[str, int] = {}
        for b in self.buckets:
            for _, axis, _ in b.issues():
                out[axis] = out.get(axis, 0) + 1
        return out

    # ------------------------------------------------------------------ hooks
    def _begin(self) -> None:
        """The first reduction of a synced backward: decide whether the all-reduce buckets
        stand aside (after no_sync the accumulated .grad of those parameters is reduced
        whole, per parameter) and queue the end of backward."""
        if self._standing_aside is not None:
            return
        r = get_runtime(self.rt)
        self._standing_aside = any(m.spec.collective == ALL_REDUCE and m.name in r.unreduced
                                   for m in self.members.values())
        torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self._queued = True

    def grad_hook(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """The hook on the parameter's tensor: the gradient this backward made."""
        m = self.members[name]
        r = get_runtime(self.rt)
        if m.spec.collective == REDUCE_SCATTER:
            def seen(g: torch.Tensor) -> torch.Tensor:
                # the all-gather's backward has put the gradient in its bucket; this is
                # the zeros it returned, plus any other use's gradient
                if m.arrived:
                    m.returned = g
                return g
            return seen
        # what a backward that stands aside runs: the per-parameter sum (a no-op for a
        # parameter whose .grad is reduced whole after no_sync)
        legacy = grad_reduce_hook(self.rt, m.spec.axis, name,
                                  None if m.spec.reduce_dtype == m.param.dtype else m.spec.reduce_dtype)

        def hook(g: torch.Tensor) -> torch.Tensor:
            if not r.sync:  # no_sync: .grad accumulates the local gradient
                r.unreduced.add(name)
                return g
            self._begin()
            if self._standing_aside:
                return legacy(g)
            self._put(m, g.reshape(1, -1))
            m.had_grad = m.param.grad is not None
            m.returned = torch.zeros_like(g) if m.had_grad else g
            self._issue_ready()
            return m.returned

        return hook

    def scattered(self, key: str, g_flat: torch.Tensor) -> torch.Tensor:
        """From the all-gather's backward (a synced one): the weight's whole gradient
        ``g_flat`` (G blocks along dim 0; cast to the reduce dtype as it is copied in)
        goes into its bucket; the
        zeros of the shard's shape returned stand for the shard's sum until the end of
        backward adds it."""
        m = self.by_key[key]
        self._begin()
        b = self.buckets[m.bucket]
        rows = g_flat.reshape(b.rows, -1)
        if m.arrived:
            # a second gradient for the weight in this backward: the step called forward
            # twice before one backward (a loss over two batches), and each call's
            # all-gather brings its own. Copied into the slot, it replaced the first one or
            # missed the bucket already issued, and the gradient came out wrong. Reduced
            # alone and handed back as the shard's sum (what bucket_mb=0 does for every
            # gradient); autograd adds it to the rest. Every rank meets it at the same
            # point of the same backward, so the collectives keep one order
            return self._alone(b, rows).view(m.param.shape).to(m.param.dtype)
        self._put(m, rows)
        self._issue_ready()
        return torch.zeros(m.param.shape, dtype=m.param.dtype, device=m.param.device)

    def _alone(self, b: Bucket, rows: torch.Tensor) -> torch.Tensor:
        """The sum of one gradient (``rows``, G blocks) over the bucket's axis, this rank's
        block of it, then over its replicas (HSDP), waited here."""
        out = run_reduce_scatter(rows.to(b.dtype).reshape(-1), "sum", b.rows, "", self.rt, b.axis,
                                 "backward")
        run_wait(out)
        if b.then is not None:
            out = run_wait(run_all_reduce(out, "sum", "", self.rt, b.then, "step", inplace=True))
        return out

    def accumulated_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        """The post-accumulate hook: autograd put what the parameter received into ``.grad``."""
        m = self.members[name]

        def hook(_: torch.Tensor) -> None:
            if m.returned is not None:
                m.accumulated = True
        return hook

    # ---------------------------------------------------------------- buckets
    def _put(self, m: Member, rows: torch.Tensor) -> None:
        """Copy a gradient (as (rows, numel)) into its slot, cast to the reduce dtype in the
        same pass, while it is in cache."""
        b = self.buckets[m.bucket]
        if b.buffer is None:
            b.buffer = rows.new_empty((b.rows, b.numel), dtype=b.dtype)
        b.buffer[:, m.offset:m.offset + m.param.numel()].copy_(rows)
        m.arrived = True

    def _skipped(self, b: Bucket) -> bool:
        return b.collective == ALL_REDUCE and bool(self._standing_aside)

    def _issue_ready(self, everything: bool = False) -> None:
        """Issue, in order, each bucket whose members have all arrived and every bucket
        before it (``everything``: the rest too, at the end of backward)."""
        while self._next < len(self.buckets) and (
                everything or self._skipped(self.buckets[self._next]) or
                all(x.arrived for x in self.buckets[self._next].members)):
            self._issue(self._next)
            self._next += 1

    def _issue(self, i: int) -> None:
        b = self.buckets[i]
        if b.buffer is None or self._skipped(b):  # no member got a gradient: nothing to sum
            return
        for x in b.members:
            if not x.arrived:  # no gradient in this backward: add nothing
                b.buffer[:, x.offset:x.offset + x.param.numel()].zero_()
        if b.collective == REDUCE_SCATTER:
            # the one before has had a bucket's worth of backward to finish: wait for it
            # and drop its whole-gradient buffer
            for flight in list(self._flying):
                if flight[3] == REDUCE_SCATTER:
                    self._wait(*flight)
            out = run_reduce_scatter(b.buffer.view(-1), "sum", b.rows, "", self.rt, b.axis,
                                     "backward")
            self._fly(i, out, REDUCE_SCATTER)
        else:
            self._fly(i, run_all_reduce(b.buffer.view(-1), "sum", "", self.rt, b.axis, "step",
                                        inplace=True), ALL_REDUCE)

    def _fly(self, i: int, out: torch.Tensor, collective: str) -> None:
        # the wait may come on another thread (CUDA runs backward's hooks on a device
        # thread): keep the runtime's per-thread record of the collective with the bucket
        self._flying.append((i, out, STATE.flight.pop(id(out)), collective))

    def _wait(self, i: int, out: torch.Tensor, record: Any, collective: str) -> None:
        self._flying.remove((i, out, record, collective))
        STATE.flight[id(out)] = record
        run_wait(out)
        b = self.buckets[i]
        b.buffer = None
        if collective == REDUCE_SCATTER and b.then is not None:
            # HSDP: the shards' sums over the replicas, in place
            self._fly(i, run_all_reduce(out, "sum", "", self.rt, b.then, "step", inplace=True),
                      ALL_REDUCE)
        else:
            b.result = out

    def finish(self) -> None:
        """End of a synced backward: issue what is left, wait for all, hand out the sums."""
        try:
            self._issue_ready(everything=True)
            while self._flying:  # (a reduce-scatter's wait may issue its all-reduce)
                self._wait(*self._flying[0])
            for b in self.buckets:
                if b.result is not None:
                    self._unpack(b, b.result)
        finally:
            self._reset()

    def _unpack(self, b: Bucket, out: torch.Tensor) -> None:
        with torch.no_grad():
            for m in b.members:
                if m.returned is None:
                    continue
                total = out[m.offset:m.offset + m.param.numel()].view(m.param.shape)
                if b.collective == REDUCE_SCATTER:
                    # the parameter received zeros for this sum (plus any other use's
                    # gradient): add it where that went
                    target = m.param.grad if m.accumulated else m.returned
                    assert target is not None
                    # cast first, as the per-parameter path returned it: old + cast(sum)
                    target.add_(total.to(target.dtype))
                elif not m.accumulated:  # torch.autograd.grad: it returns m.returned
                    m.returned.copy_(total)
                elif m.had_grad:
                    assert m.param.grad is not None
                    m.param.grad.add_(total)
                else:
                    assert m.param.grad is not None
                    m.param.grad.copy_(total)

    def _reset(self) -> None:
        for b in self.buckets:
            b.buffer = b.result = None
        for m in self.members.values():
            m.arrived, m.returned, m.had_grad, m.accumulated = False, None, False, False
        self._next = 0
        self._flying = []
        self._queued = False
        self._standing_aside = None

    def new_step(self) -> None:
        """Before a forward: a backward that raised after its first reduction never ran its
        queued ``finish`` (autograd runs a graph task's callbacks only when it succeeds).
        Wait for what it issued (every rank issued the same) and start clean, or the next
        backward would neither queue a ``finish`` nor hand out sums."""
        if self._queued:
            try:
                while self._flying:
                    self._wait(*self._flying[0])
            finally:
                self._reset()
        else:
            self._standing_aside = None
