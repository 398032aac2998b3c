"""The step-time model (shardc/planning/cost.py) and the planner's use of it.

Each term is held against what it counts: FLOPs against torch's flop counter over the
rank's own forward program, calls against the step program's collectives, the
plan's step time against its terms. Whether the model ranks meshes as they measure is a
benchmark (``shardc bench``, figures in the README), not a timed test.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import shardc
from shardc.core.machine import Machine
from shardc.core.mesh import AXES
from shardc.passes.step_nodes import collective_nodes
from shardc.planning.cost import BACKWARD_FLOPS, OPTIMIZER_PASSES, step_shape, work
from shardc.program.offline import compile_offline
from shardc.tools.models import GPT, lm_batch

pytestmark: list = []  # fast, but for the tests marked slow one by one

BATCH = lm_batch(16, 64, 512)
MESHES = ["x2y2z2d1", "x1y1z1d8", "x4y1z1d2", "x1y2z2d2", "x1y8z1d1"]

# a machine where every term counts; figures of the order profile_machine measures here
STEPPED = Machine(gpus_per_node=8, memory_bytes=3e9, inter_node_bandwidth=3e8,
                  intra_node_bandwidth={(i, s): 4e8 for i in (1, 2, 4) for s in (2, 4, 8)
                                        if i * s <= 8},
                  intra_node_latency={(i, s): 1e-3 * s for i in (1, 2, 4) for s in (2, 4, 8)
                                      if i * s <= 8},
                  inter_node_latency=1e-2, gemm_flops=2e10, memory_bandwidth=3e9,
                  op_overhead=1e-5, bandwidth_overlap=0.2, latency_overlap=0.7, name="stepped")


@pytest.fixture(scope="module")
def gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT.peer()


@pytest.mark.parametrize("spec", MESHES)
def test_flops_per_rank_are_what_the_rank_s_program_runs(spec: str, gpt, fake_world) -> None:
    """The FLOPs ``work`` gives a rank (global counts over the axes that cut them) equal
    torch's flop counter over that rank's forward program, run: the divisors are right,
    replicated compute included."""
    mesh = shardc.Mesh.parse(spec)
    fake_world(mesh.world_size)
    sm = shardc.compile(gpt, mesh, example_inputs=BATCH)
    flops, _ = work(sm.graph_module, recompute=False)
    predicted = sum(f / math.prod(mesh.size(a) for a in divs) for f, divs in flops)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:  # the forward program (no step program without grad)
        sm(*(shardc.shard_batch(t, mesh) for t in BATCH))
    assert counter.get_total_flops() > 0
    # forward counted once, backward BACKWARD_FLOPS times it: exact integers
    assert predicted == (1 + BACKWARD_FLOPS) * counter.get_total_flops()


def test_calls_are_the_step_program_s_collectives(gpt) -> None:
    """Calls per axis come from the packed, scheduled step program: what a step issues
    (the gloo test in test_step_graph_gloo holds the offline program to a real step's)."""
    sm = compile_offline(gpt, BATCH, "x2y1z2d2")
    shape = step_shape(sm)
    jp = sm.offline_step()
    want: dict[str, int] = {}
    for part in (jp.forward, jp.backward):
        for n in collective_nodes(part.graph):
            a = n.meta["shardc_comm"]["axis"]
            want[a] = want.get(a, 0) + 1
    assert shape.calls == want and set(want) == {"x", "z", "data"}
    # data-parallel gradients go out in buckets: fewer calls than parameters
    assert want["data"] < len(sm.param_layouts)
    # the schedule overlaps some of them (ORS, buckets, prefetched gathers) and not all
    assert 0 < sum(shape.overlapped_calls.values()) < sum(want.values())
    assert all(0 <= v <= 1 for v in shape.overlapped_share.values())


def test_optimizer_traffic_follows_the_parameter_sharding(gpt) -> None:
    """AdamW's pass over a rank's parameters: all of them under DDP, an eighth under FSDP."""
    def optimizer_bytes(spec: str) -> float:
        sm = compile_offline(gpt, BATCH, spec)
        params = [t for t in step_shape(sm).traffic if t[0] % (OPTIMIZER_PASSES * 4) == 0]
        mesh = shardc.Mesh.parse(spec)
        return sum(b / math.prod(mesh.size(a) for a in divs) for b, divs in params)

    n = sum(p.numel() for p in gpt.parameters())
    assert optimizer_bytes("x1y1z1d8") >= OPTIMIZER_PASSES * 4 * n
    assert optimizer_bytes("x1y1z8d1") < optimizer_bytes("x1y1z1d8") / 4


@pytest.mark.slow
def test_plan_step_time_is_its_terms(gpt) -> None:
    plan = shardc.plan(gpt, 8, STEPPED, BATCH, exact_top=10 ** 6, verify=False)
    assert len(plan) >= 10
    for c in plan:
        s = c.step
        assert s is not None and c.exact
        assert c.predicted_step_s == pytest.approx(s.compute + s.comm - s.hidden, rel=1e-12)
        for a in AXES:
            assert c.per_axis_s[a] == pytest.approx(s.bandwidth[a] + s.latency[a], rel=1e-12)
            want_bw = c.bytes_per_axis[a] / STEPPED.axis_bandwidth(c.mesh, a) if c.bytes_per_axis[a] else 0
            assert s.bandwidth[a] == pytest.approx(want_bw, rel=1e-12)
        assert 0 <= s.hidden <= s.compute
        assert s.compute > 0
    assert [c.predicted_step_s for c in plan] == sorted(c.predicted_step_s for c in plan)


@pytest.mark.slow
def test_latency_ranks_meshes_by_their_calls(gpt) -> None:
    """With calls that cost a second each and bandwidth, compute and overlap that cost
    nothing, the ranking is the count of calls: the latency term is calls times alpha."""
    slow = Machine(gpus_per_node=8, memory_bytes=3e9, inter_node_bandwidth=1e30,
                   intra_node_bandwidth=dict.fromkeys(STEPPED.intra_node_bandwidth, 1e30),
                   intra_node_latency=dict.fromkeys(STEPPED.intra_node_latency, 1.0),
                   inter_node_latency=1.0, op_overhead=1e-30, name="slow-calls")
    plan = shardc.plan(gpt, 8, slow, BATCH, exact_top=10 ** 6, verify=False)
    for c in plan[:6]:
        calls = sum(step_shape(compile_offline(gpt, BATCH, c.mesh)).calls.values())
        assert c.predicted_step_s == pytest.approx(calls, rel=1e-6), c.mesh
    # pure data parallelism issues a handful of buckets; tensor parallelism over 8
    # ranks an all-reduce per GEMM pair and norm
    assert plan[0].mesh.spec() == "x1y1z1d8"
    assert plan[-1].predicted_step_s > 10 * plan[0].predicted_step_s


def test_presets_rank_by_communication_alone(gpt) -> None:
    plan = shardc.plan(gpt, 8, "perlmutter", BATCH, verify=False)
    for c in plan:
        assert c.step is None and c.compute_s == 0 and c.hidden_s == 0
        assert c.predicted_step_s == c.predicted_comm_s == sum(c.per_axis_s.values())


def test_offline_program_of_a_vocabulary_parallel_embedding(gpt) -> None:
    """The offline trace runs the rank's program without a process group: a runtime op
    that reads the rank (the vocabulary-parallel embedding's row offset) reads the rank
    compiled for. Before, the comm report of such a program under reshard_after_forward
    (which traces the step offline) raised 'Default process group has not been
    initialized'."""
    sm = compile_offline(gpt, BATCH, "x2y1z2d1", rank=3, reshard_after_forward=True)
    rep = shardc.comm_report(sm)
    again = [r for r in rep.rows if r.phase == "backward" and "gathered again" in r.op]
    assert again


@pytest.mark.slow
@pytest.mark.distributed
def test_shardc_bench_measures_and_ranks_on_gloo(tmp_path, capsys) -> None:
    """``shardc bench`` end to end on 2 real gloo ranks (the 8-rank figures are the
    README's): every mesh asked for is measured in every round, and the summary holds
    the model's terms beside the measurement."""
    import json

    from shardc.tools.cli import main as cli_main

    STEPPED.save(tmp_path / "m.json")
    out = tmp_path / "bench"
    assert cli_main(["bench", "--ranks", "2", "--steps", "1", "--rounds", "2", "--machine",
                     str(tmp_path / "m.json"), "--out", str(out),
                     "--meshes", "x2y1z1d1,x1y1z1d2,x1y2z1d1"]) == 0
    raw = json.loads((out / "bench_steps.json").read_text())
    assert {k: len(v) for k, v in raw["steps"].items()} == {
        "x2y1z1d1": 2, "x1y1z1d2": 2, "x1y2z1d1": 2}
    summary = json.loads((out / "bench.json").read_text())
    assert summary["rounds"] == 2 and len(summary["meshes"]) == 3
    for row in summary["meshes"]:
        assert row["measured_step_s"] > 0 and row["predicted_compute_s"] > 0
        assert row["predicted_step_s"] == pytest.approx(
            row["predicted_compute_s"] + row["predicted_comm_s"] - row["predicted_hidden_s"])
    assert sorted(r["model_rank"] for r in summary["meshes"]) == [1, 2, 3]
    assert "Spearman rho" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--rounds must be at least 1"):
        cli_main(["bench", "--ranks", "2", "--rounds", "0"])


def test_a_model_on_the_meta_device_plans_its_whole_step() -> None:
    """Planning a model too large to allocate (built under torch.device("meta")) on a
    machine that models the whole step: the step program is traced on the example's
    device (its inputs were once made on the CPU beside meta weights, and the trace failed)."""
    with torch.device("meta"):
        model = GPT(vocab=512, dim=64, layers=2, heads=4, seq=32)
    tokens = torch.zeros(8, 32, dtype=torch.long, device="meta")
    plan = shardc.plan(model, 4, STEPPED, (tokens, tokens), exact_top=1, verify=False)
    assert plan and all(c.compute_s > 0 for c in plan[:1])
