"""A classification loss over mask-picked rows (``passes/masked_losses.py``):
``F.cross_entropy(logits[mask], labels[mask])`` is traced as the same loss over every row,
the unpicked ones ignored, and computes what the model does; what the rewrite cannot
take stays refused, naming the index."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import traced_beside_model
from torch.fx.experimental import symbolic_shapes

import shardc
from shardc.core.compat import PICKED_LOSSES_FROM, torch_version
from shardc.core.errors import TraceError
from shardc.passes.trace import trace

aten = torch.ops.aten

pytestmark: list = []  # fast: one process, no ranks

V = 24  # classes


class MaskedLoss(nn.Module):
    """A token classifier whose loss is written over the valid tokens only, in the ways
    training scripts write it."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.lin = nn.Linear(16, V)
        self.style = style
        self.register_buffer("w", torch.linspace(0.5, 1.5, V))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lin(torch.tanh(self.emb(ids)))
        mask = labels != -100
        s = self.style
        if s == "plain":
            return F.cross_entropy(logits[mask], labels[mask])
        if s == "flat":  # transformers' older token classifiers: view(-1, C)[active]
            active = mask.view(-1)
            return F.cross_entropy(logits.view(-1, V)[active], labels.view(-1)[active])
        if s == "module":
            return nn.CrossEntropyLoss(weight=self.w, label_smoothing=0.1)(logits[mask], labels[mask])
        if s == "sum":
            return F.cross_entropy(logits[mask], labels[mask], reduction="sum") / 7
        if s == "nll":  # a cast and a temperature on the way
            return F.nll_loss(F.log_softmax(logits[mask].float() / 0.7, dim=-1), labels[mask])
        if s == "ignore-0":  # rows of class 0 among the picked ignored too
            return F.cross_entropy(logits[mask], labels[mask], ignore_index=0, weight=self.w)
        if s == "two-masks":  # the mask computed twice: equal as expressions
            return F.cross_entropy(logits[labels != -100], labels[labels != -100])
        if s == "inf-unpicked":  # rows the mask leaves out hold infinities (added: their
            # gradient reaches the logits as it comes)
            bad = logits + torch.zeros_like(logits).masked_fill(~mask[..., None], float("inf"))
            return F.cross_entropy(bad[mask], labels[mask])
        raise AssertionError(s)


def _batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (4, 12), generator=g)
    labels = torch.randint(0, V, (4, 12), generator=g)
    labels[torch.rand(4, 12, generator=g) < 0.6] = -100  # a masked LM's share of unlabelled
    labels[:, 0] = 0  # some rows of class 0 among the picked
    return ids, labels


# The first torch whose export takes each form (the rewrite runs on the export): the
# same mask computed twice makes two sizes, which 2.10's cross_entropy_loss compares
# (2.11 and 2.12 were not run; 2.13 and 2.15 take it)
_EXPORT_TAKES = {"two-masks": (2, 13)}


def _traced(model: nn.Module, inputs: tuple) -> torch.export.ExportedProgram | None:
    """The trace, or None on a torch whose export cannot take the picked rows (2.8 takes
    some forms, by draft_export), after checking that it says why: the size the data
    decides."""
    try:
        return trace(model, inputs)
    except TraceError as e:
        if torch_version() >= _EXPORT_TAKES.get(getattr(model, "style", ""), PICKED_LOSSES_FROM):
            raise
        assert re.search(r"The guard is on a size the data decides.*boolean index", str(e)), e
        return None


def _picks(ep: torch.export.ExportedProgram) -> list[str]:
    return [n.name for n in ep.graph.nodes
            if symbolic_shapes.free_unbacked_symbols(n.meta.get("val"))
            or n.target in (aten.nonzero.default, aten.index.Tensor)]


