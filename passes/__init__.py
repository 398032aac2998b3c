"""The compiler's passes, in the order they run. Each is ``pass(gm, ctx) -> gm``.

Tracing (``trace.py``) happens before the pipeline: it turns the model into the global
ATen graph every pass after it starts from.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from shardc.context import CompileContext

from .grad_sync import grad_sync_pass
from .lower import lower_pass
from .prefetch import prefetch_pass

Pass = Callable[[fx.GraphModule, CompileContext], fx.GraphModule]

PIPELINE: list[Pass] = [
    # global graph -> this rank's program with forward collectives and placements
    lower_pass,
    # needs every forward placement: decides backward collectives from them
    grad_sync_pass,
    # only reorders: after every node exists, so the order it makes is the final one
    prefetch_pass,
]


# passes on the whole-step program (``joint.py``), each ``pass(jp, ctx) -> jp``, in order
STEP_PIPELINE: list[Callable] = []


def run_step_pipeline(jp: Any, ctx: CompileContext) -> Any:
    for p in STEP_PIPELINE:
        jp = p(jp, ctx)
    for gm in (jp.forward, jp.backward):
        gm.graph.lint()
        gm.recompile()
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
