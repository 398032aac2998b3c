"""One-process tests of the compiler (fake process group): the program's collectives,
shard sizes, error messages, explain."""
from __future__ import annotations

import copy
import math
import os
import re
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from models import GPT, MLPChain

import shardc
from shardc.core.context import GLOBAL_VAL, KIND, SOURCE
from shardc.runtime import collectives as C

pytestmark: list = []  # fast, but for the tests marked slow one by one

MESHES_8 = shardc.Mesh.all(8)


def _mlp_inputs(dim: int = 16, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, dim), torch.randn(batch, dim)


def _by_module(gm: torch.fx.GraphModule, target: object) -> Counter:
    """(module, axis) -> count of collective nodes with this target."""
    out: Counter = Counter()
    for n in gm.graph.nodes:
        if n.target is target:
            out[(n.meta[SOURCE].module, n.args[2])] += 1
    return out


@pytest.mark.parametrize("mesh", MESHES_8, ids=str)
def test_mlp_chain_has_exactly_algorithm_1_collectives(fake_world, mesh: shardc.Mesh) -> None:
    fake_world(8)
    sm = shardc.compile(MLPChain(dim=16, layers=6), mesh, _mlp_inputs())
    gm = sm.graph_module
    ag, ar, gar = (_by_module(gm, t) for t in (C.all_gather_start, C.all_reduce_start,
                                               C.grad_all_reduce))
    rs = Counter((n.meta[SOURCE].module, n.args[2]) for n in gm.graph.nodes
                 if n.target is C.all_gather_start and n.args[3] == "reduce_scatter")
    normal = []
    for i in range(6):
        lay = sm.param_layouts[f"layers.{i}.weight"]  # torch layout (n, k)
        # normal: k over y, n over x; transposed ("every other layer"): x and y swap
        normal.append(lay.shard_dim("y") == 1 or lay.shard_dim("x") == 0)
    if mesh.x > 1 or mesh.y > 1:
        assert all(a != b for a, b in zip(normal, normal[1:])), normal
    for i in range(6):
        layer = f"layers.{i}"
        fwd_axis, bwd_axis = ("y", "x") if normal[i] else ("x", "y")
        want = lambda axis: 1 if mesh.size(axis) > 1 else 0  # noqa: E731
        assert ag[(layer, "z")] == want("z"), (layer, ag)
        assert rs[(layer, "z")] == want("z"), (layer, rs)
        assert ar[(layer, fwd_axis)] == want(fwd_axis), (layer, ar)
        assert ar[(layer, bwd_axis)] == 0, (layer, ar)
        # the first layer's input is data: it has no gradient, so no all-reduce of dI
        assert gar[(layer, bwd_axis)] == (want(bwd_axis) if i > 0 else 0), (layer, gar)
        assert gar[(layer, fwd_axis)] == 0, (layer, gar)
        assert sm.grad_reductions.get(f"{layer}.weight", []) == (["data"] if mesh.data > 1 else [])
    # nothing else but the loss's mean over a hidden dim cut over the last layer's n axis,
    # and the loss's reduction over the batch axes (every rank returns the global loss)
    linear = {f"layers.{i}" for i in range(6)}
    others = Counter((n.target.__name__, n.args[2]) for n in gm.graph.nodes
                     if n.target in (C.all_gather_start, C.all_reduce_start, C.grad_all_reduce)
                     and n.meta[SOURCE].module not in linear)
    last_n_axis = "x" if normal[-1] else "y"
    want_others = Counter({("all_reduce_start", a): 1 for a in (last_n_axis, "z", "data")
                           if mesh.size(a) > 1})
    assert others == want_others
    # no collective over an axis of size 1
    for n in gm.graph.nodes:
        if n.target in (C.all_gather_start, C.all_reduce_start, C.grad_all_reduce):
            assert mesh.size(n.args[2]) > 1


@pytest.mark.parametrize("mesh", MESHES_8, ids=str)
def test_parameter_shards_are_the_papers_size(fake_world, mesh: shardc.Mesh) -> None:
    fake_world(8)
    model = MLPChain(dim=16, layers=4)
    sm = shardc.compile(model, mesh, _mlp_inputs())
    for name, p in sm.named_parameters():
        k, n = model.get_parameter(name).shape
        assert p.numel() * p.element_size() == k * n * 4 // (mesh.x * mesh.y * mesh.z), name
    assert [n for n, _ in sm.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_special_cases_are_the_known_systems(fake_world) -> None:
    fake_world(8)
    ddp = shardc.compile(MLPChain(), shardc.Mesh(data=8), _mlp_inputs())
    # DDP: the only forward collective is the loss's scalar all-reduce (every rank returns
    # the global loss); gradients are reduced over data after backward
    colls = [(n.target, n.args[2]) for n in ddp.graph_module.graph.nodes
             if n.target in (C.all_gather_start, C.all_reduce_start, C.grad_all_reduce)]
    assert colls == [(C.all_reduce_start, "data")]
    assert ddp.graph_module.graph.find_nodes(op="output")[0].args[0][0].meta[GLOBAL_VAL].dim() == 0
    assert all(v == ["data"] for v in ddp.grad_reductions.values())
    fsdp = shardc.compile(MLPChain(), shardc.Mesh(z=8), _mlp_inputs())
    kinds = Counter(n.target for n in fsdp.graph_module.graph.nodes if n.target in (
        C.all_gather_start, C.all_reduce_start, C.grad_all_reduce))
    # gather per layer (reduce-scatter back), and the loss's scalar all-reduce
    assert kinds == Counter({C.all_gather_start: 6, C.all_reduce_start: 1})
    assert not fsdp.grad_reductions
    hsdp = shardc.compile(MLPChain(), shardc.Mesh(z=4, data=2), _mlp_inputs())
    assert all(v == ["data"] for v in hsdp.grad_reductions.values())
    # Megatron: column-parallel then row-parallel, one all-reduce forward per pair
    mega = shardc.compile(MLPChain(layers=2), shardc.Mesh(x=8), _mlp_inputs())
    layouts = {k: str(v) for k, v in mega.param_layouts.items()}
    assert layouts == {"layers.0.weight": "[S(0)@x]", "layers.1.weight": "[S(1)@x]"}


class _WeightedCE(nn.Module):
    """A linear head and a mean cross-entropy in the forms that divide by a count: plain,
    with class weights (the counted targets' weights), and padded (``ignore_index``)."""

    def __init__(self, weighted: bool) -> None:
        super().__init__()
        self.head = nn.Linear(16, 10)
        self.register_buffer("w", torch.linspace(0.5, 2.0, 10) if weighted else None)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x), t, weight=self.w, ignore_index=3)


@pytest.mark.parametrize("mesh", [shardc.Mesh(data=8), shardc.Mesh(z=2, data=4), shardc.Mesh(x=2, data=4)],
                         ids=str)
