"""The compiler's passes, in the order they run. Each is ``pass(gm, ctx) -> gm``.

Tracing (``trace.py``) happens before the pipeline: it turns the model into the global
ATen graph every pass after it starts from.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from shardc.core.context import CompileContext

from .bucket import bucket_pass
from .coalesce import coalesce_pass
from .defer import defer_pass
from .gemm_modes import gemm_modes_pass
from .grad_sync import grad_sync_pass
from .inplace import inplace_pass
from .into_bucket import into_bucket_pass
from .lower import lower_pass
from .prefetch import prefetch_pass
from .schedule import schedule_pass
from .strides import strides_pass

Pass = Callable[[fx.GraphModule, CompileContext], fx.GraphModule]

PIPELINE: list[Pass] = [
    # global graph -> this rank's program with forward collectives and placements
    lower_pass,
    # needs every forward placement: decides backward collectives from them
    grad_sync_pass,
    # only reorders: after every node exists, so the order it makes is the final one
    prefetch_pass,
]


# passes on each part (forward, backward) of the step program (``joint.py``), in
# order; the same signature as the pipeline's
STEP_PIPELINE: list[Pass] = [
    # packs post-backward reductions; before scheduling, which then places the buckets
    bucket_pass,
    # a weight gradient made by a GEMM is written into its bucket, not copied there
    into_bucket_pass,
    # one all-gather / reduce-scatter per block of weights (FSDP2's grouping)
    coalesce_pass,
    # copies GEMM operands into the chosen form (NN/NT/TN); "auto" only times here and
    # rewrites once the ranks agree (gemm_modes.settle, after every rank built its part)
    gemm_modes_pass,
    # after the packing passes made their buffers: reduces fresh buffers in place
    inplace_pass,
    # only reorders: issues early, waits late, blocking paths first
    schedule_pass,
    # a view meets the strides its input really has (a kernel may lay its result out
    # otherwise than its shape function said): reshape, the same view wherever one exists
    strides_pass,
    # after the order is final: an output whose last step is a wait (a mean squared
    # error's data all-reduce) is returned unwaited and waited on first read
    defer_pass,
]


def run_step_pipeline(jp: Any, ctx: CompileContext, passes: list[Pass] | None = None) -> Any:
    """Run the step passes on the forward and the backward part of ``jp`` (a StepProgram)."""
    for part in ("forward", "backward"):
        gm = getattr(jp, part)
        for p in STEP_PIPELINE if passes is None else passes:
            try:
                gm = p(gm, ctx)
            except Exception as e:  # noqa: BLE001 - name the pass, keep the cause
                raise RuntimeError(f"shardc: step pass {p.__name__} failed on the {part}: "
                                   f"{type(e).__name__}: {e}") from e
        setattr(jp, part, gm)
    return jp


def run_pipeline(gm: fx.GraphModule, ctx: CompileContext, passes: list[Pass] | None = None
                 ) -> fx.GraphModule:
    for p in passes or PIPELINE:
        try:
            gm = p(gm, ctx)
        except (ValueError, TypeError, NotImplementedError):
            raise
        except Exception as e:  # noqa: BLE001 - name the pass, keep the cause
            raise RuntimeError(f"shardc: pass {p.__name__} failed: {type(e).__name__}: {e}") from e
    return gm
