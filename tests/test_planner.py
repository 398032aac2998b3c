"""The planner: predicted time is equations 1-7, presets, ranking, dropped meshes and
their reasons, infeasible requests, ``compile(model, "auto")``."""
from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from models import GPT, MLPChain

import shardc
from shardc.core.machine import Machine
from shardc.tools.cli import main as cli_main

pytestmark: list = []  # fast, but for the tests marked slow one by one

B, D, L = 64, 64, 6  # tokens, hidden, layers of the linear-only model


def _beta(machine: Machine, mesh: shardc.Mesh, axis: str) -> float:
    """Equation 7 and the intra-node table, written out again for the test."""
    order = ["x", "y", "z", "data"]
    inner = math.prod(mesh.size(a) for a in order[:order.index(axis)])
    size = mesh.size(axis)
    if inner * size <= machine.gpus_per_node:
        return machine.intra_node_bandwidth[(inner, size)]
    return machine.inter_node_bandwidth / min(machine.gpus_per_node, inner)


def _paper_seconds(mesh: shardc.Mesh, machine: Machine) -> float:
    """Equations 1-6 for each of the L layers (alternating normal / transposed), summed,
    every term over its own group's bandwidth (equation 7); plus the non-GEMM collectives
    of this model: the mean-squared-error's scalar all-reduce over the features, and the
    loss's scalar all-reduce over each batch axis (every rank returns the global loss)."""
    gx, gy, gz, gd = mesh.x, mesh.y, mesh.z, mesh.data
    m, k, n, b = B / gd, D, D, 4
    first_transposed = gx == 1 and gy > 1
    t = 0.0
    for i in range(L):
        transposed = (i % 2 == 1) != first_transposed
        ax, ay = ("y", "x") if transposed else ("x", "y")
        Gx, Gy = (gy, gx) if transposed else (gx, gy)
        terms = {
            "z": ((gz - 1) * k * n / (Gx * Gy * gz) + (gz - 1) / gz * k * n / (Gx * Gy)) * b,
            ay: 2 * (Gy - 1) / Gy * m * n / (gz * Gx) * b,
            ax: (2 * (Gx - 1) / Gx * m * k / (gz * Gy) * b) if i > 0 else 0.0,  # layer 0: no dI
            "data": 2 * (gd - 1) / gd * k * n / (Gx * Gy * gz) * b,
        }
        t += sum(v / _beta(machine, mesh, a) for a, v in terms.items() if v)
    last_n = "y" if ((L - 1) % 2 == 1) != first_transposed else "x"
    if mesh.size(last_n) > 1:  # the loss: a mean over features cut over the last n axis
        g = mesh.size(last_n)
        t += 2 * (g - 1) / g * 4 / _beta(machine, mesh, last_n)
    for a in ("z", "data"):
        g = mesh.size(a)
        if g > 1:
            t += 2 * (g - 1) / g * 4 / _beta(machine, mesh, a)
    return t


@pytest.mark.parametrize("machine_name,world", [("perlmutter", 8), ("frontier", 16), ("alps", 32),
                                                ("perlmutter", 64)])
def test_linear_model_prediction_is_equations_1_to_7(machine_name: str, world: int) -> None:
    machine = Machine.preset(machine_name)
    model = MLPChain(dim=D, layers=L)
    inputs = (torch.randn(B, D), torch.randn(B, D))
    plan = shardc.plan(model, world, machine, inputs, exact_top=10 ** 6)
    assert len(plan) + len(plan.dropped) == len(shardc.Mesh.all(world))
    assert all(c.exact for c in plan)
    for c in plan:
        want = _paper_seconds(c.mesh, machine)
        assert math.isclose(c.predicted_comm_s, want, rel_tol=1e-9), (c.mesh, c.predicted_comm_s, want)
    assert [c.predicted_comm_s for c in plan] == sorted(c.predicted_comm_s for c in plan)