def test_a_cross_entropy_mean_is_one_all_reduce_a_batch_axis_and_comes_out_whole(fake_world, mesh) -> None:
    """The mean divides the rows' sum by the targets counted over the whole batch: the sum
    and the count travel in one all-reduce of two values over each batch axis, so the
    loss leaves the forward whole on every rank, with no reduction of the output (two
    collectives a step before: the count's, then the mean's)."""
    from shardc.core.context import PLACEMENT
    from shardc.core.placement import Layout
    from shardc.runtime import ops as R

    fake_world(8)
    tokens = torch.randint(0, 64, (8, 16))
    models = [(GPT(), (tokens, tokens)), (_WeightedCE(True), (torch.randn(16, 16), torch.randint(0, 10, (16,)))),
              (_WeightedCE(False), (torch.randn(16, 16), torch.randint(0, 10, (16,))))]
    for model, inputs in models:
        gm = shardc.compile(model, mesh, inputs).graph_module
        batch_axes = [a for a in ("z", "data") if mesh.size(a) > 1]
        pairs = [n for n in gm.graph.nodes if n.target is C.all_reduce_start and
                 n.args[0].target in (R.sum_and_count, C.wait)
                 and n.meta[GLOBAL_VAL].shape == (2,)]
        assert sorted(n.args[2] for n in pairs) == sorted(batch_axes), (type(model).__name__, pairs)
        # no other all-reduce of a scalar: neither the count alone nor the output's
        scalars = [n for n in gm.graph.nodes if n.target is C.all_reduce_start and n.meta[GLOBAL_VAL].dim() == 0]
        assert scalars == [], (type(model).__name__, scalars)
        (loss,) = gm.graph.find_nodes(op="output")[0].args[0]
        assert loss.target is R.mean_of_sums and loss.meta[PLACEMENT] == Layout(0)


def test_fused_qkv_columns_are_interleaved(fake_world) -> None:
    fake_world(8)
    sm = shardc.compile(GPT(), shardc.Mesh(x=4, y=2), (torch.randint(0, 64, (8, 16)),) * 2)
    assert str(sm.param_layouts["blocks.0.qkv.weight"]) == "[S(1)@y, S(0/3)@x]"
    assert any("interleaved in 3 groups" in d for d in sm.decisions)
    assert not sm.fallbacks


def test_meta_device_model_compiles_without_weights(fake_world) -> None:
    fake_world(4096)
    with torch.device("meta"):
        model = GPT(vocab=512, dim=256, layers=2, heads=8, seq=64)
    sm = shardc.compile(model, shardc.Mesh(data=64, z=8, y=4, x=2),
                        (torch.zeros(512, 64, dtype=torch.long, device="meta"),) * 2)
    assert all(p.is_meta for p in sm.parameters())
    assert shardc.comm_report(sm).total_bytes() > 0


# ------------------------------------------------------------------------ errors
def test_error_mesh_does_not_match_world(fake_world) -> None:
    fake_world(8)
    with pytest.raises(ValueError, match=r"Mesh\(x=4, y=1, z=1, data=1\) has 4 ranks .* world "
                                         r"size is 8"):
        shardc.compile(MLPChain(), shardc.Mesh(x=4), _mlp_inputs())


def test_dimension_not_divisible_is_kept_whole_or_refused_for_the_planner(fake_world) -> None:
    """A GEMM dim its axis does not divide is kept whole on that axis by compile (and the
    decision says so); the planner's analysis, which drops meshes that do not divide the
    model, asks for the refusal instead, with the padding that would fit."""
    from shardc.program.offline import compile_offline

    fake_world(8)
    sm = shardc.compile(MLPChain(dim=12), shardc.Mesh(y=8), _mlp_inputs(dim=12))
    text = shardc.explain(sm)
    assert "n=12 over -; out_features=12, which 'y' (8) does not divide, kept whole" in text, text
    # 8 divides neither dim of any weight: every weight is stored whole
    assert all(not any(lay.dims) for lay in sm.param_layouts.values()), sm.param_layouts
    with pytest.raises(ValueError, match=r"'layers.0.weight' \(aten.linear.default in layers.0 at "
                                         r"models.py:\d+\) has out_features \(n\)=12, which mesh "
                                         r"axis 'y' \(size 8\) does not evenly divide.*Pad "
                                         r"out_features to 16 or change the size of 'y'"):
        compile_offline(MLPChain(dim=12), _mlp_inputs(dim=12), shardc.Mesh(y=8),
                        refuse_indivisible=True)


def test_error_batch_not_divisible(fake_world) -> None:
    fake_world(8)
    with pytest.raises(ValueError, match=r"batch size 12 .* data x z = 2 x 4 = 8 does not divide"):
        shardc.compile(MLPChain(), shardc.Mesh(data=2, z=4), _mlp_inputs(batch=12))


def test_error_compile_before_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        shardc.compile(MLPChain(), shardc.Mesh(), _mlp_inputs())


class _NumPy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(x.detach().numpy().std())  # Python work on the data: cannot be traced
        return (self.lin(x) * scale).sum()


def test_error_untraceable_model_names_cause_and_line(fake_world) -> None:
    fake_world(1)
    with pytest.raises(shardc.TraceError, match=r"could not trace _NumPy at .*test_compile"
                                                r"\.py:\d+: RuntimeError: \.numpy\(\)"):
        shardc.compile(_NumPy(), shardc.Mesh(), (torch.randn(4, 4),))


class _ReadsData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.lin.weight.data.t() + self.lin(x)).sum()


def test_error_data_in_forward_names_it_and_the_fix(fake_world) -> None:
    """export's own message names a lifted constant; ours names `.data` and `.detach()`."""
    fake_world(1)
    with pytest.raises(shardc.TraceError, match=r"could not trace _ReadsData(.|\n)*`\.data` read "
                                                r"in forward(.|\n)*`\.detach\(\)`"):
        shardc.compile(_ReadsData(), shardc.Mesh(), (torch.randn(4, 4),))


class _SumOverCount(nn.Module):
    """A loss normalised by a count passed in (transformers' ``num_items_in_batch``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor, count) -> torch.Tensor:
        return F.mse_loss(self.lin(x), y, reduction="sum") / count


def test_a_number_argument_is_checked_against_the_traced_one(fake_world) -> None:
    """export bakes a number argument into the program: a call with another number used
    to compute silently with the example's; it is refused, and a tensor count works."""
    fake_world(1)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    sm = shardc.compile(_SumOverCount(), shardc.Mesh(), (x, y, 10))
    sm(x, y, 10)
    with pytest.raises(shardc.ShardcError, match=r"input 2 \('count'\) is 20, but the program "
                                                 r"was traced with 10 .*torch\.tensor\(20\)"):
        sm(x, y, 20)
    sm = shardc.compile(_SumOverCount(), shardc.Mesh(), (x, y, torch.tensor(10.0)))
    ten, twenty = (sm(x, y, torch.tensor(c)).item() for c in (10.0, 20.0))
    assert ten == 2 * twenty


def test_an_input_that_requires_grad_needs_an_example_that_does(fake_world) -> None:
    """The program computes the gradients of the inputs whose example required one. A call
    whose input requires grad where the example's did not used to leave its .grad None
    silently (an upstream module feeding it would not train): refused, unless no gradient
    can follow (no_grad); compiled from an example that requires grad, it gets one."""
    fake_world(1)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    model = _SumOverCount()
    sm = shardc.compile(model, shardc.Mesh(), (x, y, 10))
    with pytest.raises(shardc.ShardcError, match=r"input 0 \('x'\) requires grad, but the example "
                                                 r"input there did not.*requires_grad_\(\)"):
        sm(x.clone().requires_grad_(True), y, 10)
    with torch.no_grad():
        sm(x.clone().requires_grad_(True), y, 10)
    sm = shardc.compile(model, shardc.Mesh(), (x.clone().requires_grad_(True), y, 10))
    got, want = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    sm(got, y, 10).backward()
    model(want, y, 10).backward()
    # one device, the same fp32 ops; a decomposition may reorder the sum of 8 products
    # behind each element (a few ulps)
    torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-6)


