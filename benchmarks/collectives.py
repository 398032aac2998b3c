"""What one all-reduce costs against a reduce-scatter plus an all-gather of the same buffer.

    python benchmarks/collectives.py --world 8 --mb 13 --rounds 5

ZeRO over data (``compile(shard_optimizer=True)``) replaces each bucket's all-reduce by a
reduce-scatter and an all-gather that move the same bytes in the ring model; whether that
costs the same time depends on the backend's algorithms. This times the three collectives
of torch.distributed on one buffer of ``--mb`` MiB (fp32) over ``--world`` ranks (gloo
on CPU, NCCL when every rank has a GPU), interleaved round after round with a barrier
around each, and prints each one's median and ``(reduce-scatter + all-gather) /
all-reduce``.

The reduce-scatter is timed twice: torch.distributed's own, and the one shardc's runtime
issues (``runtime/algorithms.py``: on gloo an all-to-all, then each rank reduces the
blocks it received; elsewhere the same call as torch's). CPU time a rank (the process's,
gloo's threads included) is printed beside the wall time: on CPU ranks the bytes a
collective moves are CPU work.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardc.runtime.algorithms import all_gather_flat as all_gather
from shardc.runtime.algorithms import reduce_scatter_flat

# torch's own reduce-scatter (under whichever name this torch has), to time beside shardc's
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    n = int(args.mb * 2 ** 20 / 4) // world * world
    x = torch.randn(n, device=device)
    piece = torch.empty(n // world, device=device)
    full = torch.empty(n, device=device)
    calls = {"all_reduce": lambda: dist.all_reduce(x),
             "reduce_scatter": lambda: reduce_scatter(piece, x),
             "reduce_scatter (shardc)": lambda: reduce_scatter_flat(piece, x),
             "all_gather": lambda: all_gather(full, piece)}
    times: dict[str, list[float]] = {k: [] for k in calls}
    cpus: dict[str, list[float]] = {k: [] for k in calls}
    for rnd in range(args.rounds + 1):  # the first round warms up
        for name, call in calls.items():
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            call()
            if cuda:
                torch.cuda.synchronize()
            if rnd:
                times[name].append(time.perf_counter() - t)
                cpus[name].append(time.process_time() - c)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, {k: statistics.median(v) for k, v in cpus.items()})
    if rank == 0:
        with open(out, "w") as f:
            for name, ts in times.items():
                cpu = statistics.mean(e[name] for e in every)
                f.write(f"{name}\t{statistics.median(ts)}\t{cpu}\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--mb", type=float, default=13.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "times.tsv")
        mp.spawn(_rank, args=(args.world, os.path.join(d, "store"), args, out), nprocs=args.world)
        rows = [line.rstrip("\n").split("\t") for line in open(out)]
    med = {k: float(t) for k, t, _ in rows}
    print(f"{args.world} ranks, {args.mb:g} MiB fp32, median of {args.rounds} rounds, "
          f"torch {torch.__version__}")
    for name, t, cpu in rows:
        print(f"  {name:24s} {1e3 * float(t):8.1f} ms   CPU a rank {1e3 * float(cpu):7.1f} ms")
    for rs in ("reduce_scatter", "reduce_scatter (shardc)"):
        ratio = (med[rs] + med["all_gather"]) / med["all_reduce"]
        print(f"  ({rs} + all-gather) / all-reduce: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
