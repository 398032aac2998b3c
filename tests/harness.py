"""Helpers the tests share: spawning gloo ranks, and training a compiled model side by
side with the single-device model on the same global batch."""
from __future__ import annotations

import copy
import faulthandler
import os
import tempfile
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
# machine's time for 4 ranks, about 25 spawns in the suite. The server is a clean process
# started on first use, not the test process, so a rank inherits none of the tests' state
# (caches, process groups, threads) and no OpenMP pool, which plain fork would copy.
_PRELOAD = ["torch", "torch.distributed", "shardc", "harness", "models"]


def _start_method() -> str:
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts
    return "forkserver"


def run_on_ranks(fn: Callable, world_size: int, *args: Any, start_method: str | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; re-raise the
    first rank's error with its traceback. ``start_method``: "spawn" for a caller whose
    ranks must import everything afresh (``compat_run.py``), else the fork server."""
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