def test_dropped_meshes_say_why_and_the_first_estimate_ranks_exactly() -> None:
    model = MLPChain(dim=24, layers=4)  # 24 is not cut by 16: divisibility drops
    plan = shardc.plan(model, 16, "perlmutter", (torch.randn(8, 24), torch.randn(8, 24)), exact_top=3)
    reasons = plan.drop_reasons()
    assert reasons.get("batch", 0) > 0 and reasons.get("divisibility", 0) > 0
    assert all(c.exact for c in plan[:3])
    assert plan[0].predicted_comm_s <= plan[1].predicted_comm_s
    for d in plan.dropped:
        if d.reason.startswith("divisibility"):
            assert "cut over" in d.reason or "does not evenly divide" in d.reason


@pytest.mark.slow
def test_infeasible_requests_fail_clearly(tmp_path) -> None:
    from shardc.tools.specs import paper_gpt

    model, inputs = paper_gpt("gpt-320b", batch=8)
    with pytest.raises(ValueError, match=r"no mesh of 8 ranks fits this model on 'perlmutter' "
                                         r"\(dropped: \{'memory': \d+"):
        shardc.plan(model, 8, "perlmutter", inputs)
    bad = tmp_path / "machine.json"
    bad.write_text(json.dumps({"format": "shardc.machine/1", "gpus_per_node": 4,
                               "memory_bytes": -1, "inter_node_bandwidth": 1e9,
                               "intra_node_bandwidth": []}))
    with pytest.raises(ValueError, match=r"machine.json.*memory_bytes"):
        shardc.plan(MLPChain(), 4, str(bad), (torch.randn(8, 16),) * 2)
    with pytest.raises(ValueError, match="unknown|preset"):
        shardc.plan(MLPChain(), 4, "no-such-machine", (torch.randn(8, 16),) * 2)


