"""passes/decompose.py: ops without a sharding rule decomposed where they stand, and the
whole re-trace where the graph needs it. One process, no ranks (the training of such a
model against float64 is ``test_more_models_gloo.py``'s ``rule-less`` case)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shardc.passes import trace as T
from shardc.passes.rules import RULES

pytestmark: list = []  # fast: one process, no ranks


class RuleLess(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 9)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = torch.diff(self.a(x), dim=-1)
        lo, hi = torch.aminmax(d, dim=-1, keepdim=True)  # an op of two outputs
        h = F.hardswish(self.b((d - lo) / (hi - lo + 1.0)))
        # its decomposition writes into its own intermediates (clamp_min_)
        return h.sum() + F.cosine_similarity(h, x, dim=-1).sum()


class WritesInPlace(RuleLess):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y.mul_(2.0)
        return torch.diff(y, dim=-1).sum()


def _retraces(monkeypatch) -> list[int]:
    calls: list[int] = []
    whole = torch.export.ExportedProgram.run_decompositions

    def counted(self, *a, **k):
        calls.append(1)
        return whole(self, *a, **k)
    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", counted)
    return calls


def test_rule_less_ops_are_decomposed_where_they_stand(monkeypatch) -> None:
    calls = _retraces(monkeypatch)
    torch.manual_seed(0)
    model, x = RuleLess(), torch.randn(4, 8)
    ep = T.trace(model, (x,))
    assert calls == [], "a functional graph was re-traced whole"
    ops = [n for n in ep.graph.nodes if n.op == "call_function"]
    assert all(T._has_rule(n.target, RULES) for n in ops), \
        [str(n.target) for n in ops if not T._has_rule(n.target, RULES)]
    assert not any(n.target in (torch.ops.aten.diff.default, torch.ops.aten.aminmax.default,
                                torch.ops.aten.hardswish.default,
                                torch.ops.aten.cosine_similarity.default) for n in ops)
    # functional, as the whole re-trace leaves it: nothing writes in place
    assert not [n for n in ops if n.target._schema.is_mutable]
    # the decomposed nodes keep the module they came from (placement decisions and
    # explain's sources read it)
    sub = [n for n in ops if n.target is torch.ops.aten.sub.Tensor]
    assert sub and all("nn_module_stack" in n.meta and "val" in n.meta for n in sub)
    # the same values as the model: each op's decomposition is torch's own
    torch.testing.assert_close(ep.module()(x), model(x), rtol=0, atol=0)


def test_a_graph_that_writes_in_place_is_retraced_whole(monkeypatch) -> None:
    calls = _retraces(monkeypatch)
    torch.manual_seed(0)
    model, x = WritesInPlace(), torch.randn(4, 8)
    ep = T.trace(model, (x,))
    assert calls == [1]
    # run_decompositions functionalizes: no op writes into a tensor any more
    assert not any(n.op == "call_function" and n.target._schema.is_mutable for n in ep.graph.nodes
                   if isinstance(n.target, torch._ops.OpOverload))
    torch.testing.assert_close(ep.module()(x), model(x), rtol=0, atol=0)
