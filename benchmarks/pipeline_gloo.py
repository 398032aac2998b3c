"""CPU ranks on gloo: shardc's pipeline against torch.distributed.pipelining, side by side.

    python benchmarks/pipeline_gloo.py --ranks 2 --mesh p2x1y1z1d1 --microbatches 4 --schedules 1f1b,zero_bubble
    python benchmarks/pipeline_gloo.py --ranks 8 --mesh p4x1y1z1d2 --microbatches 8 --schedules gpipe
    python benchmarks/pipeline_gloo.py --ranks 2 --mesh p2x1y1z1d1 --microbatches 4 --schedules interleaved,1f1b

shardc runs each schedule given (each its own compiled copy of the model); torch runs the
first one (1F1B where that is zero bubble). Both run the same GPT (``GPT.peer()``'s shape with ``--layers`` blocks, untied head) from
the same weights, cut into the same stages (the blocks shardc's cut gave each stage), with
the same schedule (torch's ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``, this
one over the same chunks a rank), micro-batches and AdamW;
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
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.nn.parallel import DistributedDataParallel

    import shardc
    from shardc.runtime.groups import axis_groups, pipe_group
    from shardc.tools.models import GPT, lm_batch

    mesh = shardc.Mesh.parse(args.mesh)
    torch.manual_seed(0)
    model = GPT(vocab=512, dim=256, layers=args.layers, heads=4, seq=64, fused_qkv=False, bias=False, tie=False)
    peer_model = copy.deepcopy(model)
    batch = lm_batch(args.batch, 64, 512)
    schedules = args.schedules.split(",")
    sms = [shardc.compile(copy.deepcopy(model), mesh, example_inputs=batch, microbatches=args.microbatches,
                          schedule=sch, backend=args.backend) for sch in schedules]
    sm = sms[0]
    local = [shardc.shard_batch(t, mesh) for t in batch]
    opts = [torch.optim.AdamW(x.parameters(), lr=1e-4) for x in sms]

    # torch's pipeline over the same stages: the blocks shardc gave this rank's stage (or
    # each of its chunks, stage c * p + s, under the interleaved schedule)
    s, p = sm.index, mesh.pipe
    n_stages = len(sm.stages)
    mods: list[nn.Module] = []
    stages = []
    for st in sm.mine:
        first = int(st.blocks[0].split(".")[-1])
        last = int(st.blocks[-1].split(".")[-1])
        mod: nn.Module = _TorchStage(peer_model, first, last, st.index == 0, st.index == n_stages - 1)
        if mesh.data > 1:
            mod = DistributedDataParallel(mod, process_group=axis_groups(mesh)["data"])
        mods.append(mod)
        stages.append(PipelineStage(mod, st.index, n_stages, torch.device("cpu"), group=pipe_group(mesh)))
    if schedules[0] == "interleaved":
        kind: Any = ScheduleInterleaved1F1B
        sched = kind(stages, n_microbatches=args.microbatches, loss_fn=_loss)
    else:
        kind = ScheduleGPipe if schedules[0] == "gpipe" else Schedule1F1B
        sched = kind(stages[0], n_microbatches=args.microbatches, loss_fn=_loss)
    peer_opt = torch.optim.AdamW([q for mod in mods for q in mod.parameters()], lr=1e-4)

    def shardc_step(i: int) -> float:
        loss = sms[i](*local)
        loss.backward()
        opts[i].step()
        opts[i].zero_grad(set_to_none=True)
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

    first_losses = [timed(lambda i=i: shardc_step(i))[1] for i in range(len(sms))] + [timed(torch_step)[1]]
    # torch's loss is its last stage's, over that rank's data shard: the batch's is the mean
    # over the last stage's data ranks (equal shards), as shardc returns on every rank
    shards: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shards, first_losses[-1])
    first_losses[-1] = statistics.mean(x for x in shards if x is not None)
    for _ in range(args.warmup - 1):
        for i in range(len(sms)):
            timed(lambda i=i: shardc_step(i))
        timed(torch_step)
    times: list[list[float]] = [[] for _ in range(len(sms) + 1)]
    idle: list[list[float]] = [[] for _ in sms]
    for _ in range(args.rounds):
        for i in range(len(sms)):
            times[i].append(timed(lambda i=i: shardc_step(i))[0])
            idle[i].append(sms[i].idle_fraction())
        times[-1].append(timed(torch_step)[0])
    idles: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(idles, [statistics.median(x) for x in idle])
    if rank == dist.get_world_size() - 1:
        print(f"shardc backend {args.backend}; mesh {mesh.spec()}, {args.layers} blocks, batch {args.batch}, "
              f"{args.microbatches} micro-batches, {args.rounds} rounds")
        print(f"stages: {[st.blocks for st in sm.stages]}")
        names = [f"shardc {x}" for x in schedules] + [f"torch.distributed.pipelining {kind.__name__}"]
        print("first step's loss: " + ", ".join(f"{n} {v:.6f}" for n, v in zip(names, first_losses)))
        peer = statistics.median(times[-1])
        for i, n in enumerate(names[:-1]):
            med = statistics.median(times[i])
            paired = statistics.median(x / y for x, y in zip(times[i], times[-1]))
            line = (f"{n}: median step {med * 1e3:.1f} ms, {med / peer:.3f}x torch's (paired {paired:.3f}); "
                    f"idle share per rank {[round(r[i], 3) for r in idles]}, the schedule's bubble "
                    f"{sms[i].bubble_formula():.3f}")
            if i > 0:
                own = statistics.median(x / y for x, y in zip(times[i], times[0]))
                line += f"; {med / statistics.median(times[0]):.3f}x shardc {schedules[0]} (paired {own:.3f})"
            print(line)
        print(f"{names[-1]}: median step {peer * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mesh", default="p2x1y1z1d1")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedules", default="1f1b",
                    help="comma-separated: gpipe, 1f1b, interleaved, zero_bubble (torch runs the first; "
                         "1F1B for zero_bubble)")
    ap.add_argument("--backend", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank, args=(args.ranks, f"{d}/store", args), nprocs=args.ranks, join=True,
                           start_method="spawn")


if __name__ == "__main__":
    main()
