"""The compute of one rank's step, eager against backend="inductor", without communication.

    python benchmarks/inductor_compute.py --mesh x4y1z1d1 --steps 20

One process acts as rank 0 of a world of the mesh's size under torch's "fake" process
group: every collective is issued and counted as on real ranks but moves nothing and
returns at once, so what is timed is the rank's own work (its kernels, the runtime's calls,
the copies a collective's input needs). Both programs are compiled from the same model and
take turns step by step; prints the median forward and backward time of each and their
ratios. What gloo ranks add to this (waiting, and ranks sharing cores) is what
``backend_gloo.py`` measures.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="x4y1z1d1")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    import shardc
    from shardc.tools.models import GPT, lm_batch

    mesh = shardc.Mesh.parse(args.mesh)
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=mesh.world_size)
    try:
        torch.manual_seed(0)
        batch = lm_batch(16, 64, 512)
        local = [shardc.shard_batch(t, mesh) for t in batch]
        sms = {b: shardc.compile(GPT.peer(), mesh, example_inputs=batch, backend=b)
               for b in ("eager", "inductor")}
        times: dict[str, dict[str, list[float]]] = {b: {"forward": [], "backward": []} for b in sms}
        for i in range(args.warmup + args.steps):
            for b, sm in sms.items():
                t0 = time.perf_counter()
                loss = sm(*local)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                for q in sm.parameters():
                    q.grad = None
                if i >= args.warmup:
                    times[b]["forward"].append(t1 - t0)
                    times[b]["backward"].append(t2 - t1)
        med = {b: {k: statistics.median(v) for k, v in t.items()} for b, t in times.items()}
        print(f"peers' GPT, rank 0 of {mesh} (fake group: no communication), {args.steps} steps, "
              f"torch {torch.__version__}")
        for b, m in med.items():
            print(f"  {b:<9} forward {1e3 * m['forward']:7.1f} ms  backward {1e3 * m['backward']:7.1f} ms")
        print("  inductor / eager: forward {:.2f}, backward {:.2f}".format(
            *(med["inductor"][k] / med["eager"][k] for k in ("forward", "backward"))))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
