"""The process groups of a mesh's axes (``runtime/groups.py``), in one process under the
fake process group."""
from __future__ import annotations

import torch.distributed as dist

import shardc
from shardc.runtime import groups

pytestmark: list = []  # one process, fast: the fast tier


def test_a_new_world_gets_new_groups_even_at_the_old_ones_address(fake_world) -> None:
    """A process that destroys its process group and makes another (a notebook, a test
    per world) used to find the old world's groups whenever the new WORLD object landed at
    the old one's address (the cache was keyed by ``id``): every collective then failed
    with "not initialized in the world group map", and only some runs (the allocator's
    addresses vary with the hash seed). Here the reuse is forced: the stale groups sit
    under the new world's id, and are not what the new world gets."""
    mesh = shardc.Mesh.parse("x1y1z2d2")
    fake_world(4)
    stale = groups.axis_groups(mesh)
    fake_world(4)
    groups._CACHE[(mesh.spec(), id(dist.group.WORLD))] = stale  # what an address reuse did
    fresh = groups.axis_groups(mesh)
    assert fresh["z"] is not stale["z"] and fresh["data"] is not stale["data"]
    assert dist.get_world_size(fresh["z"]) == 2  # a group of the world that now exists
