"""StepGuard: skip the optimizer step on every rank when the loss or a gradient is not
finite, and stop a run that keeps producing them.

    guard = shardc.StepGuard(sm, optimizer, max_consecutive_skips=3)
    for tokens, targets in batches:
        loss = sm(tokens, targets)
        loss.backward()
        if not guard.step(loss):          # skipped: nothing was updated anywhere
            print("skipped", guard.step_count, guard.last_offender)
        optimizer.zero_grad()

One all-reduce (sum) of ``P + 1`` float64 values per step, ``P`` the number of
parameters: slot ``i`` is parameter ``i``'s sum of squared gradient entries, counted
once per block of the global tensor (a rank that holds a copy of the block, because the
layout replicates it over an axis, contributes ``0 * its sum``: zero when finite, NaN
when not), and the last slot is ``0 * loss``. So a non-finite value on any rank, copy or
not, makes its slot NaN on every rank, the finite sums add up to exactly the global
squared norm without double counting, and every rank takes the same decision.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from shardc.core.mesh import CUT_AXES
from shardc.runtime.algorithms import all_reduce_flat

__all__ = ["StepGuard", "NonFiniteError"]


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


class StepGuard:
    """Wraps ``optimizer.step()`` for a ``ShardedModule``: ``step(loss)`` checks the loss
    and the global gradient norm on every rank at once, steps the optimizer when both
    are finite and skips it everywhere when not, and raises ``NonFiniteError`` after
    ``max_consecutive_skips`` skips in a row. ``step`` is counted from ``start_step``
    (pass the step ``shardc.checkpoint.load`` returned) and names the step in messages.

    Attributes after each ``step``: ``last_norm`` (the global gradient 2-norm, as
    ``torch.nn.utils.clip_grad_norm_`` on one device computes it, up to rounding;
    inf/NaN when skipped), ``skipped`` (total skips), ``consecutive_skips``,
    ``last_offender`` (None, ``"loss"`` or the first parameter, in ``named_parameters``
    order, whose gradient is not finite on some rank)."""

    def __init__(self, sm: Any, optimizer: torch.optim.Optimizer, max_consecutive_skips: int = 3,
                 start_step: int = 0) -> None:
        if not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1:
            raise ValueError(f"StepGuard: max_consecutive_skips must be a positive int, got "
                             f"{max_consecutive_skips!r}.")
        self.sm = sm
        self.optimizer = optimizer
        self.max_consecutive_skips = max_consecutive_skips
        self.step_count = start_step
        self.skipped = 0
        self.consecutive_skips = 0
        self.last_norm: float = 0.0
        self.last_offender: str | None = None
        self._skipped_steps: list[int] = []
        coords = sm.mesh.coords(sm.ctx.rank)
        program, names, counted_elsewhere = sm, None, set()
        if hasattr(sm, "stages"):  # a pipeline rank (shardc/program/pipeline.py)
            # one slot per parameter of the whole model, in its order, on every stage (the
            # all-reduce needs one length everywhere; a stage leaves others' slots at 0);
            # a tied parameter two stages hold is counted by the first
            program, names = sm.held(), sm._param_order
            counted_elsewhere = {n for n, holders in sm.shared.items() if holders[0] != sm.index}
        held = dict(program.named_parameters())
        self._params: list[tuple[str, torch.Tensor | None, bool]] = []
        for name in names if names is not None else list(held):
            layout = program.param_layouts.get(name)
            sharded = set(layout.sharded_axes()) if layout is not None else set()
            # the copy at coordinate 0 of every axis the layout replicates counts the block
            owner = all(coords[a] == 0 for a in CUT_AXES if a not in sharded and sm.mesh.size(a) > 1)
            self._params.append((name, held.get(name), owner and name not in counted_elsewhere))

    def check(self, loss: torch.Tensor | float | None = None) -> tuple[bool, float, str | None]:
        """(finite everywhere, global gradient norm, first offender) — collective, no step."""
        dev = next((p.device for _, p, _ in self._params if p is not None), torch.device("cpu"))
        sq = torch.zeros(len(self._params) + 1, dtype=torch.float64, device=dev)
        for i, (_, p, owner) in enumerate(self._params):
            if p is not None and p.grad is not None:
                s = p.grad.detach().double().pow(2).sum()
                sq[i] = s if owner else s * 0.0
        if loss is not None:
            lv = loss.detach().double().sum() if isinstance(loss, torch.Tensor) \
                else torch.tensor(float(loss), dtype=torch.float64)
            sq[-1] = lv.to(dev) * 0.0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            all_reduce_flat(sq)
        vals = sq.cpu().tolist()
        offender = None
        if not math.isfinite(vals[-1]):
            offender = "loss"
        else:
            for (name, _, _), v in zip(self._params, vals):
                if not math.isfinite(v):
                    offender = name
                    break
        norm = math.sqrt(sum(vals[:-1])) if offender is None else math.nan
        if offender is None and not math.isfinite(norm):  # finite grads whose squares overflow float64
            offender = "gradient norm"
        return offender is None, norm, offender

    def step(self, loss: torch.Tensor | float | None = None) -> bool:
        """Step the optimizer if the loss and every gradient are finite on every rank;
        return whether it stepped (the same on every rank). Collective."""
        self.step_count += 1
        ok, self.last_norm, self.last_offender = self.check(loss)
        if ok:
            self.optimizer.step()
            self.consecutive_skips = 0
            self._skipped_steps = []
            return True
        self.skipped += 1
        self.consecutive_skips += 1
        self._skipped_steps.append(self.step_count)
        if self.consecutive_skips >= self.max_consecutive_skips:
            what = ("the loss is not finite" if self.last_offender == "loss" else
                    "the gradient norm overflows" if self.last_offender == "gradient norm" else
                    f"the first parameter with a non-finite gradient is {self.last_offender!r}")
            raise NonFiniteError(
                f"StepGuard: {self.consecutive_skips} consecutive steps skipped (steps "
                f"{', '.join(map(str, self._skipped_steps))}) because the loss or a gradient was "
                f"NaN or Inf; at step {self.step_count} {what}. Lower the learning rate, check the "
                "inputs of those steps, or resume from the last checkpoint.")
        return False
