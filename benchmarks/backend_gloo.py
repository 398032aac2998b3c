"""CPU ranks on gloo: shardc's eager program vs backend="inductor", side by side.

    python benchmarks/backend_gloo.py --ranks 2 --mesh x2y1z1d1 --rounds 7 [--pieces]
                                      [--activation-checkpoint blocks|selective]

Both programs are compiled in the same processes from the same model; each round runs
one training step of each, in turns (eager, inductor, eager, ...), with a barrier around
every step, so both see the same machine. ``--pieces`` adds a third program: the step
program's parts cut at every collective and random op and compiled piece by piece (what
``backend="inductor"`` ran before each part was compiled whole), to show what compiling
whole buys. Prints the median step time of each over the
rounds (after ``--warmup`` steps of each: groups, inductor's compilation, allocator),
their ratio (also per round, paired, and of the minima), tokens/s per rank and MFU (peak:
every rank's matmul, measured at once).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _measure(rank, args)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, args: argparse.Namespace) -> None:
    import shardc
    from shardc.planning.throughput import model_flops, summed_peak_flops, throughput
    from shardc.tools.models import GPT, lm_batch

    mesh = shardc.Mesh.parse(args.mesh)
    torch.manual_seed(0)
    model = GPT.peer() if args.model == "peer" else GPT()
    batch = lm_batch(16, 64, 512) if args.model == "peer" else lm_batch(8, 16, 64)
    local = [shardc.shard_batch(t, mesh) for t in batch]
    steps = {}
    programs = ("eager", "inductor", "pieces") if args.pieces else ("eager", "inductor")
    for name in programs:
        sm = shardc.compile(model, mesh, example_inputs=batch,
                            backend="eager" if name == "eager" else "inductor",
                            activation_checkpoint=args.activation_checkpoint)

        opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)

        def step(sm=sm, opt=opt, name=name) -> None:
            # the step program's runners are built on the first call
            with _cut_into_pieces() if name == "pieces" else contextlib.nullcontext():
                sm(*local).backward()
            opt.step()
            opt.zero_grad()
        steps[name] = step
    times: dict[str, list[float]] = {b: [] for b in steps}
    t0 = time.perf_counter()
    for i in range(args.warmup + args.rounds):
        for backend, step in steps.items():
            dist.barrier()
            t = time.perf_counter()
            step()
            dist.barrier()
            if i >= args.warmup:
                times[backend].append(time.perf_counter() - t)
        if i == args.warmup - 1 and rank == 0:
            print(f"warm-up (inductor compiles here) {time.perf_counter() - t0:.1f} s", flush=True)
    flops = model_flops(model, batch)
    peak, source = summed_peak_flops("cpu")
    if rank != 0:
        return
    print(f"{args.model} GPT ({flops.matmul_params / 1e6:.2f}M matmul parameters), {mesh}, "
          f"{args.rounds} rounds, torch {torch.__version__}; peak {peak / 1e9:.1f} GFLOP/s ({source}, "
          f"summed over {mesh.world_size} ranks)")
    med = {b: statistics.median(v) for b, v in times.items()}
    for backend, v in times.items():
        tp = throughput(flops, med[backend], mesh.world_size, peak)
        print(f"  {backend:<9} median {med[backend] * 1e3:8.1f} ms  (min {min(v) * 1e3:.1f}, max "
              f"{max(v) * 1e3:.1f})  {tp.tokens_per_s_per_rank:,.0f} tokens/s per rank  MFU "
              f"{100 * tp.mfu:.2f}%")
    # paired: each round's two steps ran back to back, so their ratio cancels most of
    # what a shared machine's load does to both
    for name in programs[1:]:
        ratios = [i / e for e, i in zip(times["eager"], times[name])]
        print(f"  {name} / eager: ratio of medians {med[name] / med['eager']:.3f}, median of "
              f"per-round ratios {statistics.median(ratios):.3f}, ratio of minima "
              f"{min(times[name]) / min(times['eager']):.3f}")


@contextlib.contextmanager
def _cut_into_pieces() -> Iterator[None]:
    """Build the step program's parts as the piecewise program (``InductorProgram``)."""
    from shardc.program import backend

    def pieces(gm: Any, b: str, part: str | None = None) -> Any:
        return backend.InductorProgram(gm)
    old = backend.build_runner
    import shardc.program.step_program as sp
    sp.build_runner = pieces
    try:
        yield
    finally:
        sp.build_runner = old


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--mesh", default="x2y1z1d1")
    p.add_argument("--model", choices=("peer", "small"), default="peer")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--pieces", action="store_true", help="also run the piecewise inductor program")
    p.add_argument("--activation-checkpoint", choices=("none", "blocks", "selective"), default="none",
                   help="both programs with this recompute (blocks, or selective under eager: the forward "
                        "program with autograd's backward; selective under inductor: a pass of the step program)")
    args = p.parse_args()
    if args.pieces and args.activation_checkpoint != "none":
        p.error("--pieces cuts the step program, which block recompute does not run")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(args.ranks, f"{d}/store", args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
