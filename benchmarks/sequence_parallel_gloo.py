"""Sequence parallelism on gloo ranks: the activations of the norms, dropouts and residual
adds per rank, the measured peak and the step time, with it (the default) and without.

One spawn of ``--ranks`` processes compiles a GPT (dropout on) on ``x = ranks`` twice,
``sequence_parallel=True`` and ``False``, and times their steps in turns, step by step, so
the machine's load falls on both alike; the printed ratio is the median of the per-round
ratios.

    python benchmarks/sequence_parallel_gloo.py --ranks 4 --seq 1024 --batch 2 --rounds 5

Prints, per variant: the bytes per rank of the values the token-wise ops between the GEMMs
make (layer norms and dropouts; and with the residual and bias adds: read from the rank's
forward program, each value of the residual stream's shape at its local shape), the
measured peak of a step (``measured_peak``) beside the estimate (``shardc.memory``'s
``estimate``), the bytes a step moves (the comm report) and the median step time.
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch
from gloo_ranks import finish, gpt_arguments, lm_batch, run_ranks, start, step_figures

import shardc
from shardc.core.context import GLOBAL_VAL, PLACEMENT
from shardc.runtime import ops as R
from shardc.tools.models import GPT

aten = torch.ops.aten
# the ops between a block's GEMMs whose outputs sequence parallelism cuts
NORM_DROPOUT = {aten.layer_norm.default, R.global_dropout}
TOKEN_WISE = NORM_DROPOUT | {aten.add.Tensor}


def token_wise_bytes(sm: shardc.ShardedModule, hidden: list[int], ops: set = TOKEN_WISE) -> int:
    """Bytes per rank of the outputs of the norms, dropouts and adds of the rank's
    forward program whose value has the residual stream's shape (batch, sequence,
    hidden): not the column-parallel GEMMs' bias adds, whose features x cuts either way."""
    total = 0
    for n in sm.graph_module.graph.nodes:
        gval, lay = n.meta.get(GLOBAL_VAL), n.meta.get(PLACEMENT)
        if n.op != "call_function" or n.target not in ops or lay is None or \
                not isinstance(gval, torch.Tensor) or list(gval.shape) != hidden:
            continue
        total += math.prod(lay.local_shape(list(gval.shape), sm.mesh)) * gval.element_size()
    return total


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    start(rank, world, store)
    model = GPT(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, seq=args.seq,
                dropout=0.1)
    batch = lm_batch(args)
    mesh = shardc.Mesh(x=world)
    sms = {k: shardc.compile(model, mesh, example_inputs=batch, sequence_parallel=sp)
           for k, sp in (("sequence parallel", True), ("all-reduce", False))}
    local = [shardc.shard_batch(t, mesh) for t in batch]
    times, peaks, predicted = step_figures(sms, local, args.rounds)
    hidden = [args.batch, args.seq, args.dim]
    acts = {k: token_wise_bytes(sm, hidden) for k, sm in sms.items()}
    norms = {k: token_wise_bytes(sm, hidden, NORM_DROPOUT) for k, sm in sms.items()}
    moved = {k: shardc.comm_report(sm).total_bytes() for k, sm in sms.items()}
    if rank == 0:
        sp, ar = "sequence parallel", "all-reduce"
        ratio = statistics.median(a / b for a, b in zip(times[sp], times[ar]))
        lines = [f"GPT dim {args.dim}, {args.layers} layers, {args.heads} heads, batch {args.batch}, "
                 f"sequence {args.seq}, dropout 0.1, x = {world} gloo ranks, {args.rounds} rounds"]
        for k in sms:
            lines.append(f"  {k:18s} norms and dropouts {norms[k] / 2**20:7.2f} MiB, with adds {acts[k] / 2**20:7.2f} MiB, "
                         f"peak {peaks[k] / 2**20:8.1f} MiB (estimate {predicted[k] / 2**20:.1f}), "
                         f"moves {moved[k]:,} B a step, step {statistics.median(times[k]) * 1e3:8.1f} ms")
        lines += [f"  norm and dropout activations, all-reduce / sequence parallel: {norms[ar] / norms[sp]:.2f}x "
                  f"(with the residual and bias adds: {acts[ar] / acts[sp]:.2f}x)",
                  f"  peak sequence parallel / all-reduce: {peaks[sp] / peaks[ar]:.3f}x",
                  f"  bytes sequence parallel / all-reduce: {moved[sp] / moved[ar]:.4f}x",
                  f"  step sequence parallel / all-reduce: {ratio:.3f}x (median of per-round ratios)"]
    finish(rank, out, lines if rank == 0 else None)


def main() -> None:
    run_ranks(_worker, gpt_arguments(__doc__.splitlines()[0], seq=1024, batch=2, dim=256))


if __name__ == "__main__":
    main()
