"""Context parallelism on gloo ranks: step time of the balanced and contiguous sequence
cuts side by side, and the activation memory per rank beside the uncut program's.

One spawn of ``--ranks`` processes compiles a GPT with the sequence cut over every rank
(``x1y1cGz1d1``) three ways: ring attention on the balanced cut (the default) and on the
contiguous cut, and Ulysses (``context_attention="ulysses"``, where the heads divide).
Their steps are timed in turns, step by step, so the machine's load falls on all alike;
the printed ratios are medians of the per-round ratios. The uncut figure is the same model
on the whole batch in one process, as one device runs it.

    python benchmarks/context_gloo.py --ranks 4 --seq 2048 --batch 1 --rounds 5

Prints: the median step time of each cut, balanced / contiguous, and the measured peak
(``shardc.memory.measured_peak``: bytes live at once above the start of the step) of a
rank's step on the context mesh against the uncut program's.
"""
from __future__ import annotations

import argparse
import statistics

from gloo_ranks import finish, gpt_arguments, lm_batch, run_ranks, start, step_figures

import shardc
from shardc.planning.memory import measured_peak
from shardc.tools.models import GPT


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    start(rank, world, store)
    model = GPT(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, seq=args.seq)
    batch = lm_batch(args)
    mesh = shardc.Mesh(context=world)
    variants = {"balanced": {"context_layout": "balanced"}, "contiguous": {"context_layout": "contiguous"},
                "ulysses": {"context_attention": "ulysses"}}
    if args.heads % world:
        del variants["ulysses"]  # its attentions would take the ring
    sms = {k: shardc.compile(model, mesh, example_inputs=batch, **kw) for k, kw in variants.items()}
    local = [shardc.shard_batch(t, mesh) for t in batch]
    times, peaks, predicted = step_figures(sms, local, args.rounds)
    # the uncut program of the same per-rank batch: a world of one on this process
    whole = model(*batch)
    whole.backward()
    model.zero_grad(set_to_none=True)
    peaks["uncut (one device)"] = measured_peak(lambda: model(*batch).backward())
    if rank == 0:
        ratio = statistics.median(b / c for b, c in zip(times["balanced"], times["contiguous"]))
        lines = [f"GPT dim {args.dim}, {args.layers} layers, {args.heads} heads, batch {args.batch}, "
                 f"sequence {args.seq}, context = {world} gloo ranks, {args.rounds} rounds",
                 *(f"  {k:10s} step {statistics.median(v) * 1e3:9.1f} ms" for k, v in times.items()),
                 f"  balanced / contiguous: {ratio:.3f}x (median of per-round ratios)",
                 *(f"  ulysses / balanced ring: "
                   f"{statistics.median(u / b for u, b in zip(times['ulysses'], times['balanced'])):.3f}x"
                   for _ in [0] if "ulysses" in times),
                 *(f"  peak {k:20s} {v / 2**20:9.1f} MiB"
                   + (f" (estimate {predicted[k] / 2**20:.1f} MiB)" if k in predicted else "")
                   for k, v in peaks.items()),
                 f"  context peak / uncut: {peaks['balanced'] / peaks['uncut (one device)']:.3f}x"]
    finish(rank, out, lines if rank == 0 else None)


def main() -> None:
    run_ranks(_worker, gpt_arguments(__doc__.splitlines()[0], seq=2048, batch=1, dim=128))


if __name__ == "__main__":
    main()
