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


def test_mirrored_stripes_are_the_head_tail_cut() -> None:
    """interleave -2: rank c of G holds chunks c and 2G-1-c of the dim; over two axes the
    mirror is of the combined block index, and write_local undoes local_slice."""
    mesh = shardc.Mesh(context=4)
    full = torch.arange(16).float()
    lay = Layout.of(1, {"context": 0}, interleave={0: -2})
    pieces = [local_slice(full, lay, mesh.coords(r), mesh).tolist() for r in range(4)]
    assert pieces == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert str(lay) == "[S(0/2m)@context]"
    _roundtrip(lay, mesh, [16])
    _roundtrip(Layout.of(2, {"x": 1, "z": 1}, order=("x", "z"), interleave={1: -4}), shardc.Mesh(x=2, z=2), [3, 32])


def test_local_chunk_and_its_gather_are_inverse_on_mirrored_stripes(monkeypatch) -> None:
    """The program's re-cut (``local_chunk``) and gather (``concat_gathered_interleaved``)
    agree with ``local_slice`` on every interleave, plain and mirrored."""
    from shardc.runtime import collectives as C

    class _Rt:
        def __init__(self, g: int, i: int) -> None:
            self.mesh, self.i = shardc.Mesh(context=g), i

        def coord(self, axis: str) -> int:
            return self.i

    g = 4
    full = torch.arange(2 * 48 * 3).float().reshape(2, 48, 3)
    for k in (1, 2, 3, -2, -6):
        lay = Layout.of(3, {"context": 1}, interleave={1: k})
        pieces = []
        for i in range(g):
            monkeypatch.setattr(C, "get_runtime", lambda rt, i=i: _Rt(g, i))
            piece = C.local_chunk(full, "rt", "context", 1, k)
            assert torch.equal(piece, local_slice(full, lay, shardc.Mesh(context=g).coords(i), shardc.Mesh(context=g)))
            pieces.append(piece)
        assert torch.equal(C.concat_gathered_interleaved(torch.stack(pieces), 1, k), full), k


def test_restripe_moves_every_run_to_its_new_holder() -> None:
    """``restripe``: the runs each rank sends, laid in an all-to-all's buffer as torch's
    all-to-all lays them (what rank 0 sent, then rank 1, ...) and put in order by
    ``place``, are the rank's piece under the new interleave, for every pair of
    interleaves (plain, stripes, the head-tail cut) and group size; and the re-cut of a
    sequence into the head-tail cut sends at most two runs a rank, to at most two ranks."""
    from shardc.core.placement import restripe, stripe_index

    for n in (2, 3, 4, 8):
        size = 24 * n
        full = torch.arange(size)
        for k1 in (1, 2, 3, -2, 4):
            for k2 in (1, 2, 3, -2, 4):
                plans = [restripe(size, k1, k2, i, n) for i in range(n)]
                sent = []
                for i, p in enumerate(plans):
                    piece = full[stripe_index(size, k1, i, n)]
                    buf = torch.cat([piece[o:o + m] for o, m in p.send])
                    assert buf.numel() == piece.numel() == sum(p.send_splits)
                    sent.append(buf.split(list(p.send_splits)))
                for i, p in enumerate(plans):
                    got = torch.cat([sent[s][i] for s in range(n)])
                    assert [sent[s][i].numel() for s in range(n)] == list(p.recv_splits)
                    new = torch.cat([got[o:o + m] for o, m in p.place])
                    assert torch.equal(new, full[stripe_index(size, k2, i, n)]), (n, k1, k2, i)
        for i in range(n):
            p = restripe(size, 1, -2, i, n)
            assert len(p.send) <= 2 and sum(1 for m in p.send_splits if m) <= 2
