"""``shardc demo``: a GPT written for one device, compiled for CPU ranks, trained a few
steps, then what the compiled program moved per step."""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.progress import Progress, TextColumn
from rich.table import Table

import shardc
from shardc.core.mesh import CUT_AXES
from shardc.planning.throughput import model_flops, summed_peak_flops, throughput
from shardc.tools.models import GPT, lm_batch

LONG_RUN = 20  # steps from which the demo shows a progress bar instead of a line per step


def _rank_main(rank: int, world_size: int, store: str, mesh_spec: str, steps: int,
               backend: str = "eager") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        _train(rank, mesh_spec, steps, backend)
    finally:
        dist.destroy_process_group()


def _train(rank: int, mesh_spec: str, steps: int, backend: str = "eager") -> None:


    console = Console()
    mesh = shardc.Mesh.parse(mesh_spec)
    torch.manual_seed(0)  # the same full model on every rank; compile keeps each rank's shard
    model = GPT.peer()
    batch = lm_batch(16, 64, 512)
    t0 = time.perf_counter()
    sm = shardc.compile(model, mesh, example_inputs=batch, backend=backend)
    if rank == 0:
        console.print(f"compiled {sum(p.numel() for p in model.parameters()):,} parameters for {mesh} "
                      f"in {time.perf_counter() - t0:.1f} s; this rank holds "
                      f"{sm.local_param_elements():,}")
    opt = torch.optim.AdamW(sm.parameters(), lr=3e-3)
    flops = model_flops(model, batch)
    peak, peak_source = summed_peak_flops("cpu")
    times: list[float] = []
    # a long run gets a progress bar on rank 0; a short one a line per step
    progress = Progress(*Progress.get_default_columns(), TextColumn("{task.fields[info]}"),
                        console=console, disable=rank != 0 or steps < LONG_RUN)
    with progress:
        task = progress.add_task("training", total=steps, info="")
        for step in range(steps):
            x, y = lm_batch(16, 64, 512, step=step)
            if step == steps - 1:
                sm.reset_measured_comm()
            t = time.perf_counter()
            loss = sm(shardc.shard_batch(x, mesh), shardc.shard_batch(y, mesh))
            loss.backward()
            opt.step()
            opt.zero_grad()
            g = shardc.global_mean(loss, mesh)  # also a barrier: the step is every rank's
            times.append(time.perf_counter() - t)
            info = f"loss {g.item():.5f}  ({times[-1]:.2f} s)"
            if rank == 0 and steps < LONG_RUN:
                console.print(f"step {step}: {info}")
            progress.update(task, advance=1, info=info)
    if rank == 0:
        # the first step creates the process groups and warms the allocator: leave it out
        step_s = statistics.median(times[1:] if len(times) > 1 else times)
        tp = throughput(flops, step_s, mesh.world_size, peak)
        console.print(f"{tp}; model {flops.per_token / 1e6:.2f} MFLOP/token "
                      f"(6·N + 12·L·S·H, N={flops.matmul_params:,}); peak: {peak_source}, summed "
                      f"over {mesh.world_size} ranks = {peak / 1e9:.1f} GFLOP/s")
    rep = shardc.comm_report(sm)
    measured = sm.measured_comm()
    if rank != 0:
        return
    table = Table(title=f"collectives per training step, one rank, {mesh}")
    for col in ("axis", "phase", "collectives", "reported", "measured"):
        table.add_column(col, justify="right" if col != "axis" else "left")
    for axis in CUT_AXES:
        for phase in ("forward", "backward", "step"):
            rows = rep.select(axis=axis, phase=phase)
            if not rows:
                continue
            meas = sum(v for (c, a, ph), v in measured.items() if a == axis and ph == phase)
            table.add_row(axis, phase, str(len(rows)), f"{rep.total_bytes(axis=axis, phase=phase) / 2**20:.3f} MiB",
                          f"{meas / 2**20:.3f} MiB")
    table.add_row("all", "", str(len(rep.rows)), f"{rep.total_bytes() / 2**20:.3f} MiB",
                  f"{sum(measured.values()) / 2**20:.3f} MiB", style="bold")
    console.print(table)
    console.print("ops without a sharding rule: " + (", ".join(str(f) for f in sm.fallbacks) or "none"))


def run_demo(ranks: int = 8, mesh: str = "x2y2z2d1", steps: int = 5, backend: str = "eager") -> None:

    m = shardc.Mesh.parse(mesh)
    if m.world_size != ranks:
        raise SystemExit(f"shardc demo: {m} needs {m.world_size} ranks, --ranks is {ranks}.")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank_main, args=(ranks, f"{d}/store", mesh, steps, backend), nprocs=ranks, join=True)
