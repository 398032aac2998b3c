"""The CTC loss the trace substitutes for ``F.ctc_loss`` (``runtime/ctc.py``): the same
losses and gradients as torch's own on every reduction, batched or not, padded or
concatenated targets, with an infeasible sample (its loss inf, or 0 under
``zero_infinity``); and a CTC model compiles (torch's ``aten._ctc_loss`` has no fake kernel,
so without the substitute torch.export fails on every CTC head). Training against one
device on gloo ranks: ``tests/test_more_models_gloo.py``, ``hubert-ctc``."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardc
from shardc.runtime.ctc import _ctc_loss, traceable_ctc_loss

pytestmark: list = []  # one process, fast: the fast tier


@pytest.mark.parametrize("reduction, zero_infinity, layout, dtype", list(itertools.product(
    ("mean", "sum", "none"), (False, True), ("padded", "concatenated", "unbatched"),
    (torch.float64, torch.float32))))
def test_same_losses_and_gradients_as_torch(reduction, zero_infinity, layout, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    T, B, C = 12, 3, 6
    log_probs = torch.randn(T, B, C, generator=g, dtype=dtype).log_softmax(-1)
    targets = torch.randint(1, C, (B, 5), generator=g)
    target_lengths = torch.tensor([4, 2, 5])
    input_lengths = torch.tensor([12, 10, 3])  # the third cannot emit 5 labels in 3 steps
    if layout == "concatenated":
        targets = torch.cat([targets[i, :n] for i, n in enumerate(target_lengths.tolist())])
    elif layout == "unbatched":
        log_probs, targets = log_probs[:, 0], targets[0, :4]
        input_lengths, target_lengths = torch.tensor(12), torch.tensor(4)
    ours, theirs = log_probs.clone().requires_grad_(), log_probs.clone().requires_grad_()
    want = _ctc_loss(theirs, targets, input_lengths, target_lengths, reduction=reduction,
                     zero_infinity=zero_infinity)
    with traceable_ctc_loss():
        got = F.ctc_loss(ours, targets, input_lengths, target_lengths, reduction=reduction,
                         zero_infinity=zero_infinity)
    seed = torch.randn(want.shape, generator=g, dtype=dtype)
    (want * seed).sum().backward()
    (got * seed).sum().backward()
    # torch's own kernels both ways, the reduction's gradient spelled out as autograd
    # spells it: equal to a few ulps (the division by lengths is one rounding apart)
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(ours.grad, theirs.grad, equal_nan=True)
    assert F.ctc_loss is _ctc_loss  # the substitute is gone after the trace


class _CTCHead(nn.Module):
    """A speech model's CTC head as transformers writes it: labels padded with -100,
    concatenated with masked_select, lengths from the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        log_probs = self.lin(x).log_softmax(-1).transpose(0, 1)
        mask = labels >= 0
        input_lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, labels.masked_select(mask), input_lengths, mask.sum(-1),
                          zero_infinity=True)


def test_a_ctc_model_compiles_and_runs_the_loss_whole(fake_world) -> None:
    fake_world(2)
    labels = torch.randint(1, 10, (4, 6))
    labels[1, 4:] = -100
    sm = shardc.compile(_CTCHead(), shardc.Mesh.parse("x1y1z1d2"), (torch.randn(4, 20, 8), labels))
    assert "shardc.ctc_loss.default" in {f.op for f in sm.fallbacks}
    assert F.ctc_loss is _ctc_loss
