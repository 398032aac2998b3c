"""Step time of shardc beside torch's own parallelisms on the same model, interleaved.

    python benchmarks/vs_torch.py --world 4 --rounds 5 --steps 6            # TinyGPT
    python benchmarks/vs_torch.py --world 4 --shape medium                  # more compute
    python benchmarks/vs_torch.py --world 8 --quick --meshes x2y1z1d4,x2y1z2d2   # more meshes
    python benchmarks/vs_torch.py --world 8 --quick --compiled    # every system compiled

One spawn of ``--world`` gloo ranks (CPU, one thread each) runs every system on the
same model, data and AdamW, round after round, so each system's figure is a median over
rounds taken side by side with the others on the same (shared, noisy) machine; compare
the ratios, not the milliseconds. Each system is paired with the shardc mesh that is the
same parallelism:

=================  ==================================  ===================
torch              what it is                          shardc mesh
=================  ==================================  ===================
ddp                DistributedDataParallel, 25 MiB     x1y1z1d{W}
fsdp2              fully_shard per block, reshard      x1y1z{W}d1
tp_dp              DTensor Megatron TP x data (DDP)    x{W/2}y1z1d2
=================  ==================================  ===================

Gradients are packed alike: DDP with an explicit ``bucket_cap_mb=25`` (one 25 MiB bucket
size, no 1 MiB first bucket) beside shardc with an explicit ``bucket_mb=25``, which means
the same. shardc runs each mesh twice: with the step program and its passes (the default)
and with ``step_graph=False`` (autograd's backward over the forward program: what
shardc did before the step passes), which shows what the passes buy; and
``x1y1z1d{W}`` once more with ``shard_optimizer=True`` (ZeRO over data), beside DDP.
``--compiled`` compiles every system the way its users compile it: DDP over
``torch.compile(model)``; FSDP2 and the TP x DP model with each block compiled before it
is sharded (torchtitan's order: tensor parallelism, then compile, then FSDP); shardc with
``backend="inductor"``. Each system is built (and compiled) once and reused across rounds,
and its compilation happens in the two warm-up steps, outside every figure.
``--meshes`` adds shardc meshes that mirror no single torch parallelism (tensor x data,
say, where the torch rows have only data); each is compared with the fastest torch row,
and the closing line takes the fastest shardc row from all of them. ``--quick`` leaves out
the ``step_graph=False`` and ``shard_optimizer`` rows.

Prints, per system: median step time over rounds (each round's figure is the median of
``--steps`` steps after two warm-up steps), the ratio to its torch peer, the CPU time a
rank spends in a step (``time.process_time``, its threads included: gloo's too; the median
over rounds, averaged over ranks; where ranks outnumber cores the step's wall time is
about the ranks' CPU time over the cores, so this is the steadier figure), and the loss
after the last step (the same model and data: every system must agree to ~1e-5); then
the fastest shardc row against the fastest torch row.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

SHAPES = {
    # the peers' TinyGPT (../shared/peers): 3.4M parameters
    "tiny": dict(vocab=512, dim=256, layers=4, heads=4, seq=64, batch=16),
    # more compute per byte moved
    "medium": dict(vocab=1024, dim=512, layers=4, heads=8, seq=128, batch=16),
    # the larger shape (hidden 1024, 8 layers, seq 256): minutes per step on CPU
    "large": dict(vocab=2048, dim=1024, layers=8, heads=16, seq=256, batch=16),
}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.hd = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under torch's tensor parallelism each rank holds only its heads
        q = self.wq(x).view(B, T, -1, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim, bias=False)
        self.fc2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _model(shape: dict) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(shape["vocab"], shape["dim"], shape["layers"], shape["heads"], shape["seq"])


def _batch(shape: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


# ------------------------------------------------------------------------- systems
# each builds (step function, parameters) on every rank; the step runs forward,
# backward and AdamW on this rank's part of the global batch and returns the loss
Step = Callable[[], torch.Tensor]
BEST = "fastest torch"  # the peer of a row that mirrors no one torch parallelism


def _slice(t: torch.Tensor, parts: int, i: int) -> torch.Tensor:
    n = t.shape[0] // parts
    return t[i * n:(i + 1) * n]


def _train_step(model: nn.Module, params: Any, inputs: tuple, after_backward: Callable | None = None,
                mean_over: Any = None) -> Step:
    """``mean_over``: the group over which the ranks hold different batch slices (the
    returned loss is then averaged over it, outside the timed step, to compare with
    shardc's, which is already the global batch's)."""
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step() -> float:
        loss = model(*inputs)
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    step.mean_over = mean_over  # type: ignore[attr-defined]
    return step


COMPILED = False  # --compiled: every system compiled as its users compile it


def _compile_blocks(model: "TinyGPT") -> None:
    """Each block through torch.compile (torchtitan's per-block compile)."""
    for i, b in enumerate(model.blocks):
        model.blocks[i] = torch.compile(b)


def ddp(shape: dict, world: int, bucket_mb: float = 25.0) -> Step:
    from torch.nn.parallel import DistributedDataParallel as DDP

    inner: nn.Module = _model(shape)
    model = DDP(torch.compile(inner) if COMPILED else inner, bucket_cap_mb=bucket_mb)
    r = dist.get_rank()
    x, y = (_slice(t, world, r) for t in _batch(shape))
    return _train_step(model, model.parameters(), (x, y), mean_over=dist.group.WORLD)


def fsdp2(shape: dict, world: int) -> Step:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 kept it here
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = _model(shape)
    if COMPILED:
        _compile_blocks(model)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    r = dist.get_rank()
    x, y = (_slice(t, world, r) for t in _batch(shape))
    return _train_step(model, model.parameters(), (x, y), mean_over=dist.group.WORLD)


def tp_dp(shape: dict, world: int) -> Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    dp, tp = 2, world // 2
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = _model(shape)
    for b in model.blocks:
        # the block's input enters attn and mlp as one replicated DTensor: its gradient,
        # a partial sum over tp, is all-reduced once per module (q, k and v share it)
        shared = dict(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                      use_local_output=False)
        parallelize_module(b, mesh["tp"], {
            "attn": PrepareModuleInput(**shared), "mlp": PrepareModuleInput(**shared),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
    if COMPILED:
        _compile_blocks(model)
    dp_group = mesh["dp"].get_group()

    def sync() -> None:
        # one flat all-reduce of every local gradient over data, as DDP would
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp_group)
        flat /= dp
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    i = mesh.get_coordinate()[0]
    x, y = (_slice(t, dp, i) for t in _batch(shape))
    return _train_step(model, model.parameters(), (x, y), sync, mean_over=dp_group)


def shardc_mesh(spec: str, **kw: Any) -> Callable[[dict, int], Step]:
    def build(shape: dict, world: int) -> Step:
        import shardc

        mesh = shardc.Mesh.parse(spec)
        batch = _batch(shape)
        opts = {"backend": "inductor", **kw} if COMPILED else kw
        sm = shardc.compile(_model(shape), mesh, example_inputs=batch, **opts)
        return _train_step(sm, sm.parameters(), tuple(shardc.shard_batch(t, mesh) for t in batch))
    return build


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def mesh_and_options(entry: str) -> tuple[str, dict[str, Any]]:
    """``x1y1z1d8+bucket_mb=4+reshard_after_forward=True`` -> (mesh spec, compile options)."""
    spec, *opts = entry.split("+")
    kw = {}
    for o in opts:
        key, eq, val = o.partition("=")
        if not eq:
            raise ValueError(f"--meshes: {o!r} in {entry!r} is not key=value")
        kw[key] = _value(val)
    return spec, kw


def systems(world: int, meshes: list[str] = (), quick: bool = False, bucket_mb: float = 25.0
            ) -> list[tuple[str, str | None, Callable[[dict, int], Step]]]:
    """(name, the torch peer it is compared with, builder). ``meshes``: more shardc meshes,
    each ``SPEC[+option=value...]`` (compile's options), compared with the fastest torch
    system (the issue's "best shardc mesh against the best peer" is over every mesh, not
    only the three that mirror a torch parallelism); ``quick``: leave out the
    ``step_graph=False`` and ``shard_optimizer`` rows; ``bucket_mb``: DDP's
    ``bucket_cap_mb`` and shardc's ``bucket_mb`` alike."""
    out: list[tuple[str, str | None, Callable[[dict, int], Step]]] = [
        ("ddp", None, lambda shape, w: ddp(shape, w, bucket_mb)), ("fsdp2", None, fsdp2)]
    if world >= 4 and world % 2 == 0:
        out.append(("tp_dp", None, tp_dp))
    pairs = [("ddp", f"x1y1z1d{world}"), ("fsdp2", f"x1y1z{world}d1")]
    if world >= 4 and world % 2 == 0:
        pairs.append(("tp_dp", f"x{world // 2}y1z1d2"))
    # every system packs gradients alike: DDP above is given an explicit bucket_cap_mb
    # (25 by default), which drops its 1 MiB first bucket, tp_dp reduces one flat buffer,
    # and the same explicit bucket_mb is shardc's same configuration (shardc.core.context.Options)
    for peer, spec in pairs:
        out.append((f"shardc {spec}", peer, shardc_mesh(spec, bucket_mb=bucket_mb)))
        if not quick:
            out.append((f"shardc {spec} step_graph=False", peer,
                        shardc_mesh(spec, step_graph=False, bucket_mb=bucket_mb)))
    if not quick:
        # ZeRO over data beside DDP: AdamW's state and step are 1/W a rank, for a reduce-
        # scatter and an all-gather a bucket in place of DDP's all-reduce
        out.append((f"shardc x1y1z1d{world} shard_optimizer=True", "ddp",
                    shardc_mesh(f"x1y1z1d{world}", shard_optimizer=True, bucket_mb=bucket_mb)))
    for entry in meshes:
        spec, kw = mesh_and_options(entry)
        name = f"shardc {spec}" + "".join(f" {k}={v}" for k, v in kw.items())
        if name not in {n for n, _, _ in out}:
            out.append((name, BEST, shardc_mesh(spec, **{"bucket_mb": bucket_mb, **kw})))
    return out


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    global COMPILED
    COMPILED = args.compiled
    shape = SHAPES[args.shape]
    built: dict[str, Step] = {}
    table: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # this rank's CPU seconds a step, per round
    losses: dict[str, float] = {}
    for rnd in range(args.rounds):
        for name, _, build in systems(world, args.meshes, args.quick, args.bucket_mb):
            # compiled systems are built once: a rebuild would compile again
            step = built[name] if name in built else build(shape, world)
            if COMPILED:
                built[name] = step
            for _ in range(2):
                step()
            times, cpus = [], []
            for _ in range(args.steps):
                dist.barrier()
                t, c = time.perf_counter(), time.process_time()
                loss = step()
                cpus.append(time.process_time() - c)
                dist.barrier()
                times.append(time.perf_counter() - t)
            table.setdefault(name, []).append(statistics.median(times))
            cpu.setdefault(name, []).append(statistics.median(cpus))
            group = getattr(step, "mean_over", None)
            if group is not None:  # the global batch's loss, as shardc returns
                loss = loss.clone()
                dist.all_reduce(loss, group=group)
                loss /= dist.get_world_size(group)
            losses[name] = float(loss)
            if rank == 0:
                print(f"round {rnd + 1}: {name}: {1e3 * statistics.median(times):.1f} ms", flush=True)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, {n: statistics.median(v) for n, v in cpu.items()})
    if rank == 0:
        with open(out, "w") as f:
            for name, peer, _ in systems(world, args.meshes, args.quick, args.bucket_mb):
                per_rank = statistics.mean(c[name] for c in every)
                f.write(f"{name}\t{peer or ''}\t{statistics.median(table[name])}\t{losses[name]}"
                        f"\t{per_rank}\n")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--meshes", default="", type=lambda s: [m for m in s.split(",") if m],
                    help="more shardc meshes (comma-separated specs, e.g. x2y1z1d4, each "
                         "with compile options if wanted: x1y1z1d8+bucket_mb=4), each "
                         "compared with the fastest torch system")
    ap.add_argument("--bucket-mb", type=float, default=25.0,
                    help="DDP's bucket_cap_mb and shardc's bucket_mb (default 25)")
    ap.add_argument("--compiled", action="store_true",
                    help="compile every system as its users do (see the module's docstring)")
    ap.add_argument("--quick", action="store_true",
                    help="leave out the step_graph=False and shard_optimizer rows")
    args = ap.parse_args(argv)
    import shardc

    for entry in args.meshes:
        try:
            spec, kw = mesh_and_options(entry)
            shardc.core.context.Options(**kw)  # an unknown or bad option fails here, not on 8 ranks
        except (ValueError, TypeError) as e:
            ap.error(str(e))
        if shardc.Mesh.parse(spec).world_size != args.world:
            ap.error(f"--meshes: {spec} is a mesh of {shardc.Mesh.parse(spec).world_size} ranks, "
                     f"not --world {args.world}")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "table.tsv")
        mp.spawn(_rank, args=(args.world, os.path.join(d, "store"), args, out), nprocs=args.world)
        rows = [line.rstrip("\n").split("\t") for line in open(out)]
    med = {r[0]: float(r[2]) for r in rows}
    med[BEST] = min(float(r[2]) for r in rows if not r[0].startswith("shardc"))
    s = SHAPES[args.shape]
    print(f"\n{args.world} gloo ranks x 1 thread, shape {args.shape} {s}, torch {torch.__version__}, "
          f"{'compiled (--compiled), ' if args.compiled else ''}"
          f"median of {args.rounds} interleaved rounds (each the median of {args.steps} steps)\n")
    print("| system | step (ms) | vs its torch peer | CPU a rank (ms) | loss after last step |")
    print("| --- | --- | --- | --- | --- |")
    for name, peer, t, loss, c in rows:
        ratio = f"{float(t) / med[peer]:.2f}x" if peer else ""
        print(f"| {name} | {1e3 * float(t):.1f} | {ratio} | {1e3 * float(c):.1f} | {float(loss):.5f} |")
    best = min((r for r in rows if r[0].startswith("shardc")), key=lambda r: float(r[2]))
    peer = min((r for r in rows if not r[0].startswith("shardc")), key=lambda r: float(r[2]))
    print(f"\nfastest shardc ({best[0]}) / fastest torch ({peer[0]}): "
          f"{float(best[2]) / float(peer[2]):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
