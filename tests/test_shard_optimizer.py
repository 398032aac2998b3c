"""One-process tests (fake process group) of compile(shard_optimizer=True): what the
report and explain say, and which parameters are split. Training with it is tested
against one device on real gloo ranks in test_shard_optimizer_gloo.py."""
from __future__ import annotations

import torch
import torch.nn as nn
from models import GPT

import shardc

pytestmark: list = []  # one process, fast: the fast tier


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)


def test_report_moves_what_the_all_reduce_moved(fake_world) -> None:
    """Each data all-reduce of a gradient becomes a reduce-scatter plus an all-gather of
    the stepped slices: the same bytes in the ring model, in phase "step"."""
    fake_world(4)
    torch.manual_seed(0)
    model, batch = GPT(), _batch()
    plain = shardc.comm_report(shardc.compile(model, "x1y1z2d2", example_inputs=batch))
    sm = shardc.compile(model, "x1y1z2d2", example_inputs=batch, shard_optimizer=True)
    zero = shardc.comm_report(sm)
    assert zero.total_bytes(axis="data", phase="step", collective="all_reduce") == 0
    rs = zero.total_bytes(axis="data", phase="step", collective="reduce_scatter")
    ag = zero.total_bytes(axis="data", phase="step", collective="all_gather")
    assert rs > 0 and rs == ag
    assert rs + ag == plain.total_bytes(axis="data", phase="step")
    # every other row is unchanged
    assert {k: v for k, v in zero.by_key().items() if k[1] != "data" or k[2] != "step"} == \
        {k: v for k, v in plain.by_key().items() if k[1] != "data" or k[2] != "step"}
    text = shardc.explain(sm)
    assert "optimizer slice over data" in text


def test_slices_are_the_parameters(fake_world) -> None:
    fake_world(4)
    torch.manual_seed(0)
    model = GPT()
    sm = shardc.compile(model, "x1y1z1d4", example_inputs=_batch(), shard_optimizer=True)
    full = dict(model.named_parameters())
    for name, p in sm.named_parameters():
        # each parameter is 1/4 of the model's, cut over data
        assert p.numel() * 4 == full[name].numel(), name
        assert not sm.param_layouts[name].is_replicated("data"), name


class Odd(nn.Module):
    """A weight with no dim that 4 divides stays whole over data (and is said so)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 18)
        self.b = nn.Linear(18, 3, bias=False)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((self.b(torch.relu(self.a(x))) - t) ** 2).mean()


def test_a_parameter_no_dim_of_which_divides_stays_whole(fake_world) -> None:
    fake_world(4)
    sm = shardc.compile(Odd(), "x1y1z1d4", example_inputs=(torch.randn(8, 16), torch.randn(8, 3)),
                        shard_optimizer=True)
    assert sm.get_parameter("a.weight").shape == (18, 4)  # the first dim 4 divides
    assert sm.get_parameter("b.weight").shape == (3, 18)
    assert any("b.weight" in d and "kept whole over data" in d for d in sm.decisions)
    assert sm.grad_reductions["b.weight"] == ["data"]


def test_slices_are_bucketed_last_layer_first(fake_world) -> None:
    """Every slice is in exactly one bucket; buckets are filled in reverse registration
    order (backward's order) up to the cap, and a cap of 0 gives each slice its own."""
    fake_world(4)
    torch.manual_seed(0)
    model, batch = GPT(), _batch()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    quarter = total / 4 / 2 ** 20
    for mb in (25.0, 0.0, quarter):
        sm = shardc.compile(model, "x1y1z1d4", example_inputs=batch, shard_optimizer=True,
                            bucket_mb=mb, step_graph=False)
        buckets = sm._zero_buckets.buckets
        assert [zp.name for b in buckets for zp in b] == list(reversed(list(sm._zero))), mb
        sizes = [sum(zp.full.numel() * zp.full.element_size() for zp in b) for b in buckets]
        if mb == 25.0:  # the GPT's gradients are ~0.1 MiB in all
            assert len(buckets) == 1
        elif mb == 0.0:
            assert len(buckets) == len(sm._zero)
        else:
            # a bucket passes the cap only when one slice alone does
            assert all(s <= mb * 2 ** 20 or len(b) == 1 for s, b in zip(sizes, buckets)), sizes
            assert 4 <= len(buckets) < len(sm._zero), sizes


def test_a_backward_that_raises_leaves_the_next_one_whole(fake_world) -> None:
    """A backward that raises after some buckets went out never runs the end-of-backward
    callback; the next forward must wait for those and start clean, or the next backward
    would reduce nothing (its slices left without gradients, silently)."""
    fake_world(4)
    torch.manual_seed(0)
    model, batch = GPT(), _batch()
    mesh = shardc.Mesh.parse("x1y1z1d4")
    sm = shardc.compile(model, mesh, example_inputs=batch, shard_optimizer=True,
                        bucket_mb=0, step_graph=False)
    first = next(iter(sm._zero.values()))  # the embedding: its gradient comes last

    def fail(_: torch.Tensor) -> None:
        raise RuntimeError("a hook failed")
    handle = first.full.register_hook(fail)
    loss = sm(*[shardc.shard_batch(t, mesh) for t in batch])
    try:
        loss.backward()
    except RuntimeError as e:
        assert "a hook failed" in str(e)
    else:
        raise AssertionError("the backward did not raise")
    handle.remove()
    sm.zero_grad()
    sm.reset_measured_comm()
    sm(*[shardc.shard_batch(t, mesh) for t in batch]).backward()
    assert all(p.grad is not None for p in sm.parameters())
    assert sm.runtime.calls[("reduce_scatter", "data", "step")] == len(sm._zero_buckets.buckets)
