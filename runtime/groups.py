"""One torch.distributed process group per mesh axis, created once per mesh.

Groups are made lazily, on a rank's first collective call of a compiled program, so that
``shardc.compile`` and ``shardc.comm_report`` need no communication (and work under the
"fake" backend at any world size). Every rank creates every group of every axis in the
same order, as ``new_subgroups_by_enumeration`` requires.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from shardc.mesh import AXES, Mesh

_CACHE: dict[tuple[str, int], dict[str, dist.ProcessGroup | None]] = {}


def default_device() -> torch.device:
    """The device the current backend moves tensors on: CUDA for NCCL, else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def axis_groups(mesh: Mesh) -> dict[str, dist.ProcessGroup | None]:
    """This rank's group on each axis (None for an axis of size 1)."""
    if not dist.is_initialized():
        raise RuntimeError("shardc: torch.distributed is not initialised")
    key = (mesh.spec(), id(dist.group.WORLD))
    if key not in _CACHE:
        groups: dict[str, dist.ProcessGroup | None] = {}
        for axis in AXES:
            if mesh.size(axis) == 1:
                groups[axis] = None
            elif mesh.size(axis) == mesh.world_size:
                groups[axis] = dist.group.WORLD
            else:
                groups[axis], _ = dist.new_subgroups_by_enumeration(mesh.groups(axis))
        _CACHE[key] = groups
    return _CACHE[key]


def clear_cache() -> None:
    _CACHE.clear()
