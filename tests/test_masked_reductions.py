"""A sum or a mean over element-wise values of the elements a boolean mask picks
(``passes/masked_reductions.py``: a depth loss over the valid pixels, a masked mean squared
error) is traced over every element with the unpicked ones zeroed out of the sum: the
program computes the model's values and gradients, also where the unpicked elements would
make the element-wise ops infinite, and nothing is gathered on a mesh that cuts the batch;
what it cannot take keeps the picks."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import traced_beside_model

import shardc
from shardc.passes.trace import trace

aten = torch.ops.aten

pytestmark: list = []  # fast: one process, no ranks


class Masked(nn.Module):
    """A prediction over (batch, height, width) or (batch, tokens, features) and a loss
    over the elements with a target, written the ways training scripts write it."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.w = nn.Parameter(torch.rand(4, 4) + 0.5)
        self.scale = nn.Parameter(torch.tensor([0.5, 1.5, 2.0]))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        s = self.style
        if s == "rows":  # a mask over (batch, tokens) of features: mean over the rows
            pred = x @ torch.ones(4, 3, dtype=x.dtype) * self.scale
            keep = target[..., 0] > 0
            return ((pred[keep] - target[keep]) ** 2).mean(0).sum() + (pred[keep] * self.scale).sum()
        pred = torch.exp(x * self.w)
        valid = target > 0
        if s == "depth":  # GLPN's scale-invariant log loss: log(0) where the target is not
            d = torch.log(target[valid]) - torch.log(pred[valid])
            return torch.sqrt((d ** 2).mean() - 0.5 * d.mean() ** 2)
        if s == "mse":
            return F.mse_loss(pred[valid], target[valid])
        if s == "l1-sum":
            return F.l1_loss(pred[valid], target[valid], reduction="sum")
        if s == "smooth-l1":
            return F.smooth_l1_loss(pred[valid], target[valid], beta=0.5)
        if s == "huber":
            return F.huber_loss(pred[valid], torch.sqrt(target[valid]), delta=0.3)
        if s == "count":  # a count of picked booleans (an integer) beside a mean
            over = (pred[valid] > target[valid]).sum()
            assert over.dtype == torch.int64
            return F.mse_loss(pred[valid], target[valid]) * (1 + over / 100)
        if s == "sum":  # a plain sum, divided by the batch
            return (pred[valid] / target[valid]).sum() / 2
        raise AssertionError(s)


def _batch(style: str, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    if style == "rows":
        x = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
        t = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    else:
        x = torch.randn(2, 4, 4, generator=g, dtype=torch.float64)
        t = torch.rand(2, 4, 4, generator=g, dtype=torch.float64) - 0.4  # ~40% unpicked
    return x, (t.clamp(max=0) if empty else t)


STYLES = ["depth", "mse", "l1-sum", "smooth-l1", "huber", "sum", "rows", "count"]


@pytest.mark.parametrize("style", STYLES)
def test_a_reduction_over_picked_elements_computes_the_models_values_and_gradients(style: str) -> None:
    """float64 and the same element-wise ops (a sum in another order): float64's default
    tolerances. The unpicked targets are <= 0, where the depth loss's log is -inf or NaN:
    a gradient of 0 times that would be a NaN."""
    model = Masked(style).double()
    x, t = _batch(style)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = trace(model, (x, t))
    targets = [n.target for n in ep.graph.nodes]
    assert aten.nonzero.default not in targets and aten.index.Tensor not in targets
    want, got, grads = traced_beside_model(model, ep.module(), x, t)
    torch.testing.assert_close(got, want)
    for name, g, w in grads:
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, msg=name)


def test_a_sum_over_no_picked_element_is_zero_with_zero_gradients() -> None:
    """A batch with no valid element: the model's sum is 0 and its gradients 0 (not NaN
    from the unpicked elements)."""
    model = Masked("sum").double()
    x, t = _batch("sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = trace(model, (x, t))
    want, got, grads = traced_beside_model(model, ep.module(), *_batch("sum", empty=True))
    assert float(want) == float(got) == 0.0
    assert all(torch.count_nonzero(g) == 0 for _, g, _ in grads)


class _SetRead(nn.Module):
    """A median of the picked elements: a set read, which the rewrite cannot take."""

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (x[target > 0] ** 2).median()


def test_a_set_read_keeps_its_picks() -> None:
    x, t = _batch("mse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = trace(_SetRead(), (x.float(), t.float()))
    targets = [n.target for n in ep.graph.nodes]
    assert aten.nonzero.default in targets or aten.index.Tensor in targets


def test_nothing_is_gathered_on_a_mesh_that_cuts_the_batch(fake_world) -> None:
    """Each rank sums its own elements; the sums (and the count) are all-reduced."""
    fake_world(4)
    x, t = (torch.cat([v, v.flip(0)]) for v in _batch("depth"))  # a batch of 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sm = shardc.compile(Masked("depth"), "x1y1z2d2", example_inputs=(x.float(), t.float()))
    assert [f for f in sm.fallbacks if f.gathered] == []
