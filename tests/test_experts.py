"""Expert parallelism (``compile(expert_axes=...)``): the option's checks, what the
lowering builds (the segment that runs on the experts' ranks, each expert weight stored
1/G a rank, never gathered), the comm report before a step, and the refusals, in one
process under the fake process group. The numbers on real gloo ranks against float64 are
tests/test_experts_gloo.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_routing import Routed, _batch

import shardc
from shardc.core.context import GLOBAL_VAL, PARAM
from shardc.runtime.experts import EXPERT_REGION, SEGMENTS
from shardc.runtime.grouped_gemm import GROUPED_MM

pytestmark: list = []  # one process, fast: the fast tier


@pytest.mark.parametrize("axes,error,text", [
    ("data", shardc.OptionTypeError, "tuple of axis names"),
    (("x",), shardc.OptionError, "does not cut the tokens"),
    (("data", "data"), shardc.OptionError, "name each axis once"),
    ((), shardc.OptionError, "name each axis once"),
    ((3,), shardc.OptionTypeError, "tuple of axis names"),
])
def test_expert_axes_is_checked(axes, error, text) -> None:
    with pytest.raises(error, match=text):
        shardc.Options(expert_axes=axes)


@pytest.mark.parametrize("kw,error,text", [
    ({"expert_axes": ("data",), "expert_capacity": "1.25"}, shardc.OptionTypeError, "must be a number"),
    ({"expert_axes": ("data",), "expert_capacity": True}, shardc.OptionTypeError, "must be a number"),
    ({"expert_axes": ("data",), "expert_capacity": 0}, shardc.OptionError, "finite number > 0"),
    ({"expert_axes": ("data",), "expert_capacity": float("inf")}, shardc.OptionError, "finite number > 0"),
    ({"expert_capacity": 1.25}, shardc.OptionError, "without expert_axes"),
])
def test_expert_capacity_is_checked(kw, error, text) -> None:
    with pytest.raises(error, match=text):
        shardc.Options(**kw)


def test_a_capacity_moves_fixed_sizes_known_before_any_step(fake_world) -> None:
    """Under a capacity factor every rank sends each expert exactly C = ceil(f x rows / E)
    rows (padded): no counts are exchanged, and every all-to-all's bytes are exact before
    any step, on each leg; explain says what is dropped and where it is counted."""
    fake_world(4)
    sm = shardc.compile(Routed(), shardc.Mesh.parse("x1y1z2d2"), _batch(), expert_axes=("z", "data"),
                        expert_capacity=1.25)
    (seg,) = _segments(sm)
    assert seg.args[7] == 1.25
    rows = [r for r in shardc.comm_report(sm).rows if r.collective == "all_to_all"]
    assert rows and all(r.op.endswith("(padded to capacity)") for r in rows), [r.op for r in rows]
    own = 8 * 4 * 2 // 4  # token-expert rows a rank holds
    slots = 4 * 5  # E x ceil(1.25 x 16 / 4)
    x, keys, out = slots * 8 * 4, slots * 8, slots * 8 * 4
    for axis in ("z", "data"):  # each leg moves the slots, both ways, half of them off-rank
        fwd = sum(r.bytes for r in rows if r.axis == axis and r.phase == "forward")
        bwd = sum(r.bytes for r in rows if r.axis == axis and r.phase == "backward")
        assert fwd == pytest.approx(1 / 2 * (x + keys + out)) and bwd == pytest.approx(1 / 2 * (out + x))
    assert own < slots
    text = shardc.explain(sm)
    assert "capacity factor 1.25" in text and "sm.expert_load()" in text


def test_a_capacity_where_the_experts_are_not_cut_is_refused(fake_world) -> None:
    """A capacity bounds rows on their way to the experts' ranks: on a mesh where the
    experts' axis has one rank nothing travels, and running dropless would change what
    the user asked for without a word."""
    fake_world(2)
    with pytest.raises(shardc.ShardcError, match="experts are not cut"):
        shardc.compile(Routed(), shardc.Mesh.parse("x1y1z1d2"), _batch(), expert_axes=("z",),
                       expert_capacity=1.0)


def _segments(sm) -> list:
    return [n for n in sm.graph_module.graph.nodes if n.target is EXPERT_REGION]


def test_the_experts_side_of_a_region_is_one_segment(fake_world) -> None:
    """Both grouped GEMMs, the bias looked up by key and the activation between them run
    on the experts' ranks as one op: the tokens and their keys go there once, the output
    comes back once."""
    fake_world(4)
    sm = shardc.compile(Routed("norm"), shardc.Mesh.parse("x1y1z1d4"), _batch(), expert_axes=("data",))
    (seg,) = _segments(sm)
    rows, _offs, others, experts, _rt, axis, key, capacity = seg.args
    assert experts == 4 and axis == "data" and capacity == 0.0  # dropless
    # the token rows and the sorted keys travel; the output comes back
    assert sorted(str(r.meta[GLOBAL_VAL].dtype) for r in rows) == ["torch.float32", "torch.int64"]
    assert len(SEGMENTS[key].outs) == 1
    ops = {n.target for n in SEGMENTS[key].fn.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.native_layer_norm.default in ops or torch.ops.aten.layer_norm.default in ops
    # each rank stores one expert of each stacked weight; the bias table stays whole
    local = {k: tuple(v.shape) for k, v in sm.named_parameters()}
    assert local["up"] == (1, 8, 16) and local["down"] == (1, 16, 8) and local["bias"] == (4, 16)
    report = shardc.comm_report(sm)
    assert not [r for r in report.rows if r.param in ("up", "down")], "an expert weight moved"
    text = shardc.explain(sm)
    assert "run on the experts' ranks" in text and "rank at data coordinate c holds experts" in text
    assert "(expert dispatch)" in text and "(expert combine (uniform-routing estimate))" in text


def test_the_report_before_a_step_is_uniform_routing_and_says_so(fake_world) -> None:
    """Before any step the rows coming back are taken as many as were sent; the forward
    all-to-all bytes are then (G-1)/G of: the counts, the rows and keys sent, the rows
    back."""
    fake_world(4)
    sm = shardc.compile(Routed(), shardc.Mesh.parse("x1y1z1d4"), _batch(), expert_axes=("data",))
    rows = [r for r in shardc.comm_report(sm).rows if r.collective == "all_to_all"]
    assert {r.op for r in rows if "combine" in r.op} == {
        "expert combine (uniform-routing estimate)", "expert combine (gradient) (uniform-routing estimate)"}
    local_rows = 8 * 4 * 2 // 4  # tokens x top-2, a quarter each rank
    counts, x_in, keys_in, out = 4 * 8, local_rows * 8 * 4, local_rows * 8, local_rows * 8 * 4
    fwd = sum(r.bytes for r in rows if r.phase == "forward")
    assert fwd == pytest.approx(3 / 4 * (counts + x_in + keys_in + out))
    # backward: the output's gradient there, the rows' gradient back (the keys have none)
    bwd = sum(r.bytes for r in rows if r.phase == "backward")
    assert bwd == pytest.approx(3 / 4 * (out + x_in))


class _EarlyRead(Routed):
    """The activation between the GEMMs is also read before the second GEMM by a row-wise
    op outside the experts' path: the segment cannot end after the second GEMM, so each
    grouped GEMM is a segment of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = x.reshape(-1, d)
        w, idx = torch.topk(self.router(h).softmax(-1), self.k, dim=-1)
        keys, perm = torch.sort(idx.reshape(-1))
        rows = h[perm // self.k]
        counts = torch.histc(keys.float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        y1 = F.silu(self.grouped(rows, self.up, offs))
        scale = y1.mean(-1, keepdim=True) * w.reshape(-1)[perm].unsqueeze(-1)
        y = self.grouped(y1, self.down, offs) * scale
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return (x + y[inv].view(-1, self.k, d).sum(1).view(b, s, d)).pow(2).mean()


def test_a_segment_read_early_falls_back_to_one_a_gemm(fake_world) -> None:
    fake_world(2)
    sm = shardc.compile(_EarlyRead(), shardc.Mesh.parse("x1y1z1d2"), _batch(), expert_axes=("data",))
    assert len(_segments(sm)) == 2


def test_a_capacity_over_experts_in_several_segments_is_refused(fake_world) -> None:
    """A row dropped by the first GEMM's segment would still be read between the GEMMs
    (here by the scale) and sent to the second: no single meaning of "dropped"."""
    fake_world(2)
    with pytest.raises(shardc.ShardcError, match="run as 2 segments"):
        shardc.compile(_EarlyRead(), shardc.Mesh.parse("x1y1z1d2"), _batch(), expert_axes=("data",),
                       expert_capacity=1.0)


def test_a_model_without_grouped_experts_is_refused(fake_world) -> None:
    fake_world(2)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with pytest.raises(shardc.ShardcError, match="no experts were found to cut"):
        shardc.compile(model, shardc.Mesh.parse("x1y1z1d2"), (torch.randn(8, 8),), expert_axes=("data",))


def test_experts_that_the_axis_does_not_divide_are_refused(fake_world) -> None:
    fake_world(8)
    with pytest.raises(shardc.ShardcError, match="4 experts, which data=8 does not divide"):
        shardc.compile(Routed(), shardc.Mesh.parse("x1y1z1d8"), (torch.randn(16, 4, 8),),
                       expert_axes=("data",))


def test_an_axis_of_one_rank_keeps_the_experts_as_they_were(fake_world) -> None:
    """expert_axes=("z",) on a mesh without z: nothing to cut over, the program is the
    one without the option."""
    fake_world(2)
    mesh = shardc.Mesh.parse("x1y1z1d2")
    a = shardc.compile(Routed(), mesh, _batch(), expert_axes=("z",))
    b = shardc.compile(Routed(), mesh, _batch())
    assert not _segments(a)
    assert shardc.comm_report(a).by_key() == shardc.comm_report(b).by_key()


def test_expert_weights_of_a_transformers_model_are_stored_cut(fake_world) -> None:
    """transformers' experts transpose their stacked weights on the way to the grouped
    GEMM: the stored shard is still 1/G of the experts, not the whole weight."""
    import test_experts_gloo as E
    import test_train_gloo as T

    fake_world(4)
    make, batches = T._lm(E.MOES["mixtral"])
    sm = shardc.compile(make(), shardc.Mesh.parse("x1y1z1d4"), batches[0], expert_axes=("data",))
    assert len(_segments(sm)) == 2  # one a layer: both GEMMs and the gate between them
    # on the experts' ranks, shardc's grouped GEMM in place of transformers' fallback
    # (runtime/grouped_gemm.py), on the transposed views transformers makes of the weights
    for seg in _segments(sm):
        fn = SEGMENTS[seg.args[6]]
        gemms = [n.target for n in fn.fn.graph.nodes if n.op == "call_function"
                 and "grouped_mm" in str(n.target)]
        assert gemms == [GROUPED_MM, GROUPED_MM], gemms
        assert all(s != tuple(torch.empty(shape).stride()) for (shape, _), s in
                   zip(fn.others, fn.other_strides) if len(shape) == 3)
    experts = {n.meta[PARAM] for n in sm.graph_module.graph.nodes
               if n.op == "placeholder" and ".experts." in str(n.meta.get(PARAM))}
    assert experts
    for name in experts:
        local = dict(sm.named_parameters())[name]
        assert local.shape[0] == 2, (name, local.shape)  # 8 experts over data=4


def test_batched_mm_experts_are_sorted_and_cut(fake_world) -> None:
    """transformers' batched_mm kernel looks each pair's expert weight up by index and
    multiplies pair by pair; the trace makes it the sorted form (passes/picked_weights.py),
    so its experts are cut as the default kernel's are: one segment a layer, both GEMMs
    shardc's grouped GEMM, each rank storing 1/G of each expert weight."""
    import test_more_models_gloo as M
    import test_train_gloo as T

    fake_world(4)
    make, batches = T._lm(M.MODELS["mixtral-batched"][0])
    sm = shardc.compile(make(), shardc.Mesh.parse("x1y1z1d4"), batches[0], expert_axes=("data",))
    segments = _segments(sm)
    assert len(segments) == 2  # one a layer: the gate between the GEMMs computed sorted
    for seg in segments:
        fn = SEGMENTS[seg.args[6]]
        assert [n.target for n in fn.fn.graph.nodes if n.target is GROUPED_MM] == [GROUPED_MM] * 2
    experts = {n.meta[PARAM] for n in sm.graph_module.graph.nodes
               if n.op == "placeholder" and ".experts." in str(n.meta.get(PARAM))}
    assert experts
    for name in experts:
        assert dict(sm.named_parameters())[name].shape[0] == 1, name  # 4 experts over data=4


class PickedExperts(nn.Module):
    """A mixture of experts written as transformers' batched_mm kernel is: each pair's
    expert weights looked up by its key (``w[keys]``), one ``bmm`` a pair. ``between``
    is what runs between the two GEMMs: a bias looked up by the keys (row by row, so the
    rows stay sorted between the GEMMs), dropout (a draw, whose masks must be the
    model's: each GEMM sorted and put back alone). ``keys="input"`` takes the keys from
    the batch: nothing bounds them, so nothing is rewritten."""

    def __init__(self, dim: int = 8, hidden: int = 12, experts: int = 4, between: str = "",
                 keys: str = "router", stored: str = "out,in") -> None:
        super().__init__()
        self.between, self.keys, self.stored = between, keys, stored
        self.router = nn.Linear(dim, experts, bias=False)
        shape = (experts, hidden, dim) if stored == "out,in" else (experts, dim, hidden)
        self.up = nn.Parameter(torch.randn(shape) / dim ** 0.5)
        self.bias = nn.Parameter(torch.randn(experts, hidden))
        self.down = nn.Parameter(torch.randn(experts, dim, hidden) / hidden ** 0.5)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = x.reshape(-1, d)
        weights, top = torch.topk(self.router(h).softmax(-1), 2)
        keys = top.reshape(-1) if self.keys == "router" else ids.reshape(-1)
        rows = h.repeat_interleave(2, dim=0)
        if self.stored == "out,in":
            y = torch.bmm(self.up[keys], rows.unsqueeze(-1)).squeeze(-1)
        else:
            y = torch.bmm(rows.unsqueeze(1), self.up[keys]).squeeze(1)
        if self.between == "bias":
            y = y + self.bias[keys]
        y = F.gelu(y)
        if self.between == "dropout":
            y = F.dropout(y, 0.1)
        y = torch.bmm(self.down[keys], y.unsqueeze(-1)).squeeze(-1)
        y = (y * weights.reshape(-1, 1)).view(-1, 2, d).sum(1)
        return y.view(b, t, d).pow(2).mean()


@pytest.mark.parametrize("kw,sorts,grouped", [
    ({}, 1, 2),
    ({"stored": "in,out"}, 1, 2),
    ({"between": "bias"}, 1, 2),
    ({"between": "dropout"}, 1, 2),
    ({"keys": "input"}, 0, 0),
], ids=["weights-out-in", "weights-in-out", "bias-between", "dropout-between", "keys-unbounded"])
def test_picked_weight_gemms_become_grouped_gemms_with_the_models_values(kw, sorts, grouped) -> None:
    """What passes/picked_weights.py makes of each form, and the values and gradients it
    computes against the model's, in float64 (the same products; only the order of a
    weight gradient's sum over rows differs, so 1e-12 is far above what that changes and
    far below any wrong row). With dropout between the GEMMs the masks must be the
    model's: both run from the same seed."""
    from shardc.passes.rules.routing import find_regions
    from shardc.passes.trace import trace

    torch.manual_seed(0)
    model = PickedExperts(**kw).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    ids = torch.randint(0, 4, (2, 6, 2))
    ep = trace(model, (x, ids))
    nodes = list(ep.graph.nodes)
    assert sum(n.target is torch.ops.aten.sort.stable for n in nodes) == sorts
    assert sum(n.target is GROUPED_MM for n in nodes) == grouped
    assert sum(n.target is torch.ops.aten.bmm.default for n in nodes) == 2 - grouped
    regions = find_regions(ep.graph)
    assert len(regions) == sorts
    if kw.get("between") == "dropout":  # each GEMM sorted and put back on its own
        assert len(regions[0].exits) == 2
    elif sorts:  # the rows stay sorted from the first GEMM to the last
        assert len(regions[0].exits) == 1
    traced = ep.module()
    torch.manual_seed(1)
    want = model(x, ids)
    want.backward()
    torch.manual_seed(1)
    got = traced(x, ids)
    grads = torch.autograd.grad(got, [dict(traced.named_parameters())[k] for k, _ in model.named_parameters()],
                                allow_unused=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for (name, p), g in zip(model.named_parameters(), grads):
        if p.grad is None:  # the bias is read only with between="bias"
            assert g is None, name
        else:
            torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_the_planner_ranks_meshes_with_the_experts_cut_among_the_rest(fake_world) -> None:
    """A mixture of experts: the planner's candidates include each mesh with its experts
    cut over data and over z (where that axis has ranks), their memory per rank the lower
    for it (each rank stores 1/G of the experts), the all-to-all bytes in their prediction,
    each verified against its compiled program; compile(mesh="auto") takes the first with
    its options."""
    model = Routed(dim=64, hidden=256, experts=4)
    batch = (torch.randn(8, 4, 64),)
    cands = shardc.plan(model, 4, "local", batch, exact_top=10 ** 6)
    by = {(c.mesh.spec(), c.expert_axes): c for c in cands}
    cut, whole = by[("x1y1z1d4", ("data",))], by[("x1y1z1d4", None)]
    assert cut.param_bytes_per_rank < whole.param_bytes_per_rank / 2
    assert cut.bytes_per_axis["data"] != whole.bytes_per_axis["data"]
    assert ("x1y1z4d1", ("z",)) in by and not any(c.expert_axes == ("z",) and c.mesh.z == 1 for c in cands)
    # every candidate's prediction is its compiled program's report (one is verified per
    # plan; here each one with its experts cut)
    import shardc.planning.planner as P
    for c in [c for c in cands if c.expert_axes][:4]:
        P._verify(model, batch, c, {})
    fake_world(4)
    best = cands[0]
    sm = shardc.compile(model, "auto", example_inputs=batch, machine=shardc.Machine.preset("local"))
    assert sm.mesh == best.mesh and sm.ctx.options.expert_axes == best.expert_axes


def test_experts_cut_over_two_axes_travel_one_axis_at_a_time(fake_world) -> None:
    """expert_axes=("z", "data"): each rank holds E/(z x data) experts; a row goes over z
    to its expert's z coordinate, then over data, and comes back the other way. Before a
    step every leg is counted at uniform routing: (G-1)/G of, on each axis, the counts of
    the experts still reachable, the rows and keys sent and the rows back."""
    fake_world(4)
    sm = shardc.compile(Routed(), shardc.Mesh.parse("x1y1z2d2"), _batch(), expert_axes=("z", "data"))
    assert {k: tuple(v.shape) for k, v in sm.named_parameters()}["up"] == (1, 8, 16)
    rows = [r for r in shardc.comm_report(sm).rows if r.collective == "all_to_all" and r.phase == "forward"]
    own = 8 * 4 * 2 // 4  # token-expert rows a rank sends
    x, keys, out = own * 8 * 4, own * 8, own * 8 * 4
    z = sum(r.bytes for r in rows if r.axis == "z")
    data = sum(r.bytes for r in rows if r.axis == "data")
    assert z == pytest.approx(1 / 2 * (4 * 8 + x + keys + out))  # counts of all 4 experts
    assert data == pytest.approx(1 / 2 * (2 * 8 + x + keys + out))  # of the 2 left reachable
    assert "one axis at a time (z, then data)" in shardc.explain(sm)


def test_the_memory_estimate_counts_what_the_experts_hold(fake_world, monkeypatch) -> None:
    """The segment is one opaque op of the traced step: what it holds from forward to
    backward (the rows received, the experts' activations) is added beside the graph, at
    uniform routing. Without it the estimate of an expert-parallel step was a quarter of
    the measured peak (benchmarks/experts.py: 3.0 against 12.0 MiB; with it 11.0 against
    11.6)."""
    import shardc.planning.memory as M

    fake_world(2)
    sm = shardc.compile(Routed(dim=32, hidden=128), shardc.Mesh.parse("x1y1z1d2"), (torch.randn(8, 4, 32),),
                        expert_axes=("data",))
    graph, _ = M.traced_step(sm)
    held = M._expert_buffers(graph)
    made, freed = sorted(held.values(), reverse=True)
    own = 8 * 4 * 2 // 2  # rows a rank sends, and at uniform routing receives
    # at least: the rows and keys received, the first GEMM's output, its bias, the
    # activation, the second GEMM's output; made at the forward op, freed at the backward
    least = own * (32 * 4 + 8 + 3 * 128 * 4 + 32 * 4)
    assert made >= least and freed == -made
    # under a capacity factor it holds the padded runs, whatever the routing: 2x the
    # rows a rank sends at factor 2
    capped = shardc.compile(Routed(dim=32, hidden=128), shardc.Mesh.parse("x1y1z1d2"),
                            (torch.randn(8, 4, 32),), expert_axes=("data",), expert_capacity=2.0)
    made2, _ = sorted(M._expert_buffers(M.traced_step(capped)[0]).values(), reverse=True)
    assert made2 == pytest.approx(2 * made, rel=0.01)
    with_segment = M.estimate(sm).step_peak
    monkeypatch.setattr(M, "_expert_buffers", lambda graph: {})
    assert with_segment > M.estimate(sm).step_peak


def test_the_trace_lines_say_what_a_capacity_dropped(tmp_path) -> None:
    """``shardc trace --expert-axes``'s lines: the rows each rank's experts computed, and
    under a capacity the rank's own rows dropped (dropless traces say nothing of it)."""
    import json

    from shardc.tools.timeline import expert_load_lines

    def load(got: list[int], dropped: list[int]) -> dict:
        return {"axis": "data", "sent_per_expert": [5, 3], "received_per_rank": [sum(got)],
                "received_per_expert": got, "dropped_per_expert": dropped}

    for rank, (got, dropped) in enumerate([([6, 6], [1, 0]), ([6, 6], [0, 0])]):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"shardcExpertLoad": {"moe": load(got, dropped)}}))
    lines = expert_load_lines(sorted(str(p) for p in tmp_path.glob("rank*.json")))
    assert lines[0].endswith("; 1 of its own rows dropped past the capacity"), lines
    assert "dropped" not in lines[1] and "computed 12 rows (1.00x the mean)" in lines[1]


