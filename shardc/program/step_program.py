"""The step program: where compilation finishes, on the first call that needs gradients.

The rank's forward program is built by ``compile`` (``build.py``); the step program
(forward and backward as one traced program, ``passes/joint.py``, rewritten by the step
passes) can only be traced once the arguments' shapes and which of them need gradients
are known, at the first call that needs gradients, and once per new input signature.
``ShardedModule`` calls ``build`` then; ``build_offline`` traces the same program on
fake tensors, for what reads its structure (the comm report, the planner).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from shardc.core.context import CompileContext
from shardc.core.ir import StepProgram
from shardc.passes import STEP_PIPELINE, run_step_pipeline
from shardc.passes.gemm_modes import gemm_modes_pass, settle
from shardc.passes.joint import trace_joint
from shardc.passes.remat import remat_pass
from shardc.program import share
from shardc.program.backend import build_runner


def build(program: fx.GraphModule, ctx: CompileContext, args: Sequence[Any], needs: Sequence[bool],
          names: Sequence[str | None], device: torch.device) -> tuple[StepProgram | None, str]:
    """The step program for these arguments, with its parts' runners (``backend``), or
    (None, why) when any rank could not build it: every rank must run the same program or
    their collectives would not match, so one rank's failure makes all fall back to the
    forward program (one small all-reduce, once per input signature). Collective."""
    def trace() -> StepProgram:
        return run_step_pipeline(trace_joint(program, ctx, args, needs, names), ctx)

    jp, err = None, ""
    if share.ENABLED and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        # one trace for the ranks whose programs are equal (share.py)
        try:
            key: str | None = share.signature(program, ctx, args, needs, names)
        except Exception:  # noqa: BLE001 - a program the encoder cannot write: trace it
            key = None
        jp, err = share.build_shared(trace, ctx, key, share.baked_axes(program), device)
    else:
        try:
            jp = trace()
        except Exception as e:  # noqa: BLE001 - the forward program is always there
            err = f"{type(e).__name__}: {e}"
    flag = torch.tensor([1.0 if err else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        return None, err or "another rank could not build it"
    assert jp is not None
    settle([jp.forward, jp.backward], ctx)  # gemm_modes="auto": the ranks agree on forms
    jp = remat_pass(jp, ctx)  # backend="inductor": recompute in backward what is cheap
    jp.run_forward = build_runner(jp.forward, ctx.options.backend, "forward")
    jp.run_backward = build_runner(jp.backward, ctx.options.backend, "backward")
    return jp, ""


def build_offline(program: fx.GraphModule, ctx: CompileContext, args: Sequence[Any],
                  needs: Sequence[bool], names: Sequence[str | None]) -> StepProgram:
    """The step program as ``build`` makes it, traced on fake tensors without
    communication. Not for running. The step passes run on it, except that
    ``gemm_modes="auto"`` times nothing here (its choice changes copies, not collectives)."""
    passes = [p for p in STEP_PIPELINE if not (p is gemm_modes_pass and ctx.options.gemm_modes == "auto")]
    return run_step_pipeline(trace_joint(program, ctx, args, needs, names, offline=True), ctx, passes)
