"""What one all-reduce costs against a reduce-scatter plus an all-gather of the same buffer.

    python benchmarks/collectives.py --world 8 --mb 13 --rounds 5
    python benchmarks/collectives.py --world 8 --small [--group 4]

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

``--small`` times small all-reduces instead, from 4 B to 1 MiB, over groups of ``--group``
ranks (all of them at once): torch.distributed's own against the exchange that shardc's
runtime uses on gloo up to ``GLOO_EXCHANGE_BYTES`` (``runtime/algorithms.py``), forced
at every size here to show where it stops paying.
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

from shardc.runtime import algorithms

# torch's own reduce-scatter (under whichever name this torch has), to time beside shardc's
from shardc.runtime.algorithms import _native_reduce_scatter as reduce_scatter
from shardc.runtime.algorithms import all_gather_flat as all_gather
from shardc.runtime.algorithms import all_reduce_flat, reduce_scatter_flat

SMALL_SIZES = (4, 8, 16, 256, 4096, 65536, 262144, 1048576)  # bytes


def _small(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    size = args.group or world
    group = None
    for first in range(0, world, size):  # every rank takes part in creating every group
        made = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            group = made
    # the exchange at every size timed, below and above the sizes the runtime gives it
    algorithms.GLOO_EXCHANGE_BYTES, algorithms._EXCHANGE_FROM = max(SMALL_SIZES), 0
    rows = {}
    for nbytes in SMALL_SIZES:
        x = torch.randn(max(1, nbytes // 4))
        reps = 20 if nbytes <= 65536 else 5  # one call of a few bytes is below the timer's noise
        calls = {"torch": lambda: [dist.all_reduce(x, group=group) for _ in range(reps)],
                 "exchange": lambda: [all_reduce_flat(x, group=group) for _ in range(reps)]}
        for name, call in calls.items():
            ts, cs = [], []
            for rnd in range(args.rounds + 1):
                dist.barrier()
                t, c = time.perf_counter(), time.process_time()
                call()
                dist.barrier()
                if rnd:
                    ts.append((time.perf_counter() - t) / reps)
                    cs.append((time.process_time() - c) / reps)
            rows[(nbytes, name)] = (statistics.median(ts), statistics.median(cs))
    every: list[Any] = [None] * world
    dist.all_gather_object(every, rows)
    if rank == 0:
        with open(out, "w") as f:
            for (nbytes, name), (t, _) in rows.items():
                cpu = statistics.mean(e[(nbytes, name)][1] for e in every)
                f.write(f"{nbytes} B {name}\t{t}\t{cpu}\n")


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                            rank=rank, world_size=world)
    if args.small:
        _small(rank, world, args, out)
        dist.destroy_process_group()
        return
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
    ap.add_argument("--small", action="store_true",
                    help="time all-reduces of 4 B to 1 MiB: torch's against the exchange")
    ap.add_argument("--group", type=int, default=0,
                    help="with --small: ranks a group (default: all)")
    args = ap.parse_args(argv)
    if args.small and args.group and args.world % args.group:
        ap.error(f"--group {args.group} does not divide --world {args.world}")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "times.tsv")
        mp.spawn(_rank, args=(args.world, os.path.join(d, "store"), args, out), nprocs=args.world)
        rows = [line.rstrip("\n").split("\t") for line in open(out)]
    if args.small:
        print(f"all-reduce over groups of {args.group or args.world} of {args.world} ranks, "
              f"median of {args.rounds} rounds, torch {torch.__version__}")
        for name, t, cpu in rows:
            print(f"  {name:18s} {1e3 * float(t):8.2f} ms   CPU a rank {1e3 * float(cpu):6.2f} ms")
        return 0
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
