"""``shardc bench``: measure the step time of every feasible mesh of the example GPT on
local CPU ranks and compare the measured order with the planner's (the analogue of the
AxoNN paper's Fig. 2): Spearman's rho, top-k overlap, a PNG plot, a JSON of figures.

Every mesh is compiled in one spawn of the ranks and measured in interleaved rounds (each
round runs every mesh, from another starting mesh), so the figures are ratios taken side
by side on the same (shared, noisy) machine, and drift in its load spreads over all.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import shardc
from shardc.planning.planner import resolve_machine
from shardc.planning.throughput import model_flops, summed_peak_flops, throughput
from shardc.tools.models import GPT, lm_batch


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def _worker(rank: int, world: int, store: str, specs: list[str], steps: int, rounds: int,
            out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _measure(rank, specs, steps, rounds, out)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, specs: list[str], steps: int, rounds: int, out: str) -> None:


    # every rank measures its matmul peak at the same time, sharing the cores as in training
    peak, source = summed_peak_flops("cpu")
    x, y = lm_batch(16, 64, 512)
    runs = {}
    for spec in specs:  # compiled once, each warmed by one step (groups, allocator)
        mesh = shardc.Mesh.parse(spec)
        torch.manual_seed(0)
        sm = shardc.compile(GPT.peer(), mesh, example_inputs=(x, y))
        opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
        runs[spec] = (sm, opt, shardc.shard_batch(x, mesh), shardc.shard_batch(y, mesh))
        _steps(*runs[spec], 1)
    results: dict[str, list[float]] = {s: [] for s in specs}
    progress = Progress(disable=rank != 0)
    with progress:
        task = progress.add_task("rounds", total=rounds * len(specs))
        for r in range(rounds):
            # interleaved, each round from another starting mesh: drift of the machine's
            # load and the order a mesh runs in spread over all of them
            for spec in specs[r % len(specs):] + specs[:r % len(specs)]:
                results[spec] += _steps(*runs[spec], steps)
                progress.update(task, advance=1, description=f"round {r + 1}/{rounds} {spec}")
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"steps": results, "peak_flops": peak, "peak_source": source}, f)


def _steps(sm: Any, opt: Any, xl: Any, yl: Any, n: int) -> list[float]:
    times = []
    for _ in range(n):
        dist.barrier()
        t = time.perf_counter()
        sm(xl, yl).backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - t)
    return times


def run_bench(args: Any) -> None:


    for name in ("ranks", "steps", "rounds"):
        if getattr(args, name) < (2 if name == "ranks" else 1):
            raise SystemExit(f"shardc bench: --{name} must be at least {2 if name == 'ranks' else 1}, "
                             f"got {getattr(args, name)}.")
    console = Console(width=max(Console().width, 150))
    machine = resolve_machine(args.machine)
    torch.manual_seed(0)
    plan = shardc.plan(GPT.peer(), args.ranks, machine, lm_batch(16, 64, 512), exact_top=10 ** 6)
    predicted = {c.mesh.spec(): c.predicted_step_s for c in plan}
    terms = {c.mesh.spec(): c for c in plan}
    specs = [s for s in (args.meshes.split(",") if args.meshes else predicted) if s in predicted]
    console.print(f"{len(specs)} feasible meshes of {args.ranks} ranks; machine {machine.name!r}; "
                  f"{args.rounds} interleaved rounds of {args.steps} measured steps each")
    os.makedirs(args.out, exist_ok=True)
    raw = os.path.join(args.out, "bench_steps.json")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(args.ranks, f"{d}/store", specs, args.steps, args.rounds, raw),
                 nprocs=args.ranks, join=True)
    with open(raw) as f:
        raw_figures = json.load(f)
    steps = raw_figures["steps"]
    measured = {s: statistics.median(v) for s, v in steps.items()}
    flops = model_flops(GPT.peer(), lm_batch(16, 64, 512))
    rates = {s: throughput(flops, measured[s], args.ranks, raw_figures["peak_flops"]) for s in specs}
    model_rank = {s: i + 1 for i, s in enumerate(sorted(specs, key=lambda s: predicted[s]))}
    meas_rank = {s: i + 1 for i, s in enumerate(sorted(specs, key=lambda s: measured[s]))}
    rho = spearman([predicted[s] for s in specs], [measured[s] for s in specs])
    k = min(5, len(specs))
    top_model = {s for s in specs if model_rank[s] <= k}
    top_meas = {s for s in specs if meas_rank[s] <= k}
    fastest = min(specs, key=lambda s: measured[s])
    summary = {
        "machine": machine.name, "ranks": args.ranks, "steps": args.steps, "rounds": args.rounds,
        "peak_flops": raw_figures["peak_flops"], "peak_source": raw_figures["peak_source"],
        "model_flops_per_step": flops.per_step,
        "spearman_rho": rho, f"top{k}_overlap": len(top_model & top_meas),
        "fastest_measured": fastest, "its_model_rank": model_rank[fastest],
        "meshes": [{"mesh": s, "model_rank": model_rank[s], "predicted_step_s": predicted[s],
                    "predicted_comm_s": terms[s].predicted_comm_s,
                    "predicted_compute_s": terms[s].compute_s,
                    "predicted_hidden_s": terms[s].hidden_s,
                    "measured_step_s": measured[s], "measured_rank": meas_rank[s],
                    "tokens_per_s_per_rank": rates[s].tokens_per_s_per_rank, "mfu": rates[s].mfu}
                   for s in sorted(specs, key=lambda s: model_rank[s])],
    }
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(summary, f, indent=1)
    _plot(summary, os.path.join(args.out, "fig2_local.png"), k)

    t = Table(title=f"model rank vs measured step time ({args.ranks} CPU ranks, gloo)")
    for col in ("model rank", "mesh", "predicted step (s)", "compute", "comm", "hidden",
                "measured step (s)", "measured rank", "tokens/s per rank", "MFU"):
        t.add_column(col)
    for row in summary["meshes"]:
        t.add_row(str(row["model_rank"]), row["mesh"], f"{row['predicted_step_s']:.4g}",
                  f"{row['predicted_compute_s']:.3f}", f"{row['predicted_comm_s']:.3f}",
                  f"{row['predicted_hidden_s']:.3f}",
                  f"{row['measured_step_s']:.3f}", str(row["measured_rank"]),
                  f"{row['tokens_per_s_per_rank']:,.0f}", f"{100 * row['mfu']:.2f}%")
    console.print(t)
    console.print(f"MFU: model FLOPs per step {flops.per_step / 1e9:.2f} G (6·N·T + attention) over "
                  f"the ranks' summed peak, {raw_figures['peak_flops'] / 1e9:.1f} GFLOP/s "
                  f"({raw_figures['peak_source']}, all ranks at once)")
    console.print(f"Spearman rho = {rho:.3f}; top-{k} overlap {len(top_model & top_meas)}/{k}; fastest "
                  f"measured {fastest} is the model's #{model_rank[fastest]}. Figures in {args.out}/")


def _plot(summary: dict, path: str, k: int) -> None:
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency (the [plot] extra)
    except ImportError:  # an optional extra: the figures are in bench.json all the same
        print(f"no plot: matplotlib is not installed (pip install 'shardc[plot]'); "
              f"the figures are in {os.path.dirname(path)}/bench.json")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional dependency (the [plot] extra)

    rows = summary["meshes"]
    fig, ax = plt.subplots(figsize=(7, 4))
    fast = {r["mesh"] for r in sorted(rows, key=lambda r: r["measured_step_s"])[:k]}
    for r in rows:
        ax.scatter(r["model_rank"], r["measured_step_s"], color="tab:green" if r["mesh"] in fast
                   else "tab:red", zorder=3)
        ax.annotate(r["mesh"], (r["model_rank"], r["measured_step_s"]), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("rank by the performance model (1 = predicted fastest)")
    ax.set_ylabel("measured median step time (s)")
    ax.set_title(f"GPT (3.4M) on {summary['ranks']} CPU ranks: Spearman rho = "
                 f"{summary['spearman_rho']:.2f}; green = {k} fastest measured")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
