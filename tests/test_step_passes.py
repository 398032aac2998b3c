"""The step passes one by one, on small hand-built graphs of the shape the joint tracer
produces (no process group needed: the passes only read and rearrange nodes).

A backward layer as autograd traces it: dW = x^T g (a weight-gradient GEMM), then
dI = g W^T, then dI's all-reduce over x issued and waited at once, then the next layer
reads the reduced dI. The schedule pass must issue the all-reduce before the dW GEMM and
wait after it (OAR); a weight gradient's reduce-scatter must be issued as soon as dW
exists and waited last (ORS); the order of weight all-gathers must not change. The
bucket pass must pack step-phase all-reduces of one axis and dtype up to the size limit,
in order, and leave other collectives alone.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

import shardc
from shardc.core.context import COMM, CompileContext
from shardc.core.options import Options
from shardc.passes.bucket import BUCKET, bucket_pass
from shardc.passes.schedule import SCHEDULE, schedule_pass
from shardc.runtime import functional as F

pytestmark: list = []  # one process, fast: the fast tier

aten = torch.ops.aten


def _ctx(**kw) -> CompileContext:
    return CompileContext(mesh=shardc.Mesh(x=2, data=2), options=Options(**kw), rt="rt-test")


class G:
    """A graph builder that keeps ``meta["val"]`` (what the passes read) on every node."""

    def __init__(self) -> None:
        self.g = fx.Graph()

    def input(self, name: str, *shape: int, dtype=torch.float32) -> fx.Node:
        n = self.g.placeholder(name)
        n.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
        return n

    def op(self, target, *args) -> fx.Node:
        n = self.g.call_function(target, args)
        vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        n.meta["val"] = target(*vals)
        return n

    def collective(self, kind: str, x: fx.Node, axis: str, phase: str) -> tuple[fx.Node, fx.Node]:
        runner = {"all_reduce": F.run_all_reduce, "reduce_scatter": F.run_reduce_scatter,
                  "all_gather": F.run_all_gather}[kind]
        args = {"all_reduce": (x, "sum", "g"), "reduce_scatter": (x, "sum", 2, "g"),
                "all_gather": (x, 2, "g")}[kind]
        issue = self.g.call_function(runner, (*args, "rt-test", axis, phase))
        v = x.meta["val"]
        issue.meta["val"] = {"all_reduce": lambda: v, "reduce_scatter": lambda: v[: v.shape[0] // 2],
                             "all_gather": lambda: torch.cat([v, v])}[kind]()
        issue.meta[COMM] = {"collective": kind, "axis": axis, "phase": phase}
        wait = self.g.call_function(F.WAIT, (issue,))
        wait.meta["val"] = issue.meta["val"]
        return issue, wait

    def module(self, *outs: fx.Node) -> fx.GraphModule:
        self.g.output(tuple(outs))
        return fx.GraphModule(torch.nn.Module(), self.g)


def _layer_backward(b: G, g: fx.Node, x: fx.Node, w: fx.Node, i: int):
    dw = b.op(aten.mm.default, b.op(aten.t.default, x), g)
    dw.name = f"dW{i}"
    di = b.op(aten.mm.default, g, b.op(aten.t.default, w))
    di.name = f"dI{i}"
    ar, wait = b.collective("all_reduce", di, "x", "backward")
    rs, rs_wait = b.collective("reduce_scatter", dw, "z", "backward")
    return wait, dw, ar, rs, rs_wait


def test_schedule_overlaps_dI_all_reduce_with_dW_and_waits_reduce_scatter_last() -> None:
    b = G()
    g = b.input("g", 8, 16)
    xs = [b.input(f"x{i}", 8, 16) for i in range(2)]
    ws = [b.input(f"w{i}", 16, 16) for i in range(2)]
    wait0, dw0, ar0, rs0, rs_wait0 = _layer_backward(b, g, xs[1], ws[1], 1)
    wait1, dw1, ar1, rs1, rs_wait1 = _layer_backward(b, wait0, xs[0], ws[0], 0)
    gm = schedule_pass(b.module(wait1, rs_wait0, rs_wait1), _ctx())
    order = [n.name for n in gm.graph.nodes]
    pos = {n: order.index(n.name) for n in gm.graph.nodes}
    # OAR: dI first, its all-reduce issued, dW computed while it is in flight, then waited
    assert pos[ar0] < pos[dw0] < pos[wait0], order
    # ORS: the reduce-scatter leaves right after dW and is waited only after all compute
    assert pos[rs0] < pos[ar1] and pos[rs_wait0] > max(pos[dw1], pos[ar1], pos[rs1]), order
    info = {i["node"]: i for i in gm.meta[SCHEDULE]}
    assert dw0.name in info[ar0.name]["gemms"]
    # the graph still computes the same: every node after its inputs
    gm.graph.lint()


def test_schedule_issues_the_collective_with_the_shortest_way_first() -> None:
    # a mean loss over data as the tracer emits it: the whole forward (a chain of GEMMs)
    # makes the local sum; only then come the few ops that count the targets, whose
    # all-reduce the loss's division waits on. Both all-reduces block (later compute
    # reads them), so "blocking paths first" alone keeps the traced order and the count
    # goes out at the very end; it must go out before the forward's first GEMM.
    b = G()
    x, t = b.input("x", 8, 16), b.input("t", 8)
    ws = [b.input(f"w{i}", 16, 16) for i in range(3)]
    h = x
    for w in ws:
        h = b.op(aten.mm.default, h, w)
    local = b.op(aten.sum.default, h)
    count = b.op(aten.sum.default, b.op(aten.ne.Scalar, t, -100))
    count_ar, count_wait = b.collective("all_reduce", count, "data", "forward")
    part = b.op(aten.mul.Tensor, local, b.op(aten.reciprocal.default, count_wait))
    loss_ar, loss_wait = b.collective("all_reduce", part, "data", "forward")
    # the global mean's last scaling reads the reduced loss, so that all-reduce blocks too
    gm = schedule_pass(b.module(b.op(aten.mul.Tensor, loss_wait, 0.25)), _ctx())
    order = [n.name for n in gm.graph.nodes]
    first_mm = min(i for i, n in enumerate(gm.graph.nodes) if n.target is aten.mm.default)
    assert order.index(count_ar.name) < first_mm, order
    # ...and is waited on only where the division needs it, after the GEMMs
    assert order.index(count_wait.name) > max(
        i for i, n in enumerate(gm.graph.nodes) if n.target is aten.mm.default), order
    assert order.index(loss_ar.name) < order.index(loss_wait.name)
    gm.graph.lint()


def test_schedule_keeps_the_random_draws_in_order() -> None:
    """Two dropout masks: the second feeds a blocking all-reduce, so "blocking paths
    first" would draw it first, and it would take the random numbers one device gives
    the first mask (a GPT-2 with dropout trained with wrong gradients on x1y1z1d4).
    The draws keep their traced order; everything else may still move."""
    b = G()
    x, y = b.input("x", 8, 16), b.input("y", 8, 16)
    m1 = b.op(aten.bernoulli.p, x, 0.5)
    first = b.op(aten.mul.Tensor, b.op(aten.mm.default, x, b.input("w", 16, 16)), m1)
    m2 = b.op(aten.bernoulli.p, y, 0.5)
    ar, wait = b.collective("all_reduce", b.op(aten.mul.Tensor, y, m2), "x", "forward")
    gm = schedule_pass(b.module(b.op(aten.add.Tensor, wait, first)), _ctx())
    order = [n.name for n in gm.graph.nodes]
    assert order.index(m1.name) < order.index(m2.name), order
    # the blocking all-reduce still leaves before the GEMM that does not feed it
    assert order.index(ar.name) < order.index(next(n.name for n in gm.graph.nodes
                                                   if n.target is aten.mm.default)), order


def test_schedule_keeps_in_place_writes_before_the_reads_they_feed() -> None:
    """make_fx keeps in-place writes whose result nothing reads: adaptive_avg_pool1d's
    backward writes the gradient into a slice of fresh zeros, then reads the zeros. The
    read feeds a blocking all-reduce, so "blocking paths first" pulled it ahead of the
    write (Swin's gradients came out zero); a write keeps its place among the uses of
    its buffer and of every view of it, and the rest may still move."""
    b = G()
    x, y = b.input("x", 8, 16), b.input("y", 8, 8)
    buf = b.op(aten.new_zeros.default, x, [8, 16])
    part = b.op(aten.slice.Tensor, buf, 1, 0, 8)
    write = b.op(aten.copy_.default, part, y)
    other = b.op(aten.mm.default, x, b.input("w", 16, 16))
    read = b.op(aten.mul.Tensor, buf, 2.0)
    ar, wait = b.collective("all_reduce", read, "x", "forward")
    gm = schedule_pass(b.module(b.op(aten.add.Tensor, wait, other)), _ctx())
    order = [n.name for n in gm.graph.nodes]
    assert order.index(part.name) < order.index(write.name) < order.index(read.name), order
    # the blocking all-reduce still leaves before the GEMM that does not feed it
    assert order.index(ar.name) < order.index(other.name), order


def test_schedule_off_keeps_the_traced_order() -> None:
    b = G()
    g, x, w = b.input("g", 8, 16), b.input("x", 8, 16), b.input("w", 16, 16)
    wait, dw, ar, rs, rs_wait = _layer_backward(b, g, x, w, 0)
    gm = b.module(wait, rs_wait)
    before = [n.name for n in gm.graph.nodes]
    gm = schedule_pass(gm, _ctx(overlap=False))
    assert [n.name for n in gm.graph.nodes] == before
    assert all(not i["gemms"] for i in gm.meta[SCHEDULE])


def test_schedule_keeps_weight_gathers_where_prefetch_put_them() -> None:
    # forward: gather w0, wait, mm; gather w1, wait, mm. A gather reads only a parameter,
    # so it could run first; moving every gather to the top would hold every gathered
    # weight at once. Their order among the compute must stay.
    b = G()
    x = b.input("x", 8, 16)
    w0, w1 = b.input("w0", 8, 16), b.input("w1", 8, 16)
    ag0, wt0 = b.collective("all_gather", w0, "z", "forward")
    h = b.op(aten.mm.default, x, wt0)
    ag1, wt1 = b.collective("all_gather", w1, "z", "forward")
    h2 = b.op(aten.mm.default, h, wt1)
    gm = schedule_pass(b.module(h2), _ctx())
    order = [n.name for n in gm.graph.nodes]
    assert order.index(ag1.name) > order.index(h.name), order


def _step_grads(b: G, sizes: list[int], dtype=torch.float32, axis: str = "data"):
    outs = []
    for n in sizes:
        g = b.op(aten.mul.Tensor, b.input(f"g{len(b.g.nodes)}", n, dtype=dtype), 2.0)
        _, wait = b.collective("all_reduce", g, axis, "step")
        outs.append(wait)
    return outs


def test_bucket_packs_in_order_up_to_the_limit() -> None:
    b = G()
    kib = 256  # float32 elements per KiB
    outs = _step_grads(b, [100 * kib, 100 * kib, 100 * kib, 600 * kib, 50 * kib])
    gm = bucket_pass(b.module(*outs), _ctx(bucket_mb=300 / 1024))
    issues = [n for n in gm.graph.nodes if n.target is F.run_all_reduce]
    members = [n.meta.get(BUCKET, {}).get("members", 1) for n in issues]
    # 100+100+100 fill one 300 KiB bucket; 600 alone is larger than the limit; 50 alone
    assert members == [3, 1, 1], members
    sizes = [n.meta["val"].numel() for n in issues]
    assert sizes == [300 * kib, 600 * kib, 50 * kib]
    # every gradient still leaves the graph with its own shape
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert [tuple(a.meta["val"].shape) for a in out.args[0]] == \
        [(100 * kib,), (100 * kib,), (100 * kib,), (600 * kib,), (50 * kib,)]
    gm.graph.lint()


def test_bucket_caps_follow_ddp() -> None:
    """Left unset, ``bucket_mb`` is DDP's default: the first bucket closes once it holds
    1 MiB, the rest at 25; a size the user gives closes every bucket, the first too (DDP's
    explicit ``bucket_cap_mb``). A bucket closes once full, the gradient that fills it past
    the size inside it: the same buckets as DDP's own assignment
    (``torch.distributed._compute_bucket_assignment_by_size``) of the same gradients."""
    mib = 2 ** 18  # float32 elements per MiB

    def members(sizes: list[int], **kw) -> list[int]:
        b = G()
        gm = bucket_pass(b.module(*_step_grads(b, sizes)), _ctx(**kw))
        return [n.meta.get(BUCKET, {}).get("members", 1)
                for n in gm.graph.nodes if n.target is F.run_all_reduce]

    def ddp(sizes: list[int], caps: list[int]) -> list[int]:
        buckets, _ = dist._compute_bucket_assignment_by_size([torch.empty(n) for n in sizes], caps)
        return [len(b) for b in buckets]

    for sizes in ([mib // 2, mib // 2, mib // 2, mib, mib // 2], [mib // 3] * 7,
                  [3 * mib, mib // 4, mib // 4, 30 * mib, mib], [mib + 1, 1, 24 * mib, mib]):
        assert members(sizes) == ddp(sizes, [2 ** 20, 25 * 2 ** 20]), sizes
        assert members(sizes, bucket_mb=1) == ddp(sizes, [2 ** 20]), sizes
        assert members(sizes, bucket_mb=25) == ddp(sizes, [25 * 2 ** 20]), sizes
    assert members([mib // 2, mib // 2, mib // 2, mib, mib // 2]) == [2, 3]
    assert members([mib // 2, mib // 2, mib // 2, mib, mib // 2], bucket_mb=25) == [5]
    assert Options().bucket_bytes == 25 * 2 ** 20
    assert Options(bucket_mb=0).first_bucket_bytes == 0


def test_bucket_keeps_axes_and_dtypes_apart_and_can_be_off() -> None:
    b = G()
    outs = (_step_grads(b, [64, 64], axis="data") + _step_grads(b, [64, 64], axis="x")
            + _step_grads(b, [64, 64], dtype=torch.float64))
    gm = bucket_pass(b.module(*outs), _ctx())
    issues = [n for n in gm.graph.nodes if n.target is F.run_all_reduce]
    assert len(issues) == 3
    keys = sorted((n.meta[COMM]["axis"], n.meta["val"].dtype.itemsize) for n in issues)
    assert keys == [("data", 4), ("data", 8), ("x", 4)]
    b2 = G()
    outs = _step_grads(b2, [64, 64])
    gm = bucket_pass(b2.module(*outs), _ctx(bucket_mb=0))
    assert len([n for n in gm.graph.nodes if n.target is F.run_all_reduce]) == 2


def test_bucket_leaves_backward_collectives_alone() -> None:
    b = G()
    g = b.input("g", 8, 16)
    _, w1 = b.collective("all_reduce", b.op(aten.mul.Tensor, g, 2.0), "data", "backward")
    _, w2 = b.collective("all_reduce", b.op(aten.mul.Tensor, g, 3.0), "data", "backward")
    gm = bucket_pass(b.module(w1, w2), _ctx())
    assert len([n for n in gm.graph.nodes if n.target is F.run_all_reduce]) == 2


def test_coalesce_gathers_a_blocks_weights_and_scatters_its_gradients_together() -> None:
    from shardc.passes.coalesce import COALESCED, block_of, coalesce_pass

    assert block_of("model.layers.11.mlp.up_proj") == "model.layers.11"
    assert block_of("lm_head") == "lm_head"
    b = G()
    x = b.input("x", 8, 16)
    shards = [b.input(f"w{i}", 4, 16) for i in range(3)]
    waits = []
    for i, w in enumerate(shards):
        ag, wt = b.collective("all_gather", w, "z", "forward")
        ag.meta[COMM]["module"] = "blocks.0.fc1" if i < 2 else "blocks.1.fc1"
        waits.append(wt)
    h = b.op(aten.mm.default, x, b.op(aten.t.default, waits[0]))
    h = b.op(aten.mm.default, h, waits[1])
    h = b.op(aten.mm.default, h, b.op(aten.t.default, waits[2]))
    grads = []
    for i in range(2):
        g = b.op(aten.mul.Tensor, b.input(f"g{i}", 8, 16), 2.0)
        rs, wt = b.collective("reduce_scatter", g, "z", "backward")
        rs.meta[COMM]["module"] = "blocks.0.fc1"
        grads.append(wt)
    gm = coalesce_pass(b.module(h, *grads), _ctx())
    gathers = [n for n in gm.graph.nodes if n.target is F.run_all_gather]
    scatters = [n for n in gm.graph.nodes if n.target is F.run_reduce_scatter]
    # blocks.0's two weights in one gather, blocks.1's alone; the two gradients in one
    assert sorted(n.meta.get(COALESCED, {}).get("members", 1) for n in gathers) == [1, 2]
    assert [n.meta[COALESCED]["members"] for n in scatters] == [2]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert [tuple(a.meta["val"].shape) for a in out.args[0]] == [(8, 8), (4, 16), (4, 16)]
    gm.graph.lint()
    # bucket_mb=0 turns every packing off
    b2 = G()
    w0, w1 = b2.input("w0", 4, 16), b2.input("w1", 4, 16)
    a0, t0 = b2.collective("all_gather", w0, "z", "forward")
    a1, t1 = b2.collective("all_gather", w1, "z", "forward")
    a0.meta[COMM]["module"] = a1.meta[COMM]["module"] = "blocks.0"
    gm = coalesce_pass(b2.module(t0, t1), _ctx(bucket_mb=0))
    assert len([n for n in gm.graph.nodes if n.target is F.run_all_gather]) == 2


class _ThreeOutputs(torch.nn.Module):
    """A differentiable loss, a floating output that carries no gradient, an integer one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32, bias=False)
        self.b = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> tuple:
        h = self.b(torch.relu(self.a(x)))
        return h.square().mean(), h.detach() * 2, h.argmax(-1)


