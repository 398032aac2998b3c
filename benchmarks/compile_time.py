"""Compile time, cold and warm: shardc's backend="inductor" beside torch.compile(model).

    python benchmarks/compile_time.py [--shape peer]

Each figure comes from a fresh process: the first training step's time less a later
step's (what the first step spends compiling), with inductor's caches in a new empty
directory (cold) or in the directory the cold run filled (warm). torch.compile(model)
and shardc (a mesh of one, gloo, backend="inductor") each get their own directories.
shardc's figure includes tracing and building the step program, which ``shardc.compile``
and the first call do; torch.compile's includes dynamo's trace.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def _child(variant: str, shape: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    import shardc
    from shardc.tools.models import GPT, lm_batch

    torch.set_num_threads(1)
    shapes = {"peer": (GPT.peer, (16, 64, 512)), "tiny": (lambda: GPT(), (8, 16, 64))}
    make, (b, t, v) = shapes[shape]
    torch.manual_seed(0)
    model, batch = make(), lm_batch(b, t, v)
    if variant != "torch.compile":
        with tempfile.TemporaryDirectory() as d:
            dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
    t0 = time.perf_counter()
    if variant == "torch.compile":
        fn = torch.compile(model)
    else:
        fn = shardc.compile(model, shardc.Mesh(), example_inputs=batch, backend="inductor")
    fn(*batch).backward()
    first = time.perf_counter() - t0
    steps = []
    for _ in range(2):
        s = time.perf_counter()
        fn(*batch).backward()
        steps.append(time.perf_counter() - s)
    print(json.dumps({"compile": first - min(steps), "step": min(steps)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("peer", "tiny"), default="peer")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args.child, args.shape)
        return
    print(f"compile time (s): the first step less a later one, shape {args.shape}, one process, 1 thread")
    for variant in ("torch.compile", "shardc:inductor"):
        with tempfile.TemporaryDirectory() as cache:
            row = []
            for kind in ("cold", "warm"):
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
                out = subprocess.run([sys.executable, __file__, "--child", variant, "--shape", args.shape],
                                     env=env, capture_output=True, text=True, check=True).stdout
                res = json.loads(out.strip().splitlines()[-1])
                row.append(f"{kind} {res['compile']:6.1f}")
            print(f"  {variant:<16} " + "   ".join(row))


if __name__ == "__main__":
    main()
