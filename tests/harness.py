"""Helpers the tests share: spawning gloo ranks, and training a compiled model side by
side with the single-device model on the same global batch."""
from __future__ import annotations

import copy
import faulthandler
import os
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shardc


def _worker(rank: int, world_size: int, store: str, fn: Callable, args: tuple, errdir: str) -> None:
    # a rank killed by a signal (a crash in C++) leaves no Python traceback behind, only
    # "process N terminated with signal ..."; faulthandler writes every thread's stack
    fault = open(os.path.join(errdir, f"rank{rank}.fault"), "w")
    faulthandler.enable(file=fault, all_threads=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        with open(os.path.join(errdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


# Ranks start from a fork server that has imported torch and shardc once (Python's
# "forkserver" start method): a spawned rank imports them afresh, 8 s of a 2-core
# machine's time for 4 ranks, once for each module and world size in the suite (a module's
# tests share a RankPool of each size: the ``ranks`` fixture). The server is a clean process
# started on first use, not the test process, so a rank inherits none of the tests' state
# (caches, process groups, threads) and no OpenMP pool, which plain fork would copy.
# The test models' libraries too (transformers' modelling core, LitGPT): importing them cost
# each rank 2-3 s of CPU more, paid again by each pool's ranks. The server skips a module it
# cannot import (multiprocessing ignores an ImportError there).
_PRELOAD = ["torch", "torch.distributed", "shardc", "harness", "models", "transformers",
            "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
            "transformers.models.gpt2.modeling_gpt2", "litgpt.model"]


def _start_method() -> str:
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts
    return "forkserver"


# (test id, marked distributed) of the test running, set by conftest.py: a test that starts
# ranks must be marked distributed (and so slow), or the fast tier would spawn processes
SPAWNING_TEST: tuple[str, bool] | None = None


def _may_spawn() -> None:
    if SPAWNING_TEST is not None and not SPAWNING_TEST[1]:
        raise RuntimeError(f"{SPAWNING_TEST[0]} starts gloo ranks: mark it distributed and slow "
                           "(tests/conftest.py)")


def run_on_ranks(fn: Callable, world_size: int, *args: Any, start_method: str | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; re-raise the
    first rank's error with its traceback. ``start_method``: "spawn" for a caller whose
    ranks must import everything afresh (``compat_run.py``), else the fork server."""
    _may_spawn()
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.start_processes(_worker, args=(world_size, f"{d}/store", fn, args, d),
                               nprocs=world_size, join=True,
                               start_method=start_method or _start_method())
        except Exception as e:  # noqa: BLE001
            texts = {f: open(os.path.join(d, f)).read() for f in sorted(os.listdir(d))
                     if f.endswith(".err")}
            # the rank that failed first, not a peer that then lost its connection to it
            errs = sorted(texts, key=lambda f: "gloo/transport" in texts[f])
            text = texts[errs[0]] if errs else str(e)
            if not errs:
                for f in sorted(f for f in os.listdir(d) if f.endswith(".fault")):
                    stacks = open(os.path.join(d, f)).read()
                    if stacks:
                        text += f"\n{f[:-6]}'s stacks when it died:\n{stacks}"
            raise AssertionError(f"a rank failed:\n{text}") from None


# ------------------------------------------------------------- a pool of ranks
def _pool_worker(rank: int, world_size: int, store: str, conn: Any, errdir: str) -> None:
    """One rank of a ``RankPool``: joins the gloo group once, then runs the jobs
    ``(fn, args)`` it receives, answering each with ("ok", fn's result) or ("error",
    traceback). After an error it leaves (as a rank of ``run_on_ranks`` does), so peers
    waiting for it in a collective are not left there; the pool then starts afresh."""
    fault = open(os.path.join(errdir, f"rank{rank}.fault"), "w")
    faulthandler.enable(file=fault, all_threads=True)
    # the pool asks a rank that does not answer in time for its stacks before killing it
    faulthandler.register(signal.SIGUSR1, file=fault, all_threads=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    profile_dir = os.environ.get("SHARDC_PROFILE_DIR")
    profile_rank = int(os.environ.get("SHARDC_PROFILE_RANK", "0"))
    try:
        while True:
            try:
                job = conn.recv()
            except EOFError:  # the test process went away
                break
            if job is None:
                break
            fn, args = job
            try:
                if profile_dir and rank == profile_rank:
                    result = _profiled(profile_dir, fn, rank, world_size, *args)
                else:
                    result = fn(rank, world_size, *args)
            except BaseException:  # noqa: BLE001
                conn.send(("error", traceback.format_exc()))
                break
            conn.send(("ok", result))
    finally:
        dist.destroy_process_group()


def _profiled(where: str, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` under cProfile, its statistics written to a new file in ``where``:
    SHARDC_PROFILE_DIR=dir (and SHARDC_PROFILE_RANK, default 0) profiles that rank's jobs,
    for finding where a gloo module's time goes (``pstats.Stats(*glob("dir/*.prof"))``)."""
    import cProfile  # noqa: PLC0415 - only when asked

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn, *args)
    finally:
        prof.dump_stats(os.path.join(where, f"{os.getpid()}-{time.time_ns()}.prof"))


class RankPool:
    """``world_size`` gloo ranks started once from the fork server (like ``run_on_ranks``'s)
    and reused: ``run(fn, *args)`` runs ``fn(rank, world_size, *args)`` on every rank and
    returns each rank's result, or raises AssertionError with the first failing rank's
    traceback (a rank killed by a signal: every rank's faulthandler stacks; a rank that
    does not answer within ``timeout``: the stacks of those still running). A failed job
    leaves no rank behind: the pool is closed and the next job starts a fresh one."""

    GRACE_S = 5.0  # after a rank fails, how long its peers may take to report theirs

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.dir: str | None = None

    @property
    def alive(self) -> bool:
        return bool(self.procs)

    def start(self, timeout: float = 600.0) -> None:
        _may_spawn()
        self.dir = tempfile.mkdtemp(prefix="shardc-ranks-")
        ctx = mp.get_context(_start_method())
        for rank in range(self.world_size):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_pool_worker, args=(rank, self.world_size, f"{self.dir}/store",
                                                       there, self.dir))
            p.start()
            there.close()
            self.procs.append(p)
            self.conns.append(here)
        self._gather(timeout, "starting")  # every rank has joined the group

    def run(self, fn: Callable, *args: Any, timeout: float = 1800.0) -> list[Any]:
        if not self.alive:
            self.start()
        for c in self.conns:
            c.send((fn, args))
        return self._gather(timeout, getattr(fn, "__name__", str(fn)))

    def _gather(self, timeout: float, what: str) -> list[Any]:
        from multiprocessing.connection import wait

        n = self.world_size
        results: list[Any] = [None] * n
        errors: dict[int, str] = {}
        dead: dict[int, int | None] = {}
        pending = set(range(n))
        deadline = time.monotonic() + timeout
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            waitables = {self.conns[r]: r for r in pending}
            waitables.update({self.procs[r].sentinel: r for r in pending})
            for obj in wait(list(waitables), timeout=deadline - now):
                r = waitables[obj]
                if r not in pending:
                    continue
                conn = self.conns[r]
                if obj is conn or conn.poll():
                    try:
                        kind, value = conn.recv()
                    except (EOFError, OSError):
                        kind, value = "dead", None
                else:
                    kind, value = "dead", None
                if kind == "ok":
                    results[r] = value
                elif kind == "error":
                    errors[r] = value
                else:
                    self.procs[r].join(timeout=5)
                    dead[r] = self.procs[r].exitcode
                pending.discard(r)
            if (errors or dead) and pending:
                deadline = min(deadline, time.monotonic() + self.GRACE_S)
        if not (errors or dead or pending):
            return results
        text = self._failure_text(errors, dead, pending, timeout, what)
        self.close(kill=True)
        raise AssertionError(f"a rank failed:\n{text}") from None

    def _failure_text(self, errors: dict[int, str], dead: dict[int, int | None],
                      pending: set[int], timeout: float, what: str) -> str:
        # the rank that failed first, not a peer that then lost its connection to it
        # (nor, when a rank died, the peers that lost theirs: then the dead rank's stacks)
        ordered = sorted(errors.items(), key=lambda kv: ("gloo/transport" in kv[1], kv[0]))
        if ordered and ("gloo/transport" not in ordered[0][1] or not dead):
            r, text = ordered[0]
            return f"rank {r}:\n{text}"
        if pending and not dead:
            for r in sorted(pending):  # ask the ranks still running for their stacks
                if self.procs[r].pid is not None:
                    try:
                        os.kill(self.procs[r].pid, signal.SIGUSR1)
                    except OSError:
                        pass
            time.sleep(2.0)
            text = f"{what}: ranks {sorted(pending)} did not answer within {timeout:.0f} s"
        else:
            text = f"{what}: ranks {sorted(dead)} died (exit codes {[dead[r] for r in sorted(dead)]})"
        for r in range(self.world_size):
            path = os.path.join(self.dir or "", f"rank{r}.fault")
            stacks = open(path).read() if os.path.exists(path) else ""
            if stacks:
                text += f"\nrank{r}'s stacks:\n{stacks}"
        return text

    def close(self, kill: bool = False) -> None:
        if not kill:
            for c in self.conns:
                try:
                    c.send(None)
                except OSError:
                    pass
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


class RankPools:
    """One ``RankPool`` per world size, one of them alive at a time (a module's cases are
    ordered by world size, so each pool starts once): ``run(fn, world_size, *args)``. A
    test module takes them as the ``ranks`` fixture (conftest.py), closed with the module."""

    def __init__(self) -> None:
        self.pools: dict[int, RankPool] = {}

    def run(self, fn: Callable, world_size: int, *args: Any, timeout: float = 1800.0) -> list[Any]:
        for ws, pool in self.pools.items():
            if ws != world_size and pool.alive:
                pool.close()
        pool = self.pools.setdefault(world_size, RankPool(world_size))
        return pool.run(fn, *args, timeout=timeout)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


class SideBySide(NamedTuple):
    ref_losses: list[float]      # one fp32 device's loss per step, at the same parameters
    losses: list[float]          # the compiled model's global-mean loss per step
    ref_state: dict              # one device's state after the last step (see train_side_by_side)
    state: dict                  # the compiled model's full_state_dict() after the last step
    sm: shardc.ShardedModule
    grads: list[dict]            # the compiled model's full_grads() at each step
    ref_grads: list[dict]        # one fp32 device's gradients at each step, same parameters
    f64_grads: list[dict]        # a float64 copy's gradients at each step, same parameters


def drive_with(model: torch.nn.Module, grads: dict) -> None:
    """Set ``model``'s ``.grad`` to the compiled model's gathered gradients (copies), so
    that its optimizer takes the step the compiled one should have taken."""
    for n, p in model.named_parameters():
        p.grad = grads[n].clone() if grads.get(n) is not None else None


def _double(t: Any) -> Any:
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def train_side_by_side(make_model: Callable[[], torch.nn.Module], batches: list[tuple],
                       mesh: shardc.Mesh, lr: float = 1e-2, eps: float = 1e-6,
                       **compile_kw: Any) -> SideBySide:
    """Train the compiled model with AdamW on global batches beside one device, judging
    each step's gradients rather than where AdamW takes the weights.

    Two fp32 runs (compiled, one device) that each train on their own gradients drift
    apart by AdamW's amplification of rounding: it divides every gradient element by its
    own magnitude, so an element near ``eps`` (an embedding row whose token is seen once)
    turns a few fp32 roundings of the sums behind it into a visible difference of the
    weight, whoever computed it. So the single-device optimizer is driven by the compiled
    model's gradients (``full_grads``, gathered each step): its weights are where the
    compiled model's must be if the compiled optimizer steps every shard as one device
    does, which ``state`` against ``ref_state`` checks; and at each step, at those same
    weights, one fp32 device and a float64 copy (drawing the same dropout masks) compute
    the gradient too: float64 is exact to ~1e-16, so each fp32 gradient's distance to it
    is that run's rounding error, which the caller compares. A stale or wrong weight, a
    missing reduction or a wrong shard at any step shows in that step's gradients or in
    the state; rounding noise does not."""
    torch.manual_seed(0)
    model = make_model()
    # compile reads the model and never changes it: the single-device runs train copies.
    # A make_model that hands back the same model every time lets compile reuse its
    # trace (torch.export, most of the compile time) for every mesh.
    ref = copy.deepcopy(model)
    ref64 = copy.deepcopy(model).double()
    sm = shardc.compile(model, mesh, example_inputs=batches[0], **compile_kw)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr, eps=eps)
    opt = torch.optim.AdamW(sm.parameters(), lr=lr, eps=eps)
    run = SideBySide([], [], {}, {}, sm, [], [], [])
    for batch in batches:
        rng = torch.get_rng_state()  # all draw the same dropout masks
        ref64.load_state_dict(ref.state_dict())  # copy_ casts to float64
        ref64(*[_double(t) for t in batch]).backward()
        run.f64_grads.append({n: p.grad for n, p in ref64.named_parameters()})
        ref64.zero_grad(set_to_none=True)
        torch.set_rng_state(rng)
        loss_ref = ref(*batch)
        loss_ref.backward()
        run.ref_grads.append({n: p.grad for n, p in ref.named_parameters()})
        torch.set_rng_state(rng)
        local = [shardc.shard_batch(t, mesh) for t in batch]
        loss = sm(*local)
        loss.backward()
        grads = sm.full_grads()
        run.grads.append(grads)
        drive_with(ref, grads)
        opt.step()
        opt.zero_grad()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        run.ref_losses.append(loss_ref.item())
        run.losses.append(shardc.global_mean(loss, mesh).item())
    run.ref_state.update(ref.state_dict())
    run.state.update(sm.full_state_dict())
    return run


def lm_batches(n: int = 3, batch: int = 8, seq: int = 16, vocab: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (tokens, targets) batches of a language model, the same on every rank (seed 1)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(n)]


def built_once(makers: dict[str, Callable[[], torch.nn.Module]]) -> Callable[[str], Callable[[], torch.nn.Module]]:
    """``model(name)``: a builder of one model per name and process, built once with seed 0
    (what train_side_by_side seeds): compile only reads it and the single-device runs train
    copies, so a module's cases share it (and compile its cached trace)."""
    built: dict[str, torch.nn.Module] = {}

    def model(name: str) -> Callable[[], torch.nn.Module]:
        def make() -> torch.nn.Module:
            if name not in built:
                torch.manual_seed(0)
                built[name] = makers[name]()
            return built[name]
        return make
    return model


def traced_beside_model(model: torch.nn.Module, traced: torch.nn.Module, *inputs: Any
                        ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """A scalar-valued model and its trace (``ep.module()``) run on the same inputs: (the
    model's value, the trace's, [(parameter name, the trace's gradient, the model's)]); a
    parameter the value does not read has a zero gradient."""
    want, got = model(*inputs), traced(*inputs)
    names = [n for n, _ in model.named_parameters()]
    params = dict(traced.named_parameters())

    def grads(value: torch.Tensor, ps: list[torch.Tensor]) -> list[torch.Tensor]:
        gs = torch.autograd.grad(value, ps, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(ps, gs)]
    gw = grads(want, list(model.parameters()))
    gg = grads(got, [params[n] for n in names])
    return want, got, list(zip(names, gg, gw))
