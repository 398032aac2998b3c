"""``PendingOutput`` (runtime/pending.py): the step's output whose collective is still in
flight. One process, no process group: the pending computation here is a counted
function standing for "wait for the all-reduce, then divide".

What must hold: reading the value in any way (``item``, arithmetic, printing, ``float``,
``torch.save``, ``tolist``, ``deepcopy``) gives the value and computes it once; reading
only its shape (``ones_like``, the seed ``loss.backward()`` makes) computes nothing; a
detached copy stays pending and shares the one value; autograd through an output that
is pending works, and its gradient is the plain seed; ``settle_all`` computes what no
one read.
"""
from __future__ import annotations

import copy
import io

import torch

from shardc.runtime.pending import Cell, PendingOutput, settle_all

pytestmark: list = []  # one process, fast: the fast tier


class _Counted:
    def __init__(self, value: torch.Tensor) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.value.clone()


def _pending(value: torch.Tensor) -> tuple[PendingOutput, _Counted]:
    f = _Counted(value)
    return PendingOutput(value, value.device, Cell(f)), f


def test_reads_give_the_value_and_compute_it_once() -> None:
    p, f = _pending(torch.tensor(2.5))
    assert f.calls == 0 and p.shape == () and p.dtype == torch.float32
    assert p.item() == 2.5 and f.calls == 1
    assert float(p) == 2.5 and f"{p:.2f}" == "2.50" and p.tolist() == 2.5
    assert torch.equal(p * 2, torch.tensor(5.0)) and type(p * 2) is torch.Tensor
    assert repr(p) == "tensor(2.5000)"
    buf = io.BytesIO()
    torch.save(p, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf), torch.tensor(2.5))
    assert torch.equal(copy.deepcopy(p), torch.tensor(2.5))
    assert float(p.numpy()) == 2.5
    assert f.calls == 1


def test_shape_only_reads_and_detach_do_not_wait() -> None:
    p, f = _pending(torch.tensor([1.0, 2.0]))
    ones = torch.ones_like(p)
    assert type(ones) is torch.Tensor and torch.equal(ones, torch.ones(2))
    assert torch.zeros_like(p).shape == (2,) and torch.empty_like(p).shape == (2,)
    d = p.detach()
    assert isinstance(d, PendingOutput) and f.calls == 0
    # the copy and the original share one value: computed once, by whichever reads first
    assert torch.equal(d + 0, torch.tensor([1.0, 2.0])) and f.calls == 1
    assert torch.equal(p + 0, torch.tensor([1.0, 2.0])) and f.calls == 1


class _Step(torch.autograd.Function):
    """An autograd function that, as StepRunner does, returns its output pending and
    settles it at the end of its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        value = (x * x).sum()
        f = _Counted(value)
        ctx.save_for_backward(x)
        ctx.cell, ctx.counted = Cell(f), f
        return PendingOutput(value, x.device, ctx.cell)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        assert type(g) is torch.Tensor
        # the seed is made without reading the output: nothing computed yet
        _Step.calls_at_backward = ctx.counted.calls
        ctx.cell.get()
        (x,) = ctx.saved_tensors
        return 2 * g * x


def test_backward_through_a_pending_output() -> None:
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    loss = _Step.apply(x)
    assert isinstance(loss, PendingOutput) and loss.requires_grad
    assert type(loss.grad_fn).__name__ == "_StepBackward"
    loss.backward()
    assert _Step.calls_at_backward == 0
    assert torch.equal(x.grad, 2 * x.detach())
    assert loss.item() == 14.0
    assert repr(loss) == "tensor(14., grad_fn=<_StepBackward>)"
    # arithmetic on it first (a scaled loss, gradient accumulation) reads it: still exact
    x.grad = None
    (_Step.apply(x) / 2).backward()
    assert torch.equal(x.grad, x.detach())


def test_settle_all_computes_what_nobody_read() -> None:
    p, f = _pending(torch.tensor(1.0))
    settle_all()
    assert f.calls == 1
    assert p.item() == 1.0 and f.calls == 1


def test_a_failed_wait_raises_again_on_every_read() -> None:
    class Dead(RuntimeError):
        pass

    def compute() -> torch.Tensor:
        raise Dead("peer gone")

    p = PendingOutput(torch.tensor(0.0), torch.device("cpu"), Cell(compute))
    for read in (p.item, lambda: p + 1, p.detach().item):
        try:
            read()
        except Dead:
            pass
        else:
            raise AssertionError("a read after a failed wait returned")