def _joint(sm: shardc.ShardedModule):
    from shardc.passes.joint import trace_joint

    args, needs = sm._example_args()
    names = [t if role == "param" else None for role, t in sm._feeds]
    return trace_joint(sm.graph_module, sm.ctx, args, needs, names, offline=True)


def _shape(jp) -> tuple:
    """What a step program computes, without its node names."""
    def ops(gm):
        return [(n.op, str(n.target)) for n in gm.graph.nodes]
    return jp.n_outputs, jp.diff_outputs, jp.grad_of, ops(jp.forward), ops(jp.backward)


def test_joint_tangents_from_layouts_match_a_probe_of_the_outputs(fake_world, monkeypatch) -> None:
    """The joint tracer gives each floating output a tangent shaped from its layout and
    keeps those of the outputs that carry a gradient. Where the layouts cannot say (or
    say wrong), it runs the program once on fake tensors to see the outputs; both ways
    must give the same program, with one tangent per differentiable output."""
    from shardc.passes import joint as J

    fake_world(4)
    for mesh in (shardc.Mesh(x=2, data=2), shardc.Mesh(y=2, z=2)):
        torch.manual_seed(0)
        sm = shardc.compile(_ThreeOutputs(), mesh, (torch.randn(8, 16),))
        planned = _joint(sm)
        assert planned.diff_outputs == [0] and planned.n_outputs == 3
        tangents = [n for n in planned.backward.graph.nodes
                    if n.op == "placeholder" and not n.name.startswith("saved_")]
        assert len(tangents) == 1
        probed = []
        real_probe = J._probe_outputs

        def probe(*a):
            probed.append(True)
            return real_probe(*a)

        monkeypatch.setattr(J, "_probe_outputs", probe)
        monkeypatch.setattr(J, "_tangent_specs", lambda program, ctx: None)
        assert _shape(_joint(sm)) == _shape(planned) and probed
        # a layout that names the wrong shape is caught at trace time, not run
        probed.clear()
        monkeypatch.setattr(J, "_tangent_specs",
                            lambda program, ctx: [(0, (3,), torch.float32), (1, (1, 16), torch.float32)])
        assert _shape(_joint(sm)) == _shape(planned) and probed
        monkeypatch.undo()