class _RoundSTE(torch.autograd.Function):
    """A straight-through estimator: round's value, the identity's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.round()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g


class _Square(torch.autograd.Function):
    """A backward written out as the forward's derivative (as Bloom's GeLU is)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 2 * x * g


class _WithFunction(nn.Module):
    def __init__(self, fn: type) -> None:
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(self.lin(x)).sum()


def test_autograd_function_whose_backward_is_not_its_derivative_is_refused(fake_world) -> None:
    """torch.export keeps a Function's forward only: a straight-through estimator would get
    round's zero gradient, silently. A backward that is the derivative compiles."""
    fake_world(2)
    with pytest.raises(shardc.ShardcError, match=r"_WithFunction calls the torch.autograd.Function "
                       r".*_RoundSTE at .*test_compile\.py:\d+, whose backward is not the "
                       r"derivative of its forward \(they differ by 1 relative"):
        shardc.compile(_WithFunction(_RoundSTE), shardc.Mesh.parse("x2y1z1d1"), (torch.randn(4, 4),))
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardc.ShardcWarning)
        shardc.compile(_WithFunction(_Square), shardc.Mesh.parse("x2y1z1d1"), (torch.randn(4, 4),))


class _GradHook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 0.5)  # halves the gradient into a
        return self.b(h).pow(2).mean()


def test_gradient_hooks_are_refused(fake_world) -> None:
    """Export keeps no hook: a tensor hook registered in forward, or a module's backward
    hook, would be dropped from the compiled backward, silently."""
    fake_world(2)
    mesh = shardc.Mesh.parse("x2y1z1d1")
    with pytest.raises(shardc.ShardcError, match=r"_GradHook changes gradients with hooks "
                       r"\(tensor.register_hook at .*test_compile\.py:\d+\)"):
        shardc.compile(_GradHook(), mesh, (torch.randn(4, 4),))
    model = _WithFunction(_Square)
    model.lin.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(shardc.ShardcError, match=r"\(a backward hook on lin\)"):
        shardc.compile(model, mesh, (torch.randn(4, 4),))


def test_a_draft_its_own_retrace_contradicts_is_refused_at_compile(fake_world) -> None:
    """BatchNorm with momentum=None divides by its step count (float(num_batches_tracked)):
    draft_export fixes it to the example's, and re-tracing the draft contradicts that. The
    export's own error is raised, at compile, without the branch warning."""
    fake_world(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 1))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(shardc.TraceError, match=r"could not trace Sequential .*"
                                                    r"GuardOnDataDependentSymNode"):
            shardc.compile(model, shardc.Mesh(), (torch.randn(8, 4),))
    assert not [w for w in seen if "branches on tensor values" in str(w.message)]


def test_value_branch_without_draft_export_is_the_export_error(fake_world, monkeypatch) -> None:
    """torch < 2.8 has no public draft_export: a branch on tensor values stays a TraceError
    (shardc.core.compat lists draft_export among the names newer than the floor)."""
    fake_world(1)
    monkeypatch.delattr(torch.export, "draft_export", raising=False)
    with pytest.raises(shardc.TraceError, match=r"could not trace _DataDependent at .*test_compile"):
        shardc.compile(_DataDependent(), shardc.Mesh(), (torch.randn(4, 4).abs(),))


class _AutocastRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.a(x)
        return self.b(h.float()).pow(2).mean()


def test_autocast_region_in_forward_computes_in_its_dtype(fake_world) -> None:
    """Export leaves a torch.autocast region's casts to autocast at run time, and the
    trace's decompositions write them out (unlike a no_grad region's meaning, which they
    lost): the region's GEMM runs in bf16 as on one device, what follows it in fp32."""
    fake_world(2)
    sm = shardc.compile(_AutocastRegion(), shardc.Mesh.parse("x2y1z1d1"), (torch.randn(4, 8),))
    gemms = [n.meta[GLOBAL_VAL].dtype for n in sm.graph_module.graph.nodes
             if isinstance(n.target, torch._ops.OpOverload)
             and n.target._schema.name in ("aten::addmm", "aten::mm", "aten::linear")]
    assert torch.bfloat16 in gemms and torch.float32 in gemms, gemms


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a branch on a tensor's value: export cannot decide it
            return self.lin(x).sum()
        return x.sum()


@pytest.mark.skipif(not hasattr(torch.export, "draft_export"), reason="torch < 2.8: no draft_export")
def test_value_branch_is_traced_on_the_examples_side_and_checked(fake_world) -> None:
    """A branch on tensor values compiles with a warning naming the line, the program
    checks the branch every step, and the step program stands aside (it traces on
    fake tensors, which have no value to check); the gloo test runs both sides."""
    from shardc.runtime.ops import check_branch

    fake_world(2)
    x = torch.randn(4, 4).abs()  # takes the branch: sum > 0
    with pytest.warns(shardc.ShardcWarning, match=r"_DataDependent branches on tensor values at "
                      r".*test_compile\.py:\d+ \(if x\.sum\(\) > 0:"):
        sm = shardc.compile(_DataDependent(), shardc.Mesh.parse("x1y1z1d2"), (x,))
    assert any(n.target is check_branch for n in sm.graph_module.graph.nodes)
    assert sm._joint_failed is not None and "draft_export" in sm._joint_failed
    assert "could not be built (the program checks, each step, a branch" in shardc.explain(sm)


