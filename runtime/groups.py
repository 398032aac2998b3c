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

from shardc.core.mesh import CUT_AXES, PIPE, Mesh

_CACHE: dict[tuple[str, int], dict[str, dist.ProcessGroup | None]] = {}
_STAGES: dict[tuple[str, int], dist.ProcessGroup] = {}
# every world the caches' groups belong to, by id, held so that no id is reused while
# its groups are cached: a process that destroys its process group and makes a new one (a
# notebook, a test per world) got a new WORLD at the old one's address, and with it the
# destroyed world's groups. By id, not one slot: in a threaded world each rank thread has
# its own WORLD
_WORLDS: dict[int, object] = {}


def _world_id() -> int:
    """``id`` of the current world, its cached groups dropped first if they were made for
    another world at the same address."""
    world = dist.group.WORLD
    key = id(world)
    if _WORLDS.get(key) is not world:
        for cache in (_CACHE, _STAGES):
            for k in [k for k in cache if k[1] == key]:
                del cache[k]
        _WORLDS[key] = world
    return key


def default_device() -> torch.device:
    """The device the current backend moves tensors on: CUDA for NCCL, else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def axis_groups(mesh: Mesh) -> dict[str, dist.ProcessGroup | None]:
    """This rank's group on each axis (None for an axis of size 1)."""
    if not dist.is_initialized():
        raise RuntimeError("shardc: torch.distributed is not initialised")
    key = (mesh.spec(), _world_id())
    if key not in _CACHE:
        groups: dict[str, dist.ProcessGroup | None] = {}
        for axis in CUT_AXES:
            if mesh.size(axis) == 1:
                groups[axis] = None
            elif mesh.size(axis) == mesh.world_size:
                groups[axis] = dist.group.WORLD
            else:
                groups[axis], _ = dist.new_subgroups_by_enumeration(mesh.groups(axis),
                                                                    timeout=world_timeout())
        _CACHE[key] = groups
        if mesh.pipe > 1:
            # every rank makes the pipeline's groups here too, whatever it calls first: a
            # stage that never gathers a tied weight must still join the stage groups that
            # the stages holding one create (a new group is collective over the world)
            _make_pipeline_groups(mesh)
    return _CACHE[key]


def _make_pipeline_groups(mesh: Mesh) -> None:
    key = (mesh.spec(), _world_id())
    if key in _STAGES:
        return
    stages = [[r for r in range(mesh.world_size) if mesh.coords(r)[PIPE] == s] for s in range(mesh.pipe)]
    _STAGES[key], _ = dist.new_subgroups_by_enumeration(stages, timeout=world_timeout())
    if mesh.pipe == mesh.world_size:
        assert dist.group.WORLD is not None
        _STAGES[(key[0] + "/pipe", key[1])] = dist.group.WORLD
    else:
        _STAGES[(key[0] + "/pipe", key[1])], _ = dist.new_subgroups_by_enumeration(
            mesh.groups(PIPE), timeout=world_timeout())


def stage_group(mesh: Mesh) -> dist.ProcessGroup:
    """This rank's pipeline stage: the ranks that share its ``pipe`` coordinate (the
    world when ``pipe`` is 1). Made by every rank, for every stage, in one order."""
    if mesh.pipe == 1:
        assert dist.group.WORLD is not None
        return dist.group.WORLD
    axis_groups(mesh)
    return _STAGES[(mesh.spec(), _world_id())]


def pipe_group(mesh: Mesh) -> dist.ProcessGroup:
    """This rank's group along ``pipe``: the ranks of every stage that share its x, y, z
    and data coordinates (made by every rank, for every such group, in one order)."""
    axis_groups(mesh)
    return _STAGES[(mesh.spec() + "/pipe", _world_id())]


def stage_ranks(mesh: Mesh, rank: int) -> list[int]:
    """The ranks of ``rank``'s stage, in rank order (its ranks' order in ``stage_group``)."""
    stage = mesh.coords(rank)[PIPE]
    return [r for r in range(mesh.world_size) if mesh.coords(r)[PIPE] == stage]


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
    _STAGES.clear()
    _WORLDS.clear()