class MaskedLogits(nn.Module):
    """A binary loss over the picked elements (ELECTRA's discriminator over the attended
    tokens, a multi-label head over the labelled rows)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.lin = nn.Linear(16, 3)
        self.style = style
        self.register_buffer("pos", torch.tensor([0.5, 2.0, 1.0]))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lin(torch.tanh(self.emb(ids)))
        mask = labels != -100
        if self.style == "bce-tokens":  # one logit a token, the mask over every dim
            one, target = logits[..., 0], (labels % 2).to(logits.dtype)
            return F.binary_cross_entropy_with_logits(one[mask], target[mask])
        target = (labels[..., None] % torch.tensor([2, 3, 5]) == 0).to(logits.dtype)
        if self.style == "bce-rows":  # three per row, a weight per class
            return F.binary_cross_entropy_with_logits(logits[mask], target[mask], pos_weight=self.pos)
        if self.style == "bce-sum":
            return F.binary_cross_entropy_with_logits(logits[mask] * 2, target[mask], reduction="sum")
        raise AssertionError(self.style)


_STYLES = ["plain", "flat", "module", "sum", "nll", "ignore-0", "two-masks", "inf-unpicked",
           "bce-tokens", "bce-rows", "bce-sum"]


@pytest.mark.parametrize("style", _STYLES)
def test_a_loss_over_picked_rows_is_traced_over_every_row_and_computes_the_model(style: str) -> None:
    """The traced program picks nothing (no size the data decides, no index) and gives the
    model's loss and gradients. In float64 the only difference is the order of the
    loss's sum (zeros added for the ignored rows): 1e-12 is far above that and far below
    a wrong row (a picked row's term is O(1e-2) of the loss here)."""
    torch.manual_seed(0)
    model = (MaskedLogits if style.startswith("bce") else MaskedLoss)(style).double()
    ids, labels = _batch()
    ep = _traced(model, (ids, labels))
    if ep is None:
        return
    assert _picks(ep) == []
    want, got, grads = traced_beside_model(model, ep.module(), ids, labels)
    assert torch.isfinite(want)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for n, a, b in grads:
        assert torch.isfinite(a).all(), n  # the unpicked rows' infinities reach no gradient
        assert b.abs().sum() > 0, n
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=n)


class _AcrossRows(nn.Module):
    """A log-softmax across the picked rows (dim 0): a set read, which every row's form
    would change."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, V)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = labels != -100
        return F.nll_loss(self.lin(x)[mask].log_softmax(0), labels[mask])


def test_a_normalisation_across_the_picked_rows_is_not_rewritten() -> None:
    """Left as the model wrote it: picked (then run on the gathered rows, or refused where
    the export cannot take it)."""
    x, labels = torch.randn(4, 6, 8), torch.randint(0, V, (4, 6))
    labels[:, :2] = -100
    try:
        ep = trace(_AcrossRows(), (x, labels))
    except TraceError as e:
        assert "size the data decides" in str(e) or "depends on the data" in str(e), e
        return
    assert _picks(ep) != []


def test_no_row_picked_gives_what_the_model_gives() -> None:
    """Every label -100: the mean over no rows is NaN for the model and for the program
    (0 / 0), not a silent 0."""
    model = MaskedLoss("plain").double()
    ids, labels = _batch()
    ep = _traced(model, (ids, labels))
    if ep is None:
        return
    traced = ep.module()
    labels = torch.full_like(labels, -100)
    assert torch.isnan(model(ids, labels)) and torch.isnan(traced(ids, labels))


class _Kept(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, V)
        self.style = style

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.lin(x)
        mask = labels != -100
        if self.style == "none":  # a value per picked row: its size is the data's
            return F.cross_entropy(logits[mask], labels[mask], reduction="none").sum(),
        # the picked logits read by something besides the loss
        picked = logits[mask]
        return F.cross_entropy(picked, labels[mask]), picked.argmax(-1).float().mean()


@pytest.mark.parametrize("style", ["none", "also-read"])
def test_what_the_rewrite_cannot_take_stays_refused_naming_the_index(style: str) -> None:
    x, labels = torch.randn(4, 6, 8), torch.randint(0, V, (4, 6))
    labels[:, :2] = -100
    with pytest.raises(TraceError, match=r"(size that depends on the data.*aten\.(index|nonzero))"
                       r"|(The guard is on a size the data decides)"):
        trace(_Kept(style), (x, labels))


def test_the_rows_keep_the_batch_layout(fake_world) -> None:
    """On a mesh that cuts the batch, nothing is gathered: each rank's loss is over its own
    rows, combined as any cross-entropy's mean is."""
    fake_world(4)
    model = MaskedLoss("module")
    ids, labels = _batch()
    if _traced(model, (ids, labels)) is None:
        return
    sm = shardc.compile(model, shardc.Mesh.parse("x2y1z1d2"), example_inputs=(ids, labels))
    assert [f for f in sm.fallbacks if f.gathered] == []
