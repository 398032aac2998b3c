"""The runtime's reduce-scatter on gloo (``runtime/algorithms.py``): an all-to-all, then
each rank reduces the blocks it received. Checked on 4 real gloo processes against the
exact reduction of every rank's input, for every op, dtype and call form the runtime
uses, and against gloo's own reduce-scatter where gloo has one. Then the small all-reduce
by an exchange: the same checks, which sizes take it, and that every rank ends with the
same bits."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

OPS = ("SUM", "MAX", "MIN", "PRODUCT")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64)
# unit roundoff of each floating dtype (int64 reduces exactly)
EPS = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -23,
       torch.float64: 2 ** -52}


def _exact(blocks: torch.Tensor, op: str) -> torch.Tensor:
    b = blocks.double()
    return {"SUM": b.sum(0), "MAX": b.amax(0), "MIN": b.amin(0), "PRODUCT": b.prod(0)}[op]


def _cases(rank: int, world: int) -> None:
    from shardc.runtime import algorithms as A

    assert A.GLOO_REDUCE_SCATTER == "all_to_all"  # the default this file tests
    pair = dist.new_group([0, 2])  # every rank creates every group
    bad = []
    for dt in DTYPES:
        for name in OPS:
            op = getattr(dist.ReduceOp, name)
            for async_op in (False, True):
                # products of 4 values in [0.5, 2] stay in range for fp16 and int64
                g = torch.Generator().manual_seed(100 * rank + len(bad))
                x = (torch.rand(world * 6, 5, generator=g) * 1.5 + 0.5)
                x = x.round() if dt == torch.int64 else x
                x = x.to(dt)
                out = torch.full((6, 5), -7, dtype=dt)
                work = A.reduce_scatter_flat(out, x, op=op, async_op=async_op)
                if async_op:
                    work.wait()
                else:
                    assert work is None
                every = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(every, x)
                blocks = torch.stack([e[rank * 6:(rank + 1) * 6] for e in every])
                exact = _exact(blocks, name)
                # the four addends are reduced once each in rank order, in the dtype's
                # own precision (bf16/fp16 sum in float and round once): within one
                # rounding of the result per addend; max/min/int are exact
                eps = EPS.get(dt, 0.0)
                tol = 4 * eps * exact.abs()
                if ((out.double() - exact).abs() > tol).any():
                    bad.append(f"{dt} {name} async={async_op}: max error "
                               f"{(out.double() - exact).abs().max().item()}")
    # a subgroup: the pair's blocks only, gloo's own reduce-scatter gives the same sums
    # (two addends: one rounding, in either order)
    if rank in (0, 2):
        x = torch.randn(2 * 8, generator=torch.Generator().manual_seed(rank))
        out = torch.empty(8)
        A.reduce_scatter_flat(out, x, group=pair)
        A.GLOO_REDUCE_SCATTER = "native"
        try:
            native = torch.empty(8)
            A.reduce_scatter_flat(native, x, group=pair)
        finally:
            A.GLOO_REDUCE_SCATTER = "all_to_all"
        if not torch.equal(out, native):
            bad.append(f"pair: {out} != gloo's {native}")
    # a non-contiguous output receives the block too
    x = torch.arange(world * 6, dtype=torch.float32).reshape(world * 3, 2) + rank
    out = torch.empty(2, 3).t()
    A.reduce_scatter_flat(out, x)
    want = sum(torch.arange(world * 6, dtype=torch.float32).reshape(world * 3, 2)[rank * 3:rank * 3 + 3] + r
               for r in range(world))
    if not torch.equal(out, want):
        bad.append(f"strided output: {out} != {want}")
    _all_reduce_cases(rank, world, pair, bad)
    assert not bad, "\n".join(bad)


def _all_reduce_cases(rank: int, world: int, pair: object, bad: list[str]) -> None:
    from shardc.runtime import algorithms as A

    exchanges = [0]
    real = dist.all_to_all_single

    def spy(*args: object, **kwargs: object) -> object:
        exchanges[0] += 1
        return real(*args, **kwargs)

    def went(x: torch.Tensor, **kw: object) -> bool:
        """Reduce ``x`` in place; True if it went by the exchange."""
        before = exchanges[0]
        work = A.all_reduce_flat(x, **kw)
        if kw.get("async_op"):
            work.wait()
        return exchanges[0] > before

    dist.all_to_all_single = spy
    try:
        for dt in DTYPES:
            for name in OPS:
                for async_op in (False, True):
                    g = torch.Generator().manual_seed(1000 + 100 * rank + len(bad))
                    x = torch.rand(3, 5, generator=g) * 1.5 + 0.5  # as above: products in range
                    x = (x.round() if dt == torch.int64 else x).to(dt)
                    every = [torch.empty_like(x) for _ in range(world)]
                    dist.all_gather(every, x)
                    exact = _exact(torch.stack(every), name)
                    if not went(x, op=getattr(dist.ReduceOp, name), async_op=async_op):
                        bad.append(f"all-reduce {dt} {name}: {x.numel() * x.element_size()} B "
                                   "did not go by the exchange")
                    eps = EPS.get(dt, 0.0)
                    if ((x.double() - exact).abs() > 4 * eps * exact.abs()).any():
                        bad.append(f"all-reduce {dt} {name} async={async_op}: max error "
                                   f"{(x.double() - exact).abs().max().item()}")
                    # every rank reduced the same copies in the same order: the same bits
                    # (a ring gives every rank the same result too; a model replicated
                    # over the group must stay identical)
                    got = [torch.empty_like(x) for _ in range(world)]
                    dist.all_gather(got, x)
                    if not all(torch.equal(t, got[0]) for t in got):
                        bad.append(f"all-reduce {dt} {name}: ranks disagree")
        # outside the window: gloo's own, same sums
        for n, by_exchange in ((1, False), (2, False), (4, True),
                               (A.GLOO_EXCHANGE_BYTES // 4, True),
                               (A.GLOO_EXCHANGE_BYTES // 4 + 1, False)):
            x = torch.full((n,), float(rank + 1))
            if went(x) != by_exchange:
                bad.append(f"all-reduce of {n} fp32: exchange={not by_exchange}, "
                           f"want {by_exchange}")
            if not torch.equal(x, torch.full((n,), float(sum(range(1, world + 1))))):
                bad.append(f"all-reduce of {n} fp32: wrong sum {x[:4]}")
        strided = torch.ones(8, 4).t()  # not contiguous: gloo's own, reduced in place
        if went(strided) or not torch.equal(strided, torch.full((4, 8), float(world))):
            bad.append("all-reduce of a strided tensor")
        if rank in (0, 2):  # a subgroup: the pair's two tensors only
            x = torch.full((16,), float(rank))
            if not went(x, group=pair) or not torch.equal(x, torch.full((16,), 2.0)):
                bad.append(f"all-reduce over the pair: {x}")
    finally:
        dist.all_to_all_single = real


def _sparse_all_to_all_cases(rank: int, world: int) -> None:
    """A re-cut's all-to-all (``all_to_all_flat(..., point_to_point=True)``) goes point to
    point on gloo, never through torch's all-to-all, and gives torch's rows: for a
    re-cut's splits, splits with a peer that only sends, and rows for every peer; without
    the flag, and with ``GLOO_ALL_TO_ALL = "native"``, torch's own call runs."""
    from shardc.core.placement import restripe
    from shardc.runtime import algorithms as A

    real = dist.all_to_all_single
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    plans = {"re-cut": [list(restripe(8 * world, 1, -2, r, world).send_splits) for r in range(world)],
             # rank r sends 2 rows to rank r+1 and 1 to itself
             "one way": [[2 if j == (r + 1) % world else 1 if j == r else 0 for j in range(world)]
                         for r in range(world)],
             "every peer": [[1 + (r + j) % 3 for j in range(world)] for r in range(world)]}
    try:
        dist.all_to_all_single = counted
        for name, sends in plans.items():
            ins = sends[rank]
            outs = [sends[s][rank] for s in range(world)]
            for p2p, how, async_op in ((True, "point_to_point", False), (True, "point_to_point", True),
                                       (False, "point_to_point", True), (True, "native", False)):
                A.GLOO_ALL_TO_ALL = how
                x = torch.arange(sum(ins) * 3, dtype=torch.int64).view(-1, 3) + 1000 * rank
                out = torch.full((sum(outs), 3), -1, dtype=torch.int64)
                del calls[:]
                work = A.all_to_all_flat(out, x, outs, ins, async_op=async_op, point_to_point=p2p)
                if async_op:
                    work.wait()
                assert bool(calls) == (not p2p or how == "native"), (name, p2p, how, calls)
                want = torch.empty_like(out)
                real(want, x, outs, ins)
                assert torch.equal(out, want), (name, rank, out, want)
    finally:
        dist.all_to_all_single = real
        A.GLOO_ALL_TO_ALL = "point_to_point"


def test_collectives_by_all_to_all_on_4_gloo_ranks(ranks) -> None:
    ranks.run(_cases, 4)


def test_sparse_all_to_all_goes_point_to_point_on_4_gloo_ranks(ranks) -> None:
    ranks.run(_sparse_all_to_all_cases, 4)
