"""The first training step on gloo ranks with the step program traced once per class of
equal ranks (``shardc/program/share.py``) against every rank tracing its own.

    python benchmarks/share_trace.py [--ranks 8] [--rounds 2] [--meshes x1y1z1d8,...]

One spawn of ``--ranks`` processes; for each model and mesh, each round compiles the model
twice and times the first step (forward and backward, which builds the step program),
sharing on and off in alternating order, from a barrier to a barrier (the slowest rank's
time). Prints the median per setting, their ratio, and how the ranks got their programs.
On a machine with fewer cores than ranks the ranks' traces queue for the cores, which is
what sharing removes; with a core per rank it saves CPU, not wall time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _rank(rank: int, world: int, store: str, meshes: list[str], rounds: int, out: str) -> None:
    from models import GPT, llama  # tests/models.py

    import shardc
    from shardc.program import share
    from shardc.tools.models import lm_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    batch = lm_batch(8, 16, 64)
    rows = []
    for name, make in (("gpt", lambda: GPT(vocab=64, dim=32, layers=2, heads=4, seq=16)),
                       ("llama", lambda: llama(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, seq=16))):
        torch.manual_seed(0)
        model = make()
        for spec in meshes:
            mesh = shardc.Mesh.parse(spec)
            times: dict[bool, list[float]] = {True: [], False: []}
            how: dict[str, int] = {}
            for k in range(rounds):
                for enabled in ((True, False) if k % 2 == 0 else (False, True)):
                    share.ENABLED = enabled
                    sm = shardc.compile(model, mesh, example_inputs=batch)
                    local = [shardc.shard_batch(x, mesh) for x in batch]
                    before = dict(share.COUNTS)
                    dist.barrier()
                    t = time.perf_counter()
                    sm(*local).backward()
                    dist.barrier()
                    times[enabled].append(time.perf_counter() - t)
                    if enabled:
                        how = {k: share.COUNTS[k] - before.get(k, 0) for k in share.COUNTS}
            share.ENABLED = True
            counts: list = [None] * world
            dist.all_gather_object(counts, how)
            total = {k: sum(c.get(k, 0) for c in counts) for k in ("traced", "received", "retraced")}
            rows.append((name, spec, statistics.median(times[True]), statistics.median(times[False]), total))
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{world} gloo ranks on {os.cpu_count()} cores, torch {torch.__version__}, "
                    f"first step (s), median of {rounds}\n")
            f.write("| model | mesh | shared | every rank traces | ratio | traced / received |\n")
            f.write("| --- | --- | --- | --- | --- | --- |\n")
            for name, spec, on, off, total in rows:
                f.write(f"| {name} | `{spec}` | {on:.2f} | {off:.2f} | {on / off:.3f}x | "
                        f"{total['traced']} / {total['received']}"
                        + (f" ({total['retraced']} traced again)" if total["retraced"] else "") + " |\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--meshes", default="x1y1z1d8,x1y1z8d1,x1y1z2d4,x2y1z2d2,x2y2z2d1")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.txt")
        mp.spawn(_rank, (args.ranks, os.path.join(d, "store"), args.meshes.split(","), args.rounds, out),
                 nprocs=args.ranks)
        with open(out) as f:
            print(f.read(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
