"""Gradient clipping over a sharded model: ``shardc.clip_grad_norm_``.

The global norm is a function of every gradient element of the single-device model. On
the mesh each element lives on some ranks: a parameter cut over an axis has a different
piece on each rank of it, and one replicated over an axis has the same piece on each. Every
rank adds up ``|g|**p`` over its shards, counting a shard only if the rank sits at
coordinate 0 of each axis its parameter is replicated over (so every element is counted on
exactly one rank, with no division that would round), and one all-reduce of one float64
over the world gives the sum. The inf-norm is a max, where replicas do no harm: one
all-reduce of the local maxima.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from shardc.core.errors import ShardcError
from shardc.core.mesh import CUT_AXES
from shardc.program.module import ShardedModule


def _counted_here(sm: ShardedModule, name: str, coords: dict[str, int]) -> bool:
    """Whether this rank is the one that counts ``name``'s shard: coordinate 0 on every
    axis over which the parameter is replicated."""
    layout, mesh = sm.param_layouts[name], sm.mesh
    return all(coords[a] == 0 for a in CUT_AXES if mesh.size(a) > 1 and layout.is_replicated(a))


def clip_grad_norm_(sm: Any, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of a ``ShardedModule`` by their global norm, in place, and return
    that norm (collective: call it on every rank, after a synced backward).

    Same result as ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm,
    norm_type)`` on one device: the norm over every element of every gradient of the
    single-device model (a parameter replicated on an axis counted once), the same
    coefficient ``min(1, max_norm / (norm + 1e-6))`` applied to every shard. ``norm_type``
    is a positive float or ``inf``. Local sums are taken in float64, so the norm is exact
    to the rounding of the returned fp32 value. The one all-reduce (8 bytes) is outside
    the compiled program: it is not in the comm report nor ``sm.measured_comm()``. On a
    pipeline (``pipe > 1``) the norm is over every stage's gradients, as one device's.
    """
    shared_elsewhere: set[str] = set()
    programs = [sm]
    if hasattr(sm, "stages"):  # a pipeline rank (shardc/program/pipeline.py): its stage programs
        # a parameter two stages hold (a tied embedding and head) is counted by the first
        shared_elsewhere = {n for n, holders in sm.shared.items() if holders[0] != sm.index}
        programs = list(sm.programs)
    for program in programs:
        if not isinstance(program, ShardedModule):
            raise TypeError(f"shardc.clip_grad_norm_: expects the ShardedModule shardc.compile returned, "
                            f"got {type(program).__name__}. For a plain module use "
                            "torch.nn.utils.clip_grad_norm_.")
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"shardc.clip_grad_norm_: norm_type must be positive or inf, got {norm_type}.")
    if any(not program.runtime.sync or program.pending_reductions() for program in programs):
        raise ShardcError(
            "shardc.clip_grad_norm_: some gradients are not reduced yet (called inside "
            "sm.no_sync(), or after it without a synced backward), so each rank holds only "
            "its local part and the norm would be wrong. Run the last micro-batch's "
            "backward outside no_sync first.")
    grads: list[torch.Tensor] = []
    counted: list[torch.Tensor] = []
    for program in programs:
        coords = program.mesh.coords(program.ctx.rank)
        for name, p in program.named_parameters():
            if p.grad is None:
                continue
            grads.append(p.grad)
            if _counted_here(program, name, coords) and name not in shared_elsewhere:
                counted.append(p.grad)
    if not grads:
        return torch.tensor(0.0)
    device, dtype = grads[0].device, grads[0].dtype
    inf = math.isinf(norm_type)
    if inf:
        local = max((g.detach().abs().max().to(torch.float64) for g in grads if g.numel()),
                    default=torch.zeros((), dtype=torch.float64, device=device))
    else:
        local = sum((g.detach().to(torch.float64).abs().pow(norm_type).sum() for g in counted),
                    torch.zeros((), dtype=torch.float64, device=device))
    acc = local.reshape(1).to(device)
    if dist.get_world_size() > 1:
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    total64 = acc[0] if inf else acc[0].pow(1.0 / norm_type)
    total = total64.to(dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"shardc.clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
            "non-finite, so it cannot be clipped. Set error_if_nonfinite=False to clip anyway.")
    # torch's formula, in the gradients' dtype, so the scaling is bit-for-bit the one a
    # single device applies given the same norm
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.device))
    return total
