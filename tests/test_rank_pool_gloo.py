"""The pool of gloo ranks the distributed tests share (``harness.RankPool``, the ``ranks``
fixture): results come back per rank; a rank's assertion fails the case with that rank's
traceback, a rank that dies fails it with its stacks, a rank that hangs fails it after
the timeout with the stacks of the ranks still running; and after any of these the next
case runs on a fresh pool."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from harness import RankPool

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _sum_of_ranks(rank: int, world_size: int, scale: int) -> tuple[int, int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, os.getpid(), t.item() * scale


def _rank_1_asserts(rank: int, world_size: int) -> None:
    t = torch.ones(1)
    dist.all_reduce(t)
    assert rank != 1, "rank 1's own assertion"
    dist.all_reduce(t)  # the others wait here for rank 1, which has left


def _rank_0_dies(rank: int, world_size: int) -> None:
    if rank == 0:
        import ctypes

        ctypes.string_at(0)  # a segfault: no Python traceback, only faulthandler's stacks
    dist.barrier()


def _rank_2_hangs(rank: int, world_size: int) -> None:
    if rank == 2:
        import time

        time.sleep(3600)
    dist.barrier()


def test_results_per_rank_and_the_pool_is_reused() -> None:
    pool = RankPool(4)
    try:
        first = pool.run(_sum_of_ranks, 10)
        assert [r for r, _, _ in first] == [0, 1, 2, 3]
        assert all(s == 60.0 for _, _, s in first)  # 0+1+2+3, times 10
        again = pool.run(_sum_of_ranks, 1)
        assert [p for _, p, _ in again] == [p for _, p, _ in first]  # the same processes
    finally:
        pool.close()


def test_a_failing_rank_fails_the_case_with_its_traceback_and_the_pool_restarts() -> None:
    pool = RankPool(4)
    try:
        pids = [p for _, p, _ in pool.run(_sum_of_ranks, 1)]
        with pytest.raises(AssertionError) as e:
            pool.run(_rank_1_asserts)
        assert "rank 1:" in str(e.value) and "rank 1's own assertion" in str(e.value)
        assert "_rank_1_asserts" in str(e.value)  # the rank's traceback
        assert not pool.alive
        after = pool.run(_sum_of_ranks, 1)
        assert all(s == 6.0 for _, _, s in after)
        assert not set(p for _, p, _ in after) & set(pids)  # fresh ranks
    finally:
        pool.close()


def test_a_dead_rank_fails_the_case_with_its_stacks() -> None:
    pool = RankPool(2)
    try:
        with pytest.raises(AssertionError) as e:
            pool.run(_rank_0_dies)
        text = str(e.value)
        assert "ranks [0] died" in text, text
        assert "rank0's stacks" in text and "_rank_0_dies" in text, text
        assert [s for _, _, s in pool.run(_sum_of_ranks, 1)] == [1.0, 1.0]
    finally:
        pool.close()


def test_a_hung_rank_fails_the_case_after_the_timeout_with_its_stacks() -> None:
    pool = RankPool(4)
    try:
        with pytest.raises(AssertionError) as e:
            pool.run(_rank_2_hangs, timeout=5)
        text = str(e.value)
        assert "did not answer within 5 s" in text, text
        assert "rank2's stacks" in text and "_rank_2_hangs" in text, text
        assert [s for _, _, s in pool.run(_sum_of_ranks, 1)] == [6.0] * 4
    finally:
        pool.close()
