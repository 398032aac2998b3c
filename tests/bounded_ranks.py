"""Spawning gloo ranks whose failures are the point of the test: a short process-group
timeout, a deadline for the whole run, and each rank's outcome kept even when another
rank died (``mp.spawn`` kills every rank as soon as one exits non-zero, before the
survivors can say what they saw)."""
from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, store: str, fn: Callable, args: tuple, outdir: str,
            pg_timeout_s: float, before_init: Callable | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if before_init is not None:  # what a rank does before torch.distributed exists
        args = (before_init(rank, world_size), *args)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": traceback.format_exc()}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # A group whose peer died may not tear down cleanly; the outcome is written, so
    # leave without waiting on it.
    os._exit(0)


def run_bounded(fn: Callable, world_size: int, *args: Any, pg_timeout_s: float = 60.0,
                deadline_s: float = 300.0, wait_for: set[int] | None = None,
                before_init: Callable | None = None) -> dict[int, dict]:
    """Run ``fn(rank, world_size, *args)`` on gloo ranks until the ranks in ``wait_for``
    (default: all) have exited, or the deadline. Returns rank -> {"exitcode", "hung",
    "ok", "value" or "error"}; a rank still running then is killed and reported with
    ``"hung": True``. With ``before_init``, each rank first runs ``before_init(rank,
    world_size)`` and ``fn`` gets its result as its first extra argument."""
    from harness import _may_spawn

    _may_spawn()
    ctx = mp.get_context("spawn")
    wait_for = set(range(world_size)) if wait_for is None else wait_for
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_worker, args=(r, world_size, f"{d}/store", fn, args, d,
                                                   pg_timeout_s, before_init))
                 for r in range(world_size)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        for r in sorted(wait_for):
            procs[r].join(max(0.0, deadline_s - (time.monotonic() - t0)))
        out: dict[int, dict] = {}
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                out[r] = {"hung": True, "exitcode": None}
                continue
            path = os.path.join(d, f"rank{r}.json")
            res = json.load(open(path)) if os.path.exists(path) else {}
            out[r] = {"hung": False, "exitcode": p.exitcode, **res}
        return out


def check_all_ok(results: dict[int, dict]) -> list:
    """Every rank's return value; an AssertionError with every failing rank's story."""
    bad = {r: res for r, res in results.items() if not res.get("ok")}
    if bad:
        raise AssertionError("\n".join(
            f"rank {r}: " + ("hung past the deadline" if res.get("hung") else
                             res.get("error") or f"exited with {res.get('exitcode')}")
            for r, res in sorted(bad.items())))
    return [results[r]["value"] for r in sorted(results)]
