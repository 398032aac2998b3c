"""Train a GPT written for one device on a 4D mesh of ranks.

    torchrun --nproc-per-node 8 examples/train_gpt.py --mesh x2y2z2d1 --steps 10

On CPU it uses gloo, on CUDA NCCL (one GPU per rank); nothing else changes.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import shardc
from shardc.models import GPT, lm_batch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", default="x2y2z2d1")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = "cuda"
    mesh = shardc.Mesh.parse(args.mesh)
    torch.manual_seed(0)  # every rank builds the same full model; compile keeps its shard
    model = GPT.peer().to(device)
    sm = shardc.compile(model, mesh, example_inputs=lm_batch(16, 64, 512, device=device))
    opt = torch.optim.AdamW(sm.parameters(), lr=args.lr)
    for step in range(args.steps):
        x, y = lm_batch(16, 64, 512, step=step, device=device)
        loss = sm(shardc.shard_batch(x, mesh), shardc.shard_batch(y, mesh))
        loss.backward()
        opt.step()
        opt.zero_grad()
        g = shardc.global_mean(loss, mesh)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {g.item():.5f}")
    if dist.get_rank() == 0:
        print(shardc.comm_report(sm))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
