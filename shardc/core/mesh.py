"""The four-dimensional device grid: data x z x y x x.

The rank order is part of the contract (the planner's bandwidth model depends on it):
x is innermost, then y, then z, then data, so ``rank = x + Gx*(y + Gy*(z + Gz*data))``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

AXES: tuple[str, ...] = ("x", "y", "z", "data")  # innermost first
BATCH_AXES: tuple[str, ...] = ("data", "z")  # outermost first: the order dim 0 is split in

_PARSE = re.compile(r"^x(\d+)y(\d+)z(\d+)d(\d+)$")


@dataclass(frozen=True)
class Mesh:
    """Sizes of the grid's axes, by name. ``Mesh(data=2, z=2, y=1, x=2)``."""

    data: int = 1
    z: int = 1
    y: int = 1
    x: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(
                    f"Mesh: axis {axis!r} must have a positive integer size, got {size!r}."
                )

    @property
    def world_size(self) -> int:
        return self.data * self.z * self.y * self.x

    def size(self, axis: str) -> int:
        if axis not in AXES:
            raise ValueError(f"Mesh.size: unknown axis {axis!r}; the axes are {AXES}.")
        return int(getattr(self, axis))

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> size, innermost (x) first."""
        return {a: self.size(a) for a in AXES}

    def stride(self, axis: str) -> int:
        """Distance in rank numbers between neighbours along ``axis``: the product of the
        sizes of the axes inside it (the planner's "inner" figure)."""
        s = 1
        for a in AXES:
            if a == axis:
                return s
            s *= self.size(a)
        raise ValueError(f"Mesh.stride: unknown axis {axis!r}.")

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Mesh.coords: rank {rank} is outside a mesh of {self.world_size} ranks.")
        out: dict[str, int] = {}
        for a in AXES:
            out[a] = rank % self.size(a)
            rank //= self.size(a)
        return {"x": out["x"], "y": out["y"], "z": out["z"], "data": out["data"]}

    def rank(self, coords: dict[str, int]) -> int:
        r = 0
        for a in reversed(AXES):
            r = r * self.size(a) + coords.get(a, 0)
        return r

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ranks that differ only in their ``axis`` coordinate, ordered by
        that coordinate; the groups are ordered by their first rank."""
        others = [a for a in AXES if a != axis]
        seen: list[list[int]] = []
        for r in range(self.world_size):
            c = self.coords(r)
            if c[axis] != 0:
                continue
            seen.append([self.rank({**c, axis: i}) for i in range(self.size(axis))])
        del others
        return seen

    def group_of(self, rank: int, axis: str) -> list[int]:
        c = self.coords(rank)
        return [self.rank({**c, axis: i}) for i in range(self.size(axis))]

    def __str__(self) -> str:
        return f"Mesh(x={self.x}, y={self.y}, z={self.z}, data={self.data})"

    def spec(self) -> str:
        """The short form ``Mesh.parse`` reads: ``x2y1z2d2``."""
        return f"x{self.x}y{self.y}z{self.z}d{self.data}"

    @classmethod
    def parse(cls, text: str) -> "Mesh":
        m = _PARSE.match(text.strip())
        if not m:
            raise ValueError(
                f"Mesh.parse: {text!r} is not a mesh spec; write the four sizes as "
                "'x<Gx>y<Gy>z<Gz>d<Gdata>', e.g. 'x2y1z2d2'."
            )
        x, y, z, d = (int(g) for g in m.groups())
        return cls(data=d, z=z, y=y, x=x)

    @classmethod
    def all(cls, world_size: int) -> list["Mesh"]:
        """Every mesh whose sizes multiply to ``world_size``, in a fixed order."""
        if world_size < 1:
            raise ValueError(f"Mesh.all: world size must be positive, got {world_size}.")
        return list(_factorizations(world_size))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorizations(n: int) -> Iterator[Mesh]:
    for d in _divisors(n):
        for z in _divisors(n // d):
            for y in _divisors(n // (d * z)):
                x = n // (d * z * y)
                yield Mesh(data=d, z=z, y=y, x=x)
