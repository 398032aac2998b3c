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
    with pytest.raises(ValueError, match="'x2 y2' is not a mesh spec"):
        shardc.Mesh.parse("x2 y2")
    with pytest.raises(ValueError, match="gives axis 'x' twice"):
        shardc.Mesh.parse("x2y2x2")
    with pytest.raises(ValueError, match="unknown axis letter 'w'"):
        shardc.Mesh.parse("x2w2")
    with pytest.raises(ValueError, match="'x2c2' is not a mesh spec"):
        shardc.Mesh.parse("x2c2")  # the 4D letters are still required beside c
    with pytest.raises(ValueError, match="axis 'context' must have a positive integer size"):
        shardc.Mesh(context=0)
    # A dropped 4D letter is a typo, not a size of 1: 'x2y1z2' once meant nothing, and must
    # not start meaning Mesh(x=2, z=2) on a world of 4.
    for typo in ("x2y1z2", "p2d2", "p2x2y1z1"):
        with pytest.raises(ValueError, match=f"'{typo}' is not a mesh spec; write the four sizes"):
            shardc.Mesh.parse(typo)
    with pytest.raises(ValueError, match="axis 'pipe' must have a positive integer size"):
        shardc.Mesh(pipe=0)
    with pytest.raises(ValueError, match="axis 'z' must have a positive integer size"):
        shardc.Mesh(z=0)
    with pytest.raises(ValueError, match="rank 8 is outside a mesh of 8 ranks"):
        shardc.Mesh(x=8).coords(8)
    with pytest.raises(ValueError, match="unknown axis 'w'"):
        shardc.Mesh().size("w")


def test_pipe_axis_is_outermost() -> None:
    """The API's contract: letters in any order, pipe left out when it is 1, and a stage's
    ranks are contiguous (pipe outermost), so x, y and z groups stay inside a stage."""
    m = shardc.Mesh.parse("d2p2x2y1z1")
    assert m == shardc.Mesh(pipe=2, data=2, x=2) == shardc.Mesh.parse("p2x2y1z1d2")
    assert m.spec() == "p2x2y1z1d2" and shardc.Mesh.parse(m.spec()) == m
    assert str(m) == "Mesh(pipe=2, x=2, y=1, z=1, data=2)"
    assert shardc.Mesh(x=2).spec() == "x2y1z1d1"  # the 4D spelling is unchanged
    assert m.world_size == 8 and m.stage_size == 4 and m.stride("pipe") == 4
    assert m.coords(5) == {"x": 1, "y": 0, "context": 0, "z": 0, "data": 0, "pipe": 1}
    assert all(m.rank(m.coords(r)) == r for r in range(8))
    assert m.groups("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.groups("x") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with_pipe = shardc.Mesh.all(8, axes=("x", "y", "z", "data", "pipe"))
    assert len(with_pipe) == len(set(with_pipe)) and {mm.pipe for mm in with_pipe} == {1, 2, 4, 8}
    assert [mm for mm in with_pipe if mm.pipe == 1] == shardc.Mesh.all(8)


def test_context_axis_sits_between_y_and_z() -> None:
    """API.md: c between y and z in the rank order, letters in any order, left out of the
    spec when it is 1; a context group's ranks are y*x apart, inside z."""
    m = shardc.Mesh.parse("c2p2x2y1z1d2")
    assert m == shardc.Mesh(pipe=2, data=2, z=1, context=2, y=1, x=2) == shardc.Mesh.parse("p2x2y1c2z1d2")
    assert m.spec() == "p2x2y1c2z1d2" and shardc.Mesh.parse(m.spec()) == m
    assert str(m) == "Mesh(pipe=2, x=2, y=1, context=2, z=1, data=2)"
    assert m.world_size == 16 and m.stage_size == 8
    assert m.stride("context") == 2 and m.stride("z") == 4 and m.stride("data") == 4 and m.stride("pipe") == 8
    assert m.coords(3) == {"x": 1, "y": 0, "context": 1, "z": 0, "data": 0, "pipe": 0}
    assert all(m.rank(m.coords(r)) == r for r in range(16))
    assert m.groups("context")[:2] == [[0, 2], [1, 3]]
    assert shardc.Mesh(context=1, x=2) == shardc.Mesh(x=2) and shardc.Mesh(x=2).spec() == "x2y1z1d1"
    assert len(shardc.Mesh.all(8)) == 20  # the 4D meshes only, as before
    with_c = shardc.Mesh.all(8, axes=("x", "y", "context", "z", "data"))
    assert len(with_c) == len(set(with_c)) and {mm.context for mm in with_c} == {1, 2, 4, 8}
    assert [mm for mm in with_c if mm.context == 1] == shardc.Mesh.all(8)
