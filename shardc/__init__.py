"""shardc: a sharding compiler for PyTorch training (AxoNN's 4D hybrid parallelism)."""
from __future__ import annotations

import importlib
from typing import Any

from shardc.compiler import compile, global_mean, shard_batch
from shardc.core.errors import CollectiveError, OptionError, OptionTypeError, ShardcError, ShardcWarning, TraceError
from shardc.core.ir import Selective
from shardc.core.machine import Machine
from shardc.core.mesh import Mesh
from shardc.core.options import Options
from shardc.core.placement import Layout, Partial, Replicate, Shard
from shardc.core.precision import CastAtUse, Precision
from shardc.planning.planner import Candidate, plan
from shardc.program.explain import explain
from shardc.program.module import ShardedModule
from shardc.program.report import CommReport, CommRow, comm_report
from shardc.runtime.pending import PendingOutput
from shardc.train.clip import clip_grad_norm_
from shardc.train.guard import NonFiniteError, StepGuard

__all__ = ["Mesh", "compile", "shard_batch", "global_mean", "ShardedModule", "ShardcError",
           "TraceError", "CollectiveError", "Layout", "Shard", "Replicate", "Partial", "explain", "comm_report",
           "CommReport", "CommRow", "Machine", "plan", "Candidate", "checkpoint", "StepGuard",
           "NonFiniteError", "clip_grad_norm_", "ShardcWarning", "Precision", "CastAtUse", "Selective",
           "PendingOutput", "Options", "OptionError", "OptionTypeError"]


def __getattr__(name: str) -> Any:
    # shardc.checkpoint on first use: torch.distributed.checkpoint takes ~0.7 s to import,
    # paid by every rank of every run that never checkpoints otherwise
    if name == "checkpoint":
        return importlib.import_module("shardc.checkpoint")
    raise AttributeError(f"module 'shardc' has no attribute {name!r}")
