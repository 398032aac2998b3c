"""One torch.distributed process group per mesh axis, created once per mesh.

Groups are made lazily, on a rank's first collective call of a compiled program, so that
``shardc.compile`` and ``shardc.comm_report`` need no communication (and work under the
"fake" backend at any world size). Every rank creates every group of every axis in the
same order, as ``new_subgroups_by_enumeration`` requires.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from shardc.core.mesh import AXES, Mesh

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
                groups[axis], _ = dist.new_subgroups_by_enumeration(mesh.groups(axis),
                                                                    timeout=world_timeout())
        _CACHE[key] = groups
    return _CACHE[key]


def world_timeout() -> timedelta | None:
    """The timeout the user gave ``init_process_group``. torch gives a new group its
    backend's default (30 minutes on gloo) instead: without passing this on, a collective
    on an axis waits on a dead rank half an hour whatever the user asked for."""
    world = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return world._get_backend(torch.device(device)).options._timeout  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - private API; no backend for it or no such field
            continue
    return None


def clear_cache() -> None:
    _CACHE.clear()