class _CountBranch(nn.Module):
    """A branch on a count read as a Python int: draft_export fixes the count itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        k = int(n.sum().item())
        if k % 3 == 1 and k > 2:
            return self.lin(x).sum()
        return x.sum()


@pytest.mark.skipif(not hasattr(torch.export, "draft_export"), reason="torch < 2.8: no draft_export")
@pytest.mark.filterwarnings("ignore::shardc.ShardcWarning")
@pytest.mark.parametrize("model, same_side, other_side", [
    # torch 2.11's draft_export left no check on this one (a boolean .item()): the other
    # side's batch returned the example side's value
    (_DataDependent, (torch.randn(4, 4).abs() + 1,), (-torch.randn(4, 4).abs() - 1,)),
    # the example takes the false side: the guard is the negation of the .item()
    (_DataDependent, (-torch.randn(4, 4).abs() - 1,), (torch.randn(4, 4).abs() + 1,)),
    (_CountBranch, (torch.randn(4, 4), torch.tensor([2, 2, 0, 0])),
     (torch.randn(4, 4), torch.tensor([3, 4, 0, 0]))),
], ids=["bool_item", "bool_item_false", "int_item"])
def test_value_branch_runs_its_side_and_stops_the_other(fake_world, model, same_side,
                                                        other_side) -> None:
    """On a mesh of one (every op runs for real), a batch on the traced side computes what
    the model does, and one on the other side raises instead of computing the wrong one,
    on every torch of the range (the check is shardc's own where torch leaves none)."""
    fake_world(1)
    torch.manual_seed(0)
    m = model()
    g = torch.Generator().manual_seed(1)
    # another batch on the same side: its sign is what the branch reads
    example = tuple(a if a.dtype != torch.float32 else
                    torch.sign(a) * (torch.randn(a.shape, generator=g).abs() + 1) for a in same_side)
    sm = shardc.compile(copy.deepcopy(m), shardc.Mesh(), example)
    # the same ATen ops on the same values in one process
    assert sm(*same_side).item() == m(*same_side).item()
    with pytest.raises(RuntimeError, match=r"this batch takes a branch the compiled program "
                                           r"does not have.*test_compile\.py"):
        sm(*other_side)


class _LabelledRows(nn.Module):
    """DeBERTa-v2's classification loss: the rows with a label (>= 0), found by nonzero,
    and a branch on how many there are."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lin(x)
        rows = (labels >= 0).nonzero()
        if rows.size(0) > 0:
            picked = torch.gather(logits, 0, rows.expand(rows.size(0), logits.size(1)))
            return F.cross_entropy(picked, torch.gather(labels, 0, rows.view(-1)))
        return logits.sum() * 0


@pytest.mark.skipif(not hasattr(torch.export, "draft_export"), reason="torch < 2.8: no draft_export")
@pytest.mark.filterwarnings("ignore::shardc.ShardcWarning")
def test_scalar_work_on_data_dependent_sizes_is_not_a_fallback(fake_world) -> None:
    """The sizes and comparisons draft_export leaves of such a branch (``u0 >= 0``,
    ``sym_size``) are numbers every rank computes as one device does: sm.fallbacks lists
    the nonzero, which gathers the batch-cut labels, and not them."""
    fake_world(2)
    labels = torch.tensor([0, 2, -100, 1, 1, -100, 0, 2])
    sm = shardc.compile(_LabelledRows(), shardc.Mesh.parse("x1y1z1d2"), (torch.randn(8, 4), labels))
    assert [f.op for f in sm.fallbacks if f.gathered] == ["aten.nonzero.default"]
    assert all(not f.op.startswith("<built-in") and "sym_" not in f.op for f in sm.fallbacks), \
        sm.fallbacks


class _EveryCrossEntropy(nn.Module):
    """``F.cross_entropy`` as segmentation and sequence code calls it: classes on dim 1 of
    (N, C, H, W) and of (N, C, L), with class weights, label smoothing, ignored pixels and
    probability targets (mixup's)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.seq = nn.Linear(4, 8)
        self.register_buffer("w", torch.linspace(0.5, 1.5, 8))

    def forward(self, img: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor,
                soft: torch.Tensor) -> torch.Tensor:
        seg = F.cross_entropy(self.conv(img), mask, weight=self.w, label_smoothing=0.1,
                              ignore_index=255)
        logits = self.seq(tokens).transpose(1, 2)  # (N, L, C) -> (N, C, L)
        return (seg + F.cross_entropy(logits, soft.transpose(1, 2), label_smoothing=0.05)
                + F.cross_entropy(logits, mask[:, 0], ignore_index=255, reduction="sum"))


@pytest.mark.parametrize("spec", ["x1y1z1d4", "x2y1z1d2"])
def test_every_cross_entropy_form_keeps_the_batch_on_its_rank(fake_world, spec: str) -> None:
    """Each of these once ran whole on every rank, the batch (and on x the classes)
    gathered: numerics of the forms are the rule sweep's (tests/test_rules_reduction.py)."""
    fake_world(4)
    mask = torch.randint(0, 8, (8, 4, 4))
    mask[0, :2] = 255
    batch = (torch.randn(8, 3, 4, 4), mask, torch.randn(8, 4, 4),
             torch.softmax(torch.randn(8, 4, 8), -1))
    sm = shardc.compile(_EveryCrossEntropy(), shardc.Mesh.parse(spec), batch)
    assert sm.fallbacks == []
    assert not [r for r in shardc.comm_report(sm).rows if r.collective == "all_gather"]


class _PerSample(nn.Module):
    """Ops that work within each sample, written as user code writes them: a hand-made
    norm's ``var``/``var_mean``, ``cumprod`` along the sequence, ``scatter_add`` and
    ``index_add`` of messages into their slots, ``F.unfold``'s patches, ``any``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, img: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        var, mean = torch.var_mean(h, -1, keepdim=True)
        h = (h - mean) / (var + 1e-5).sqrt() + h.std(-1, keepdim=True)
        gated = torch.cumprod(torch.sigmoid(h), 1)
        pooled = torch.zeros_like(h).scatter_add(-1, slots, gated)
        pooled = pooled.index_add(1, torch.tensor([0, 2, 2, 1, 5, 4]), gated)
        patches = F.unfold(self.conv(img), 2, stride=2)
        # torch.any, as F.gaussian_nll_loss checks its variances: a partial max, not a gather
        flag = torch.where((h > 3).any(-1, keepdim=True).any(), 2.0, 1.0)
        return pooled.pow(2).mean() * flag + patches.pow(2).mean()


@pytest.mark.parametrize("spec", ["x1y1z1d4", "x2y1z1d2"])
def test_per_sample_ops_keep_the_batch_on_its_rank(fake_world, spec: str) -> None:
    """Each ran whole on every rank with the batch gathered; numerics are the rule
    sweep's (tests/test_rules_view.py, tests/test_rules_reduction.py)."""
    fake_world(4)
    batch = (torch.randn(8, 6, 16), torch.randn(8, 3, 8, 8), torch.randint(0, 16, (8, 6, 16)))
    sm = shardc.compile(_PerSample(), shardc.Mesh.parse(spec), batch)
    assert [f for f in sm.fallbacks if f.gathered] == []


class _ComplexParts(nn.Module):
    """A complex tensor built from two real ones, by parts and in polar form (rotary
    embeddings in Meta's Llama code use ``torch.polar``), read back as real numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        z = torch.complex(h, h.flip(-1)) * torch.polar(h.abs() + 1, h)
        return torch.view_as_real(z).pow(2).mean()


@pytest.mark.parametrize("spec", ["x1y1z1d4", "x2y1z1d2"])
def test_complex_from_parts_keeps_the_batch_on_its_rank(fake_world, spec: str) -> None:
    """torch.complex and torch.polar are elementwise: each once ran whole on the gathered
    batch (numerics: tests/test_rules_pointwise.py's cases)."""
    fake_world(4)
    sm = shardc.compile(_ComplexParts(), shardc.Mesh.parse(spec), (torch.randn(8, 6, 16),))
    assert [f.op for f in sm.fallbacks if f.gathered] == []


class _Solves(nn.Module):
    """torch.linalg on a stack of per-sample matrices, and an inverse of a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.eye(6) * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        k = h @ h.transpose(1, 2) + torch.eye(6)
        return (torch.linalg.solve(k, h).sum() + torch.linalg.cholesky(k).diagonal(dim1=1, dim2=2).sum()
                + torch.inverse(k).sum() + (h @ torch.inverse(self.w)).sum())


@pytest.mark.parametrize("spec", ["x1y1z1d4", "x2y1z1d2"])
def test_batched_linear_algebra_compiles_and_keeps_the_batch_cut(fake_world, spec: str) -> None:
    """A solve, Cholesky factor or inverse once failed to compile: their decompositions
    check for a singular matrix by a side effect, which export carries as a state token.
    Kept whole, each runs on the rank's own samples."""
    fake_world(4)
    sm = shardc.compile(_Solves(), shardc.Mesh.parse(spec), (torch.randn(8, 6, 6),))
    assert [f for f in sm.fallbacks if f.gathered] == []


class _Noisy(nn.Module):
    """Noise shaped like an activation: a VAE's reparameterisation, diffusion's noised
    input, Gumbel-softmax's exponential draw."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.dec = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.enc(x).chunk(2, -1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        noised = x + 0.1 * torch.randn_like(x) + torch.rand_like(x)
        pick = F.gumbel_softmax(self.dec(z), tau=0.5)
        return (self.dec(noised) - pick).pow(2).mean()


@pytest.mark.parametrize("spec", ["x1y1z1d4", "x2y1z1d2"])
def test_noise_shaped_like_an_activation_gathers_nothing(fake_world, spec: str) -> None:
    """randn_like and friends read only their input's shape: each ran whole on the
    gathered input. Drawing as one device does is the gloo sweep's
    (tests/test_rules_random.py)."""
    fake_world(4)
    sm = shardc.compile(_Noisy(), shardc.Mesh.parse(spec), (torch.randn(8, 6, 8),))
    assert [f for f in sm.fallbacks if f.gathered] == []


class _MaskedRows(nn.Module):
    """BART's classification head picks its end-of-sentence rows so: ``h[mask]`` has as
    many rows as the mask has True values, known only when the step runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h[mask].view(h.size(0), -1, 8)[:, -1, :].pow(2).sum()


class _NonzeroRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x[torch.nonzero(mask[:, 0]).squeeze(1)]).sum()


# the fallback for the op that makes the size copies export's runtime checks on it (``u0 >=
# 0``), whose raw symbol fx warns about; compile refuses the program before anything runs it
@pytest.mark.filterwarnings("ignore:Raw Sym")
@pytest.mark.parametrize("model, op, origin", [
    # h[mask] is the nonzero of the mask and a lookup by it (passes/data_sized.py); torch
    # 2.8's decompositions fail on it before that rewrite, naming the index itself
    (_MaskedRows, "aten.view.default", r"aten\.(nonzero\.default|index\.Tensor)"),
    (_NonzeroRows, "aten.linear.default", "aten.nonzero.default")])
@pytest.mark.parametrize("spec", ["x1y1z1d4", "x2y1z1d2", "x1y1z4d1"])
def test_data_dependent_size_is_refused_naming_where_it_was_made(fake_world, model, op, origin,
                                                                spec) -> None:
    """A rule that meets a size known only at run time (torch's guard on an unbacked
    symbol) is a ShardcError naming the op, the op that made the size and both lines,
    with the fixed-size rewrite; it was a RuntimeError from inside the view or GEMM rule."""
    fake_world(4)
    x = torch.randn(4, 6, 8)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 2] = mask[:, 4] = True
    # torch 2.6 and 2.7 fail in their own decompositions of h[mask], before any rule:
    # compile names the origin and the rewrite there too
    with pytest.raises(shardc.ShardcError, match=rf"({op} in .* at test_compile\.py:\d+ works on|"
                                                 r"could not decompose .*, which works on) "
                                                 rf"a size that depends on the data, made by "
                                                 rf"{origin} in .* at test_compile\.py:\d+( \(.*\))?\. .*"
                                                 r"h\[torch\.arange\(B\), idx\]"):
        shardc.compile(model(), shardc.Mesh.parse(spec), (x, mask))


class _InPlaceDropoutHead(nn.Module):
    """torchvision's MobileNet/EfficientNet classifier: in-place dropout before the head,
    which decomposes into a Bernoulli draw on ``empty_like`` of the features."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.body(x))
        h = h * torch.bernoulli(torch.empty_like(h), 0.8)
        return F.mse_loss(self.head(F.dropout(h, 0.1, training=True, inplace=True)), t)


@pytest.mark.parametrize("spec", ["x1y1z1d2", "x2y1z1d1", "x1y1z2d1"])
def test_bernoulli_draw_gathers_nothing(fake_world, spec: str) -> None:
    """The draw is made for the global shape on every rank and cut to the layout of the
    tensor it was asked on; the replicated fallback gathered that (uninitialised) tensor
    to draw on it. The draws against one device: tests/test_rules_random.py."""
    fake_world(2)
    sm = shardc.compile(_InPlaceDropoutHead(), shardc.Mesh.parse(spec), _mlp_inputs())
    assert sm.fallbacks == []
    gathers = [r for r in shardc.comm_report(sm).rows if r.collective == "all_gather"
               and r.param is None]
    assert gathers == [], gathers


def test_wrong_local_batch_is_refused(fake_world) -> None:
    fake_world(2)
    sm = shardc.compile(MLPChain(), shardc.Mesh(data=2), _mlp_inputs())
    with pytest.raises(ValueError, match=r"this rank's piece of the example input \[16, 16\] laid "
                                         r"out as \[S\(0\)@data\] is \[8, 16\]"):
        sm(*_mlp_inputs())


# ----------------------------------------------------------------------- explain
GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "explain_mlp2_x2y2z2.txt")


def test_explain_matches_golden(fake_world) -> None:
    # If this fails, fix the compiler, not the expectation (unless the change is intended:
    # then regenerate with SHARDC_UPDATE_GOLDEN=1 and read the diff).
    fake_world(8)
    torch.manual_seed(0)
    sm = shardc.compile(MLPChain(dim=8, layers=2), shardc.Mesh(x=2, y=2, z=2),
                        (torch.randn(8, 8), torch.randn(8, 8)))
    text = shardc.explain(sm)
    if os.environ.get("SHARDC_UPDATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            f.write(text)
    with open(GOLDEN) as f:
        assert text == f.read()


def test_explain_names_fallback_ops(fake_world) -> None:
    class Scanner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return torch.logcumsumexp(h, dim=-1).mean()  # logcumsumexp has no sharding rule

    fake_world(4)
    sm = shardc.compile(Scanner(), shardc.Mesh(x=2, data=2), (torch.randn(8, 8),))
    text = shardc.explain(sm)
    assert "aten.logcumsumexp" in text and "no sharding rule, ran replicated" in text
    assert "test_compile.py" in text  # the source line of the op
    assert any(r.op.startswith("aten.logcumsumexp") for r in shardc.comm_report(sm).rows)
    assert math.isfinite(float(shardc.comm_report(sm).total_bytes()))


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_weight_gathers_are_prefetched_in_topological_order(fake_world, depth: int) -> None:
    fake_world(8)
    sm = shardc.compile(MLPChain(dim=16, layers=6), shardc.Mesh(x=2, y=2, z=2), _mlp_inputs(),
                        prefetch_depth=depth)
    nodes = list(sm.graph_module.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if n.target is C.all_gather_start]
    gemms = [n for n in nodes if n.target is torch.ops.aten.linear.default]
    assert len(starts) == len(gemms) == 6
    # gathers keep the order of the GEMMs that use them
    assert [n.args[0].name for n in starts] == [f"p_layers_{i}_weight" for i in range(6)]
    for i in range(6):
        # the gather of layer i is issued before GEMM i - depth runs (d layers ahead)
        if depth and i >= depth:
            assert pos[starts[i]] < pos[gemms[i - depth]]
        if depth == 0 and i > 0:
            assert pos[starts[i]] > pos[gemms[i - 1]]
        assert pos[starts[i]] < pos[gemms[i]]
    off = shardc.compile(MLPChain(dim=16, layers=6), shardc.Mesh(x=2, y=2, z=2), _mlp_inputs(),
                         overlap=False, prefetch_depth=depth)
    assert [n.name for n in off.graph_module.graph.nodes] == [
        n.name for n in shardc.compile(MLPChain(dim=16, layers=6), shardc.Mesh(x=2, y=2, z=2),
                                       _mlp_inputs(), prefetch_depth=0).graph_module.graph.nodes]


def test_gemm_modes_need_the_whole_step_program(fake_world) -> None:
    """The forms are a pass of the step program: where it does not run, refused."""
    fake_world(1)
    for kw in ({"step_graph": False}, {"activation_checkpoint": "blocks"}):
        with pytest.raises(ValueError, match="gemm_modes='auto' rewrites the GEMMs of the step program"):
            shardc.compile(MLPChain(), shardc.Mesh(), _mlp_inputs(), gemm_modes="auto", **kw)
    shardc.compile(MLPChain(), shardc.Mesh(), _mlp_inputs(), gemm_modes="auto")
    with pytest.raises(ValueError, match="gemm_modes='XX' is not one of"):
        shardc.compile(MLPChain(), shardc.Mesh(), _mlp_inputs(), gemm_modes="XX")


class _Drop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc(x), 0.1, True) * 2.0


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_dropout_draws_what_one_device_draws(fake_world, device: str) -> None:
    # Each device type has its own dropout kernel (CUDA's fused Philox kernel consumes the
    # generator unlike CPU's Bernoulli draw): the compiled program must make the same call.
    fake_world(1)
    torch.manual_seed(0)
    model = _Drop().to(device)
    x = torch.randn(8, 16, device=device)
    sm = shardc.compile(copy.deepcopy(model), shardc.Mesh(), (x,))
    torch.manual_seed(5)
    want = model(x)
    torch.manual_seed(5)
    got = sm(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["gpt", "gpt2"])
def test_explain_every_mesh_of_8(fake_world, name: str) -> None:
    # Vocabulary-parallel cross-entropy keeps a P(max) in the layout: explain and the comm
    # report must print it on every mesh (it once raised on every mesh with x or y > 1).
    from models import gpt2

    fake_world(8)
    torch.manual_seed(0)
    model = GPT() if name == "gpt" else gpt2()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
    compiled = 0
    for mesh in shardc.Mesh.all(8):
        try:
            sm = shardc.compile(model, mesh, inputs)
        except shardc.ShardcError as e:  # a mesh the model's dims do not divide: said clearly
            assert "does not evenly divide" in str(e), (mesh, e)
            continue
        compiled += 1
        text = shardc.explain(sm)
        assert "decisions:" in text and "communication per step" in text, mesh
        if mesh.x > 1:
            assert "P(max)@x" in text, mesh
        assert shardc.comm_report(sm).total_bytes() > 0, mesh
    assert compiled >= 19, compiled  # only x8 may cut the heads too finely


def test_input_layouts_refuses_bad_input(fake_world) -> None:
    fake_world(4)
    x = torch.randn(8, 16)
    mesh = shardc.Mesh(x=2, y=2)
    with pytest.raises(shardc.ShardcError, match="not the position of a tensor"):
        shardc.compile(MLPChain(), mesh, (x, x), input_layouts={5: shardc.Layout.of(2, {"x": 0})})
    with pytest.raises(shardc.ShardcError, match="with ndim=2"):
        shardc.compile(MLPChain(), mesh, (x, x), input_layouts={0: shardc.Layout.of(3, {"x": 0})})
    with pytest.raises(shardc.ShardcError, match="does not evenly divide"):
        shardc.compile(MLPChain(), mesh, (x[:6], x[:6]),
                       input_layouts={0: shardc.Layout.of(2, {"x": 0, "y": 0})})
    # a layout that fits: the rank's input is its piece, and the program says so
    sm = shardc.compile(MLPChain(), mesh, (x, x), input_layouts={0: shardc.Layout.of(2, {"y": 1})})
    ph = next(n for n in sm.graph_module.graph.nodes if n.op == "placeholder" and n.name == "x")
    assert str(ph.meta["shardc_placement"]) == "[S(1)@y]"


def test_sliced_inputs_are_accepted(fake_world) -> None:
    """A language model's inputs and targets are slices of one (B, T+1) batch:
    non-contiguous tensors. export used to bake their strides into views the program
    could not make (a TraceError blaming control flow at compile, a view error at run
    time). Both compile and run now take them and train as the model does on one
    device (a mesh of one runs every op; the fake group would not move data)."""
    fake_world(1)
    torch.manual_seed(0)
    model = GPT(layers=2)
    data = torch.randint(0, 64, (8, 17))
    x, y = data[:, :-1], data[:, 1:]
    assert not x.is_contiguous() and not y.is_contiguous()
    sm = shardc.compile(copy.deepcopy(model), shardc.Mesh(), (x, y))
    loss = sm(x, y)
    loss.backward()
    # this GPT's own `.view` refuses the slices on one device: its reference runs on
    # contiguous copies (the same values)
    ref = model(x.contiguous(), y.contiguous())
    ref.backward()
    # the same ops on the same values in one process: identical
    assert loss.item() == ref.item()
    grads = dict(sm.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(grads[name].grad, p.grad), name
    # on a fake world of 4 the compile (trace, layouts, the step program's offline
    # trace) takes them too
    fake_world(4)
    assert shardc.comm_report(shardc.compile(GPT(layers=2), shardc.Mesh(x=2, data=2), (x, y))).total_bytes() > 0


class _Tagger(nn.Module):
    """A token classifier whose loss reads its labels: transformers' ``labels=input_ids``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 10)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lin(self.emb(ids) * self.scale)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


class _Regress(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.lin(x), t)


def _same_twice() -> tuple:
    ids = torch.randint(0, 10, (4, 6))
    return _Tagger, (ids, ids)


def _view_and_base() -> tuple:
    x = torch.randn(4, 8)
    return _Regress, (x, x.view(4, 8))


def _two_views_of_one_storage() -> tuple:
    both = torch.randn(2, 4, 8)
    return _Regress, (both[0], both[1])


def _overlapping_views() -> tuple:
    data = torch.randn(4, 9)
    return _Regress, (data[:, :8], data[:, 1:])


@pytest.mark.parametrize("make", [_same_twice, _view_and_base, _two_views_of_one_storage,
                                  _overlapping_views], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("spec", ["x1y1z1d1", "x2y1z1d2"])
def test_aliased_example_inputs_are_separate_inputs(fake_world, make, spec: str) -> None:
    """Example inputs that share storage (the same tensor twice, a view and its base, two
    views of one storage) are separate inputs of the program. export identified them by
    their tensor: the program read the first where the second was passed, so every later
    call computed (ids, ids)'s loss whatever the labels (-100 labels raised IndexError)."""
    model_cls, example = make()
    mesh = shardc.Mesh.parse(spec)
    fake_world(mesh.world_size)
    torch.manual_seed(0)
    model = model_cls()
    sm = shardc.compile(copy.deepcopy(model), mesh, example)
    names = [n.name for n in sm.graph_module.graph.nodes if n.op == "placeholder"
             and n.meta.get(KIND) == "input"]
    assert len(names) == 2, names
    reads = {n.name: len(n.users) for n in sm.graph_module.graph.nodes if n.name in names}
    assert all(reads.values()), f"an input the program never reads: {reads}"
    if mesh.world_size > 1:
        return  # the fake group moves no data: numbers on the mesh of one
    # later calls with inputs that differ from each other compute what one device does
    g = torch.Generator().manual_seed(3)
    if model_cls is _Tagger:
        ids = torch.randint(0, 10, (4, 6), generator=g)
        labels = torch.randint(0, 10, (4, 6), generator=g)
        labels[:, :2] = -100
        calls = [(ids, labels), (ids, ids)]
    else:
        calls = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))]
    ref64 = copy.deepcopy(model).double()
    for args in calls:
        sm.zero_grad()
        ref64.zero_grad()
        loss = sm(*args)
        loss.backward()
        want = ref64(*(a.double() if a.is_floating_point() else a for a in args))
        want.backward()
        # fp32 against float64 over a few dozen terms: ~1e-7 relative; the aliased input
        # read in the wrong place was 6e-2 off (and -100 labels raised)
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
        got = dict(sm.named_parameters())
        for name, p in ref64.named_parameters():
            torch.testing.assert_close(got[name].grad.double(), p.grad, rtol=1e-5, atol=1e-6,
                                       msg=name)


