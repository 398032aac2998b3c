"""The step program's backward frees each saved activation after its last read, eager and
inductor alike (``runtime/step.py``: autograd's references are dropped and the part takes
its arguments as one list that it empties). Before, every saved value stayed alive until
backward returned, beside the gradients backward makes: on the memory table's GPT that was
11-16% of a rank's step peak (docs/memory.md).

One process, a fake group of 2 on data (collectives not executed): the fast tier. The
A/B is in one process: ``backward(retain_graph=True)`` must keep what is saved (a second
backward reads it), so its peak is what the step's was before.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import shardc
from shardc.planning.memory import measured_peak

pytestmark: list = []  # fake group: the fast tier

D, L = 256, 12


class _Chain(nn.Module):
    """L square layers on D x D activations (each rank's half of the batch): what forward
    saves (every layer's input and the last output, (L + 1) D^2 floats) is as large as the
    weight gradients backward makes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(L))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_backward_frees_what_it_saved_as_it_goes(fake_world, backend: str) -> None:
    fake_world(2)
    torch.manual_seed(0)
    x = torch.randn(2 * D, D)
    sm = shardc.compile(_Chain(), shardc.Mesh(data=2), (x,), backend=backend)
    local = shardc.shard_batch(x, sm.mesh)
    sm(local).backward()  # builds (and under inductor compiles) the step program
    reference = {k: p.grad.clone() for k, p in sm.named_parameters()}

    def peak(run) -> int:
        sm.zero_grad(set_to_none=True)  # outside the measurement: it starts with no gradient
        return measured_peak(run)

    freed = peak(lambda: sm(local).backward())
    kept = peak(lambda: sm(local).backward(retain_graph=True))
    # With retain_graph every saved value lives to backward's end: its peak is what every
    # step's was before (measured equal, 6.50 and 8.00 MiB). Freed as backward reads them,
    # the peak (at backward's end, beside every weight gradient) is lower by what was
    # saved and already read: measured 1.25 (eager) and 3.00 MiB (inductor) of the 3.25
    # forward saves. Four activations (1 MiB) is below both and far above noise: the
    # profiler's record of allocations is exact.
    act = local.numel() * local.element_size()
    assert kept - freed >= 4 * act, (kept, freed, act)
    # the same gradients as the first step's
    sm.zero_grad(set_to_none=True)
    sm(local).backward()
    assert all(torch.equal(p.grad, reference[k]) for k, p in sm.named_parameters())


def test_a_retained_graph_runs_backward_twice(fake_world) -> None:
    """``retain_graph=True`` keeps the saved values for a second backward (nothing may be
    freed there), which accumulates the same gradient again."""
    fake_world(2)
    torch.manual_seed(0)
    x = torch.randn(2 * D, D)
    sm = shardc.compile(_Chain(), shardc.Mesh(data=2), (x,))
    local = shardc.shard_batch(x, sm.mesh)
    loss = sm(local)
    loss.backward(retain_graph=True)
    once = {k: p.grad.clone() for k, p in sm.named_parameters()}
    loss.backward()
    for k, p in sm.named_parameters():
        assert torch.equal(p.grad, 2 * once[k])
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