def test_gemm_modes_copy_operands_into_the_form_and_keep_the_product() -> None:
    """A fixed form copies each operand not stored as the form asks (and only those) and
    the product stays a product of the same matrices: each entry within the standard
    bound of a K-term fp32 dot product, K * u * (|A| @ |B|), of the float64 one."""
    from shardc.passes.gemm_modes import GEMM, gemm_modes_pass, gemm_nodes
    from shardc.runtime.gemm import form

    def build() -> fx.GraphModule:
        b = G()
        x, w, g = b.input("x", 8, 32), b.input("w", 16, 32), b.input("g", 8, 16)
        y = b.op(aten.mm.default, x, b.op(aten.t.default, w))        # x @ W^T: NT
        dw = b.op(aten.mm.default, b.op(aten.t.default, g), x)        # g^T @ x: TN
        z = b.op(aten.addmm.default, b.input("bias", 16), x, b.op(aten.t.default, w))
        return b.module(y, dw, z)

    gen = torch.Generator().manual_seed(0)
    ins = [torch.randn(8, 32, generator=gen), torch.randn(16, 32, generator=gen),
           torch.randn(8, 16, generator=gen), torch.randn(16, generator=gen)]
    want = build()(*[t.double() for t in ins])
    absolute = build()(*[t.double().abs() for t in ins])
    for mode in ("NN", "NT", "TN"):
        gm = gemm_modes_pass(build(), _ctx(gemm_modes=mode))
        gemms = gemm_nodes(gm.graph)
        assert [n.meta[GEMM]["traced"] for n in gemms] == ["NT", "TN", "NT"]
        assert all(n.meta[GEMM]["mode"] == mode for n in gemms)
        # every GEMM now reads operands stored in the form (the fake values say so)
        assert all(form(n.args[-2].meta["val"], n.args[-1].meta["val"]) == mode for n in gemms)
        copies = [n for n in gm.graph.nodes if n.target is aten.clone.default]
        # one per operand not stored as the form asks: NN: W^T twice, g^T; NT: g^T and x
        # of dW; TN: x and W^T of both forward products
        assert len(copies) == {"NN": 3, "NT": 2, "TN": 4}[mode], (mode, len(copies))
        got = gm(*ins)
        for c, c64, bound in zip(got, want, absolute):
            k = 32 if c.shape[1] != 32 else 8
            # (k + 1): addmm adds the bias too
            assert ((c.double() - c64).abs() <= (k + 1) * 2.0 ** -24 * bound).all(), mode
    # default: untouched
    gm = gemm_modes_pass(build(), _ctx(gemm_modes="default"))
    assert not [n for n in gm.graph.nodes if n.target is aten.clone.default]