def test_the_cost_model_counts_the_experts_grouped_gemms(fake_world) -> None:
    """torch's flop counter has no formula for a grouped GEMM: the cost model counted the
    experts' GEMMs as memory traffic and the MFU count left them out (a batched_mm
    model's per-pair bmm had been counted as an attention). Both count 2 x rows x in x out
    a GEMM now, forward; the cost model and MFU three times that for the step."""
    from shardc.passes.trace import trace
    from shardc.planning.cost import work
    from shardc.planning.throughput import count_flops

    torch.manual_seed(0)
    model = PickedExperts()
    x, ids = torch.randn(2, 6, 8), torch.randint(0, 4, (2, 6, 2))
    tokens, pairs = 12, 24
    forward = 2 * tokens * 8 * 4 + 2 * (2 * pairs * 8 * 12)  # the router, the experts' two
    flops = count_flops(trace(model, (x, ids)), tokens)
    assert (flops.gemm_flops, flops.attention_flops) == (3 * forward, 0)
    fake_world(2)
    sm = shardc.compile(model, shardc.Mesh.parse("x1y1z1d2"), (x, ids))
    terms, _ = work(sm.graph_module, recompute=False)
    assert sum(f for f, _ in terms) == 3 * forward
    assert all(divs == ("data",) for _, divs in terms), terms  # each rank its own rows
