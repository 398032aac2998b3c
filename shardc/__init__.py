"""shardc: a sharding compiler for PyTorch training (AxoNN's 4D hybrid parallelism)."""
from __future__ import annotations

from typing import Any

from shardc.train.clip import clip_grad_norm_
from shardc.compiler import compile, global_mean, shard_batch
from shardc.core.errors import CollectiveError, ShardcError, ShardcWarning, TraceError
from shardc.program.explain import explain
from shardc.train.guard import NonFiniteError, StepGuard
from shardc.core.machine import Machine
from shardc.core.mesh import Mesh
from shardc.program.module import ShardedModule
from shardc.core.placement import Layout, Partial, Replicate, Shard
from shardc.planning.planner import Candidate, plan
from shardc.core.precision import CastAtUse, Precision
from shardc.passes.recompute import Selective
from shardc.program.report import CommReport, CommRow, comm_report
from shardc.runtime.pending import PendingOutput

__all__ = ["Mesh", "compile", "shard_batch", "global_mean", "ShardedModule", "ShardcError",
           "TraceError", "CollectiveError", "Layout", "Shard", "Replicate", "Partial", "explain", "comm_report",
           "CommReport", "CommRow", "Machine", "plan", "Candidate", "checkpoint", "StepGuard",
           "NonFiniteError", "clip_grad_norm_", "ShardcWarning", "Precision", "CastAtUse", "Selective",
           "PendingOutput"]


def __getattr__(name: str) -> Any:
    # shardc.checkpoint on first use: torch.distributed.checkpoint takes ~0.7 s to import,
    # paid by every rank of every run that never checkpoints otherwise
    if name == "checkpoint":
        import importlib
        return importlib.import_module("shardc.checkpoint")
    raise AttributeError(f"module 'shardc' has no attribute {name!r}")
