"""Layouts: local shapes, slicing a full tensor, writing shards back (the inverse)."""
from __future__ import annotations

import torch

import shardc
from shardc.core.placement import Layout, local_slice
from shardc.program.module import write_local

pytestmark: list = []  # one process, fast: the fast tier


def test_str_and_queries() -> None:
    lay = Layout.of(2, {"x": 0, "y": 1, "z": 0}, order=("y", "x", "z"))
    assert str(lay) == "[S(0)@z, S(1)@y, S(0)@x]"
    assert lay.dims == (("x", "z"), ("y",))
    assert isinstance(lay.placement("data"), shardc.Replicate)
    assert lay.with_partial("data", "sum").placement("data") == shardc.Partial("sum")


def _roundtrip(lay: Layout, mesh: shardc.Mesh, shape: list[int]) -> None:
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape).float()
    out = torch.full_like(full, -1)
    pieces = []
    for r in range(mesh.world_size):
        piece = local_slice(full, lay, mesh.coords(r), mesh)
        assert list(piece.shape) == lay.local_shape(shape, mesh)
        pieces.append(piece)
        write_local(out, lay, mesh.coords(r), mesh, piece)
    assert torch.equal(out, full)


def test_slice_and_write_back_nested_and_interleaved() -> None:
    mesh = shardc.Mesh(x=2, y=2, z=2)
    _roundtrip(Layout.of(2, {"x": 0, "y": 1, "z": 0}, order=("y", "x", "z")), mesh, [8, 4])
    # a fused QKV weight: rows read as (3, 8), each third cut over x then z
    lay = Layout.of(2, {"x": 0, "z": 0}, order=("x", "z"), interleave={0: 3})
    _roundtrip(lay, mesh, [24, 4])
    full = torch.arange(24).float()
    q_k_v = local_slice(full, Layout.of(1, {"x": 0}, interleave={0: 3}), {"x": 1, "y": 0, "z": 0,
                                                                          "data": 0}, mesh)
    # rank x=1 holds the second half of each of q, k and v
    assert q_k_v.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
