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


def run_on_ranks(fn: Callable, world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; re-raise the
    first rank's error with its traceback."""
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.spawn(_worker, args=(world_size, f"{d}/store", fn, args, d), nprocs=world_size, join=True)
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
    ref_losses: list[float]      # the single-device (fp32) model's loss per step
    losses: list[float]          # the compiled model's global-mean loss per step
    ref_state: dict              # single-device state after the last step
    state: dict                  # the compiled model's full_state_dict() after the last step
    sm: shardc.ShardedModule
    grads: dict                  # the compiled model's full_grads() at the first step
    ref_grads: dict              # the single-device fp32 gradients at the first step
    f64_grads: dict              # a float64 copy's gradients at the first step (or {})


def _double(t: Any) -> Any:
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def train_side_by_side(make_model: Callable[[], torch.nn.Module], batches: list[tuple],
                       mesh: shardc.Mesh, lr: float = 1e-2, eps: float = 1e-6,
                       float64_reference: bool = False, **compile_kw: Any) -> SideBySide:
    """Train the single-device model and its compiled copy on the same global batches,
    with AdamW. The first step's gradients of both (the compiled ones gathered with
    ``full_grads``, collective) are kept, and with ``float64_reference`` those of a float64
    copy of the same initial model on the same first batch, drawing the same dropout
    masks: the exact-arithmetic gradient to measure both fp32 runs against."""
    torch.manual_seed(0)
    model = make_model()
    # compile reads the model and never changes it: the single-device runs train copies.
    # A make_model that hands back the same model every time lets compile reuse its
    # trace (torch.export, most of the compile time) for every mesh.
    ref = copy.deepcopy(model)
    ref64 = copy.deepcopy(model).double() if float64_reference else None
    sm = shardc.compile(model, mesh, example_inputs=batches[0], **compile_kw)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr, eps=eps)
    opt = torch.optim.AdamW(sm.parameters(), lr=lr, eps=eps)
    ref_losses, losses = [], []
    grads: dict = {}
    ref_grads: dict = {}
    f64_grads: dict = {}
    for step, batch in enumerate(batches):
        rng = torch.get_rng_state()  # all draw the same dropout masks
        if step == 0 and ref64 is not None:
            ref64(*[_double(t) for t in batch]).backward()
            f64_grads = {n: p.grad for n, p in ref64.named_parameters()}
            torch.set_rng_state(rng)
        loss_ref = ref(*batch)
        loss_ref.backward()
        if step == 0:
            ref_grads = {n: p.grad.clone() if p.grad is not None else None
                         for n, p in ref.named_parameters()}
        opt_ref.step()
        opt_ref.zero_grad()
        torch.set_rng_state(rng)
        local = [shardc.shard_batch(t, mesh) for t in batch]
        loss = sm(*local)
        loss.backward()
        if step == 0:
            grads = sm.full_grads()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss_ref.item())
        losses.append(shardc.global_mean(loss, mesh).item())
    return SideBySide(ref_losses, losses, ref.state_dict(), sm.full_state_dict(), sm,
                      grads, ref_grads, f64_grads)
