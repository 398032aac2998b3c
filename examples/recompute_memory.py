"""Peak bytes allocated during one forward and backward, activation_checkpoint "none"
against "blocks" and "selective", on gloo CPU ranks (the figures of docs/recompute.md's
table):

    python examples/recompute_memory.py LAYERS MESH [MESH ...] [--prefetch-depth N] [--backend inductor]
                                        [--reshard-after-forward]
    python examples/recompute_memory.py 8 x1y1z1d4 x1y1z4d1

With ``--backend inductor`` the three run compiled: "blocks" as compiled segments under
autograd's checkpoint, "selective" inside the step program (``passes/remat.py``).

A GPT of LAYERS blocks (dim 64, 64 tokens, 16 sequences a rank); the peak is measured
from torch's profiler's allocation records (``shardc.planning.memory.measured_peak``, through
tests/test_recompute_gloo.py's ``_peak_growth``), the minimum of two steps after a
warm-up step, on rank 0.
"""
from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402
from harness import run_on_ranks  # noqa: E402
from models import GPT  # noqa: E402
from test_recompute_gloo import _peak_growth  # noqa: E402

import shardc  # noqa: E402


def _measure(rank: int, world_size: int, spec: str, layers: int, prefetch_depth: int,
             backend: str = "eager", reshard: bool = False) -> None:
    warnings.simplefilter("ignore")
    mesh = shardc.Mesh.parse(spec)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (16 * mesh.size("data") * mesh.size("z"), 64), generator=g)
    torch.manual_seed(0)
    model = GPT(dim=64, layers=layers, heads=8, seq=64)
    peak = {}
    for policy in ("none", "blocks", "selective"):
        # reshard_after_forward is a pass of the step program, which "blocks" does not run
        extra = {"reshard_after_forward": True} if reshard and policy != "blocks" else {}
        sm = shardc.compile(model, mesh, example_inputs=(tokens, tokens), activation_checkpoint=policy,
                            prefetch_depth=prefetch_depth, backend=backend, **extra)
        local = [shardc.shard_batch(tokens, mesh)] * 2
        _peak_growth(sm, local)
        peak[policy] = min(_peak_growth(sm, local) for _ in range(2))
    if rank == 0:
        also = " reshard_after_forward" if reshard else ""
        print(f"{spec} layers={layers} prefetch_depth={prefetch_depth} backend={backend}{also}: "
              f"none {peak['none'] / 2**20:.2f} MiB, blocks "
              f"{peak['blocks'] / 2**20:.2f} MiB (ratio {peak['none'] / peak['blocks']:.2f}), selective "
              f"{peak['selective'] / 2**20:.2f} MiB (ratio {peak['none'] / peak['selective']:.2f})", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("layers", type=int)
    ap.add_argument("meshes", nargs="+")
    ap.add_argument("--prefetch-depth", type=int, default=1)
    ap.add_argument("--backend", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--reshard-after-forward", action="store_true",
                    help="'none' and 'selective' (under inductor) with reshard_after_forward=True")
    args = ap.parse_args()
    for spec in args.meshes:
        run_on_ranks(_measure, shardc.Mesh.parse(spec).world_size, spec, args.layers,
                     args.prefetch_depth, args.backend, args.reshard_after_forward)
