"""CPU ranks on gloo: shardc's pipeline against torch.distributed.pipelining, side by side.

    python benchmarks/pipeline_gloo.py --ranks 2 --mesh p2 --microbatches 4 --schedule 1f1b
    python benchmarks/pipeline_gloo.py --ranks 8 --mesh p4d2 --microbatches 8 --schedule gpipe

Both run the same GPT (``GPT.peer()``'s shape with ``--layers`` blocks, untied head) from
the same weights, cut into the same stages (the blocks shardc's cut gave each stage), with
the same schedule (torch's ``ScheduleGPipe`` / ``Schedule1F1B``), micro-batches and AdamW;
with a data axis torch's stages are DDP modules over the data group (its pipeline stage
defers their reduction to the last micro-batch, as shardc's no_sync does). Each round
runs one training step of each, in turns, with a barrier around every step, so both see
the same machine. Prints each one's median step time over the rounds, their ratio (also
per round, paired), the losses of the first step (they must agree) and shardc's measured
idle share of a step on each rank beside the schedule's bubble formula.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class _TorchStage(nn.Module):
    """Blocks ``first``..``last`` of the GPT, with the embeddings on the first stage and
    the final norm and head on the last (the head's logits go to torch's loss_fn)."""

    def __init__(self, model: nn.Module, first: int, last: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self.tok = model.tok if is_first else None
        self.pos = model.pos if is_first else None
        self.blocks = nn.ModuleList(model.blocks[first:last + 1])
        self.ln_f = model.ln_f if is_last else None
        self.head = model.head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for b in self.blocks:
            x = b(x)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _rank(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _measure(rank, args)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, args: argparse.Namespace) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel

    import shardc
    from shardc.runtime.groups import axis_groups, pipe_group
    from shardc.tools.models import GPT, lm_batch

    mesh = shardc.Mesh.parse(args.mesh)
    torch.manual_seed(0)
    model = GPT(vocab=512, dim=256, layers=args.layers, heads=4, seq=64, fused_qkv=False, bias=False, tie=False)
    peer_model = copy.deepcopy(model)
    batch = lm_batch(args.batch, 64, 512)
    sm = shardc.compile(model, mesh, example_inputs=batch, microbatches=args.microbatches,
                        schedule=args.schedule, backend=args.backend)
    local = [shardc.shard_batch(t, mesh) for t in batch]
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-4)

    # torch's pipeline over the same stages: the blocks shardc gave this rank's stage
    first = int(sm.stage.blocks[0].split(".")[-1])
    last = int(sm.stage.blocks[-1].split(".")[-1])
    s, p = sm.index, mesh.pipe
    mod: nn.Module = _TorchStage(peer_model, first, last, s == 0, s == p - 1)
    if mesh.data > 1:
        mod = DistributedDataParallel(mod, process_group=axis_groups(mesh)["data"])
    stage = PipelineStage(mod, s, p, torch.device("cpu"), group=pipe_group(mesh))
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    sched = kind(stage, n_microbatches=args.microbatches, loss_fn=_loss)
    peer_opt = torch.optim.AdamW(mod.parameters(), lr=1e-4)

    def shardc_step() -> float:
        loss = sm(*local)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def torch_step() -> float | None:
        losses: list[torch.Tensor] = []
        if s == 0:
            sched.step(local[0])
        elif s == p - 1:
            sched.step(target=local[1], losses=losses)
        else:
            sched.step()
        peer_opt.step()
        peer_opt.zero_grad(set_to_none=True)
        return sum(x.item() for x in losses) / len(losses) if losses else None

    def timed(fn: Any) -> tuple[float, Any]:
        dist.barrier()
        t = time.perf_counter()
        out = fn()
        dist.barrier()
        return time.perf_counter() - t, out

    first_losses = (timed(shardc_step)[1], timed(torch_step)[1])
    for _ in range(args.warmup - 1):
        timed(shardc_step)
        timed(torch_step)
    ours, theirs, idle = [], [], []
    for _ in range(args.rounds):
        ours.append(timed(shardc_step)[0])
        theirs.append(timed(torch_step)[0])
        idle.append(sm.idle_fraction())
    idles: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(idles, statistics.median(idle))
    if rank == dist.get_world_size() - 1:
        a, b = statistics.median(ours), statistics.median(theirs)
        paired = statistics.median(x / y for x, y in zip(ours, theirs))
        print(f"shardc backend {args.backend}; mesh {mesh.spec()}, {args.layers} blocks, batch {args.batch}, {args.microbatches} micro-batches, "
              f"schedule {args.schedule}, {args.rounds} rounds")
        print(f"stages: {[st.blocks for st in sm.stages]}")
        print(f"first step's loss: shardc {first_losses[0]:.6f}, torch.distributed.pipelining "
              f"{first_losses[1]:.6f}")
        print(f"median step: shardc {a * 1e3:.1f} ms, torch.distributed.pipelining {b * 1e3:.1f} ms, "
              f"ratio {a / b:.3f} (per round, paired: {paired:.3f})")
        from shardc.runtime.pipeline import bubble_fraction

        print(f"shardc idle share per rank (median): {[round(x, 3) for x in idles]}; the schedule's "
              f"bubble (p-1)/(m+p-1) = {bubble_fraction(args.schedule, p, args.microbatches):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mesh", default="p2")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    ap.add_argument("--backend", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank, args=(args.ranks, f"{d}/store", args), nprocs=args.ranks, join=True,
                           start_method="spawn")


if __name__ == "__main__":
    main()
