"""Context parallelism on gloo ranks: step time of the balanced and contiguous sequence
cuts side by side, beside torch's own context-parallel ring, and the activation memory per
rank beside the uncut program's.

One spawn of ``--ranks`` processes compiles a GPT with the sequence cut over every rank
(``x1y1cGz1d1``) three ways: ring attention on the balanced cut (the default) and on the
contiguous cut, and Ulysses (``context_attention="ulysses"``, where the heads divide).
Beside them runs torch's context parallelism on the same model: the ring that
``torch.distributed.tensor.experimental.context_parallel`` dispatches a causal attention to
(``_templated_ring_attention`` and its backward, torch's load-balanced layout: the
sequence in 2G chunks, rank r holding chunks r and 2G-1-r), each rank's parameters'
gradients averaged by DDP, the way torchtitan composes it with data parallelism.
``context_parallel`` itself cannot run here: its DTensor dispatch knows the CUDA attention
kernels only and fails on the CPU's (``_scaled_dot_product_flash_attention_for_cpu``), so
the peer calls the same ring functions with the CPU kernel, whose forward and backward take
the arguments the CUDA flash kernel's do. ``--torch-rotate`` picks torch's way of passing
the keys and values: ``allgather`` (torch's default: every block gathered at once) or
``alltoall`` (a ring of one-block hops, as shardc's).

All are timed in turns, step by step, so the machine's load falls on all alike; the printed
ratios are medians of the per-round ratios. The uncut figure is the same model on the
whole batch in one process, as one device runs it.

    python benchmarks/context_gloo.py --ranks 4 --seq 2048 --batch 1 --rounds 5

Prints: the median step time of each, balanced / contiguous, shardc / torch, each one's
first loss (the same model on the same batch: equal to fp32 noise), and the measured peak
(``shardc.memory.measured_peak``: bytes live at once above the start of the step) of a
rank's step beside the uncut program's.
"""
from __future__ import annotations

import argparse
import copy
import statistics
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from gloo_ranks import finish, gpt_arguments, lm_batch, run_ranks, start, step_figures

import shardc
from shardc.planning.memory import measured_peak
from shardc.tools.models import GPT

try:  # where torch keeps its context-parallel ring (the module moved between releases)
    from torch.distributed.tensor.experimental._context_parallel import _attention as _cp
except ImportError:  # pragma: no cover - older torch
    from torch.distributed.tensor.experimental import _attention as _cp  # type: ignore[no-redef]


def _head_tail(seq: int, rank: int, world: int) -> torch.Tensor:
    """The positions torch's load-balanced layout gives ``rank``: chunks r and 2G-1-r of
    the sequence read as 2G chunks."""
    c = seq // (2 * world)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)])


class _TorchRing(torch.autograd.Function):
    """Causal attention of this rank's (head, tail) queries to the whole sequence by
    torch's context-parallel ring, with the CPU's fused kernel."""

    @staticmethod
    def forward(ctx, q, k, v, group):  # type: ignore[override]
        out, lse = _cp._templated_ring_attention(
            group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
            is_causal=True, dropout_p=0.0, scale=None)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _cp._templated_ring_attention_backward(
            ctx.group, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=dout.contiguous(), grad_out_name="grad_out", query=q, key=k, value=v, out=out,
            logsumexp=lse, is_causal=True, dropout_p=0.0, scale=None)[:3]
        return dq, dk, dv, None


class _TorchContextGPT(nn.Module):
    """The GPT's forward on this rank's positions (``_head_tail``), attention by
    ``_TorchRing``; the loss is the mean over this rank's tokens, so DDP's average of the
    ranks' gradients is the global mean's."""

    def __init__(self, gpt: GPT, group: dist.ProcessGroup, positions: torch.Tensor) -> None:
        super().__init__()
        # a plain attribute, not a buffer: DDP would broadcast rank 0's to every rank
        self.gpt, self.group, self.positions = gpt, group, positions

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.drop(g.tok(idx) + g.pos(self.positions))
        for b in g.blocks:
            B, T, C = x.shape
            q, k, v = (t.view(B, T, b.heads, C // b.heads).transpose(1, 2)
                       for t in b.qkv(b.ln1(x)).split(C, dim=2))
            y = _TorchRing.apply(q, k, v, self.group).transpose(1, 2).contiguous().view(B, T, C)
            x = x + b.drop(b.proj(y))
            x = x + b.drop(b.fc2(F.gelu(b.fc1(b.ln2(x)))))
        logits = g.head(g.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _torch_peer(model: GPT, batch: tuple, rank: int, world: int, rotate: str
                ) -> tuple[Callable[[], None], float]:
    """One forward and backward of torch's context parallelism on this rank, and its
    first loss (all ranks' mean: the global batch's)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    _cp.set_rotate_method(rotate)
    pos = _head_tail(batch[0].shape[1], rank, world)
    ring_group = dist.new_group(list(range(world)))  # the ring's, apart from DDP's reductions
    ddp = DDP(_TorchContextGPT(copy.deepcopy(model), ring_group, pos))
    local = [t[:, pos].contiguous() for t in batch]

    def run() -> None:
        ddp(*local).backward()
        for p in ddp.parameters():
            p.grad = None

    loss = ddp(*local).detach()
    dist.all_reduce(loss)
    for p in ddp.parameters():
        p.grad = None
    return run, float(loss) / world


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
    first = {k: float(sm(*local).detach()) for k, sm in sms.items()}
    peer, first["torch"] = _torch_peer(model, batch, rank, world, args.torch_rotate)
    # the same model on the same batch: a peer that computes something else is no peer
    # (fp32 sums in other orders: ~1e-7 relative)
    if abs(first["torch"] - first["balanced"]) > 1e-5 * abs(first["balanced"]):
        raise SystemExit(f"torch's context parallelism gives another loss: {first}")
    times, peaks, predicted = step_figures(sms, local, args.rounds, peers={"torch": peer})
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
                 *(f"  {k} / torch ({args.torch_rotate}): "
                   f"{statistics.median(a / b for a, b in zip(times[k], times['torch'])):.3f}x"
                   for k in sms),
                 "  first loss: " + ", ".join(f"{k} {v:.6f}" for k, v in first.items()),
                 *(f"  ulysses / balanced ring: "
                   f"{statistics.median(u / b for u, b in zip(times['ulysses'], times['balanced'])):.3f}x"
                   for _ in [0] if "ulysses" in times),
                 *(f"  peak {k:20s} {v / 2**20:9.1f} MiB"
                   + (f" (estimate {predicted[k] / 2**20:.1f} MiB)" if k in predicted else "")
                   for k, v in peaks.items()),
                 f"  context peak / uncut: {peaks['balanced'] / peaks['uncut (one device)']:.3f}x"]
    finish(rank, out, lines if rank == 0 else None)


def main() -> None:
    run_ranks(_worker, gpt_arguments(__doc__.splitlines()[0], seq=2048, batch=1, dim=128,
                                     extra={"torch-rotate": ("allgather", ["allgather", "alltoall"])}))


if __name__ == "__main__":
    main()
