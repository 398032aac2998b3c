"""Checkpoint figures: the peers' GPT (3.4M parameters) with AdamW, one step, saved on
one mesh and loaded into another; prints each rank's file sizes and the times.

    torchrun --nproc-per-node 4 examples/checkpoint_figures.py --dir /tmp/ckpt-figures

Every rank writes about a quarter of the bytes on every mesh: sharded meshes write their
shards, replicated ones (d4) spread the copies' writes over the replicas.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import shardc
from shardc.tools.models import GPT, lm_batch

CASES = [("x1y1z4d1", "x2y2z1d1"), ("x1y1z1d4", "x4y1z1d1"), ("x2y1z2d1", "x1y1z1d4")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT.peer()
    batch = lm_batch(8, 64, 512)
    for saved_on, loaded_on in CASES:
        mesh = shardc.Mesh.parse(saved_on)
        sm = shardc.compile(model, mesh, example_inputs=batch)
        opt = torch.optim.AdamW(sm.parameters())
        sm(*[shardc.shard_batch(t, mesh) for t in batch]).backward()
        opt.step()
        dist.barrier()
        t = time.perf_counter()
        d = shardc.checkpoint.save(sm, opt, os.path.join(args.dir, saved_on), step=1)
        t_save = time.perf_counter() - t
        sm2 = shardc.compile(model, shardc.Mesh.parse(loaded_on), example_inputs=batch)
        opt2 = torch.optim.AdamW(sm2.parameters())
        dist.barrier()
        t = time.perf_counter()
        shardc.checkpoint.load(sm2, opt2, os.path.join(args.dir, saved_on))
        t_load = time.perf_counter() - t
        t = time.perf_counter()
        shardc.checkpoint.load(sm2, opt2, os.path.join(args.dir, saved_on), verify=False)
        t_noverify = time.perf_counter() - t
        if rank == 0:
            sizes = {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d))}
            print(f"{saved_on}: files {sizes}, total {sum(sizes.values()) / 2**20:.2f} MiB; "
                  f"save {t_save:.2f} s; load into {loaded_on} {t_load:.2f} s "
                  f"(verify=False {t_noverify:.2f} s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