def test_inplace_reduces_only_fresh_buffers_nothing_else_reads() -> None:
    """A GEMM's partial sum or a packed bucket is reduced in place; a program input, a
    view (it shares memory with its base) or a value read again later keeps the copy."""
    from shardc.passes.bucket import bucket_pass
    from shardc.passes.inplace import inplace_pass

    b = G()
    x, w = b.input("x", 8, 16), b.input("w", 16, 16)
    fresh = b.op(aten.mm.default, x, w)
    ar_fresh, t_fresh = b.collective("all_reduce", fresh, "x", "backward")
    ar_input, t_input = b.collective("all_reduce", x, "x", "backward")
    view = b.op(aten.view.default, b.op(aten.mm.default, x, w), [128])
    ar_view, t_view = b.collective("all_reduce", view, "x", "backward")
    again = b.op(aten.mm.default, x, w)
    ar_again, t_again = b.collective("all_reduce", again, "x", "backward")
    used = b.op(aten.add.Tensor, again, 1.0)
    # _unsafe_view declares no alias but is a view: in place only when its base is fresh
    # and read by nothing else
    lone = b.op(aten._unsafe_view.default, b.op(aten.mm.default, x, w), [128])
    ar_lone, t_lone = b.collective("all_reduce", lone, "x", "backward")
    shared = b.op(aten.mm.default, x, w)
    unsafe = b.op(aten._unsafe_view.default, shared, [128])
    ar_unsafe, t_unsafe = b.collective("all_reduce", unsafe, "x", "backward")
    reads = b.op(aten.add.Tensor, shared, 1.0)
    gm = inplace_pass(b.module(t_fresh, t_input, t_view, t_again, used, t_lone, t_unsafe, reads),
                      _ctx())
    assert [n.kwargs.get("inplace", False)
            for n in (ar_fresh, ar_input, ar_view, ar_again, ar_lone, ar_unsafe)] == \
        [True, False, False, False, True, False]
    # a bucket's packed buffer is fresh and read by its reduction alone
    b2 = G()
    grads = []
    for i in range(3):
        g = b2.op(aten.mul.Tensor, b2.input(f"g{i}", 4, 4), 2.0)
        _, wt = b2.collective("all_reduce", g, "data", "step")
        grads.append(wt)
    gm = inplace_pass(bucket_pass(b2.module(*grads), _ctx(backend="inductor")), _ctx())
    (issue,) = [n for n in gm.graph.nodes if n.target is F.run_all_reduce]
    assert issue.kwargs.get("inplace") is True and issue.args[0].target is aten.cat.default


