"""The device grid: pipe x data x z x context x y x x.

The rank order is part of the contract (the planner's bandwidth model depends on it):
x is innermost, then y, then context, then z, then data, then pipe, so
``rank = x + Gx*(y + Gy*(c + Gc*(z + Gz*(data + Gdata*pipe))))``. A pipeline stage's
ranks are contiguous: its x, y and z groups stay inside a node while stages cross nodes;
context sits beside y, inside z, because its ring passes activations every layer.

``pipe`` never cuts a tensor: it picks which of the model's stages a rank runs
(shardc/program/pipeline.py). ``context`` cuts the sequence dim (dim 1) of the inputs,
and so of every activation made from them. ``CUT_AXES`` are the axes a layout may cut
over; ``AXES`` (also ``GRID_AXES``) the 4D grid's, the ones the planner chooses among.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

CONTEXT = "context"
AXES: tuple[str, ...] = ("x", "y", "z", "data")  # the 4D grid, innermost first
GRID_AXES = AXES
CUT_AXES: tuple[str, ...] = ("x", "y", CONTEXT, "z", "data")  # innermost first
BATCH_AXES: tuple[str, ...] = ("data", "z")  # outermost first: the order dim 0 is split in
SEQUENCE_DIM = 1  # the dim of every input that ``context`` cuts

PIPE = "pipe"
ALL_AXES: tuple[str, ...] = CUT_AXES + (PIPE,)  # innermost first
_LETTERS = {"x": "x", "y": "y", "z": "z", "d": "data", "p": PIPE, "c": CONTEXT}
_PART = re.compile(r"([a-z])(\d+)")
_CORE = ("x", "y", "z", "d")


@dataclass(frozen=True)
class Mesh:
    """Sizes of the grid's axes, by name. ``Mesh(data=2, z=2, y=1, x=2)``."""

    data: int = 1
    z: int = 1
    y: int = 1
    x: int = 1
    pipe: int = 1
    context: int = 1

    def __post_init__(self) -> None:
        for axis in ALL_AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(
                    f"Mesh: axis {axis!r} must have a positive integer size, got {size!r}."
                )

    @property
    def world_size(self) -> int:
        return self.data * self.z * self.y * self.x * self.pipe * self.context

    @property
    def stage_size(self) -> int:
        """Ranks in one pipeline stage (the whole world when ``pipe`` is 1)."""
        return self.data * self.z * self.y * self.x * self.context

    def size(self, axis: str) -> int:
        if axis not in ALL_AXES:
            raise ValueError(f"Mesh.size: unknown axis {axis!r}; the axes are {ALL_AXES}.")
        return int(getattr(self, axis))

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> size, innermost (x) first."""
        return {a: self.size(a) for a in AXES}

    def stride(self, axis: str) -> int:
        """Distance in rank numbers between neighbours along ``axis``: the product of the
        sizes of the axes inside it (the planner's "inner" figure)."""
        s = 1
        for a in ALL_AXES:
            if a == axis:
                return s
            s *= self.size(a)
        raise ValueError(f"Mesh.stride: unknown axis {axis!r}.")

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Mesh.coords: rank {rank} is outside a mesh of {self.world_size} ranks.")
        out: dict[str, int] = {}
        for a in ALL_AXES:
            out[a] = rank % self.size(a)
            rank //= self.size(a)
        return out

    def rank(self, coords: dict[str, int]) -> int:
        r = 0
        for a in reversed(ALL_AXES):
            r = r * self.size(a) + coords.get(a, 0)
        return r

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ranks that differ only in their ``axis`` coordinate, ordered by
        that coordinate; the groups are ordered by their first rank."""
        seen: list[list[int]] = []
        for r in range(self.world_size):
            c = self.coords(r)
            if c[axis] != 0:
                continue
            seen.append([self.rank({**c, axis: i}) for i in range(self.size(axis))])
        return seen

    def group_of(self, rank: int, axis: str) -> list[int]:
        c = self.coords(rank)
        return [self.rank({**c, axis: i}) for i in range(self.size(axis))]

    def __str__(self) -> str:
        pipe = f"pipe={self.pipe}, " if self.pipe > 1 else ""
        context = f"context={self.context}, " if self.context > 1 else ""
        return f"Mesh({pipe}x={self.x}, y={self.y}, {context}z={self.z}, data={self.data})"

    def spec(self) -> str:
        """The short form ``Mesh.parse`` reads: ``x2y1z2d2``, ``p2x2y1z1d2`` with stages,
        ``x1y1c4z1d2`` with a context axis."""
        pipe = f"p{self.pipe}" if self.pipe > 1 else ""
        context = f"c{self.context}" if self.context > 1 else ""
        return f"{pipe}x{self.x}y{self.y}{context}z{self.z}d{self.data}"

    @classmethod
    def parse(cls, text: str) -> "Mesh":
        """Letters and sizes in any order, each letter once. The four sizes x, y, z and d
        (data) are always written, so a 4D spec keeps its old meaning and a dropped letter is
        a typo, not a size of 1; p (pipe) and c (context) may be left out when they are 1
        (``'p2x2y1z1d2'``, ``'x1y1c4z1d2'``)."""
        body = text.strip()
        parts = _PART.findall(body)
        not_a_spec = ValueError(
            f"Mesh.parse: {text!r} is not a mesh spec; write the four sizes x, y, z and d (data), "
            "in any order, p (pipe) when there are stages and c (context) when the sequence is cut, "
            "e.g. 'x2y1z2d2', 'p2x2y1z1d2' or 'x1y1c2z1d2'.")
        if not parts or "".join(f"{k}{v}" for k, v in parts) != body:
            raise not_a_spec
        sizes: dict[str, int] = {}
        for letter, size in parts:
            if letter not in _LETTERS:
                raise ValueError(f"Mesh.parse: {text!r} has an unknown axis letter {letter!r}; the "
                                 f"letters are {', '.join(_LETTERS)}.")
            if _LETTERS[letter] in sizes:
                raise ValueError(f"Mesh.parse: {text!r} gives axis {letter!r} twice.")
            sizes[_LETTERS[letter]] = int(size)
        if not {_LETTERS[c] for c in _CORE} <= set(sizes):
            raise not_a_spec
        return cls(**sizes)

    @classmethod
    def all(cls, world_size: int, axes: tuple[str, ...] = GRID_AXES) -> list["Mesh"]:
        """Every mesh whose sizes multiply to ``world_size``, in a fixed order; the 4D ones
        unless ``axes`` names ``"pipe"`` or ``"context"`` too."""
        if world_size < 1:
            raise ValueError(f"Mesh.all: world size must be positive, got {world_size}.")
        unknown = [a for a in axes if a not in ALL_AXES]
        if unknown:
            raise ValueError(f"Mesh.all: unknown axes {unknown}; the axes are {ALL_AXES}.")
        pipes = _divisors(world_size) if PIPE in axes else [1]
        return [Mesh(pipe=p, context=c, data=m.data, z=m.z, y=m.y, x=m.x)
                for p in pipes
                for c in (_divisors(world_size // p) if CONTEXT in axes else [1])
                for m in _factorizations(world_size // (p * c))]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(n: int) -> Iterator[Mesh]:
    for d in _divisors(n):
        for z in _divisors(n // d):
            for y in _divisors(n // (d * z)):
                x = n // (d * z * y)
                yield Mesh(data=d, z=z, y=y, x=x)
