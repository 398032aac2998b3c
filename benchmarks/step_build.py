"""How long building the step program takes (trace, split, step passes), per model
and mesh, in one process standing for rank 0 of a mesh of 8 (torch's "fake" process
group: nothing is sent, which tracing does not need).

    python benchmarks/step_build.py                 # transformers' GPT-2 and Llama, 5 meshes

Each case compiles the model for the mesh and runs one training step; the figure is the
time of ``ShardedModule._build_joint`` (what the first step that needs gradients pays
once per input shape), summed over the cases.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main(argv: list[str] | None = None) -> int:
    from models import gpt2, llama  # tests/models.py: small real transformers models
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import shardc
    from shardc.program.module import ShardedModule

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--meshes", default="x2y2z2d1,x8y1z1d1,x1y1z8d1,x2y1z1d4,x1y2z2d2")
    args = ap.parse_args(argv)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    spent: list[float] = []
    build = ShardedModule._build_joint

    def timed(self, *a):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return build(self, *a)
        finally:
            spent.append(time.perf_counter() - t)

    ShardedModule._build_joint = timed  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
    for name, make in (("gpt2", gpt2), ("llama", llama)):
        torch.manual_seed(0)
        model = make()
        for spec in args.meshes.split(","):
            mesh = shardc.Mesh.parse(spec)
            sm = shardc.compile(model, mesh, example_inputs=batch)
            sm(*[shardc.shard_batch(x, mesh) for x in batch]).backward()
            print(f"{name}@{spec}: {spent[-1]:.3f} s")
    print(f"{len(spent)} step programs built in {sum(spent):.2f} s "
          f"({sum(spent) / len(spent):.3f} s each), torch {torch.__version__}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