def test_bucket_copies_each_gradient_as_it_is_made() -> None:
    """Under the eager backend a bucket is an empty buffer filled by a chain of copies
    (F.pack_into), each right after the gradient it copies; the chain ends in the
    bucket's all-reduce, which reduces it in place (nothing else reads it), and the
    memory model sees every link as the one buffer."""
    from shardc.passes.bucket import bucket_pass
    from shardc.passes.inplace import inplace_pass
    from shardc.planning.memory import alias_of

    b = G()
    grads, outs = [], []
    for i in range(3):
        g = b.op(aten.mul.Tensor, b.input(f"g{i}", 4, 4), 2.0)
        grads.append(g)
        _, wt = b.collective("all_reduce", g, "data", "step")
        outs.append(wt)
    gm = inplace_pass(bucket_pass(b.module(*outs), _ctx()), _ctx())
    nodes = list(gm.graph.nodes)
    (issue,) = [n for n in nodes if n.target is F.run_all_reduce]
    assert issue.kwargs.get("inplace") is True
    chain = []
    n = issue.args[0]
    while n.target is F.pack_into:
        chain.append(n)
        assert alias_of(n) is n.args[0]
        n = n.args[0]
    assert n.target is aten.empty.memory_format and len(chain) == 3
    chain.reverse()
    # each copy follows its gradient (the first after the buffer made after it)
    for link, g in zip(chain, grads):
        assert link.args[1] is g
        before = nodes[nodes.index(link) - 1]
        assert before is g or (link is chain[0] and before is n), (link, before)
    # the bucket's layout is the members' order: offsets 0, 16, 32
    assert [link.args[2] for link in chain] == [0, 16, 32]


