"""Expert parallelism on gloo ranks: shardc with the experts cut over data, shardc with
the experts replicated (each rank holds all, their gradients all-reduced), and a torch
reference written the torchtitan way (DDP for the dense part, each rank's experts its own,
``all_to_all_single`` dispatch and combine, one GEMM per local expert), side by side.

    python benchmarks/experts.py [--ranks 8] [--rounds 5] [--hidden 128] [--ffn 512] [--experts 8]
                                 [--capacity F]

With ``--capacity F`` a fourth system runs beside them: the experts cut with
``expert_capacity=F`` (padded, fixed-size all-to-alls, rows past the capacity dropped);
the rows it dropped and its bytes are printed too.

A transformers Mixtral (2 layers, top 2, its default ``grouped_mm`` experts kernel, which
on CPU fp32 is transformers' one-GEMM-per-expert fallback) whose experts are most of its
parameters. Every system starts from the same weights and trains on the same batches with
AdamW; each round runs one step of each in turn, a barrier around every step. Prints the
median step times and their ratios, the first step's loss of each (the same model: equal
to fp32 noise), the tokens each rank's experts computed, the all-to-all bytes (the comm
report, exact after a step), the expert parameters a rank holds, and the measured peak of
a step beside the planner's estimate.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def _rank(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _measure(rank, world, args)
    finally:
        dist.destroy_process_group()


def _model(args: argparse.Namespace) -> nn.Module:
    import transformers

    from shardc.tools.models import HFCausalLM

    cfg = transformers.MixtralConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, num_local_experts=args.experts,
        num_experts_per_tok=2, max_position_embeddings=args.seq, use_cache=False,
        tie_word_embeddings=False, router_jitter_noise=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    return HFCausalLM(transformers.MixtralForCausalLM(cfg))


class _TorchExperts(nn.Module):
    """One MoE layer's experts, this rank's share of them, the torchtitan way: the
    token-expert rows sorted by expert, their counts exchanged, the rows sent to their
    experts' ranks by ``all_to_all_single`` (autograd's own, torch.distributed.nn), one GEMM
    per local expert, the results sent back and weighted."""

    def __init__(self, experts: nn.Module, rank: int, world: int) -> None:
        super().__init__()
        self.n, self.world = experts.num_experts, world
        self.local = self.n // world
        cut = slice(rank * self.local, (rank + 1) * self.local)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[cut].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[cut].clone())
        self.act_fn = experts.act_fn

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        k = top_k_index.shape[-1]
        keys, perm = torch.sort(top_k_index.reshape(-1))
        rows = hidden[perm // k]
        counts = torch.bincount(keys, minlength=self.n)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts)
        by_src = recv.view(self.world, self.local)
        send, got = counts.view(self.world, self.local).sum(1).tolist(), by_src.sum(1).tolist()
        x = all_to_all_single(rows.new_empty(sum(got), rows.shape[1]), rows, got, send)
        expert = torch.arange(self.local).repeat(self.world).repeat_interleave(by_src.reshape(-1))
        order = torch.sort(expert, stable=True).indices
        x = x[order]
        outs, start = [], 0
        for e, n in enumerate(by_src.sum(0).tolist()):
            gate, up = (x[start:start + n] @ self.gate_up_proj[e].t()).chunk(2, dim=-1)
            outs.append((self.act_fn(gate) * up) @ self.down_proj[e].t())
            start += n
        y = torch.cat(outs)[torch.argsort(order)]
        y = all_to_all_single(y.new_empty(sum(send), y.shape[1]), y, send, got)
        y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        out = torch.empty_like(y)
        out[perm] = y
        return out.view(-1, k, y.shape[-1]).sum(1)


def _torch_reference(model: nn.Module, rank: int, world: int) -> tuple[nn.Module, list[nn.Parameter]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    experts = []
    for layer in model.model.model.layers:
        layer.mlp.experts = _TorchExperts(layer.mlp.experts, rank, world)
        experts += [layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj]
    ids = {id(p) for p in experts}
    # the experts' gradients are this rank's alone (every token that met them did so here):
    # DDP reduces the rest
    DDP._set_params_and_buffers_to_ignore_for_model(
        model, [n for n, p in model.named_parameters() if id(p) in ids])
    return DDP(model), experts


def _measure(rank: int, world: int, args: argparse.Namespace) -> None:
    import copy

    import transformers.integrations.moe as moe

    import shardc
    from shardc.planning.memory import estimate, measured_peak

    moe._can_use_grouped_mm = lambda *a, **k: False  # the CPU fp32 path, stated
    base = _model(args)
    g = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(0, 512, (args.batch, args.seq), generator=g) for _ in range(2))
               for _ in range(2)]
    mesh = shardc.Mesh.parse(f"x1y1z1d{world}")
    local = [[shardc.shard_batch(t, mesh) for t in b] for b in batches]
    systems: dict[str, Any] = {}
    for name, axes in (("shardc experts cut", ("data",)), ("shardc replicated", None)):
        sm = shardc.compile(copy.deepcopy(base), mesh, example_inputs=batches[0], expert_axes=axes)
        systems[name] = (sm, torch.optim.AdamW(sm.parameters(), lr=1e-4), None)
    cap = f"shardc capacity {args.capacity:g}" if args.capacity else None
    if cap:
        sm = shardc.compile(copy.deepcopy(base), mesh, example_inputs=batches[0], expert_axes=("data",),
                            expert_capacity=args.capacity)
        systems[cap] = (sm, torch.optim.AdamW(sm.parameters(), lr=1e-4), None)
    ref, experts = _torch_reference(copy.deepcopy(base), rank, world)
    systems["torch EP + DDP"] = (ref, torch.optim.AdamW(ref.parameters(), lr=1e-4), experts)
    losses: dict[str, float] = {}

    def step(name: str, i: int) -> None:
        m, opt, own = systems[name]
        loss = m(*local[i % 2])
        loss.backward()
        if own is not None:  # each rank's loss is its tokens' mean: the global mean's gradient
            for p in own:
                p.grad.div_(world)
        opt.step()
        opt.zero_grad()
        losses.setdefault(name, loss.detach())

    times: dict[str, list[float]] = {n: [] for n in systems}
    for i in range(args.warmup + args.rounds):
        for name in systems:
            dist.barrier()
            t = time.perf_counter()
            step(name, i)
            dist.barrier()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
    # DDP's loss is the rank's own tokens' mean; shardc's the global batch's on every rank
    dist.all_reduce(losses["torch EP + DDP"])
    losses["torch EP + DDP"] /= world
    cut, whole = systems["shardc experts cut"][0], systems["shardc replicated"][0]
    cut.reset_measured_comm()
    peaks = {n: measured_peak(lambda m=m: m(*local[0]).backward()) for n, m in
             (("cut", cut), ("replicated", whole))}
    for _sys, opt, _ in systems.values():
        opt.zero_grad()
    load = cut.expert_load()
    tokens = torch.tensor([sum(v.received_per_expert) for v in load.values()])
    every = [torch.empty_like(tokens) for _ in range(world)]
    dist.all_gather(every, tokens)
    est = {n: estimate(m).step_peak for n, m in (("cut", cut), ("replicated", whole))}
    dropped = torch.zeros(2, dtype=torch.int64)
    if cap:
        capped = systems[cap][0]
        capped(*local[0]).backward()
        capped.zero_grad()
        dropped[0] = sum(sum(v.dropped_per_expert) for v in capped.expert_load().values())
        dropped[1] = sum(sum(v.sent_per_expert) for v in capped.expert_load().values())
        dist.all_reduce(dropped)
    if rank != 0:
        return
    n_exp = sum(p.numel() for n, p in base.named_parameters() if ".experts." in n)
    n_all = sum(p.numel() for p in base.parameters())
    print(f"Mixtral, hidden {args.hidden}, expert ffn {args.ffn}, {args.experts} experts top-2, "
          f"{n_all / 1e6:.2f}M parameters ({100 * n_exp / n_all:.0f}% experts), batch {args.batch}x"
          f"{args.seq}, {world} gloo ranks, {args.rounds} rounds, torch {torch.__version__}")
    med = {n: statistics.median(v) for n, v in times.items()}
    for n, v in times.items():
        print(f"  {n:<20} median {med[n] * 1e3:8.1f} ms (min {min(v) * 1e3:.1f})  first loss {float(losses[n]):.6f}")
    c = "shardc experts cut"
    for other in ("shardc replicated", "torch EP + DDP", *([cap] if cap else [])):
        ratios = [a / b for a, b in zip(times[c], times[other])]
        print(f"  {c} / {other}: {med[c] / med[other]:.3f} (median of per-round ratios "
              f"{statistics.median(ratios):.3f})")
    print("  rows each rank's experts computed in the last step, per layer: "
          + "  ".join(f"rank {r}: {t.tolist()}" for r, t in enumerate(every)))
    a2a = sum(r.bytes for r in shardc.comm_report(cut).rows if r.collective == "all_to_all")
    by = shardc.comm_report(cut).by_key()
    print(f"  all-to-all bytes a step, rank 0 (exact, routed): {a2a / 2**20:.2f} MiB; every collective: "
          + ", ".join(f"{k[0]}@{k[1]} {k[2]} {v / 2**20:.2f} MiB" for k, v in sorted(by.items())))
    if cap:
        capped_a2a = sum(r.bytes for r in shardc.comm_report(systems[cap][0]).rows if r.collective == "all_to_all")
        print(f"  {cap}: all-to-all bytes a step, rank 0 (fixed, padded): {capped_a2a / 2**20:.2f} MiB; "
              f"rows dropped in one step, all ranks and layers: {int(dropped[0])} of {int(dropped[1])}")
    held = {n: sum(p.numel() for k, p in m.named_parameters() if ".experts." in k)
            for n, m in (("cut", cut), ("replicated", whole))}
    print(f"  expert parameters a rank holds: cut {held['cut'] / 1e6:.3f}M, replicated "
          f"{held['replicated'] / 1e6:.3f}M ({held['replicated'] / max(held['cut'], 1):.1f}x); AdamW "
          "state follows them")
    for n in ("cut", "replicated"):
        print(f"  step peak above the parameters, {n}: measured {peaks[n] / 2**20:.1f} MiB, "
              f"estimate {est[n] / 2**20:.1f} MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--capacity", type=float, default=None, help="also run expert_capacity=F")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(args.ranks, f"{d}/store", args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
