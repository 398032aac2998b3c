"""transformers' Llama on gloo ranks with the sequence cut over context: its causal mask
folded to ``is_causal=True`` at compile time (``passes/causal_masks.py``, the default)
beside the same compile with the fold turned off, as shardc compiled it before.

Under an export transformers materialises its causal mask (a [B, 1, T, T] boolean,
computed from ``arange`` every step); left in, every rank computes it whole and the ring
takes its math form for masked blocks. Both programs are stepped in turns, so the
machine's load falls on both alike.

    python benchmarks/mask_fold.py --ranks 4 --seq 4096 --rounds 3

Prints the median step time of each, their ratio, each one's first loss (equal: the same
attention) and the measured peak of a rank's step.
"""
from __future__ import annotations

import argparse
import copy
import statistics

from gloo_ranks import finish, gpt_arguments, lm_batch, run_ranks, start, step_figures

import shardc
from shardc.passes import causal_masks
from shardc.tools.models import llama


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    start(rank, world, store)
    model = llama(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                  kv_heads=max(1, args.heads // 2), seq=args.seq)
    batch = lm_batch(args)
    mesh = shardc.Mesh(context=world)
    limit, sms = causal_masks.MOST_ELEMENTS, {}
    try:  # a limit below every mask: none is computed, so none is folded
        for name, most in (("folded", limit), ("mask kept", -1)):
            causal_masks.MOST_ELEMENTS = most
            sms[name] = shardc.compile(copy.deepcopy(model), mesh, example_inputs=batch)
    finally:
        causal_masks.MOST_ELEMENTS = limit
    local = [shardc.shard_batch(t, mesh) for t in batch]
    first = {k: float(sm(*local).detach()) for k, sm in sms.items()}
    times, peaks, _ = step_figures(sms, local, args.rounds)
    lines = [f"transformers Llama dim {args.dim}, {args.layers} layers, {args.heads} heads "
             f"({max(1, args.heads // 2)} key/value), sequence {args.seq}, context = {world} gloo ranks, "
             f"{args.rounds} rounds",
             *(f"  {k:10s} step {statistics.median(v) * 1e3:9.1f} ms, peak {peaks[k] / 2**20:7.1f} MiB"
               for k, v in times.items()),
             f"  folded / mask kept: "
             f"{statistics.median(a / b for a, b in zip(times['folded'], times['mask kept'])):.3f}x "
             "(median of per-round ratios)",
             "  first loss: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items())]
    finish(rank, out, lines if rank == 0 else None)


def main() -> None:
    run_ranks(_worker, gpt_arguments(__doc__.splitlines()[0], seq=4096, batch=1, dim=128, vocab=64,
                                     rounds=3))


if __name__ == "__main__":
    main()
