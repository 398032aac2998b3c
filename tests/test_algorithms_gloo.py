"""The runtime's reduce-scatter on gloo (``runtime/algorithms.py``): an all-to-all, then
each rank reduces the blocks it received. Checked on 4 real gloo processes against the
exact reduction of every rank's input, for every op, dtype and call form the runtime
uses, and against gloo's own reduce-scatter where gloo has one."""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness import run_on_ranks

OPS = ("SUM", "MAX", "MIN", "PRODUCT")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64)


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
                eps = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10,
                       torch.float32: 2 ** -23, torch.float64: 2 ** -52}.get(dt, 0.0)
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
    assert not bad, "\n".join(bad)


def test_reduce_scatter_by_all_to_all_on_4_gloo_ranks() -> None:
    run_on_ranks(_cases, 4)
