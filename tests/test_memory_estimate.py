"""One-process tests (fake process group) of shardc.planning.memory.estimate and the planner's
traced memory. How close the estimate comes to a measured peak is tested on real gloo
ranks in test_recompute_gloo.py (and tabled by benchmarks/memory.py)."""
from __future__ import annotations

import pytest
import torch
from models import GPT

import shardc
from shardc.planning.memory import estimate, peak_bytes
from shardc.program.offline import compile_offline

pytestmark: list = []  # fast, but for the tests marked slow one by one


def _tokens(n: int = 16) -> torch.Tensor:
    return torch.randint(0, 64, (n, 64), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
def test_the_options_move_the_estimate_as_they_move_memory(fake_world) -> None:
    fake_world(4)
    torch.manual_seed(0)
    model, t = GPT(dim=64, layers=4, heads=8, seq=64), _tokens()
    est = {name: estimate(shardc.compile(model, "x1y1z2d2", example_inputs=(t, t), **kw))
           for name, kw in {"none": {}, "blocks": {"activation_checkpoint": "blocks"},
                            "selective": {"activation_checkpoint": "selective"},
                            "bf16": {"precision": "bf16"},
                            "zero": {"shard_optimizer": True}}.items()}
    assert est["blocks"].step_peak < est["selective"].step_peak < est["none"].step_peak
    # bf16 halves the activations and gathered weights, not the fp32 gradients
    assert 0.4 * est["none"].step_peak < est["bf16"].step_peak < 0.7 * est["none"].step_peak
    assert est["bf16"].resident == est["none"].resident
    # shard_optimizer: AdamW's state halves over data = 2; the program copies are added
    assert est["zero"].optimizer * 2 == est["none"].optimizer
    assert est["zero"].parameters > est["none"].parameters


def test_selective_recompute_reads_what_the_policy_saved(fake_world) -> None:
    """Each block's recompute is matched op for op with its forward, and every op the
    policy saves (per GPT block: the qkv, projection and two MLP GEMMs and attention) is
    read from forward rather than counted again. torch 2.15's checkpoint unpacks saved
    values through ``aten.alias`` as well as ``detach``; counted as ops of the block, they
    broke the match and the estimate fell to block recompute's (11.2 against 29.8 MB
    measured on x1y1z2d2)."""
    from shardc.planning.memory import traced_step

    fake_world(4)
    torch.manual_seed(0)
    t = _tokens()[:, :16].contiguous()
    sm = shardc.compile(GPT(dim=32, layers=2, heads=4, seq=16), "x1y1z2d2", example_inputs=(t, t),
                        activation_checkpoint="selective")
    _, saved_as = traced_step(sm)
    assert len(saved_as) == 2 * 5, sorted(str(n.target) for n in saved_as)
    assert all(r.target == f.target for r, f in saved_as.items())


def test_sgd_keeps_no_state_and_a_bad_name_is_refused(fake_world) -> None:
    fake_world(4)
    torch.manual_seed(0)
    t = _tokens()
    t = t[:, :16].contiguous()
    sm = shardc.compile(GPT(), "x1y1z2d2", example_inputs=(t, t))
    assert estimate(sm, "sgd").optimizer == 0
    assert estimate(sm, 3).optimizer == 3 * sum(p.numel() * 4 for p in sm.parameters())
    with pytest.raises(ValueError, match="optimizer='lion' is not one of"):
        estimate(sm, "lion")


def test_liveness_frees_at_the_last_reader() -> None:
    """a = x*2 (4 KiB), b = a+1 (4 KiB), a dies at b, c = b.sum(): peak 8 KiB, and the
    view of a adds nothing."""
    def f(x: torch.Tensor) -> torch.Tensor:
        a = x * 2
        b = a.view(-1) + 1
        return b.sum()
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(f, tracing_mode="fake")(torch.zeros(32, 32))
    assert peak_bytes(gm.graph) == 2 * 32 * 32 * 4


def test_plan_traced_memory_is_the_programs_estimate() -> None:
    torch.manual_seed(0)
    model, t = GPT(dim=64, layers=2, heads=8, seq=64), _tokens()
    plan = shardc.plan(model, 4, "perlmutter", (t, t), memory="traced", exact_top=2, verify=False,
                       activation_checkpoint="blocks")
    for c in plan[:2]:
        est = estimate(compile_offline(model, (t, t), c.mesh, activation_checkpoint="blocks"))
        assert c.memory_bytes_per_rank == est.total
    with pytest.raises(ValueError, match="memory must be 'formula' or 'traced'"):
        shardc.plan(model, 4, "perlmutter", (t, t), memory="exact")


@pytest.mark.parametrize("kw", [{"step_graph": False}, {"activation_checkpoint": "blocks"}])
def test_a_gather_groups_buffer_is_held_from_its_first_gather_to_its_last_wait(fake_world, kw
                                                                              ) -> None:
    """Under autograd's backward a block's weights go out in one all-gather
    (collectives.GatherGroup): its (G, members) buffer is made at the first member's
    gather and freed at the last member's wait, once in forward and again where block
    recompute gathers the block in backward; the estimate holds it beside the members'
    own copies."""
    from shardc.planning.memory import (
        _gather_group_buffers,
        _grad_bucket_buffers,
        traced_step,
    )

    fake_world(4)
    torch.manual_seed(0)
    t = _tokens()
    sm = shardc.compile(GPT(dim=64, layers=3, heads=8, seq=64), "x1y1z4d1", example_inputs=(t, t),
                        **kw)
    groups = sm._gather_groups
    # one a block, and the final norm's weight and bias (outside the blocks, the
    # embeddings and the head are one weight each)
    assert sorted(g.label for g in groups) == ["blocks.0", "blocks.1", "blocks.2", "ln_f"]
    graph, saved_as = traced_step(sm)
    held = _gather_group_buffers(sm, graph)
    # recompute gathers each block again in backward (not the modules outside them)
    again = "activation_checkpoint" in kw
    made = sorted(v for v in held.values() if v > 0)
    # fp32 weights, gathered from the 4 ranks of z: 4 x the group's shard elements x 4 bytes
    assert made == sorted(4 * g.numel * 4 for g in groups for _ in
                          range(2 if again and g.label != "ln_f" else 1))
    assert sum(held.values()) == 0  # every buffer is freed
    buckets = _grad_bucket_buffers(sm, graph)
    both = dict(buckets)
    for n, v in held.items():
        both[n] = both.get(n, 0) + v
    peak, without = peak_bytes(graph, saved_as, both), peak_bytes(graph, saved_as, buckets)
    if again:
        # the backward peak is where recompute re-gathers a block: its buffer is in it
        assert peak > without
    else:
        # the peak is in backward (activations and gradients), long after the forward's
        # buffers went: they do not add to it
        assert peak == without
    assert estimate(sm).step_peak == peak
