"""passes/causal_masks.py: a mask built from positions alone that is exactly causal becomes
``is_causal=True``; any other mask stays, and the traced program computes what the model
does either way."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import llama

from shardc.passes import causal_masks
from shardc.passes.trace import trace

pytestmark: list = []  # one process, fast: the fast tier

aten = torch.ops.aten


def _attentions(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in ep.graph.nodes if n.target is aten.scaled_dot_product_attention.default]


def _mask_and_causal(n: torch.fx.Node) -> tuple[object, bool]:
    args = list(n.args) + [None] * (6 - len(n.args))
    return n.kwargs.get("attn_mask", args[3]), bool(n.kwargs.get("is_causal", args[5]))


class _Masked(nn.Module):
    """Attention under a mask the forward builds from ``arange``: ``kind`` picks which."""

    def __init__(self, kind: str, dropout: float = 0.0) -> None:
        super().__init__()
        self.kind, self.dropout = kind, dropout
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, -1))
        i = torch.arange(T, device=x.device)
        keep = i[None, :] <= i[:, None]
        if self.kind == "window":  # a sliding window: not the causal mask
            keep = keep & (i[:, None] - i[None, :] < 3)
        mask: torch.Tensor
        if self.kind == "float":
            mask = torch.zeros(T, T).masked_fill(~keep, float("-inf"))
        elif self.kind == "float_min":  # finfo.min is not -inf: exp leaves a trace of it
            mask = torch.zeros(T, T).masked_fill(~keep, torch.finfo(torch.float32).min)
        else:
            mask = keep[None, None].expand(B, 1, T, T)
        if pad is not None:  # from an input: known only at run time
            mask = mask & pad[:, None, None, :].bool()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout).sum()


@pytest.mark.parametrize("kind,folded", [("causal", True), ("float", True), ("window", False),
                                         ("float_min", False)])
def test_a_mask_from_positions_is_folded_only_when_it_is_causal(kind: str, folded: bool) -> None:
    model = _Masked(kind)
    x = torch.randn(2, 12, 16)
    ep = trace(model, (x,))
    [n] = _attentions(ep)
    mask, causal = _mask_and_causal(n)
    assert (mask is None and causal) == folded, (mask, causal)
    if folded:  # nothing of the mask is left to compute
        assert not any(t.target in (aten.le.Tensor, aten.arange.default) for t in ep.graph.nodes
                       if t.op == "call_function")
    # the traced program computes what the model does (fp32: the fused kernel against the
    # math form with a mask, sums in another order, ~1e-6 of values of size ~10)
    torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_mask_that_reads_an_input_stays() -> None:
    model = _Masked("causal")
    x, pad = torch.randn(2, 12, 16), torch.ones(2, 12, dtype=torch.long)
    pad[0, :3] = 0
    ep = trace(model, (x, pad))
    [n] = _attentions(ep)
    mask, causal = _mask_and_causal(n)
    assert mask is not None and not causal
    torch.testing.assert_close(ep.module()(x, pad), model(x, pad))


def test_an_attention_with_dropout_keeps_its_mask() -> None:
    """Another kernel would draw another dropout mask than the model's."""
    ep = trace(_Masked("causal", dropout=0.1), (torch.randn(2, 12, 16),))
    [n] = _attentions(ep)
    assert _mask_and_causal(n)[0] is not None


def test_a_mask_larger_than_the_limit_is_not_computed(monkeypatch) -> None:
    monkeypatch.setattr(causal_masks, "MOST_ELEMENTS", 12 * 12 - 1)
    monkeypatch.setattr(causal_masks, "_value", lambda nodes: pytest.fail("computed"))
    ep = trace(_Masked("causal"), (torch.randn(1, 12, 16),))
    [n] = _attentions(ep)
    assert _mask_and_causal(n)[0] is not None


def test_transformers_llama_attends_causally_without_a_mask() -> None:
    """transformers builds a [B, 1, T, T] mask under export (and a packed-sequence test
    on the positions): it is the causal mask, so no mask is left in the program."""
    model = llama(layers=2, seq=32)
    ids = torch.randint(0, 64, (2, 32))
    ep = trace(model, (ids, ids))
    attn = _attentions(ep)
    assert len(attn) == 2 and all(_mask_and_causal(n) == (None, True) for n in attn)
    assert not any(t.target is aten.cumsum.default for t in ep.graph.nodes if t.op == "call_function")
    torch.testing.assert_close(ep.module()(ids, ids), model(ids, ids), rtol=1e-5, atol=1e-5)


def test_pipeline_stages_cut_a_graph_without_the_mask() -> None:
    """The stage cut reads its own export: folded there too, so no stage sends a mask to
    the next."""
    from shardc.passes.stages import unlifted_graph

    model = llama(layers=2, seq=32)
    ids = torch.randint(0, 64, (2, 32))
    gm = unlifted_graph(model, (ids, ids))
    attn = [n for n in gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    assert len(attn) == 2 and all(_mask_and_causal(n) == (None, True) for n in attn)
    torch.testing.assert_close(gm(ids, ids), model(ids, ids), rtol=1e-5, atol=1e-5)
