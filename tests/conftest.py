"""Shared fixtures: a one-process "fake" process group of any world size, and the pool of
gloo ranks a module's distributed cases share."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterator

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))  # tests import models.py / harness.py


@pytest.fixture
def fake_world() -> Iterator[Callable[[int, int], None]]:
    """``fake_world(world_size, rank=0)`` makes this process one rank of a fake group:
    collectives are not executed, which is all compile and the report need."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world_size: int, rank: int = 0) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks() -> Iterator[Any]:
    """The module's gloo ranks (``harness.RankPools``): ``ranks.run(fn, world_size,
    *args)`` runs ``fn(rank, world_size, *args)`` on a pool of that size, started on first
    use and kept for the module's later cases; each rank's result comes back, or the
    failing rank's traceback as an AssertionError (and the pool starts afresh)."""
    from harness import RankPools

    pools = RankPools()
    yield pools
    pools.close()
