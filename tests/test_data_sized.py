"""Rows the data picks (``passes/data_sized.py``): a region that only writes its picked
rows back where they came from is traced at its bound and computes what the model does;
one that reads them as a set stays refused, with the reason."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from harness import traced_beside_model
from test_more_models_gloo import LoopedExperts
from torch.fx.experimental import symbolic_shapes

import shardc
from shardc.passes.trace import trace
from shardc.program.backend import direct_calls

aten = torch.ops.aten

pytestmark: list = []  # fast: one process, no ranks


def _unbacked(ep: torch.export.ExportedProgram) -> list[str]:
    return [n.name for n in ep.graph.nodes if symbolic_shapes.free_unbacked_symbols(n.meta.get("val"))]


@pytest.mark.filterwarnings("ignore:shardc.compile. rows picked")
@pytest.mark.parametrize("style", ["where", "mask"])
def test_looped_experts_are_traced_at_their_bound_and_compute_the_model(style: str) -> None:
    """Both loops (``torch.where`` + ``index_add_``, and ``y[mask] = expert(x[mask])``
    with the mask written twice) lose every size the data decides, and the padded program
    gives the model's loss and gradients. In float64 the only difference is the GEMMs'
    summation over more rows (zeros added): 1e-12 is far above that and far below any
    wrong row (O(1e-2) here)."""
    torch.manual_seed(0)
    model = LoopedExperts(style).double()
    g = torch.Generator().manual_seed(3)
    ids, tgt = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    with pytest.warns(UserWarning, match=r"rows picked by the data .*\(up to \d+ rows\) are computed at their bound"):
        ep = trace(model, (ids, tgt))
    assert _unbacked(ep) == []
    assert sum(n.target is aten.nonzero_static.default for n in ep.graph.nodes) == 4
    assert not any(n.target is aten.nonzero.default for n in ep.graph.nodes)
    want, got, grads = traced_beside_model(model, ep.module(), ids, tgt)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for n, a, b in grads:
        assert b.abs().sum() > 0 or n.startswith("experts"), n  # the batch reaches every weight
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=n)


class _RowsSummed(nn.Module):
    """The picked rows read as a set (their mean): padding would change it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x[mask]).mean()


@pytest.mark.filterwarnings("ignore:Raw Sym")
def test_rows_read_as_a_set_stay_refused_with_the_reason(fake_world) -> None:
    fake_world(2)
    x, mask = torch.randn(4, 6, 8), torch.rand(4, 6) > 0.5
    with pytest.raises(shardc.ShardcError, match=r"depends on the data, made by aten.nonzero.default .*"
                                                 r"only written back where they came from; here "
                                                 r"aten.mean.default .*test_data_sized.py:\d+"):
        shardc.compile(_RowsSummed(), shardc.Mesh.parse("x1y1z1d2"), (x, mask))


def test_an_optional_index_list_keeps_the_boxed_op() -> None:
    """``x[None, i]``'s backward is ``index_put(zeros, [None, i], g)``: torch's Python
    binding refuses the None on real tensors (the probe on meta ones took it), so the
    eager backend must keep the ATen op there."""
    g = fx.Graph()
    x, i, v = g.placeholder("x"), g.placeholder("i"), g.placeholder("v")
    x.meta["val"], i.meta["val"], v.meta["val"] = torch.zeros(1, 5, 3), torch.tensor([0, 2]), torch.ones(1, 2, 3)
    out = g.call_function(aten.index_put.default, (x, [None, i], v, True))
    out.meta["val"] = torch.zeros(1, 5, 3)
    g.output(out)
    gm = direct_calls(fx.GraphModule({}, g))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [aten.index_put.default]
    got = gm(torch.zeros(1, 5, 3), torch.tensor([0, 2]), torch.ones(1, 2, 3))
    assert got.sum().item() == 6.0 and got[0, 1].abs().sum().item() == 0.0


@pytest.mark.filterwarnings("ignore:shardc.compile. rows picked")
# the masks: (2 slots, 128 tokens) over 4 ranks; 256 token-slot pairs over 2; 128 tokens over 4
@pytest.mark.parametrize("style, spec, axes, bound", [("where", "x1y1z2d2", "data and z", 64),
                                                      ("mask", "x2y1z1d2", "data", 128),
                                                      ("switch", "x1y1z1d4", "data", 32)])
def test_each_rank_picks_its_own_rows(fake_world, style: str, spec: str, axes: str, bound: int) -> None:
    """On a mesh that cuts the batch, no region gathers its mask or its rows: each rank
    picks from its own block, as many rows as its block holds (the gloo tests check the
    values, passes/rules/picked.py)."""
    fake_world(4)
    g = torch.Generator().manual_seed(3)
    ids, tgt = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
    sm = shardc.compile(LoopedExperts(style), shardc.Mesh.parse(spec), (ids, tgt))
    assert [f for f in sm.fallbacks if f.gathered] == []
    picks = [d for d in sm.decisions if "picks the rows of its own block" in d]
    assert len(picks) == 4 and all(f"over {axes} " in d for d in picks), sm.decisions
    assert all(f"(up to {bound} of" in d for d in picks), picks