def test_bucket_buffer_waits_for_a_late_large_gradient() -> None:
    """A bucket whose last gradient is larger than all the earlier ones together (a
    replicated position embedding's, made at the very end of backward) allocates its
    buffer after that gradient, not after the first: allocated first, the buffer would
    hold the large gradient's bytes through the whole backward. The earlier gradients
    are copied in right after the buffer, and none of those copies becomes a GEMM
    writing into the bucket (that GEMM would move to the copy and keep its operands)."""
    from shardc.passes.bucket import LATE_PACK
    from shardc.passes.into_bucket import into_bucket_pass

    b = G()
    x = b.input("x", 16, 4)
    grads, outs = [], []
    for i, (rows, cols) in enumerate([(4, 4), (4, 4), (64, 64)]):  # 16, 16 and 4,096 floats
        g = b.op(aten.mm.default, b.op(aten.t.default, b.input(f"a{i}", 16, rows)), x) if i < 2 \
            else b.op(aten.mul.Tensor, b.input("g2", rows, cols), 2.0)
        grads.append(g)
        _, wt = b.collective("all_reduce", g, "data", "step")
        outs.append(wt)
    gm = into_bucket_pass(bucket_pass(b.module(*outs), _ctx()), _ctx())
    nodes = list(gm.graph.nodes)
    (buf,) = [n for n in nodes if n.target is aten.empty.memory_format]
    # the buffer comes right after the large gradient, every copy after the buffer
    assert nodes.index(buf) == nodes.index(grads[2]) + 1
    links = [n for n in nodes if n.target in (F.pack_into, F.mm_into)]
    assert len(links) == 3 and all(n.target is F.pack_into for n in links), links
    assert all(nodes.index(n) > nodes.index(buf) for n in links)
    assert [n.meta.get(LATE_PACK, False) for n in links] == [True, True, False]
    assert [n.args[1] for n in links] == grads and [n.args[2] for n in links] == [0, 16, 32]
    gm.graph.lint()
    # the common case, gradients of like sizes: the buffer follows the first, and a
    # GEMM's gradient is written straight into it
    b2 = G()
    x2 = b2.input("x", 16, 4)
    outs2 = []
    for i in range(3):
        g = b2.op(aten.mm.default, b2.op(aten.t.default, b2.input(f"a{i}", 16, 4)), x2)
        outs2.append(b2.collective("all_reduce", g, "data", "step")[1])
    gm2 = into_bucket_pass(bucket_pass(b2.module(*outs2), _ctx()), _ctx())
    assert [n.target for n in gm2.graph.nodes if n.target in (F.pack_into, F.mm_into)] == [F.mm_into] * 3


