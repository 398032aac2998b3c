"""One-process tests of the description ranks compare (shardc/program/agreement.py) and of the
fake backend skipping the exchange. The exchange itself runs on gloo in
tests/test_bad_inputs_gloo.py."""
from __future__ import annotations

import torch
import torch.nn as nn

import shardc
from shardc.core.options import Options
from shardc.passes.trace import trace
from shardc.program.agreement import (
    _digest,
    describe,
    first_difference,
    node_keys,
    reorder_like,
)

pytestmark: list = []  # one process, fast: the fast tier


class Net(nn.Module):
    def __init__(self, hidden: int = 8, head: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, hidden)
        self.head = nn.Linear(hidden, 2) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return (self.head(h) if self.head is not None else h).mean()


def _items(model: nn.Module, mesh: str = "x2y1z1d2", x: torch.Tensor | None = None, **opts: object):
    x = torch.randn(4, 4) if x is None else x
    return describe(model, shardc.Mesh.parse(mesh), (x,), Options(**opts), None,
                    trace(model, (x,)).graph)


def test_same_model_same_digest_and_no_difference() -> None:
    torch.manual_seed(0)
    a = _items(Net())
    torch.manual_seed(0)
    b = _items(Net())
    assert _digest(a) == _digest(b)
    assert "no item differs" in first_difference(a, b, 0, 1)


def test_first_difference_names_the_cause_before_its_consequences() -> None:
    torch.manual_seed(0)
    base = _items(Net())
    torch.manual_seed(0)
    extra = _items(Net(head=True))
    # the extra parameter shifts every traced op after it; the parameter is named
    assert first_difference(base, extra, 0, 5).startswith(
        "rank 5 compiled parameter 'head.weight' (shape [2, 8], dtype float32, requires_grad True), "
        "which rank 0 does not have.")
    torch.manual_seed(1)
    reseeded = _items(Net())
    assert "rank 1 compiled parameter 'fc.weight' with other values than rank 0" in \
        first_difference(base, reseeded, 0, 1)
    torch.manual_seed(0)
    other_option = _items(Net(), prefetch_depth=2)
    assert first_difference(base, other_option, 0, 2).startswith(
        "rank 2 has option prefetch_depth = 2, rank 0 has 1.")


def test_fake_backend_compiles_without_an_exchange(fake_world, monkeypatch) -> None:
    # a fake group's collectives return garbage: an exchange there would read it
    fake_world(4096)

    def no_collective(*args: object, **kwargs: object) -> None:
        raise AssertionError("compile communicated under the fake backend")

    monkeypatch.setattr(torch.distributed, "all_gather", no_collective)
    sm = shardc.compile(Net(hidden=64), shardc.Mesh(x=2, y=2, z=2, data=512), (torch.randn(1024, 4),))
    assert sm.param_layouts


class Heads(nn.Module):
    """Two heads, each a view of the input checked and scaled, computed in ``order``
    (a set of strings iterated: its order follows the process's hash seed)."""

    def __init__(self, order: tuple[str, ...]) -> None:
        super().__init__()
        self.order = order
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = {}
        for name in self.order:
            v = x.unsqueeze(1).float()  # the same view for both: told apart by its readers
            out[name] = getattr(self, name)(v).sum(1)
        return (out["a"] * out["b"]).mean()


def test_the_same_ops_in_another_order_are_aligned_to_rank_0s() -> None:
    """Keys match node for node however each trace ordered and named them, and rebuilding
    one trace in the other's order (with its names) makes the descriptions equal; a real
    difference (another op) keeps its own keys and is not rebuilt."""
    x = torch.randn(4, 4)
    torch.manual_seed(0)
    first = Heads(("a", "b"))
    torch.manual_seed(0)
    second = Heads(("b", "a"))
    ep_a, ep_b = trace(first, (x,)), trace(second, (x,))
    mesh = shardc.Mesh.parse("x2y1z1d2")
    items = [describe(m, mesh, (x,), Options(), None, ep.graph)
             for m, ep in ((first, ep_a), (second, ep_b))]
    assert _digest(items[0]) != _digest(items[1])
    keys_a, keys_b = node_keys(ep_a.graph), node_keys(ep_b.graph)
    assert sorted(keys_a.values()) == sorted(keys_b.values())
    order = [(keys_a[n], n.name) for n in ep_a.graph.nodes]
    assert reorder_like(ep_b, order)
    assert _digest(describe(second, mesh, (x,), Options(), None, ep_b.graph)) == _digest(items[0])
    # the rebuilt program computes what it did
    torch.testing.assert_close(ep_b.module()(x), second(x))

    class Other(Heads):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).exp()

    torch.manual_seed(0)
    other = Other(("b", "a"))
    ep_o = trace(other, (x,))
    before = [n.name for n in ep_o.graph.nodes]
    assert not reorder_like(ep_o, order)
    assert [n.name for n in ep_o.graph.nodes] == before
