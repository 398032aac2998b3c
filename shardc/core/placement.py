"""Placements: how one tensor is laid out over the mesh's axes.

Per axis a tensor is sharded along one of its dims (``S(d)``), replicated (``R``) or
partial: ``P(sum)`` / ``P(avg)`` / ``P(max)`` / ``P(min)``, the true value is the sum /
mean / max / min of the ranks' values (a GEMM with its contraction dim cut leaves a sum,
a local mean loss over batch shards a mean, vocabulary-parallel cross-entropy a max). Placements are keyed by
axis name, never by position (STYLE.md, section 2).

When several axes shard the same dim their order matters: ``dims[d] = ("z", "x")``
means dim d is cut into ``Gz`` blocks by z and each block into ``Gx`` by x. Gathering
over the innermost axis of a dim yields a contiguous block, which is why parameter
storage puts z innermost (its all-gather must produce the x/y block Algorithm 1 uses).

``interleave[d] = k`` says dim d is read as ``(k, size/k)`` and only the second factor is
split: a fused QKV projection's output columns, so each rank holds matching q, k and v
heads. ``interleave[d] = -k`` (``MIRRORED`` for k = 2) reads the dim the same way but cuts
every odd stripe in mirrored order: block i of n holds chunk i of the even stripes and
chunk n-1-i of the odd ones. With two stripes that is the head-tail cut of a causal
sequence (rank c: chunks c and 2n-1-c), which gives every rank of a context ring the same
work (runtime/ring.py). ``stripe_chunks`` says which pieces a block holds, for both.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from shardc.core.mesh import CUT_AXES, Mesh


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


PARTIAL_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Partial:
    """The true value is the reduction (``op``) over the axis of the ranks' values: a sum
    as a GEMM whose contraction dim is cut leaves it, a mean as a local mean loss over
    batch shards, a max as vocabulary-parallel cross-entropy's row maxima."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in PARTIAL_OPS:
            raise ValueError(f"Partial: op must be one of {PARTIAL_OPS}, got {self.op!r}")

    def __str__(self) -> str:
        return f"P({self.op})"


Placement = Shard | Replicate | Partial

# the interleave of the head-tail cut: two stripes, the second in mirrored order
MIRRORED = -2


def stripe_chunk(k: int, stripe: int, idx: int, n: int) -> int:
    """Which chunk of ``stripe`` block ``idx`` of ``n`` holds under interleave ``k``; the
    map is its own inverse, so it also says which block holds chunk ``idx``."""
    return n - 1 - idx if k < 0 and stripe % 2 else idx


