"""What sorting transformers' ``batched_mm`` experts at the trace
(``passes/picked_weights.py``) changes: a rank's CPU time and peak memory for forward and
backward, and the bytes of a step, against the pair-by-pair form as the model writes it.

    python benchmarks/picked_weights.py [--mesh x1y1z1d4] [--hidden 256] [--experts 8]

A transformers Mixtral (2 layers, top 2, ``_experts_implementation="batched_mm"``) is
compiled on one process under torch's fake process group (collectives are not executed:
the time and memory are the rank's compute alone; the bytes are the comm report's). The
pair-by-pair form copies each pair's expert weights (``gate_up_proj[expert_ids]``: S x
out x in elements a GEMM, S = tokens x top-k); the sorted form runs one grouped GEMM over
each expert's rows. ``expert_axes``, which only the sorted form takes, is not measured:
under the fake process group no rows reach the experts' ranks.
"""
from __future__ import annotations

import argparse
import time
import warnings


def _measure(spec: str, hidden: int, experts: int, sorted_form: bool, expert_axes: tuple | None
             ) -> tuple[float, float, float]:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import shardc
    import shardc.passes.trace as trace
    from shardc.planning.memory import measured_peak
    from shardc.tools.models import HFCausalLM

    rewrite = trace.group_picked_gemms
    if not sorted_form:  # the trace as it was: the model's bmm of looked-up weights
        trace.group_picked_gemms = lambda gm: 0  # type: ignore[assignment]
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
        cfg._experts_implementation = "batched_mm"
        torch.manual_seed(0)
        model = HFCausalLM(transformers.MixtralForCausalLM(cfg))
        g = torch.Generator().manual_seed(1)
        batch = tuple(torch.randint(0, 1024, (16, 128), generator=g) for _ in range(2))
        sm = shardc.compile(model, mesh, example_inputs=batch, expert_axes=expert_axes)
        xs = [shardc.shard_batch(t, mesh) for t in batch]
        sm(*xs).backward()  # builds the step program
        times = []
        for _ in range(3):
            t = time.process_time()
            sm(*xs).backward()
            times.append(time.process_time() - t)
        peak = measured_peak(lambda: sm(*xs).backward())
        step = sum(r.bytes for r in shardc.comm_report(sm).rows)
        return min(times), peak, step
    finally:
        trace.group_picked_gemms = rewrite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="x1y1z1d4")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    print(f"Mixtral batched_mm, 2 layers, hidden {args.hidden}, {args.experts} experts of "
          f"{2 * args.hidden}, top 2, 16 x 128 tokens, on {args.mesh}")
    # (expert_axes is not measured here: under the fake process group no rows arrive)
    for label, sorted_form in (("pair by pair (as written)", False), ("sorted, grouped GEMMs", True)):
        cpu, peak, step = _measure(args.mesh, args.hidden, args.experts, sorted_form, None)
        print(f"  {label:26s}: forward + backward {cpu * 1e3:6.0f} ms of CPU a rank, "
              f"peak {peak / 2**20:7.1f} MiB, step moves {step / 2**20:6.1f} MiB")


if __name__ == "__main__":
    main()
