"""A Python loop over the entries a mask holds (``for e in hit.nonzero():``, transformers'
``eager`` experts kernel, DBRX's and Switch Transformers' experts; ``passes/hit_loops.py``)
is traced over every entry the mask could hold, each iteration nothing where its entry is
not held: the traced program computes what the model does, values and gradients, with
some experts never hit; a loop whose iterations reach the result other than through writes
of their picked rows is refused, saying so. The multi-process cases (transformers' Mixtral
with the eager kernel, DBRX) are in tests/test_more_models_gloo.py."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import traced_beside_model

import shardc
from shardc.core.compat import LOOP_ENTRIES_AS_DATA_FROM, torch_version
from shardc.core.errors import TraceError
from shardc.passes.hit_loops import MAX_ITERATIONS
from shardc.passes.trace import trace

aten = torch.ops.aten

pytestmark: list = []  # fast: one process, no ranks

E, H = 4, 8


class Hits(nn.Module):
    """A mixture of experts looped over the experts the batch hit, in the ways models write
    it. The router never sends a token to expert 1 (its bias), and the one-hot has an extra
    class (transformers' and DBRX's ``num_classes=E + 1``) that no token takes."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.router = nn.Linear(H, E)
        self.experts = nn.ModuleList(nn.Linear(H, H) for _ in range(E))
        self.w = nn.Parameter(torch.randn(E, H, H) / H ** 0.5)  # DBRX's stacked weights
        self.bias = nn.Parameter(torch.randn(E, H))
        with torch.no_grad():
            self.router.bias[1] = -100.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = torch.softmax(self.router(x), -1).topk(2, -1)
        mask = F.one_hot(top.indices, E + 1).permute(2, 1, 0)  # (expert, slot, token)
        hit = torch.greater(mask.sum((-1, -2)), 0)
        out = torch.zeros_like(x)
        s = self.style
        if s == "eager":  # transformers' eager kernel: skips the extra class by value
            for e in hit.nonzero():
                e = e[0]
                if e == E:
                    continue
                slot, tok = torch.where(mask[e])
                out.index_add_(0, tok, self.experts[e](x[tok]) * top.values[tok, slot, None])
        elif s == "stacked":  # DBRX: every entry indexes the stacked weights
            for e in hit.nonzero():
                e = e[0]
                slot, tok = torch.where(mask[e])
                y = torch.tanh(x[tok] @ self.w[e]) + self.bias[e]
                out.index_add_(0, tok, y * top.values[tok, slot, None])
        elif s == "flat":  # a flat index, 0-d entries; Switch's rows written by a boolean mask
            for e in hit[:E].nonzero().view(-1):
                rows = mask[e].sum(0) > 0
                out[rows] = self.experts[e](x[rows])
        elif s == "where":  # torch.where's tuple, each entry a 0-d tensor
            for e in torch.where(hit[:E])[0]:
                slot, tok = torch.where(mask[e])
                out.index_add_(0, tok, self.experts[e](x[tok]) * top.values[tok, slot, None])
        elif s == "breaks":  # stops at expert 2, whether or not the batch hit it
            for e in hit[:E].nonzero():
                if e[0] == 2:
                    break
                slot, tok = torch.where(mask[e[0]])
                out.index_add_(0, tok, self.experts[e[0]](x[tok]))
        elif s == "escapes":  # each hit expert's bias added to every token
            for e in hit[:E].nonzero():
                out = out + self.bias[e[0]]
        return (out ** 2).mean()


@pytest.mark.parametrize("style", ["eager", "stacked", "flat", "where"])
def test_a_loop_over_the_hit_entries_computes_the_models_values_and_gradients(style: str) -> None:
    """Expert 1 and the extra class are never hit: their iterations must add nothing.
    float64, and the same ops in the same order (the padded rows write a scratch row),
    so the tolerance is float64's default (a few ulps)."""
    torch.manual_seed(0)
    model = Hits(style).double()
    x = torch.randn(16, H, dtype=torch.float64)
    if style == "stacked" and torch_version() < LOOP_ENTRIES_AS_DATA_FROM:
        with pytest.raises(TraceError, match="trip count of a Python loop"):
            trace(model, (x,))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = trace(model, (x,))
    targets = {n.target for n in ep.graph.nodes}
    assert torch.ops.shardc.hit_row.default not in targets
    assert aten.nonzero.default not in targets  # every pick padded to its bound
    for batch in (x, torch.randn(16, H, dtype=torch.float64)):
        want, got, grads = traced_beside_model(model, ep.module(), batch)
        torch.testing.assert_close(got, want)
        for name, g, w in grads:
            torch.testing.assert_close(g, w, msg=name)


def test_a_loop_reaching_the_result_otherwise_is_refused_saying_so() -> None:
    """Iterating an expert the batch did not hit would add its bias: refused, not traced."""
    with pytest.raises(TraceError, match=re.escape("reaches the model's result other than "
                                                   "through a write of the rows it picks")):
        trace(Hits("escapes"), (torch.randn(16, H),))


def test_a_loop_that_leaves_early_is_refused_saying_so() -> None:
    """Traced over every expert, a break at expert 2 would skip the experts after it even
    where the batch did not hit 2 (the model's loop then goes on): refused."""
    with pytest.raises(TraceError, match="leaves early"):
        trace(Hits("breaks"), (torch.randn(16, H),))


class _OverTokens(nn.Module):
    """A loop over the tokens a mask holds: more entries than MAX_ITERATIONS."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for t in (x[:, 0] > 0).nonzero():
            out = out + x[t[0]]
        return out.sum()


def test_a_loop_over_more_entries_than_the_bound_is_left_as_export_leaves_it() -> None:
    """Unrolled, it would be thousands of copies of its body: refused (torch.export's
    error with shardc's hint), or on torch 2.8 to 2.10 traced by draft_export at the
    example's trip count and checked at every step."""
    x = torch.randn(MAX_ITERATIONS + 1, 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            ep = trace(_OverTokens(), (x,))
        except TraceError as e:
            assert "trip count of a Python loop" in str(e), e
            return
    assert any("branches on tensor values" in str(w.message) for w in seen)
    assert torch.ops.shardc.hit_row.default not in {n.target for n in ep.graph.nodes}


def test_a_looped_mixture_compiles_on_a_mesh_that_cuts_the_batch(fake_world) -> None:
    """On x1y1z2d2 under the fake process group: each rank picks from its own block of
    the mask (nothing gathered) and explain says so."""
    fake_world(4)
    torch.manual_seed(0)
    style = "stacked" if torch_version() >= LOOP_ENTRIES_AS_DATA_FROM else "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sm = shardc.compile(Hits(style), "x1y1z2d2", example_inputs=(torch.randn(16, H),))
    assert [f for f in sm.fallbacks if f.gathered] == []
    assert any("picks the rows of its own block" in d for d in sm.decisions), sm.decisions
