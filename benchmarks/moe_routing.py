"""What a routing region (passes/rules/routing.py) changes for a mixture of experts: the
bytes of a step and a rank's CPU time for forward and backward, with the region and with
the sort gathered over the batch axes as it was before regions existed.

    python benchmarks/moe_routing.py [--mesh x1y1z1d4] [--hidden 512] [--experts 8]

A transformers Mixtral (2 layers, top 2, its default ``grouped_mm`` experts kernel) is
compiled on one process under torch's fake process group (collectives are not executed,
so the time is compute alone; the bytes are the comm report's). With the region each rank
routes its own tokens, and the experts' weights are data-parallel like every other weight
(their gradients all-reduced over the batch axes, what DDP moves). Gathered, every rank
computes every token's expert work (data x z times a rank's share) and so holds complete
expert gradients: fewer bytes where the experts' weights outweigh the batch's tokens, at
that multiple of the compute and of the activations' memory.
"""
from __future__ import annotations

import argparse
import time
import warnings


def _measure(spec: str, hidden: int, experts: int, region: bool) -> tuple[dict, float]:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import shardc
    import shardc.passes.rules.routing as routing
    from shardc.tools.models import HFCausalLM

    find = routing.find_regions
    if not region:  # the lowering as it was: every sort of the batch's rows gathered
        routing.find_regions = lambda graph: []  # type: ignore[assignment]
    try:
        mesh = shardc.Mesh.parse(spec)
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=mesh.world_size)
        cfg = transformers.MixtralConfig(
            vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=8, num_local_experts=experts,
            num_experts_per_tok=2, max_position_embeddings=256, use_cache=False,
            tie_word_embeddings=False)
        torch.manual_seed(0)
        model = HFCausalLM(transformers.MixtralForCausalLM(cfg))
        g = torch.Generator().manual_seed(1)
        batch = tuple(torch.randint(0, 1024, (16, 256), generator=g) for _ in range(2))
        sm = shardc.compile(model, mesh, example_inputs=batch)
        xs = [shardc.shard_batch(t, mesh) for t in batch]
        sm(*xs).backward()  # builds the step program
        times = []
        for _ in range(3):
            t = time.process_time()
            sm(*xs).backward()
            times.append(time.process_time() - t)
        by_phase: dict[str, float] = {}
        for r in shardc.comm_report(sm).rows:
            by_phase[r.phase] = by_phase.get(r.phase, 0) + r.bytes
        return by_phase, min(times)
    finally:
        routing.find_regions = find


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="x1y1z1d4")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    print(f"Mixtral, 2 layers, hidden {args.hidden}, {args.experts} experts of {2 * args.hidden}, "
          f"top 2, 16 x 256 tokens, on {args.mesh}")
    for region in (True, False):
        by_phase, cpu = _measure(args.mesh, args.hidden, args.experts, region)
        phases = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in by_phase.items())
        print(f"  {'routing region' if region else 'sort gathered '}: step {sum(by_phase.values()) / 2**20:.1f} MiB "
              f"({phases}); forward + backward {cpu * 1e3:.0f} ms of CPU a rank")


if __name__ == "__main__":
    main()