def stripe_index(size: int, k: int, idx: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions along the dim that block ``idx`` of ``n`` holds, in local order: an
    index for ``index_select``, whose backward adds into one buffer of the dim's size
    (a concatenation of slices would allocate one a slice)."""
    return torch.cat([torch.arange(a, a + m, device=device) for a, m, _ in stripe_chunks(size, k, idx, n)])


def stripe_chunks(size: int, k: int, idx: int, n: int) -> list[tuple[int, int, int]]:
    """(global offset, length, local offset) of each piece block ``idx`` of ``n`` holds of
    a dim of ``size`` read with interleave ``k`` (module docstring), in local order."""
    s = abs(k)
    part = size // s // n
    return [(j * (size // s) + stripe_chunk(k, j, idx, n) * part, part, j * part) for j in range(s)]


@dataclass(frozen=True)
class Restripe:
    """One rank's part in moving a dim cut over a group of ranks from one interleave to
    another (``restripe``): an exchange of the pieces each rank holds with the ranks that
    hold them after, in the form of torch.distributed's all-to-all with split sizes.

    ``send``: (offset, length) along the dim of each run of the rank's piece that goes
    out, in the send buffer's order (by destination rank, then offset); ``send_splits``
    and ``recv_splits``: the rows sent to and received from each rank of the group (its
    own included); ``place``: (offset in the received buffer, length) of each run, in the
    rank's new local order. A run may go to the rank itself: the all-to-all copies it."""

    send: tuple[tuple[int, int], ...]
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    place: tuple[tuple[int, int], ...]


def _runs(pieces: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """(offset, length) pieces, consecutive ones that touch merged into one."""
    out: list[tuple[int, int]] = []
    for off, m in pieces:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + m)
        else:
            out.append((off, m))
    return tuple(out)


def _sent(size: int, k_from: int, k_to: int, idx: int, n: int) -> list[tuple[int, int, int, int]]:
    """(destination, offset in the sender's piece, length, offset in the destination's
    piece) of what block ``idx`` sends, in its send buffer's order."""
    targets = [stripe_chunks(size, k_to, j, n) for j in range(n)]
    out = []
    for ga, m, lo in stripe_chunks(size, k_from, idx, n):
        for j in range(n):
            for gb, mb, lb in targets[j]:
                s, e = max(ga, gb), min(ga + m, gb + mb)
                if s < e:
                    out.append((j, lo + s - ga, e - s, lb + s - gb))
    return sorted(out)


@functools.lru_cache(maxsize=1024)  # a pure plan, read twice a re-cut every step
def restripe(size: int, k_from: int, k_to: int, idx: int, n: int) -> Restripe:
    """Block ``idx`` of ``n``'s part in re-cutting a dim of ``size`` from interleave
    ``k_from`` to ``k_to`` (module docstring). Each rank sends only what it holds and
    another needs: from the contiguous cut of a sequence to the head-tail cut, at most two
    chunks a rank, where an all-gather and a local slice would move every block to every
    rank."""
    mine = _sent(size, k_from, k_to, idx, n)
    send_splits = [0] * n
    for j, _lo, m, _lb in mine:
        send_splits[j] += m
    got: list[tuple[int, int, int]] = []  # (offset in my new piece, length, offset received)
    recv_splits = [0] * n
    at = 0
    for s in range(n):  # an all-to-all's buffer holds what rank 0 sent, then rank 1, ...
        for j, _lo, m, lb in _sent(size, k_from, k_to, s, n):
            if j == idx:
                got.append((lb, m, at))
                recv_splits[s] += m
                at += m
    return Restripe(_runs([(lo, m) for _j, lo, m, _lb in mine]), tuple(send_splits),
                    tuple(recv_splits), _runs([(a, m) for _lb, m, a in sorted(got)]))


@dataclass(frozen=True)
class Layout:
    """The placement of one tensor on every axis of the mesh."""

    ndim: int
    dims: tuple[tuple[str, ...], ...] = ()  # per tensor dim: sharding axes, outer first
    partial: tuple[tuple[str, str], ...] = ()  # (axis, one of PARTIAL_OPS)
    interleave: tuple[int, ...] = ()  # per tensor dim: k (1 = plain)

    def __post_init__(self) -> None:
        if not self.dims:
            object.__setattr__(self, "dims", tuple(() for _ in range(self.ndim)))
        if not self.interleave:
            object.__setattr__(self, "interleave", tuple(1 for _ in range(self.ndim)))
        assert len(self.dims) == self.ndim and len(self.interleave) == self.ndim, self
        used = [a for d in self.dims for a in d] + [a for a, _ in self.partial]
        # users build layouts (compile's input_layouts): wrong ones are bad input
        if len(used) != len(set(used)):
            raise ValueError(f"Layout: an axis is used twice in {self!r}; each mesh axis cuts one "
                             "dim or is partial, at most once.")
        unknown = [a for a in used if a not in CUT_AXES]
        if unknown:
            raise ValueError(f"Layout: unknown mesh axes {unknown} in {self!r}; the axes are {CUT_AXES}.")
        for a, op in self.partial:
            if op not in PARTIAL_OPS:
                raise ValueError(f"Layout: partial op on {a!r} must be one of {PARTIAL_OPS}, got {op!r}")

    # -- constructors -------------------------------------------------------------
    @classmethod
    def replicate(cls, ndim: int) -> "Layout":
        return cls(ndim)

    @classmethod
    def of(cls, ndim: int, shards: Mapping[str, int] | None = None,
           partial: Mapping[str, str] | None = None, order: Iterable[str] = ("data", "z", "context", "y", "x"),
           interleave: Mapping[int, int] | None = None) -> "Layout":
        """Build from axis -> dim; axes on one dim nest in ``order`` (outer first)."""
        shards = dict(shards or {})
        dims: list[list[str]] = [[] for _ in range(ndim)]
        for a in order:
            if a in shards:
                d = shards.pop(a) % ndim if ndim else 0
                dims[d].append(a)
        if shards:
            raise ValueError(f"Layout.of: unknown mesh axes {sorted(shards)}; the axes are {tuple(order)}.")
        il = [1] * ndim
        for d, k in (interleave or {}).items():
            il[d % ndim] = k
        return cls(ndim, tuple(tuple(d) for d in dims), tuple(sorted((partial or {}).items())),
                   tuple(il))

    # -- queries ------------------------------------------------------------------
    def placement(self, axis: str) -> Placement:
        for d, axes in enumerate(self.dims):
            if axis in axes:
                return Shard(d)
        for a, op in self.partial:
            if a == axis:
                return Partial(op)
        return Replicate()

    def shard_dim(self, axis: str) -> int | None:
        for d, axes in enumerate(self.dims):
            if axis in axes:
                return d
        return None

    def partial_axes(self) -> dict[str, str]:
        return dict(self.partial)

    def is_replicated(self, axis: str) -> bool:
        return isinstance(self.placement(axis), Replicate)

    def local_shape(self, shape: Iterable[int], mesh: Mesh) -> list[int]:
        out = []
        for d, n in enumerate(shape):
            f = 1
            for a in self.dims[d]:
                f *= mesh.size(a)
            out.append(n // f)
        return out

    def divides(self, shape: Iterable[int], mesh: Mesh) -> bool:
        for d, n in enumerate(shape):
            f = 1
            for a in self.dims[d]:
                f *= mesh.size(a)
            if n % (f * abs(self.interleave[d])):
                return False
        return True

    def clean(self, mesh: Mesh) -> "Layout":
        """Forget axes of size 1: they hold the whole tensor whatever we call it."""
        dims = tuple(tuple(a for a in axes if mesh.size(a) > 1) for axes in self.dims)
        partial = tuple((a, op) for a, op in self.partial if mesh.size(a) > 1)
        il = tuple(k if dims[d] else 1 for d, k in enumerate(self.interleave))
        return Layout(self.ndim, dims, partial, il)

    # -- edits (each returns a new Layout) ----------------------------------------
    def with_replicated(self, axis: str) -> "Layout":
        dims = tuple(tuple(a for a in axes if a != axis) for axes in self.dims)
        partial = tuple(p for p in self.partial if p[0] != axis)
        il = tuple(k if dims[d] else 1 for d, k in enumerate(self.interleave))
        return Layout(self.ndim, dims, partial, il)

    def with_shard(self, axis: str, dim: int, inner: bool = True) -> "Layout":
        base = self.with_replicated(axis)
        dim %= self.ndim
        dims = list(base.dims)
        dims[dim] = dims[dim] + (axis,) if inner else (axis,) + dims[dim]
        return Layout(self.ndim, tuple(dims), base.partial, base.interleave)

    def with_partial(self, axis: str, op: str = "sum") -> "Layout":
        base = self.with_replicated(axis)
        return Layout(self.ndim, base.dims, tuple(sorted(base.partial + ((axis, op),))),
                      base.interleave)

    def with_interleave(self, dim: int, k: int) -> "Layout":
        il = list(self.interleave)
        il[dim % self.ndim] = k
        return Layout(self.ndim, self.dims, self.partial, tuple(il))

    def sharded_axes(self) -> list[str]:
        return [a for axes in self.dims for a in axes]

    # -- printing -----------------------------------------------------------------
    def __str__(self) -> str:
        parts = []
        for a in reversed(CUT_AXES):
            p = self.placement(a)
            if isinstance(p, Replicate):
                continue
            s = str(p)
            if isinstance(p, Shard) and self.interleave[p.dim] != 1:
                k = self.interleave[p.dim]  # "m": mirrored stripes, the head-tail cut
                s = f"S({p.dim}/{k})" if k > 1 else f"S({p.dim}/{-k}m)"
            parts.append(f"{s}@{a}")
        return "[" + ", ".join(parts) + "]" if parts else "[R]"


def shard_offsets(layout: Layout, shape: list[int], coords: Mapping[str, int],
                  mesh: Mesh) -> list[tuple[int, int, int]]:
    """(dim, block index, number of blocks) for every sharded dim of this rank."""
    out = []
    for d, axes in enumerate(layout.dims):
        if not axes:
            continue
        idx, n = 0, 1
        for a in axes:
            idx = idx * mesh.size(a) + coords[a]
            n *= mesh.size(a)
        out.append((d, idx, n))
    return out


Block = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # global offsets, sizes, local offsets


def blocks(layout: Layout, shape: Iterable[int], coords: Mapping[str, int], mesh: Mesh) -> list[Block]:
    """The disjoint blocks of the global tensor that the rank at ``coords`` holds, each as
    (global offsets, sizes, offsets in the local tensor). ``local_slice`` takes exactly
    these, in this order along each dim."""
    shape = list(shape)
    # per dim: (global offset, size, local offset) of each interval; a cut dim's pieces
    # are its stripes' (one for a plain cut)
    per_dim: list[list[tuple[int, int, int]]] = [[(0, n, 0)] for n in shape]
    for d, idx, n in shard_offsets(layout, shape, coords, mesh):
        per_dim[d] = stripe_chunks(shape[d], layout.interleave[d], idx, n)
    return [(tuple(c[0] for c in combo), tuple(c[1] for c in combo), tuple(c[2] for c in combo))
            for combo in itertools.product(*per_dim)]


def local_slice(full, layout: Layout, coords: Mapping[str, int], mesh: Mesh):
    """This rank's piece of a full tensor (no communication)."""
    t = full
    for d, idx, n in shard_offsets(layout, list(full.shape), coords, mesh):
        k = layout.interleave[d]
        size = t.shape[d]
        if k == 1:
            t = t.narrow(d, idx * (size // n), size // n)
        elif k > 1:
            shape = list(t.shape)
            v = t.reshape(shape[:d] + [k, size // k] + shape[d + 1:])
            v = v.narrow(d + 1, idx * (size // k // n), size // k // n)
            t = v.reshape(shape[:d] + [size // n] + shape[d + 1:])
        else:
            t = torch.cat([t.narrow(d, a, m) for a, m, _ in stripe_chunks(size, k, idx, n)], d)
    return t
