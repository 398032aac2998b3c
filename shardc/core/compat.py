"""The torch releases shardc supports, and the names it uses that are newer than the oldest.

``pyproject.toml`` states the range; ``tools/torch_matrix.sh`` runs it (docs/torch_versions.md
gives the versions it passed on, and why the floor is where it is);
that page's audit table gives, for every torch API the project calls, the first release
that has it. Everything there is at or below
``TORCH_FLOOR`` except the names in ``NEWER_THAN_FLOOR``, which the code reaches only
through a fallback (``tests/test_torch_range.py`` hides them and trains).
"""
from __future__ import annotations

import re
from typing import Any

import torch

TORCH_FLOOR = (2, 8)   # the oldest release the torch matrix passes (tools/torch_matrix.sh)
TORCH_CEILING = (3, 0)  # exclusive: the next major may break the export and dispatch APIs

# qualified name -> first torch release that has it; each is looked up with getattr and
# a fallback (runtime/collectives.py: all_gather_into_tensor / reduce_scatter_tensor,
# the same collectives under the names every release since 1.13 has)
NEWER_THAN_FLOOR: dict[str, str] = {
    "torch.distributed.all_gather_single": "2.13",
    "torch.distributed.reduce_scatter_single": "2.13",
}


# Block recompute under backend="inductor" (compiled pieces inside torch.utils.checkpoint):
# run on 2.11, 2.13 and 2.15. On 2.8 the gradient hooks of the parameters a compiled piece
# reads inside a checkpointed block never fired (Llama's RMSNorm weights on x1y1z1d2: their
# gradients were not all-reduced, measured != reported), which 2.8 without the checkpoint
# did not do; 2.9 and 2.10 were not run. Below this, compile refuses the pair.
RECOMPUTE_COMPILED_FROM = (2, 11)

# A classification loss over rows a boolean mask picks (passes/masked_losses.py) is
# rewritten on the export, so the export must take it first: 2.8's and 2.9's guard on
# whether the picked rows are empty (log_softmax's meta function), a TraceError naming the
# size the data decides, unless draft_export fixes that branch; 2.10, 2.13 and 2.15 take
# it (the same mask computed twice only from 2.13: 2.10 compares the two sizes).
PICKED_LOSSES_FROM = (2, 10)

# A loop over the entries a mask holds traced with each entry as data (passes/hit_loops.py,
# DBRX's experts, which index their stacked weights by the entry): 2.8's and 2.10's export
# cannot take a select at an index the data decides ("could not extract specialized
# integer"), so the model stays refused there, naming the size; 2.13 and 2.15 take it
# (2.11 and 2.12 were not run).
LOOP_ENTRIES_AS_DATA_FROM = (2, 13)


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed torch), e.g. "2.13.0+cpu"."""
    m = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    if m is None:
        raise ValueError(f"not a torch version: {version or torch.__version__!r}")
    return int(m.group(1)), int(m.group(2))


def supported(version: str | None = None) -> bool:
    return TORCH_FLOOR <= torch_version(version) < TORCH_CEILING


def checkpoint_whole(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)`` that
    recomputes the whole of ``fn`` in backward, never stopping early (a recompute re-issues
    its block's collectives, which every rank must issue alike). ``checkpoint``'s
    ``early_stop`` keyword is newer than the floor: torch 2.8 passed it on to ``fn``, which
    failed every block recompute there; the context manager is in every supported release."""
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
