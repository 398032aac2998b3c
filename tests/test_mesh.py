"""Mesh: sizes by axis name, the rank order the planner relies on, parsing."""
from __future__ import annotations

import pytest

import shardc

pytestmark: list = []  # one process, fast: the fast tier


def test_sizes_and_world_size() -> None:
    mesh = shardc.Mesh(data=2, z=2, y=1, x=2)
    assert mesh.world_size == 8
    assert mesh.size("x") == 2 and mesh.size("y") == 1 and mesh.size("data") == 2
    assert str(mesh) == "Mesh(x=2, y=1, z=2, data=2)"


def test_rank_order_x_innermost() -> None:
    mesh = shardc.Mesh(data=2, z=2, y=2, x=1)
    for rank in range(mesh.world_size):
        c = mesh.coords(rank)
        assert rank == c["x"] + mesh.x * (c["y"] + mesh.y * (c["z"] + mesh.z * c["data"]))
    # DESIGN.md's example: the x-groups and y-groups of a 2x2x2x1 grid (data, z, y, x)
    m = shardc.Mesh(data=1, z=2, y=2, x=2)
    assert m.groups("x") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.groups("y") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.groups("z") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_parse_and_all() -> None:
    assert shardc.Mesh.parse("x2y1z2d2") == shardc.Mesh(data=2, z=2, y=1, x=2)
    assert shardc.Mesh.parse(shardc.Mesh(data=4, x=2).spec()) == shardc.Mesh(data=4, x=2)
    meshes = shardc.Mesh.all(8)
    assert len(meshes) == 20 and len(set(meshes)) == 20
    assert all(m.world_size == 8 for m in meshes)
    assert len(shardc.Mesh.all(1)) == 1


def test_bad_meshes() -> None:
    with pytest.raises(ValueError, match="'x2y2' is not a mesh spec"):
        shardc.Mesh.parse("x2y2")
    with pytest.raises(ValueError, match="axis 'z' must have a positive integer size"):
        shardc.Mesh(z=0)
    with pytest.raises(ValueError, match="rank 8 is outside a mesh of 8 ranks"):
        shardc.Mesh(x=8).coords(8)
    with pytest.raises(ValueError, match="unknown axis 'w'"):
        shardc.Mesh().size("w")