def _forward_with_loss(overlap: bool = True, save_loss: bool = False):
    """A forward part: a local loss, all-reduced over data, scaled; returns the loss
    and, as saved for backward, an activation (and the loss itself if ``save_loss``)."""
    from shardc.passes.step_nodes import N_OUTPUTS, PART

    b = G()
    x, w = b.input("x", 8, 16), b.input("w", 16, 16)
    h = b.op(aten.mm.default, x, w)
    ar, wait = b.collective("all_reduce", b.op(aten.sum.default, h), "data", "forward")
    loss = b.op(aten.mul.Tensor, wait, 0.25)
    gm = b.module(loss, h, *([loss] if save_loss else []))
    gm.meta.update({PART: "forward", N_OUTPUTS: (1, 2)})
    return gm, ar, _ctx(overlap=overlap)


def test_defer_returns_the_loss_unwaited_with_its_tail() -> None:
    from shardc.core.ir import DEFERRED
    from shardc.passes.defer import defer_pass

    gm, ar, ctx = _forward_with_loss()
    gm = defer_pass(gm, ctx)
    (d,) = gm.meta[DEFERRED]
    # the forward no longer waits; it returns None in the loss's place, the saved
    # activation, then the tail's input: the all-reduce's buffer, still in flight
    assert not [n for n in gm.graph.nodes if n.target is F.WAIT]
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert outs[0] is None and outs[1].target is aten.mm.default and outs[2] is ar
    assert d.index == 0 and d.n_inputs == 1 and d.like.shape == ()
    assert [n.target for n in d.tail.graph.nodes if n.op == "call_function"] == \
        [F.WAIT, aten.mul.Tensor]
    # the issue stays where it was; the schedule knows its wait comes after the part
    assert ar in gm.graph.nodes
    gm.graph.lint()


