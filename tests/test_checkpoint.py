"""One-process checks of how a checkpoint describes a shard: the blocks a rank lists are
exactly the piece ``local_slice`` gives it (several disjoint blocks when a dim is
interleaved), and the ranks chosen to write cover every element of the global tensor
exactly once, whatever the layout replicates."""
from __future__ import annotations

import pytest
import torch

import shardc
from shardc.checkpoint import _replica_index, blocks
from shardc.core.placement import Layout, local_slice

pytestmark: list = []  # one process, fast: the fast tier

MESH = shardc.Mesh(data=2, z=2, y=1, x=3)
LAYOUTS = [
    Layout.replicate(2),
    Layout.of(2, {"x": 1}),
    Layout.of(2, {"x": 0, "z": 0}),                      # one dim over two axes
    Layout.of(2, {"x": 0, "z": 0}, order=("x", "z")),    # ... nested the other way
    Layout.of(2, {"z": 0, "x": 1}, interleave={1: 3}),   # fused QKV columns
    Layout.of(1, {"x": 0, "z": 0}, interleave={0: 3}),   # its bias: interleaved over two axes
    Layout.of(3, {"data": 2, "x": 0}, interleave={0: 2, 2: 4}),
    Layout.of(3, {"data": 0, "x": 1}, interleave={1: -2}),  # a sequence's head-tail cut
    Layout.of(2, {"x": 1, "z": 1}, interleave={1: -6}),     # mirrored stripes over two axes
    Layout.of(0),                                        # a scalar
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_blocks_are_the_local_slice_and_writers_cover_once(layout: Layout) -> None:
    shape = [36, 36, 8][:layout.ndim]
    assert layout.divides(shape, MESH)
    full = torch.arange(int(torch.tensor(shape).prod())).float().reshape(shape)
    written = torch.zeros(shape)
    for rank in range(MESH.world_size):
        coords = MESH.coords(rank)
        local = local_slice(full, layout, coords, MESH)
        rebuilt = torch.full_like(local, -1.0)
        blks = blocks(layout, shape, coords, MESH)
        r, nrep = _replica_index(layout, coords, MESH)
        for goff, sizes, loff in blks:
            src, dst, w = full, rebuilt, written
            for d, (g, n, lo) in enumerate(zip(goff, sizes, loff)):
                src, dst = src.narrow(d, g, n), dst.narrow(d, lo, n)
                w = w.narrow(d, g, n)
            dst.copy_(src)
            if r == 5 % nrep:  # save: the k-th tensor is written by replica k mod nrep
                w += 1
        assert torch.equal(rebuilt, local), (rank, layout)
        # the blocks are disjoint: their volumes add up to the local tensor's
        assert sum(int(torch.tensor(s).prod()) for _, s, _ in blks) == local.numel()
    assert torch.equal(written, torch.ones(shape)), layout