@pytest.mark.slow
@pytest.mark.parametrize("spec,world", [("plan_gpt_20b", 32), ("plan_gpt_40b", 64)])
def test_paper_fig2_cases_print_their_top_10(spec: str, world: int, capsys) -> None:
    assert cli_main(["plan", f"shardc.tools.specs:{spec}", "--world-size", str(world),
                     "--machine", "perlmutter", "--top", "10", "--checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "top 10 of" in out and f"meshes for {world} ranks on perlmutter" in out
    assert out.count("GiB") >= 10


def test_compile_auto_uses_the_best_mesh(fake_world) -> None:
    fake_world(8)
    model = MLPChain(dim=32, layers=4)
    inputs = (torch.randn(16, 32), torch.randn(16, 32))
    best = shardc.plan(model, 8, "local", inputs)[0].mesh
    fake_world(8)
    sm = shardc.compile(model, "auto", example_inputs=inputs, machine=Machine.preset("local"))
    assert sm.mesh == best


def test_planning_again_reuses_each_pattern_s_compile(monkeypatch) -> None:
    """A second plan of the same model (another machine, or the same) compiles no pattern
    the first compiled: a pattern's analysis does not depend on the machine. Another
    batch shape or another option compiles afresh. (``exact_top`` covers every mesh, so
    that the first plan compiles every pattern another machine's ranking could need.)"""
    import shardc.planning.planner as P

    model = MLPChain(D, L)
    x = (torch.randn(B, D), torch.randn(B, D))
    first = shardc.plan(model, 8, "perlmutter", x, verify=False, exact_top=10 ** 6)
    calls: list = []
    real = P.compile_offline
    monkeypatch.setattr(P, "compile_offline", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    again = shardc.plan(model, 8, "frontier", x, verify=False, exact_top=10 ** 6)
    same = shardc.plan(model, 8, "perlmutter", x, verify=False, exact_top=10 ** 6)
    assert calls == []
    assert [(c.mesh, c.predicted_step_s) for c in same] == [(c.mesh, c.predicted_step_s) for c in first]
    assert {c.mesh for c in again} == {c.mesh for c in first}
    shardc.plan(model, 8, "perlmutter", (torch.randn(2 * B, D), torch.randn(2 * B, D)), verify=False)
    assert calls, "another batch shape compiled nothing"
    n = len(calls)
    shardc.plan(model, 8, "perlmutter", x, verify=False, precision="bf16")
    assert len(calls) > n, "another option compiled nothing"


# two nodes of four ranks that state their compute: the planner ranks stages there
_NODES = Machine(gpus_per_node=4, memory_bytes=3e9, inter_node_bandwidth=3e8,
                 intra_node_bandwidth={(i, s): 4e8 for i in (1, 2) for s in (2, 4) if i * s <= 4},
                 gemm_flops=2e10, memory_bandwidth=3e9, op_overhead=1e-5, bandwidth_overlap=0.2,
                 name="two-nodes")


@pytest.mark.slow  # compiles every pattern of 8, 4, 2 and 1 ranks: a minute and more
def test_pipeline_candidates_price_the_bubble_and_the_sends() -> None:
    """A mesh with stages is its stage mesh's 4D prediction scaled by the heaviest stage's
    share, plus the bubble ((p - 1) / m of the stage's per-micro-batch work) and the sends
    between stages (each boundary value forward and its gradient back, this rank's data x
    z share, over the link between nodes here: a stage of four ranks fills a node)."""
    from models import GPT

    from shardc.planning.stages import p2p_bandwidth, stage_shares

    torch.manual_seed(0)
    model = GPT(layers=4)  # dim 32: the boundary value is the (16, 16, 32) residual stream
    batch = (torch.randint(0, 64, (16, 16)), torch.randint(0, 64, (16, 16)))
    plan = shardc.plan(model, 8, _NODES, batch, exact_top=10 ** 6, verify=False)
    staged = {c.mesh.spec(): c for c in plan if c.mesh.pipe > 1}
    assert "p2x1y1z1d4" in staged and "p4x1y1z1d2" in staged, sorted(staged)
    assert any("stages: pipe=8" in d.reason and "at most 4 stages" in d.reason for d in plan.dropped)
    inner = {c.mesh.spec(): c for c in shardc.plan(model, 4, _NODES, batch, exact_top=10 ** 6, verify=False,
                                                    pipeline=False)}
    shares = stage_shares(model, batch, [2])[2]
    c, c4 = staged["p2x1y1z1d4"], inner["x1y1z1d4"]
    assert c.options == {"microbatches": 2} and c.microbatches == 2
    assert c.compute_s == pytest.approx(c4.compute_s * shares.flops)
    assert c.param_bytes_per_rank == pytest.approx(c4.param_bytes_per_rank * shares.params)
    # 1F1B with m = p keeps p micro-batches of the stage's layers: the stage's share of all
    assert c.activation_bytes_per_rank == pytest.approx(c4.activation_bytes_per_rank * shares.flops)
    assert c.per_axis_s["data"] == pytest.approx(c4.per_axis_s["data"] * shares.params)
    sends = 2 * 16 * 16 * 32 * 4 / 4  # forward and back, a quarter of the rows a rank
    assert c.bytes_per_axis["pipe"] == sends
    assert p2p_bandwidth(_NODES, c.mesh) == _NODES.inter_node_bandwidth / 4  # four pairs share the link
    assert c.per_axis_s["pipe"] == pytest.approx(sends / (_NODES.inter_node_bandwidth / 4))
    work = c.compute_s - c.hidden_s + sum(c.per_axis_s[a] for a in ("x", "y", "z"))
    assert c.bubble_s == pytest.approx(work * (2 - 1) / 2) and c.bubble_s > 0
    assert c.predicted_step_s == pytest.approx(c.compute_s - c.hidden_s + c.predicted_comm_s + c.bubble_s)
    # more micro-batches shrink the bubble; GPipe keeps every micro-batch's activations
    more = {x.mesh.spec(): x for x in shardc.plan(model, 8, _NODES, batch, exact_top=10 ** 6, verify=False,
                                                   microbatches=4, schedule="gpipe") if x.mesh.pipe > 1}
    assert more["p2x1y1z1d4"].bubble_s < c.bubble_s and more["p2x1y1z1d4"].options == {"microbatches": 4}
    assert more["p2x1y1z1d4"].activation_bytes_per_rank == pytest.approx(
        c4.activation_bytes_per_rank * shares.flops)


def test_pipeline_planning_needs_a_machine_that_prices_compute() -> None:
    batch = (torch.randn(16, 16), torch.randn(16, 16))
    model = MLPChain(layers=4)
    with pytest.raises(shardc.ShardcError, match="pipeline=True needs a machine that states its compute"):
        shardc.plan(model, 4, "perlmutter", batch, pipeline=True, verify=False, exact_top=1)
    # by default a machine of bandwidth alone, or one node, plans 4D meshes only
    assert all(c.mesh.pipe == 1 for c in shardc.plan(model, 4, "perlmutter", batch, verify=False, exact_top=1))
    assert all(c.mesh.pipe == 1 for c in shardc.plan(model, 4, _NODES, batch, verify=False, exact_top=1))
    # an option a pipeline does not run keeps the planner from proposing stages
    with pytest.raises(shardc.OptionError, match="reshard_after_forward=True with pipe > 1"):
        shardc.plan(model, 4, _NODES, batch, verify=False, pipeline=True, reshard_after_forward=True,
                    exact_top=1)
    # the optimizer sharded over data runs inside stages: staged meshes are planned with
    # it, and a stage replicated over data holds 1/2 of its weights' 16 bytes a parameter
    def staged(**kw: bool) -> dict[str, Any]:
        return {c.mesh.spec(): c for c in shardc.plan(model, 4, _NODES, batch, verify=False, pipeline=True,
                                                    exact_top=1, **kw) if c.mesh.pipe > 1}
    plain, zero = staged(), staged(shard_optimizer=True)
    assert zero["p2x1y1z1d2"].param_bytes_per_rank == plain["p2x1y1z1d2"].param_bytes_per_rank / 2
    # the interleaved schedule, two chunks a rank: the bubble halves ((p-1)/(v m) of the
    # work), each rank sends twice the boundaries, and four stages of two chunks each
    # would need eight blocks: dropped
    inter = staged(schedule="interleaved")
    a, b = plain["p2x1y1z1d2"], inter["p2x1y1z1d2"]
    assert a.bubble_s > 0 and b.bubble_s == pytest.approx(a.bubble_s / 2)
    assert a.bytes_per_axis["pipe"] > 0 and b.bytes_per_axis["pipe"] == 2 * a.bytes_per_axis["pipe"]
    assert "p4x1y1z1d1" in plain and "p4x1y1z1d1" not in inter


def test_context_meshes_are_planned_where_a_sequence_does_not_fit() -> None:
    """``context=True`` ranks meshes that cut the sequence beside the 4D ones, each from its
    own compiled pattern: the ring's sends are its ``context`` bytes, equal to the
    compiled program's report. By default they are ranked only where nothing without
    them fits: on a machine whose memory a 1k-token sequence's activations overflow
    on every 4D mesh, the plan is of context meshes alone, and ``context=False`` fits
    nothing."""
    from dataclasses import replace

    from shardc.program.offline import compile_offline

    model = GPT(layers=2, seq=1024)
    batch = (torch.randint(0, 64, (2, 1024)), torch.randint(0, 64, (2, 1024)))
    everything = shardc.plan(model, 4, "perlmutter", batch, context=True, exact_top=20)
    cut = [c for c in everything if c.mesh.context > 1]
    whole = [c for c in everything if c.mesh.context == 1]
    assert cut and whole
    assert all(c.exact for c in everything)  # every pattern compiled for itself
    best_cut = min(cut, key=lambda c: c.memory_bytes_per_rank)
    report = shardc.comm_report(compile_offline(model, batch, best_cut.mesh, refuse_indivisible=True))
    for axis, b in best_cut.bytes_per_axis.items():
        assert float(report.total_bytes(axis=axis)) == pytest.approx(b, rel=1e-9, abs=1e-6), axis
    assert best_cut.bytes_per_axis["context"] > 0
    # the default on a machine with room: the 4D meshes alone, as before
    assert all(c.mesh.context == 1 for c in shardc.plan(model, 4, "perlmutter", batch, exact_top=3))
    # a machine that holds the leanest context mesh and no 4D one
    lo = min(c.memory_bytes_per_rank for c in whole)
    assert best_cut.memory_bytes_per_rank < lo
    tight = replace(Machine.preset("perlmutter"), memory_bytes=(lo + best_cut.memory_bytes_per_rank) / 2)
    p = shardc.plan(model, 4, tight, batch, exact_top=3)
    assert p and all(c.mesh.context > 1 for c in p)
    assert any(d.reason.startswith("memory") and d.mesh.context == 1 for d in p.dropped)
    with pytest.raises(shardc.ShardcError, match="no mesh of 4 ranks fits"):
        shardc.plan(model, 4, tight, batch, exact_top=3, context=False, pipeline=False)
