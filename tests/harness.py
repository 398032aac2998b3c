"""Helpers the tests share: spawning gloo ranks, and training a compiled model side by
side with the single-device model on the same global batch."""
from __future__ import annotations

import copy
import os
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shardc


def _worker(rank: int, world_size: int, store: str, fn: Callable, args: tuple, errdir: str) -> None:
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
            errs = sorted(f for f in os.listdir(d) if f.endswith(".err"))
            text = open(os.path.join(d, errs[0])).read() if errs else str(e)
            raise AssertionError(f"a rank failed:\n{text}") from None


def train_side_by_side(make_model: Callable[[], torch.nn.Module], batches: list[tuple],
                       mesh: shardc.Mesh, lr: float = 1e-2, eps: float = 1e-6, **compile_kw: Any
                       ) -> tuple[list[float], list[float], dict, dict, shardc.ShardedModule]:
    """Train the single-device model and its compiled copy on the same global batches.
    Returns (reference losses, compiled global-mean losses, reference state, compiled
    full state, compiled module)."""
    torch.manual_seed(0)
    ref = make_model()
    model = copy.deepcopy(ref)
    sm = shardc.compile(model, mesh, example_inputs=batches[0], **compile_kw)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr, eps=eps)
    opt = torch.optim.AdamW(sm.parameters(), lr=lr, eps=eps)
    ref_losses, losses = [], []
    for batch in batches:
        rng = torch.get_rng_state()  # both draw the same dropout masks
        loss_ref = ref(*batch)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        torch.set_rng_state(rng)
        local = [shardc.shard_batch(t, mesh) for t in batch]
        loss = sm(*local)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss_ref.item())
        losses.append(shardc.global_mean(loss, mesh).item())
    return ref_losses, losses, ref.state_dict(), sm.full_state_dict(), sm
