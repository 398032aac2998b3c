"""A rank that dies or stalls mid-step must not hang the others: on real gloo processes
(4 ranks, mesh x2d2, so both axes are subgroups) with a 5-second process-group timeout,
the survivors raise ``shardc.CollectiveError`` naming the collective and axis that
failed, within the timeout (plus the time the machine takes to notice), and the test
itself is bounded by a deadline whatever happens.

- died: rank 3 calls ``os._exit`` between forward and backward of the second step; its
  sockets close, so the peers that talk to it fail at once and the rest time out.
- stalled: rank 3 sleeps instead of running backward; nobody's socket closes, every
  survivor has to give up on the timeout. This is the case that needs shardc to hand the
  user's timeout to the axis subgroups (torch gives new groups its 30-minute default).
"""
from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from bounded_ranks import run_bounded

import shardc

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PG_TIMEOUT_S = 5.0
# Noticing a closed socket is immediate; a timeout fires after PG_TIMEOUT_S, and a
# survivor may need two in a row (its partner gave up first, then the next collective).
# The rest is a loaded 2-core machine's scheduling.
NOTICE_S = 4 * PG_TIMEOUT_S + 20.0


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(F.relu(self.fc1(x))), t)


def _step_until_rank_3_fails(rank: int, world_size: int, how: str) -> dict:
    mesh = shardc.Mesh(x=2, data=2)
    torch.manual_seed(0)
    x, t = torch.randn(8, 8), torch.randint(0, 4, (8,))
    sm = shardc.compile(MLP(), mesh, example_inputs=(x, t))
    opt = torch.optim.SGD(sm.parameters(), lr=0.1)
    lx, lt = shardc.shard_batch(x, mesh), shardc.shard_batch(t, mesh)
    sm(lx, lt).backward()  # a whole step first: every axis group exists and works
    opt.step()
    opt.zero_grad()
    loss = sm(lx, lt)
    if rank == 3:
        if how == "died":
            os._exit(17)
        time.sleep(NOTICE_S + 60)  # longer than the survivors may take; killed after them
        os._exit(18)
    t0 = time.monotonic()
    try:
        loss.backward()
        shardc.global_mean(loss, mesh)
    except shardc.CollectiveError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0,
                "is_runtime_error": isinstance(e, RuntimeError)}
    return {"error": None, "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("how", ["died", "stalled"])
def test_survivors_raise_a_collective_error_within_the_timeout(how: str) -> None:
    results = run_bounded(_step_until_rank_3_fails, 4, how, pg_timeout_s=PG_TIMEOUT_S,
                          deadline_s=240.0, wait_for={0, 1, 2})
    # rank 3 died as told, or is still asleep when the others are done (then killed)
    assert results[3]["exitcode"] == 17 if how == "died" else results[3]["hung"]
    for r in (0, 1, 2):
        res = results[r]
        assert not res["hung"], f"rank {r} hung after rank 3 {how}"
        assert res.get("ok"), f"rank {r} failed otherwise:\n{res.get('error')}"
        got = res["value"]
        assert got["error"] is not None, f"rank {r} finished the step although rank 3 {how}"
        assert got["is_runtime_error"]
        assert re.search(r"shardc: (all_reduce|all_gather|reduce_scatter) over (mesh axis '(x|data)'"
                         r"|all 4 ranks) \(.*rank %d.*\) failed: " % r, got["error"]), got["error"]
        assert "init_process_group(..., timeout=" in got["error"]
        assert got["seconds"] < NOTICE_S, (r, got["seconds"])