@pytest.mark.parametrize("which", ["emb.weight", "scale"])
def test_an_example_input_that_is_model_state_is_refused(fake_world, which: str) -> None:
    """An input that is one of the model's parameters or buffers (or a view of one) would
    be read apart from the compiled model's own shards: refused, naming it and the fix."""
    fake_world(1)
    model = _Tagger()
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    t = state[which]
    ids = torch.randint(0, 10, (4, 6))
    bad = t[:4].detach() if t.dim() == 2 else t

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, ids: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
            return self.inner(ids, ids) + extra.sum()

    kind = "parameter" if which == "emb.weight" else "buffer"
    with pytest.raises(shardc.ShardcError, match=rf"example input 1 is the model's {kind} "
                                                 rf"'inner\.{re.escape(which)}' \(or a view of it\)"
                                                 r".*t\.detach\(\)\.clone\(\)"):
        shardc.compile(Reads(), shardc.Mesh(), (ids, bad))
    # a copy is data like any other
    shardc.compile(Reads(), shardc.Mesh(), (ids, bad.detach().clone()))


def test_step_program_builds_through_a_zero_derivative(fake_world) -> None:
    """``sgn``'s derivative reaches a weight gather's backward as an efficient zero
    tensor, whose ops trace to device "meta" under make_fx: the step program could
    not be built and the model silently lost the step passes (autograd's backward ran)."""
    fake_world(2)

    class SignOfMax(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 4))
            self.v = torch.nn.Parameter(torch.randn(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * torch.sgn(self.w.amax(0)) * self.v).sum()

    mesh = shardc.Mesh(z=2)
    x = torch.randn(4, 4)
    sm = shardc.compile(SignOfMax(), mesh, example_inputs=(x,))
    with warnings.catch_warnings():
        # the fallback is a warning: make it fail here
        warnings.filterwarnings("error", message="shardc: the step program")
        sm(shardc.shard_batch(x, mesh)).backward()
    assert sm._joint_failed is None
    assert sm._joint, "no step program was built"


def test_a_parameter_replaced_after_compile_is_read_and_trained(fake_world) -> None:
    """``load_state_dict(..., assign=True)`` and ``module.weight = nn.Parameter(...)`` put
    new Parameter objects into the modules after compile: the next step's program reads
    them (not the ones bound at compile) and their ``.grad`` gets the gradient."""
    fake_world(1)
    torch.manual_seed(0)
    model = MLPChain()
    x, y = _mlp_inputs()
    sm = shardc.compile(copy.deepcopy(model), shardc.Mesh(), (x, y))
    sm(x, y).backward()
    new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    sm.load_state_dict(new, assign=True)
    sm.get_submodule("layers.2").weight = nn.Parameter(torch.randn(16, 16))
    new["layers.2.weight"] = sm.get_parameter("layers.2.weight").detach().clone()
    model.load_state_dict(new)
    loss = sm(x, y)
    loss.backward()
    want = model(x, y)
    want.backward()
    # one rank, the same ops in the same order: the same numbers
    assert torch.equal(loss.detach(), want.detach())
    for name, p in sm.named_parameters():
        assert p.grad is not None, name
        assert torch.equal(p.grad, model.get_parameter(name).grad), name


class _Normed(nn.Module):
    """BatchNorm's running statistics and a plain persistent buffer, a non-persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 1)
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.out(self.bn(self.lin(x))) * self.scale).pow(2).mean()


def test_state_dict_keeps_the_buffers_and_load_state_dict_restores_them(fake_world) -> None:
    """torch's own ``sm.state_dict()`` and ``sm.load_state_dict()`` carry the model's
    persistent buffers: they used to hold the parameters alone, so a checkpoint written with
    torch.save(sm.state_dict()) lost BatchNorm's running statistics and a resume restarted
    them without a word."""
    fake_world(1)
    torch.manual_seed(0)
    model = _Normed()
    x = torch.randn(16, 4)
    sm = shardc.compile(copy.deepcopy(model), shardc.Mesh(), (x,))
    for _ in range(3):
        sm(x).backward()
    saved = sm.state_dict()
    assert list(saved) and set(saved) == set(model.state_dict())  # names as the model's
    assert int(saved["bn.num_batches_tracked"]) == 3
    assert not torch.equal(saved["bn.running_mean"], model.bn.running_mean)  # it moved

    again = shardc.compile(copy.deepcopy(model), shardc.Mesh(), (x,))
    again.load_state_dict(saved)
    for key, t in again.full_state_dict().items():
        assert torch.equal(t, saved[key]), key
    # a dict of the parameters alone is missing the buffers, as torch's strict load says
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "scale", "bn.running_mean"'):
        again.load_state_dict({k: v for k, v in saved.items() if "." in k and "running" not in k
                               and "num_batches" not in k})
    got = again.load_state_dict({k: v for k, v in saved.items() if k != "scale"}, strict=False)
    assert got.missing_keys == ["scale"] and got.unexpected_keys == []
    with pytest.raises(RuntimeError, match=r"size mismatch for bn.running_var"):
        again.load_state_dict({**saved, "bn.running_var": torch.ones(4)})


def test_shard_batch_takes_a_tuple_list_or_dict_of_tensors(fake_world) -> None:
    """A batch as users hold it, ``(ids, labels)`` or a tokenizer's dict: each tensor is
    sliced as alone, anything else passes (it raised AttributeError on ``.shape``)."""
    from collections import UserDict

    fake_world(8, rank=5)
    mesh = shardc.Mesh.parse("x1y1z2d2c2")
    ids, labels = torch.arange(4 * 6).view(4, 6), torch.arange(4 * 6).view(4, 6) + 100
    one = shardc.shard_batch(ids, mesh)
    assert one.shape == (1, 3)  # rank 5: data 1 x z 0 -> row 2, context 1 -> its half
    got = shardc.shard_batch((ids, [labels, 7]), "x1y1z2d2c2")
    assert torch.equal(got[0], one) and torch.equal(got[1][0], shardc.shard_batch(labels, mesh))
    assert got[1][1] == 7
    enc = shardc.shard_batch(UserDict(input_ids=ids, labels=labels), mesh)
    assert set(enc) == {"input_ids", "labels"} and torch.equal(enc["input_ids"], one)
    with pytest.raises(shardc.ShardcError, match="holds no tensor"):
        shardc.shard_batch(["not", "tensors"], mesh)


def test_the_buffers_are_the_compiled_models_own_and_reachable(fake_world) -> None:
    """Buffers are copied at compile, as parameters are, and registered under the model's
    names: named_buffers() lists them, torch.distributed.checkpoint's state-dict helpers
    resolve their keys (they raised AttributeError on 'bn.running_mean'), and neither a
    later write into the original model nor load_full_state_dict reaches across."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    fake_world(1)
    torch.manual_seed(0)
    model = _Normed()
    x = torch.randn(16, 4)
    sm = shardc.compile(model, shardc.Mesh(), (x,))
    assert {n: t.tolist() for n, t in sm.named_buffers()} == \
        {n: t.tolist() for n, t in model.named_buffers()}  # the non-persistent one too
    before = sm(x).item()
    with torch.no_grad():
        model.scale.fill_(3.0)  # the user's model, after compile
    assert sm(x).item() == before  # eval-free BatchNorm: the batch's statistics, same x
    sd = get_model_state_dict(sm)
    assert set(sd) == set(model.state_dict())
    assert int(sd["bn.num_batches_tracked"]) == 2
    sd["bn.running_mean"] = torch.full((8,), 7.0)
    set_model_state_dict(sm, sd)
    assert torch.equal(sm.bn.running_mean, torch.full((8,), 7.0))
    sm.load_full_state_dict({**sm.full_state_dict(), "bn.running_var": torch.full((8,), 5.0)})
    assert torch.equal(dict(sm.named_buffers())["bn.running_var"], torch.full((8,), 5.0))
    assert float(model.scale) == 3.0 and not torch.equal(model.bn.running_var, torch.full((8,), 5.0))
    assert int(model.bn.num_batches_tracked) == 0  # compile and the steps never wrote it


def test_a_compiled_model_refuses_a_change_of_device_or_dtype(fake_world) -> None:
    """.half(), .double(), .to(dtype or device) after compile: refused before anything
    changes (a cast used to reach the parameters and fail inside the program with FX's
    dtype error); a call that changes nothing passes."""
    fake_world(1)
    torch.manual_seed(0)
    x = torch.randn(16, 4)
    sm = shardc.compile(_Normed(), shardc.Mesh(), (x,))
    for change in (lambda: sm.half(), lambda: sm.double(), lambda: sm.bfloat16(),
                   lambda: sm.to(torch.float64), lambda: sm.to("meta")):
        with pytest.raises(shardc.ShardcError, match="cannot change its device or dtype .*'lin.weight' "
                           "would go from torch.float32 on cpu to .*Move or cast the model before"):
            change()
    assert sm.float() is sm and sm.to("cpu") is sm and sm.cpu() is sm
    assert {p.dtype for p in sm.parameters()} == {torch.float32}
    assert {b.dtype for _, b in sm.named_buffers() if b.is_floating_point()} == {torch.float32}
    assert math.isfinite(sm(x).item())  # and it still runs


def test_a_forward_that_draws_from_numpy_is_warned_and_leaves_the_stream_alone(fake_world) -> None:
    """export freezes numpy's draws into constants: the compiled program would reuse one
    mask every step. compile says so, and leaves numpy's and Python's generators where
    they were (it consumes no user random stream)."""
    import random

    import numpy as np

    class NumpyMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            keep = torch.tensor(np.random.rand(*x.shape) > 0.1) & torch.tensor(random.random() < 2)
            return F.mse_loss(self.fc(x * keep), t)

    fake_world(2)
    np.random.seed(3)
    random.seed(3)
    want_np, want_py = np.random.rand(), random.random()
    np.random.seed(3)
    random.seed(3)
    with pytest.warns(shardc.ShardcWarning, match=r"NumpyMask's forward draws random numbers from "
                                                   r"Python's random and numpy\.random while it is "
                                                   r"traced.*reuses the trace's numbers"):
        shardc.compile(NumpyMask(), shardc.Mesh(data=2), _mlp_inputs())
    assert np.random.rand() == want_np and random.random() == want_py
    # a model that draws nothing on the host compiles without the warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardc.ShardcWarning)
        shardc.compile(MLPChain(), shardc.Mesh(data=2), _mlp_inputs())


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 3, 8).transpose(0, 1),                   # a permuted view
    lambda: torch.randn(6, 8)[1:, 2:],                             # an offset into storage
    lambda: torch.randn(3, 1, 8).expand(3, 4, 8),                  # an expanded (overlapping) view
])
def test_as_strided_on_traced_storage_reads_what_the_trace_read(make) -> None:
    """The runtime's as_strided on a re-laid-out copy (contiguous, as a gather makes it)
    returns what torch's as_strided returned on the tensor the trace saw."""
    from shardc.runtime.ops import as_strided_on_traced_storage

    x = make()
    size, stride = [2, 2, 3], [x.stride(0), 1, x.stride(1) or 1]
    want = x.as_strided(size, stride)
    got = as_strided_on_traced_storage(x.contiguous(), list(x.shape), list(x.stride()),
                                       x.storage_offset(), size, stride, None)
    assert torch.equal(got, want)


