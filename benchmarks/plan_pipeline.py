"""What the planner proposes for a 70B-class model on two nodes of eight GPUs, with and
without pipeline stages, and why (the terms of each candidate).

    python benchmarks/plan_pipeline.py [--batch 32] [--seq 2048] [--top 12]

The model is a GPT of 80 blocks, hidden 8192, 64 heads, vocabulary 51,200 (65B
parameters), bf16, on the meta device (nothing allocated), activation checkpointing per
block. The machine is written out below from data-sheet figures (an assumption, not a
measurement): H100 SXM nodes, NVSwitch inside (450 GB/s a direction per GPU, the same
for every group shape), eight 400 Gb/s NICs a node (400 GB/s), 80 GB a GPU, and a GEMM
rate of 600 TFLOP/s (about 60% of the bf16 peak, what large GEMMs sustain).
"""
from __future__ import annotations

import argparse
import time

import torch

import shardc
from shardc.core.machine import Machine
from shardc.tools.models import GPT

GB = 1e9


def two_h100_nodes() -> Machine:
    table = {(i, s): 450 * GB for i in (1, 2, 4) for s in (2, 4, 8) if i * s <= 8}
    return Machine(gpus_per_node=8, memory_bytes=80 * GB, inter_node_bandwidth=400 * GB,
                   intra_node_bandwidth=table, gemm_flops=600e12, memory_bandwidth=3.35e12,
                   op_overhead=5e-6, bandwidth_overlap=0.5, latency_overlap=0.5, inter_node_latency=2e-5,
                   name="2 x 8 H100 (data sheet)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    with torch.device("meta"):
        model = GPT(vocab=51200, dim=8192, layers=80, heads=64, seq=args.seq).to(torch.bfloat16)
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    n = sum(p.numel() for p in model.parameters())
    machine = two_h100_nodes()
    print(f"GPT {n / 1e9:.1f}B parameters, {args.batch} x {args.seq} tokens, on {machine.name}")
    for pipeline in (False, True):
        t0 = time.perf_counter()
        plan = shardc.plan(model, 16, machine, (tokens, tokens), pipeline=pipeline, checkpointing=True,
                           verify=False, exact_top=args.top)
        print(f"\npipeline={pipeline}: {len(plan)} candidates, planned in {time.perf_counter() - t0:.0f} s; "
              f"dropped: {plan.drop_reasons()}")
        print(f"{'mesh':<22} {'step s':>8} {'compute':>8} {'hidden':>7} {'bubble':>7} "
              + " ".join(f"{a:>7}" for a in ("x", "y", "z", "data", "pipe")) + f" {'GiB/rank':>9}")
        for c in plan[:args.top]:
            spec = c.mesh.spec() + (f" m={c.microbatches}" if c.microbatches else "")
            print(f"{spec:<22} {c.predicted_step_s:8.3f} {c.compute_s:8.3f} {c.hidden_s:7.3f} {c.bubble_s:7.3f} "
                  + " ".join(f"{c.per_axis_s.get(a, 0.0):7.3f}" for a in ("x", "y", "z", "data", "pipe"))
                  + f" {c.memory_bytes_per_rank / 2**30:9.1f}")


if __name__ == "__main__":
    main()
