"""Train a GPT written for one device on a 4D mesh of ranks.

    torchrun --nproc-per-node 8 examples/train_gpt.py --mesh x2y2z2d1 --steps 10

On CPU it uses gloo, on CUDA NCCL with one GPU per process (``LOCAL_RANK`` picks it);
nothing else changes. Two nodes of 8 GPUs, x and y inside a node (see docs/gpus.md):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD:29500 examples/train_gpt.py --mesh x4y2z2d1

Prints the loss per step (a progress bar from 20 steps on), then tokens/s per rank and
model FLOPs utilisation (``shardc.planning.throughput``), then the communication report.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import shardc
from shardc.core.launch import init_distributed
from shardc.planning.throughput import model_flops, summed_peak_flops, throughput
from shardc.tools.models import GPT, lm_batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", default="x2y2z2d1")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--backend", choices=("eager", "inductor"), default="eager")
    args = p.parse_args()
    device = init_distributed()  # NCCL on the LOCAL_RANK-th GPU, else gloo on CPU
    rank0 = dist.get_rank() == 0
    mesh = shardc.Mesh.parse(args.mesh)
    torch.manual_seed(0)  # every rank builds the same full model; compile keeps its shard
    model = GPT.peer().to(device)
    batch = lm_batch(16, 64, 512, device=str(device))
    sm = shardc.compile(model, mesh, example_inputs=batch, backend=args.backend)
    opt = torch.optim.AdamW(sm.parameters(), lr=args.lr)
    flops = model_flops(model, batch)
    peak, peak_source = summed_peak_flops(device)
    times = []
    from rich.progress import Progress, TextColumn

    with Progress(*Progress.get_default_columns(), TextColumn("{task.fields[info]}"),
                  disable=not rank0 or args.steps < 20) as progress:
        task = progress.add_task("training", total=args.steps, info="")
        for step in range(args.steps):
            x, y = lm_batch(16, 64, 512, step=step, device=str(device))
            t = time.perf_counter()
            loss = sm(shardc.shard_batch(x, mesh), shardc.shard_batch(y, mesh))
            loss.backward()
            opt.step()
            opt.zero_grad()
            g = shardc.global_mean(loss, mesh).item()  # waits for every rank's step
            times.append(time.perf_counter() - t)
            if rank0 and args.steps < 20:
                print(f"step {step}: loss {g:.5f} ({times[-1]:.3f} s)")
            progress.update(task, advance=1, info=f"loss {g:.5f}")
    if rank0:
        # the first step creates process groups (and compiles, with inductor): left out
        tp = throughput(flops, statistics.median(times[1:] or times), mesh.world_size, peak)
        print(f"{tp}; peak {peak_source}, {peak / 1e12:.3f} TFLOP/s over {mesh.world_size} ranks")
        print(shardc.comm_report(sm))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
