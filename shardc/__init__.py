"""shardc: a sharding compiler for PyTorch training (AxoNN's 4D hybrid parallelism)."""
from __future__ import annotations

from shardc.clip import clip_grad_norm_
from shardc.compiler import compile, global_mean, shard_batch
from shardc.errors import ShardcError, ShardcWarning, TraceError
from shardc.explain import explain
from shardc.machine import Machine
from shardc.mesh import Mesh
from shardc.module import ShardedModule
from shardc.placement import Layout, Partial, Replicate, Shard
from shardc.planner import Candidate, plan
from shardc.report import CommReport, CommRow, comm_report

__all__ = ["Mesh", "compile", "shard_batch", "global_mean", "ShardedModule", "ShardcError",
           "TraceError", "Layout", "Shard", "Replicate", "Partial", "explain", "comm_report",
           "CommReport", "CommRow", "Machine", "plan", "Candidate", "clip_grad_norm_",
           "ShardcWarning"]
