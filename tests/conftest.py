"""Shared fixtures (a one-process "fake" process group of any world size) and how the
suite splits over pytest-xdist's workers (``-n 2 --dist loadgroup``, as .ci/run runs it)."""
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for ``--dist loadgroup``: every test that starts real ranks in one group, so
    one such test runs at a time (two would put 12 or 16 ranks on the 2 cores CI has, and
    the ranks' collectives wait on each other's scheduling); every other test with the
    rest of its module, so a module-scoped fixture (a rule family's whole sweep, computed
    once for all its cases) runs on one worker only. The single-process tests then run
    beside the ranks, on the core a latency-bound gloo run leaves idle. Without xdist the
    marks do nothing."""
    for item in items:
        ranks = item.get_closest_marker("distributed") is not None or "gloo" in item.name \
            or "gloo" in item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group("ranks" if ranks else item.nodeid.split("::")[0]))
