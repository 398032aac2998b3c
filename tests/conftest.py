"""Shared fixtures (a one-process "fake" process group of any world size, the pool of gloo
ranks a module's distributed cases share) and the tiers' guard.

Tiers (pyproject.toml registers the markers, ``--strict-markers`` refuses others):

- ``slow``: more than a few seconds, or spawns processes. ``pytest -m "not slow"`` is the
  fast tier a developer runs on every change; ``pytest tests`` (everything) is CI's.
- ``distributed``: spawns real gloo ranks (``harness.run_on_ranks``, the ``ranks`` pool,
  or processes of its own); always also ``slow``.
- ``sweep``: one case of a rule sweep or a mesh sweep. The slice of each rule family that
  the fast tier keeps is ``sweep`` without ``slow`` (``rules_sweep.FAST_SLICE``).

The guard: every test module states its tier in a module-level ``pytestmark`` (``[]`` for
a module whose tests are fast unless marked one by one), or collection fails; a test
marked ``distributed`` must be ``slow``; a rule-sweep case must be ``sweep``; a test that
starts gloo ranks without ``distributed`` fails; and a test outside ``slow`` that took
longer than ``FAST_LIMIT_S`` is named in the summary, to be marked or made faster.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))  # tests import models.py / harness.py

FAST_LIMIT_S = 10.0
_TOO_SLOW: list[tuple[str, float]] = []
# seconds per test module (setup, call and teardown): CI's log then says where its time
# went, which is what keeping the whole run inside its budget needs
_MODULE_S: dict[str, float] = {}


@pytest.fixture
def fake_world() -> Iterator[Callable[[int, int], None]]:
    """``fake_world(world_size, rank=0)`` makes this process one rank of a fake group:
    collectives are not executed, which is all compile and the report need."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardc.runtime import algorithms

    def init(world_size: int, rank: int = 0) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    # torch's fake group fills a collective's output from this rank's input in recent
    # releases (this rank's block, for a reduce-scatter); 2.8's left the reduce-scatter's
    # output as allocated, so a test that runs a program twice and compares read two
    # different garbages (NaN, often). Fill it alike on every torch.
    native = algorithms._native_reduce_scatter

    def filled(out: torch.Tensor, x: torch.Tensor, op: Any = dist.ReduceOp.SUM,
               group: Any = None, async_op: bool = False) -> Any:
        work = native(out, x, op=op, group=group, async_op=async_op)
        if dist.get_backend(group) == "fake":
            out.view(-1).copy_(x.reshape(dist.get_world_size(group), -1)[dist.get_rank(group)])
        return work

    algorithms._native_reduce_scatter = filled
    yield init
    algorithms._native_reduce_scatter = native
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


# ------------------------------------------------------------------ the tiers' guard
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problems: list[str] = []
    seen: set[str] = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__ not in seen:
            seen.add(module.__name__)
            if "pytestmark" not in vars(module):
                problems.append(f"{item.path.name}: sets no module-level pytestmark; state the "
                                "tier of its tests (pytestmark = [] when each slow test is marked)")
        names = {m.name for m in item.iter_markers()}
        if "distributed" in names and "slow" not in names:
            problems.append(f"{item.nodeid}: marked distributed but not slow")
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "sweep" not in names and any(
                type(v).__name__ == "Case" and type(v).__module__ == "rules_sweep"
                for v in callspec.params.values()):
            problems.append(f"{item.nodeid}: a rule-sweep case not marked sweep")
    if problems:
        raise pytest.UsageError("tests without a tier (see tests/conftest.py):\n  "
                                + "\n  ".join(problems[:40]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    import harness

    harness.SPAWNING_TEST = (item.nodeid, item.get_closest_marker("distributed") is not None)
    try:
        yield
    finally:
        harness.SPAWNING_TEST = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _MODULE_S[module] = _MODULE_S.get(module, 0.0) + report.duration
    if report.when == "call" and report.duration > FAST_LIMIT_S and "slow" not in report.keywords:
        _TOO_SLOW.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if len(_MODULE_S) > 1:
        total = sum(_MODULE_S.values())
        terminalreporter.write_sep("=", f"seconds per test module (of {total:.0f} s in tests)")
        for module, s in sorted(_MODULE_S.items(), key=lambda t: -t[1])[:20]:
            terminalreporter.write_line(f"{s:7.0f} s  {100 * s / total:4.1f}%  {module}")
    if _TOO_SLOW:
        terminalreporter.write_sep("=", f"tests outside 'slow' that took over {FAST_LIMIT_S:.0f} s")
        for nodeid, s in sorted(_TOO_SLOW, key=lambda t: -t[1]):
            terminalreporter.write_line(f"{s:7.1f} s  {nodeid}  (mark it slow, or make it faster)")
