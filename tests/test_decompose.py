"""passes/decompose.py: ops without a sharding rule decomposed where they stand, and the
whole re-trace where the graph needs it. One process, no ranks (the training of such a
model against float64 is ``test_more_models_gloo.py``'s ``rule-less`` case)."""
from __future__ import annotations

import pytest
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
    """Writes into tensors it made that nothing views (a router's ``w /= w.sum()``, an
    experts' ``index_add_`` into zeros): made out of place where they stand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        before = y.sum()  # read before the write: the old value
        y.mul_(2.0)
        z = torch.zeros(4, 9).index_add_(0, torch.tensor([1, 0, 3, 1]), y)
        z /= z.abs().sum(-1, keepdim=True) + 1.0
        return torch.diff(z, dim=-1).sum() + before + y.sum()


class WritesIntoParts(RuleLess):
    """A tensor made empty and filled part by part (DeepSeek-V3's attention builds its
    query so: ``q = k.new_empty(...); q[..., :d] = a; q[..., d:] = b``, and Qwen3-Next's
    delta rule writes part of a row from what the rows above hold): each copy into a
    slice, a row or a slice of a row made scatters where it stands. ``tensor_split``
    (decomposed as it is dispatched) and ``eye`` (no tensor input) have no rule either."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        q = y.new_empty(4, 13)
        q[:, :9] = y
        q[:, 9:] = torch.tensor_split(self.b(x), [4], dim=1)[0]
        q[2] = torch.diff(q[2].clone(), prepend=q[2, :1].clone())  # a row, from what it held
        q[1, :5] = q[1, :5].clone() + (q[1, :5, None] * q[:1, :5]).sum(-2)  # part of a row
        return torch.diff(q @ torch.eye(13), dim=-1).sum() + q[:, 3].pow(2).sum()


class WritesThroughAView(RuleLess):
    """A write a view sees (``v`` read after it), one into a slice, one into a buffer, one
    whose out-of-place twin would promote the dtype: only the whole re-trace
    functionalizes those."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if self.kind == "view":
            v = y.view(-1)
            y.mul_(2.0)
            out = v.sum()
        elif self.kind == "slice":
            y[:, :4].mul_(2.0)
            out = y.sum()
        elif self.kind == "cast":  # a copy into a part that casts its value
            q = y.new_empty(4, 13)
            q[:, :9] = y
            q[:, 9:] = y[:, :4].double() / 3.0
            out = q.sum()
        elif self.kind == "part-viewed":  # a view of the base taken before a part's write
            q = y.new_empty(4, 13)
            q[:, 9:] = y[:, :4]
            head = q[:, 8:]
            q[:, :9] = y
            out = head.sum()
        elif self.kind == "promotes":  # in place keeps float32 where add makes float64
            y.add_(torch.ones(9, dtype=torch.float64))
            out = y.sum()
        else:
            self.steps.add_(1.0)
            out = y.sum() * self.steps
        return torch.diff(y, dim=-1).sum() + out


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


def _writers(ep: torch.export.ExportedProgram) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable]


def test_writes_into_fresh_tensors_are_made_out_of_place_where_they_stand(monkeypatch) -> None:
    calls = _retraces(monkeypatch)
    torch.manual_seed(0)
    model, x = WritesInPlace(), torch.randn(4, 8)
    ep = T.trace(model, (x,))
    assert calls == [], "writes into tensors the graph made were re-traced whole"
    assert _writers(ep) == []
    ops = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert {torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor} <= ops
    # the read before the write sees the old value, those after it the new one
    torch.testing.assert_close(ep.module()(x), model(x), rtol=0, atol=0)


def test_a_tensor_filled_part_by_part_is_scattered_where_it_stands(monkeypatch) -> None:
    calls = _retraces(monkeypatch)
    torch.manual_seed(0)
    model, x = WritesIntoParts(), torch.randn(4, 8)
    ep = T.trace(model, (x,))
    assert calls == [], "a tensor filled part by part was re-traced whole"
    assert _writers(ep) == []
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    # one scatter at least a view a write goes through (torch 2.8's export writes
    # ``q[:, :9]`` through two slices, the first of the whole dim 0; 2.13's through one)
    assert ops.count(torch.ops.aten.slice_scatter.default) >= 3
    assert ops.count(torch.ops.aten.select_scatter.default) >= 2
    torch.testing.assert_close(ep.module()(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["view", "slice", "buffer", "promotes", "cast", "part-viewed"])
def test_a_write_a_view_sees_is_retraced_whole(monkeypatch, kind: str) -> None:
    calls = _retraces(monkeypatch)
    torch.manual_seed(0)
    model, x = WritesThroughAView(kind), torch.randn(4, 8)
    expected = model(x)  # before the trace: the buffer's write is then the export's to apply
    model.steps.zero_()
    ep = T.trace(model, (x,))
    assert calls == [1]
    # run_decompositions functionalizes: no op writes into a tensor any more
    assert _writers(ep) == []
    torch.testing.assert_close(ep.module()(x), expected, rtol=0, atol=0)
