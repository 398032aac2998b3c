"""What the GPT benchmarks on gloo ranks share: their command line, the spawn of the ranks
and the result file rank 0 writes, the batch, and timing several compiled programs in
turns (step by step, so that the machine's load falls on each alike)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def gpt_arguments(description: str, extra: dict[str, tuple[str, list[str]]] | None = None,
                  **defaults: int) -> argparse.Namespace:
    """``--ranks --seq --batch --dim --layers --heads --vocab --rounds``, with the script's
    own defaults, and the script's ``extra`` choices (name -> (default, choices))."""
    ap = argparse.ArgumentParser(description=description)
    base = {"ranks": 4, "seq": 1024, "batch": 1, "dim": 128, "layers": 2, "heads": 4, "vocab": 512,
            "rounds": 5}
    for name, value in {**base, **defaults}.items():
        ap.add_argument(f"--{name}", type=int, default=value)
    for name, (default, choices) in (extra or {}).items():
        ap.add_argument(f"--{name}", default=default, choices=choices)
    return ap.parse_args()


def run_ranks(worker: Callable[..., None], args: argparse.Namespace) -> None:
    """Spawn ``args.ranks`` processes running ``worker(rank, world, store, args, out)`` and
    print the file rank 0 wrote to ``out``."""
    tmp = tempfile.mkdtemp()
    out = os.path.join(tmp, "result.txt")
    mp.spawn(worker, args=(args.ranks, os.path.join(tmp, "store"), args, out), nprocs=args.ranks)
    print(open(out).read(), end="")


def start(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)


def finish(rank: int, out: str, lines: list[str] | None) -> None:
    """Rank 0 writes its result lines to ``out`` (run_ranks prints them); every rank leaves."""
    if rank == 0 and lines is not None:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def lm_batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),
            torch.randint(0, args.vocab, (args.batch, args.seq), generator=g))


def times_in_turns(sms: dict[str, Any], step: Callable[[Any], None], rounds: int,
                   warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of each program's steps, the programs stepped in turns, round by round."""
    times: dict[str, list[float]] = {k: [] for k in sms}
    for _ in range(warmup):
        for sm in sms.values():
            step(sm)
    for _ in range(rounds):
        for k, sm in sms.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(sm)
            dist.barrier()
            times[k].append(time.perf_counter() - t0)
    return times


def step_figures(sms: dict[str, Any], local: list[Any], rounds: int,
                 peers: dict[str, Callable[[], None]] | None = None
                 ) -> tuple[dict[str, list[float]], dict[str, int], dict[str, int]]:
    """For each compiled program, and each peer (a function running one forward and
    backward of a torch system, its gradients cleared), in turns: its step times
    (``times_in_turns``) and the measured peak of a step; for the compiled programs also
    the memory estimate's step peak."""
    from shardc.planning.memory import estimate, measured_peak  # noqa: PLC0415 - after sys.path

    def step(sm: Any) -> None:
        sm(*local).backward()
        for p in sm.parameters():
            p.grad = None

    runs: dict[str, Callable[[], None]] = {k: (lambda sm=sm: step(sm)) for k, sm in sms.items()}
    runs.update(peers or {})
    times = times_in_turns(runs, lambda run: run(), rounds)
    peaks = {k: measured_peak(run) for k, run in runs.items()}
    predicted = {k: estimate(sm).step_peak for k, sm in sms.items()}
    return times, peaks, predicted