class _Mse(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.model(x), target)


@pytest.mark.parametrize("spec", ["x1y1z1d8", "x2y1z1d4", "x1y2z1d4", "x2y2z2d1"])
def test_a_bias_is_added_by_its_gemm_where_the_sum_is_whole(fake_world, spec: str) -> None:
    """A linear whose output is a whole sum takes its bias in the GEMM (one device's addmm);
    one whose output is a partial sum over an axis (k cut) adds it after the reduction,
    as its own op, since the bias must be added once."""
    fake_world(8)
    mesh = shardc.Mesh.parse(spec)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    sm = shardc.compile(_Mse(model), mesh, _mlp_inputs())
    nodes = list(sm.graph_module.graph.nodes)
    for i in (0, 2):
        gemm = [n for n in nodes if n.target is torch.ops.aten.linear.default
                and n.meta[SOURCE].module == f"model.{i}"]
        assert len(gemm) == 1, gemm
        w = sm.param_layouts[f"model.{i}.weight"]
        k_cut = any(w.shard_dim(a) == 1 for a in ("x", "y") if mesh.size(a) > 1)
        assert (len(gemm[0].args) == 3) == (not k_cut), (i, gemm[0].args)
        adds = [n for n in nodes if n.target is torch.ops.aten.add.Tensor
                and n.meta[SOURCE].module == f"model.{i}"]
        assert len(adds) == int(k_cut), adds
