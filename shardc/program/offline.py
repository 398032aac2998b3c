"""Compile one rank's program in this process, without a process group.

Nothing communicates at compile time (the runtime makes its groups on first use), so the
program of any rank of any mesh can be built here: the planner compiles a pattern's
smallest mesh this way, and ``shardc inspect`` / ``shardc comm`` print what it built.
"""
from __future__ import annotations

from typing import Any

import torch

from shardc.core.mesh import Mesh
from shardc.core.options import Options
from shardc.program.build import build, check_batch


def compile_offline(model: torch.nn.Module, inputs: tuple, mesh: Any, rank: int = 0, **kw: Any) -> Any:
    """Compile the program of rank ``rank`` of ``mesh`` (a Mesh or a spec such as
    ``"x2y2z2d1"``) for global-shaped ``inputs``; ``kw`` are ``shardc.compile``'s options."""
    mesh = Mesh.parse(mesh) if isinstance(mesh, str) else mesh
    check_batch(tuple(inputs), mesh)
    return build(model, mesh, tuple(inputs), Options(**kw), rank)
