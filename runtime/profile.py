"""Measure the intra-node bandwidth table of :class:`shardc.core.machine.Machine`.

Why: equation 7 covers groups that span nodes, but inside a node the bandwidth a group
sees depends on the topology (which links its members share) and on how many groups of
the same shape run at once. AxoNN (SC'24, V-B, case 1) therefore measures, once per
machine, every two-level hierarchy (inner, size) with ``inner * size <= G_node`` by
running the same collective in all groups of that shape simultaneously. This module does
exactly that with ``torch.distributed`` on one node and returns a ready ``Machine``.

Device-agnostic: NCCL on CUDA devices when available (one rank per GPU), else gloo on
CPU processes (the "local" development setup).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.progress import Progress
from torch.multiprocessing.spawn import spawn

from shardc.core.machine import Machine

__all__ = ["profile_machine", "profile_shapes", "shape_groups"]

MiB = 1 << 20


def profile_shapes(ranks: int) -> list[tuple[int, int]]:
    """Every (inner, size) to measure on a node of ``ranks``: size >= 2 and
    ``inner * size`` dividing ``ranks`` (so the node tiles into whole groups)."""
    return [
        (inner, size)
        for inner in range(1, ranks + 1)
        for size in range(2, ranks // inner + 1)
        if ranks % (inner * size) == 0
    ]


def shape_groups(ranks: int, inner: int, size: int) -> list[list[int]]:
    """All groups of shape (inner, size) on ``ranks`` ranks: ``size`` ranks at stride
    ``inner``, ``[base + i * inner for i in range(size)]``, covering every rank once (the
    same groups a mesh axis of that size and stride forms)."""
    block = inner * size
    return [
        [b + off + i * inner for i in range(size)]
        for b in range(0, ranks, block)
        for off in range(inner)
    ]


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _worker(
    rank: int,
    ranks: int,
    init_file: str,
    result_file: str,
    message_bytes: int,
    iters: int,
    warmup: int,
    show_progress: bool,
    timeout_s: float,
    backend: str,
) -> None:
    """One profiling rank: measure every shape, rank 0 writes the results as JSON."""
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # as torchrun runs CPU ranks (OMP_NUM_THREADS=1 unless told otherwise): threads
        # beyond the cores' share would measure oversubscription, not the machine
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=ranks,
        timeout=timedelta(seconds=timeout_s),
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    shapes = profile_shapes(ranks)
    numel = max(1, message_bytes // 4)
    nbytes = numel * 4
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    results: list[dict[str, Any]] = []

    progress: Any = None
    task: Any = None
    if rank == 0 and show_progress:

        progress = Progress(transient=False)
        progress.start()
        task = progress.add_task(
            f"profiling {len(shapes)} group shapes on {ranks} {backend} ranks",
            total=len(shapes) * (warmup + iters),
        )
    def after_each() -> None:
        if progress is not None:
            progress.advance(task)
        buf.fill_(1.0)  # keep values bounded across iterations

    try:
        for inner, size in shapes:
            groups = shape_groups(ranks, inner, size)
            if size == ranks:
                group = dist.group.WORLD
            else:
                new = dist.new_subgroups_by_enumeration
                group, _ = new(groups)  # type: ignore[no-untyped-call]
            # every group starts together: the table is about simultaneous collectives
            median = _timed(lambda: dist.all_reduce(buf, group=group), warmup, iters, device,
                            sync, after_each)
            # latency: a message small enough that its bytes cost nothing; a step program
            # issues dozens of such calls (norm statistics, the loss, small buckets)
            small = torch.ones(_SMALL_NUMEL, dtype=torch.float32, device=device)
            latency = _timed(lambda: dist.all_reduce(small, group=group), warmup,
                             _LATENCY_ITERS, device, sync)
            sent = 2 * (size - 1) / size * nbytes  # ring all-reduce, bytes per rank
            results.append(
                {"inner": inner, "size": size, "seconds": median, "latency_s": latency,
                 # the message's time less one call's latency: its bytes' share alone
                 "bytes_per_s": sent / max(median - latency, median / 2, 1e-12)}
            )
        compute = _compute_terms(buf, device, sync, warmup, iters)
    finally:
        if progress is not None:
            progress.stop()

    if rank == 0:
        if backend == "nccl":
            memory = float(torch.cuda.get_device_properties(device).total_memory)
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            memory = float(total) / ranks
        tmp = result_file + ".tmp"
        Path(tmp).write_text(
            json.dumps({"backend": backend, "memory_bytes": memory,
                        "message_bytes": nbytes, "results": results, **compute}),
            encoding="utf-8",
        )
        os.replace(tmp, result_file)
    dist.barrier()
    dist.destroy_process_group()


_SMALL_NUMEL = 16  # a 64-byte all-reduce: its time is the call's latency
_LATENCY_ITERS = 20
_OPS = 200  # small ops timed back to back for the per-op overhead


def _timed(fn: Any, warmup: int, iters: int, device: torch.device, sync: Any,
           after_each: Any = None) -> float:
    """``fn`` run ``warmup`` + ``iters`` times, every rank starting together (a barrier);
    an iteration lasts as long as its slowest rank: the max over ranks, then the median
    over the timed iterations. ``after_each`` runs untimed after every iteration."""
    times = []
    for it in range(warmup + iters):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if it >= warmup:
            times.append(time.perf_counter() - t0)
        if after_each is not None:
            after_each()
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(statistics.median(t.tolist()))


def _compute_terms(buf: torch.Tensor, device: torch.device, sync: Any, warmup: int,
                   iters: int) -> dict[str, float]:
    """Every rank at once (as in training, ranks sharing cores see their share): the
    GEMM rate, the memory bandwidth, the cost of one small op, and how much of an
    all-reduce of ``buf`` over every rank (and of five small ones) hides behind GEMMs
    issued while it is in flight."""
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    x = torch.ones(256, device=device)

    def timed(fn: Any) -> float:
        return _timed(fn, warmup, iters, device, sync)

    def ops() -> None:
        y = x
        for _ in range(_OPS):
            y = y + 1.0

    reps = max(1, int(0.05 / max(timed(lambda: torch.mm(a, b)), 1e-6)))  # ~50 ms of GEMMs

    def gemms() -> None:
        for _ in range(reps):
            torch.mm(a, b)

    t_gemm = timed(gemms)
    small = torch.ones(_SMALL_NUMEL, device=device)

    def hidden(comm: Any, chunks: int) -> float:
        """The share of ``comm`` (issuing ``chunks`` async collectives) that GEMMs issued
        while they are in flight hide."""
        t_comm = timed(lambda: [w.wait() for w in comm()])

        def both() -> None:
            works = []
            for w in comm():
                works.append(w)
                for _ in range(max(1, reps // chunks)):
                    torch.mm(a, b)
            for w in works:
                w.wait()

        t_both = timed(both)
        t_g = t_gemm * max(1, reps // chunks) * chunks / reps
        return min(1.0, max(0.0, (t_g + t_comm - t_both) / max(min(t_g, t_comm), 1e-12)))

    # a step program's collectives: a few large (buckets, weights) and many small ones
    # (norm statistics, the loss) issued one after another between GEMMs
    big = hidden(lambda: [dist.all_reduce(buf, async_op=True)], 1)
    little = hidden(lambda: (dist.all_reduce(small, async_op=True) for _ in range(5)), 5)
    # beyond the caches: 4 Mi floats read and 4 Mi written per pass
    src = torch.ones(1 << 22, device=device)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: [torch.add(src, 1.0, out=dst) for _ in range(5)])
    return {"gemm_flops": 2 * n ** 3 * reps / t_gemm, "op_overhead": timed(ops) / _OPS,
            "memory_bandwidth": 5 * 2 * src.numel() * src.element_size() / t_copy,
            "bandwidth_overlap": big, "latency_overlap": little}


def profile_machine(
    ranks: int,
    message_bytes: int = 64 * MiB,
    iters: int = 5,
    *,
    warmup: int = 1,
    progress: bool = True,
    timeout_s: float = 600.0,
    backend: str | None = None,
) -> Machine:
    """Measure this node's intra-node bandwidth and latency tables, its GEMM rate, its
    per-op overhead and how well it overlaps communication with compute, with ``ranks``
    processes.

    For every shape of :func:`profile_shapes`, all groups of :func:`shape_groups` run an
    all-reduce of ``message_bytes`` at once, ``warmup`` untimed then ``iters`` timed
    rounds; a round's time is its slowest rank's. The latency table gets the median
    round of a 64-byte all-reduce (the cost of a call, whatever its size); the bandwidth
    table the ring-model bandwidth ``2(size-1)/size * message_bytes / (seconds -
    latency)`` (the bytes each rank sends, the quantity equations 1-5 divide by beta).
    The paper uses 1 GB messages so start-up costs vanish; 64 MiB is the default here to
    keep CPU runs short. Then, every rank at once: ``gemm_flops`` from square GEMMs,
    ``memory_bandwidth`` from an element-wise op over 16 MiB, ``op_overhead`` from a chain
    of small element-wise ops, ``bandwidth_overlap`` from an
    all-reduce of ``message_bytes`` over every rank issued before GEMMs of about 50 ms and
    waited after them (the part of the shorter of the two that disappears), and
    ``latency_overlap`` the same with five 64-byte all-reduces issued between the GEMMs.

    Returns ``Machine(name="profiled", gpus_per_node=ranks, ...)`` with memory_bytes the
    GPU's memory (CUDA) or the host's RAM divided by ``ranks`` (CPU), and
    inter_node_bandwidth (inter_node_latency) set to the SMALLEST (LARGEST) intra-node
    figure measured: a single node has no inter-node link to measure, and this keeps the
    model from ever preferring a mesh that would span nodes. Replace them with the real
    network's figures on a cluster.

    ``backend``: None picks "nccl" (one rank per CUDA device) when CUDA is available,
    else "gloo" on CPU processes; pass "gloo" to profile CPU ranks on a GPU machine.
    """
    for name, v, least in (("ranks", ranks, 2), ("message_bytes", message_bytes, 4),
                           ("iters", iters, 1), ("warmup", warmup, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(
                f"profile_machine: {name} must be an integer >= {least}, got {v!r}"
                + (" (one rank has no group to measure)." if name == "ranks" else ".")
            )
    if timeout_s <= 0:
        raise ValueError(f"profile_machine: timeout_s must be positive, got {timeout_s!r}.")
    backend = backend or _default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(
            f"profile_machine: backend must be 'gloo', 'nccl' or None (automatic), "
            f"got {backend!r}."
        )
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "profile_machine: backend 'nccl' needs CUDA devices and none is available; "
            "pass backend='gloo' (or None) to profile CPU processes."
        )
    if backend == "nccl" and ranks > torch.cuda.device_count():
        raise ValueError(
            f"profile_machine: {ranks} ranks but only {torch.cuda.device_count()} CUDA "
            "devices; NCCL needs one rank per GPU, pass ranks <= the GPU count."
        )
    with tempfile.TemporaryDirectory(prefix="shardc-profile-") as tmp:
        init_file = os.path.join(tmp, "init")
        result_file = os.path.join(tmp, "result.json")
        spawn(  # type: ignore[no-untyped-call]
            _worker,
            args=(ranks, init_file, result_file, message_bytes, iters, warmup,
                  progress, timeout_s, backend),
            nprocs=ranks,
            join=True,
        )
        try:
            data = json.loads(Path(result_file).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise RuntimeError(
                f"profile_machine: the profiling ranks exited without writing results "
                f"({e}); rerun with progress=True to see how far they got."
            ) from None
    table = {(r["inner"], r["size"]): float(r["bytes_per_s"]) for r in data["results"]}
    latency = {(r["inner"], r["size"]): float(r["latency_s"]) for r in data["results"]}
    return Machine(
        gpus_per_node=ranks,
        memory_bytes=float(data["memory_bytes"]),
        inter_node_bandwidth=min(table.values()),
        intra_node_bandwidth=table,
        name="profiled",
        intra_node_latency=latency,
        # like the bandwidth: no link to measure, so the worst figure of the node
        inter_node_latency=max(latency.values()),
        gemm_flops=float(data["gemm_flops"]),
        memory_bandwidth=float(data["memory_bandwidth"]),
        op_overhead=float(data["op_overhead"]),
        bandwidth_overlap=float(data["bandwidth_overlap"]),
        latency_overlap=float(data["latency_overlap"]),
    )
