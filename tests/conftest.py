"""Shared fixtures: a one-process "fake" process group of any world size."""
from __future__ import annotations

import os
import sys
from typing import Callable, Iterator

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