def test_defer_leaves_a_value_backward_reads_and_overlap_off() -> None:
    from shardc.core.ir import DEFERRED
    from shardc.passes.defer import defer_pass

    for gm, _, ctx in (_forward_with_loss(save_loss=True), _forward_with_loss(overlap=False)):
        before = [n.name for n in gm.graph.nodes]
        gm = defer_pass(gm, ctx)
        assert gm.meta[DEFERRED] == [] and [n.name for n in gm.graph.nodes] == before


def test_into_bucket_writes_a_gemms_gradient_into_its_slot_and_keeps_the_bytes() -> None:
    """A weight gradient that is a GEMM's result seen through views (autograd's
    ``t(t(mm))``) is written by the GEMM into its bucket slot (``F.mm_into``); a gradient
    whose flat order is not the GEMM's (one transpose), a slot that does not start on 64
    bytes, and a GEMM something else reads keep the copy. The bucket holds the same bytes
    bit for bit, and gemm_modes still sees the GEMM."""
    from shardc.passes.gemm_modes import gemm_nodes
    from shardc.passes.into_bucket import into_bucket_pass

    b = G()
    ab = [(b.input(f"a{i}", m, 6), b.input(f"b{i}", 6, n))
          for i, (m, n) in enumerate([(8, 4), (8, 4), (4, 3), (4, 4), (4, 4)])]
    mm = [b.op(aten.mm.default, a, w) for a, w in ab]
    grads = [
        (b.op(aten.t.default, b.op(aten.t.default, mm[0])), 0),  # written into
        (b.op(aten.t.default, mm[1]), 32),  # transposed: not the GEMM's order, copied
        (mm[2], 64),  # written into; 12 floats, so the next slot starts on 304 bytes
        (b.op(aten.view.default, mm[3], [16]), 76),  # 304 bytes: copied
        (mm[4], 96),  # read again below: copied
    ]
    twice = b.op(aten.mul.Tensor, mm[4], 2.0)
    # zeros, not empty: floats 92-95 are no slot's, and must compare equal too
    buf = b.g.call_function(aten.zeros.default, ([112],), {"device": "meta"})
    buf.meta["val"] = torch.empty(112, device="meta")
    for x, off in grads:
        buf = b.op(F.pack_into, buf, x, off)
    gm = b.module(buf, twice)
    torch.manual_seed(0)
    ins = [torch.randn(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder"]
    for n in gm.graph.nodes:  # run on the CPU
        if n.target is aten.zeros.default:
            n.kwargs = {}
    gm.recompile()
    want = [t.clone() for t in gm(*ins)]
    gm = into_bucket_pass(gm, _ctx())
    kinds = [(n.target, n.args[-2] if n.target is F.mm_into else n.args[2])
             for n in gm.graph.nodes if n.target in (F.pack_into, F.mm_into)]
    assert kinds == [(F.mm_into, 0), (F.pack_into, 32), (F.mm_into, 64), (F.pack_into, 76),
                     (F.pack_into, 96)], kinds
    # the first GEMM and both its transposes are gone, the third GEMM too
    assert sum(n.target is aten.mm.default for n in gm.graph.nodes) == 3
    assert sum(n.target is aten.t.default for n in gm.graph.nodes) == 1
    got = gm(*ins)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    # gemm_modes counts a GEMM written into its bucket as a GEMM
    assert len(gemm_nodes(gm.graph)) == 5


def test_a_view_meets_the_strides_its_input_really_has() -> None:
    """strides_pass: a view traced on fake tensors assumed their (contiguous) strides; a
    kernel that returns its input's transposed layout instead made it raise (Qwen3-Next's
    softplus_backward). As reshape it still aliases where a view exists, and copies only
    where the view would have raised; the direct-call binding runs it as Tensor.reshape."""
    from shardc.passes.strides import strides_pass
    from shardc.program.backend import direct_calls

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    # what the trace saw: a contiguous (6, 4); what runs: a transpose of a (4, 6)
    merged = g.call_function(aten.view.default, (x, [24]))
    same = g.call_function(aten.view.default, (g.placeholder("y"), [24]))
    g.output((merged, same))
    gm = fx.GraphModule(torch.nn.Module(), g)
    real = torch.arange(24.0).view(4, 6).t()
    y = torch.arange(24.0).view(6, 4)
    try:
        gm(real, y)
        raise AssertionError("the view was expected to raise on the transposed input")
    except RuntimeError as e:
        assert "view size is not compatible" in str(e)
    gm = strides_pass(gm, _ctx())
    for run in (gm, direct_calls(gm)):
        a, b = run(real, y)
        assert torch.equal(a, real.reshape(24))
        assert b.data_ptr() == y.data_ptr()  # still a view where one exists
    assert not any(n.target is aten.view.default for n in gm.graph.nodes)
