"""Bad input, on real gloo processes (4 ranks, mesh x2d2, spawned once): every case
runs on every rank and must end with the expected error and message there (or, for the
cases that are meant to work, with the checks that they do), never a hang; after each
case an all-reduce over every rank proves the process group still works.

Two kinds of case:
- every rank makes the same mistake (a wrong dtype, a batch that does not divide, ...):
  a local check refuses it before anything is communicated;
- the ranks disagree (one rank built a wider layer, an extra layer, another seed, passed
  another mesh or option, or failed to compile at all): ``shardc.compile`` refuses on
  every rank, naming the first difference or the rank that failed.

The process group's timeout is 30 s, so a case that would hang fails as a
CollectiveError instead; the whole run has a deadline. Set SHARDC_BAD_INPUTS_OUT=path
to write every case's message as JSON (the README's table comes from it).
"""
from __future__ import annotations

import copy
import json
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from bounded_ranks import run_bounded

import shardc

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORLD = 4
MESH = shardc.Mesh(x=2, data=2)


class MLP(nn.Module):
    def __init__(self, hidden: int = 16, extra: bool = False, unused: bool = False,
                 act: str = "relu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.fc2 = nn.Linear(hidden, 4)
        self.extra = nn.Linear(4, 4) if extra else None
        self.unused = nn.Linear(3, 3) if unused else None
        self.act = act

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = F.relu(h) if self.act == "relu" else F.gelu(h)
        h = self.fc2(h)
        if self.extra is not None:
            h = self.extra(h)
        return F.cross_entropy(h, t)


class NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * x).mean()


class WritesItsInputInPlace(nn.Module):
    """Every op has a rule, so the trace keeps the write as an in-place op (no
    USER_INPUT_MUTATION): the rank's program would write into its own piece."""

    def __init__(self, through_view: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.through_view = through_view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.through_view:
            x.narrow(1, 0, 2).mul_(0.5)
        else:
            x.mul_(2.0)
        return self.fc(x).mean()


class WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        # an op without a rule: the trace is decomposed, which makes the write an output
        return torch.logcumsumexp(self.fc(x), 0).mean()


class NumPyScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(x.detach().numpy().std())  # Python on the data: torch.export cannot trace it
        return (self.fc(x) * scale).sum()


@dataclass
class Env:
    rank: int
    model: MLP            # the model every rank compiled (seed 0)
    sm: shardc.ShardedModule
    x: torch.Tensor       # the global batch
    t: torch.Tensor
    lx: torch.Tensor      # this rank's slice
    lt: torch.Tensor


@dataclass
class Case:
    name: str
    run: Callable[[Env], Any]
    raises: type[BaseException] | None   # None: the case is meant to work
    match: str = ""                        # regex the message must contain


CASES: list[Case] = []


def case(name: str, raises: type[BaseException] | None, match: str = "") -> Callable:
    def add(fn: Callable[[Env], Any]) -> Callable[[Env], Any]:
        CASES.append(Case(name, fn, raises, match))
        return fn
    return add


def _mlp(seed: int = 0, **kw: Any) -> MLP:
    torch.manual_seed(seed)
    return MLP(**kw)


# ------------------------------------------------------------------- at run time
@case("input of the wrong dtype", shardc.ShardcError,
      r"input 0 \('x'\) has dtype float64, but the program was traced for float32\. Cast it")
def _(e: Env) -> None:
    e.sm(e.lx.double(), e.lt)


@case("integer input of another width (int32 targets)", shardc.ShardcError,
      r"input 1 \('t'\) has dtype int32, but the program was traced for int64")
def _(e: Env) -> None:
    e.sm(e.lx, e.lt.int())


@case("an input that requires grad where the example did not", shardc.ShardcError,
      r"input 0 \('x'\) requires grad, but the example input there did not.*requires_grad_\(\)")
def _(e: Env) -> None:
    # traced without x's gradient: a backward would leave x.grad None, silently
    e.sm(e.lx.clone().requires_grad_(True), e.lt)


@case("an input that requires grad, under no_grad (no gradient is wanted)", None)
def _(e: Env) -> str:
    with torch.no_grad():
        loss = e.sm(e.lx.clone().requires_grad_(True), e.lt)
    want = copy.deepcopy(e.model).double()(e.x.double(), e.t)
    # fp32 against float64 over sums of 8-16 terms: ~1e-7 relative
    torch.testing.assert_close(shardc.global_mean(loss, MESH).double(), want, rtol=1e-5, atol=1e-6)
    return "runs: without gradients nothing is lost"


@case("an input that requires grad, compiled from an example that does", None)
def _(e: Env) -> str:
    sm = shardc.compile(copy.deepcopy(e.model), MESH, (e.x.clone().requires_grad_(True), e.t))
    x = e.lx.clone().requires_grad_(True)
    sm(x, e.lt).backward()
    ref_x = e.x.double().requires_grad_(True)
    copy.deepcopy(e.model).double()(ref_x, e.t).backward()
    # the compiled model trains like one device on the global batch, its input too: this
    # rank's rows' gradient is their slice of one device's. fp32 against float64 over
    # sums of 8-16 terms: ~1e-7 relative
    want = shardc.shard_batch(ref_x.grad, MESH)
    torch.testing.assert_close(x.grad.double(), want, rtol=1e-5, atol=1e-7)
    return "x.grad is this rank's slice of one device's gradient"


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(F.relu(self.bn(self.fc1(x)))), t)


@case("torch.save(sm.state_dict()) and sm.load_state_dict() keep BatchNorm's statistics", None)
def _(e: Env) -> str:
    torch.manual_seed(0)
    model = Normed()
    sm = shardc.compile(copy.deepcopy(model), MESH, (e.x, e.t))
    for _ in range(2):
        sm(e.lx, e.lt).backward()
    saved = sm.state_dict()  # this rank's pieces of the parameters, the buffers whole
    assert int(saved["bn.num_batches_tracked"]) == 2
    again = shardc.compile(copy.deepcopy(model), MESH, (e.x, e.t))
    again.load_state_dict(saved)
    want, got = sm.full_state_dict(), again.full_state_dict()
    for key in model.state_dict():
        assert torch.equal(got[key], want[key]), key
    return "the round trip restores every parameter and buffer"


@case("the global batch instead of this rank's slice", shardc.ShardcError,
      r"input 0 \('x'\) has shape \[8, 8\], but this rank's piece of the example input \[8, 8\] "
      r"laid out as .* is \[4, 8\].*shard_batch")
def _(e: Env) -> None:
    e.sm(e.x, e.lt)


@case("a list where a tensor was traced", shardc.ShardcError,
      r"input 0 \('x'\) is a list, but the program was traced with a tensor of shape \[8, 8\]")
def _(e: Env) -> None:
    e.sm(e.lx.tolist(), e.lt)


@case("too few inputs", shardc.ShardcError, r"expected 2 inputs \(x, t\), as in example_inputs, got 1")
def _(e: Env) -> None:
    e.sm(e.lx)


@case("input on the wrong device", shardc.ShardcError,
      r"input 0 \('x'\) is on device meta, but the program runs on cpu.*Move it")
def _(e: Env) -> None:
    e.sm(e.lx.to("meta"), e.lt)


@case("an empty batch at run time", shardc.ShardcError,
      r"input 0 \('x'\) has shape \[0, 8\] \(an empty batch\)")
def _(e: Env) -> None:
    e.sm(e.lx[:0], e.lt[:0])


@case("module switched to eval after compiling in training mode", shardc.ShardcError,
      r"traced in training mode .* now in eval mode\. Compile a second program")
def _(e: Env) -> None:
    e.sm.eval()
    try:
        e.sm(e.lx, e.lt)
    finally:
        e.sm.train()


@case("backward twice", RuntimeError, r"Trying to backward through the graph a second time.*retain_graph=True")
def _(e: Env) -> None:
    loss = e.sm(e.lx, e.lt)
    loss.backward()
    e.sm.zero_grad()
    loss.backward()


@case("optimizer over the original model's parameters", shardc.ShardcError,
      r"SGD\.step\(\) over the parameters of the model passed to shardc\.compile \('fc1\.weight'.*"
      r"none of which has a gradient.*sm\.parameters\(\)")
def _(e: Env) -> None:
    opt = torch.optim.SGD(e.model.parameters(), lr=0.1)
    e.sm(e.lx, e.lt).backward()
    e.sm.zero_grad()
    opt.step()


@case("shard_batch of a batch data x z does not divide", shardc.ShardcError,
      r"a batch of 7 \(dim 0\) cannot be split evenly over data x z = 2 x 1 = 2 ranks")
def _(e: Env) -> None:
    shardc.shard_batch(e.x[:7], MESH)


@case("load_full_state_dict with a misspelt key", shardc.ShardcError,
      r"missing keys \['fc1\.weight'\]; unexpected keys \['fc1\.wieght'\]")
def _(e: Env) -> None:
    sd = e.sm.full_state_dict()
    sd["fc1.wieght"] = sd.pop("fc1.weight")
    e.sm.load_full_state_dict(sd)


@case("load_full_state_dict with a wrong shape (nothing loaded)", shardc.ShardcError,
      r"'fc2\.weight' has shape \[4, 8\], the model's is \[4, 16\]")
def _(e: Env) -> None:
    before = {n: p.detach().clone() for n, p in e.sm.named_parameters()}
    sd = e.sm.full_state_dict()
    sd["fc1.weight"] = sd["fc1.weight"] + 1.0
    sd["fc2.weight"] = sd["fc2.weight"][:, :8]
    try:
        e.sm.load_full_state_dict(sd)
    finally:
        # refused before any tensor was written: fc1 did not take its new value
        for n, p in e.sm.named_parameters():
            assert torch.equal(p.detach(), before[n]), n


# ----------------------------------------------------------------- at compile
@case("example_inputs missing", shardc.ShardcError, r"example_inputs is required")
def _(e: Env) -> None:
    shardc.compile(_mlp(), MESH)


@case("example_inputs nested", shardc.ShardcError,
      r"example_inputs has 1 element\(s\), which do not fit MLP\.forward\(x.*t.*\).*one example per "
      r"positional argument")
def _(e: Env) -> None:
    shardc.compile(_mlp(), MESH, [(e.x, e.t)])


@case("example_inputs a bare tensor", shardc.ShardcError, r"Wrap a single input: example_inputs=\(x,\)")
def _(e: Env) -> None:
    shardc.compile(NoParams(), MESH, e.x)


@case("an empty example batch", shardc.ShardcError, r"example input 0 is an empty batch \(0 rows")
def _(e: Env) -> None:
    shardc.compile(_mlp(), MESH, (e.x[:0], e.t[:0]))


@case("example batch data x z does not divide", shardc.ShardcError,
      r"example input 0 has batch size 7 \(dim 0\), which data x z = 2 x 1 = 2 does not divide")
def _(e: Env) -> None:
    shardc.compile(_mlp(), MESH, (e.x[:7], e.t[:7]))


@case("mesh world size != torch world size", shardc.ShardcError,
      r"Mesh\(x=2, y=1, z=1, data=1\) has 2 ranks .* world size is 4.*Mesh\.all\(4\)")
def _(e: Env) -> None:
    shardc.compile(_mlp(), "x2y1z1d1", (e.x, e.t))


@case("mesh spec typo", ValueError, r"'x2y1z2' is not a mesh spec; write the four sizes")
def _(e: Env) -> None:
    shardc.compile(_mlp(), "x2y1z2", (e.x, e.t))


@case("mesh of the wrong type", TypeError, r"mesh must be a shardc\.Mesh, a spec like 'x2y1z2d2' or 'auto', got int")
def _(e: Env) -> None:
    shardc.compile(_mlp(), 4, (e.x, e.t))  # type: ignore[arg-type]


@case("mesh='auto' without a machine", shardc.ShardcError, r"mesh='auto' needs machine=")
def _(e: Env) -> None:
    shardc.compile(_mlp(), "auto", (e.x, e.t))


@case("a model that is not a module", TypeError, r"model must be a torch\.nn\.Module, got function")
def _(e: Env) -> None:
    shardc.compile(lambda x: x, MESH, (e.x,))  # type: ignore[arg-type]


@case("an untraceable model", shardc.TraceError,
      r"could not trace NumPyScale at .*test_bad_inputs_gloo\.py:\d+")
def _(e: Env) -> None:
    shardc.compile(NumPyScale(), MESH, (e.x,))


@case("forward writes into its input", shardc.ShardcError,
      r"mutates state during forward \(USER_INPUT_MUTATION of 'x'\); shardc writes back only buffers")
def _(e: Env) -> None:
    shardc.compile(WritesItsInput(), MESH, (e.x.clone(),))


@case("forward writes into its input in place", shardc.ShardcError,
      r"writes into its input 'x' during forward \(aten\.mul_\.Tensor .*test_bad_inputs_gloo\.py")
def _(e: Env) -> None:
    shardc.compile(WritesItsInputInPlace(through_view=False), MESH, (e.x.clone(),))


@case("forward writes into a view of its input", shardc.ShardcError,
      r"writes into its input 'x' during forward \(aten\.mul_\.Tensor")
def _(e: Env) -> None:
    shardc.compile(WritesItsInputInPlace(through_view=True), MESH, (e.x.clone(),))


@case("option of the wrong type", shardc.ShardcError, r"option overlap='no' must be a bool \(True or False\), got str")
def _(e: Env) -> None:
    shardc.compile(_mlp(), MESH, (e.x, e.t), overlap="no")  # type: ignore[arg-type]


@case("option out of range", ValueError, r"prefetch_depth must be >= 0, got -1")
def _(e: Env) -> None:
    shardc.compile(_mlp(), MESH, (e.x, e.t), prefetch_depth=-1)


@case("option value not among the choices", ValueError, r"gemm_modes='XX' is not one of")
def _(e: Env) -> None:
    shardc.compile(_mlp(), MESH, (e.x, e.t), gemm_modes="XX")


@case("misspelt option", TypeError, r"no option named 'prefetch_dept' \(did you mean 'prefetch_depth'\?\)")
def _(e: Env) -> None:
    shardc.compile(_mlp(), MESH, (e.x, e.t), prefetch_dept=2)  # type: ignore[call-arg]


@case("input_layouts key out of range", shardc.ShardcError,
      r"input_layouts key 5 is not the position of a tensor in example_inputs \(0\.\.1\)")
def _(e: Env) -> None:
    shardc.compile(_mlp(), MESH, (e.x, e.t), input_layouts={5: shardc.Layout.of(2, {"x": 0})})


@case("input_layouts that does not divide", shardc.ShardcError,
      r"input_layouts\[0\] = .* does not evenly divide the input's shape \[7, 8\]")
def _(e: Env) -> None:
    shardc.compile(NoParams(), MESH, (e.x[:7],), input_layouts={0: shardc.Layout.of(2, {"x": 0})})


@case("input_layouts naming an unknown axis", ValueError, r"Layout\.of: unknown mesh axes \['w'\]")
def _(e: Env) -> None:
    shardc.compile(NoParams(), MESH, (e.x,), input_layouts={0: shardc.Layout.of(2, {"w": 0})})


# --------------------------------------------------------- ranks that disagree
@case("one rank built a wider layer", shardc.ShardcError,
      r"the ranks did not compile the same program: rank 3 compiled parameter 'fc1\.weight' with "
      r"shape \[32, 8\], rank 0 with shape \[16, 8\]\. Build the same model")
def _(e: Env) -> None:
    shardc.compile(_mlp(hidden=32 if e.rank == 3 else 16), MESH, (e.x, e.t))


@case("one rank built an extra layer", shardc.ShardcError,
      r"rank 1 compiled parameter 'extra\.weight' \(shape \[4, 4\], dtype float32, requires_grad "
      r"True\), which rank 0 does not have")
def _(e: Env) -> None:
    shardc.compile(_mlp(extra=e.rank == 1), MESH, (e.x, e.t))


@case("one rank seeded differently", shardc.ShardcError,
      r"rank 2 compiled parameter 'fc1\.weight' with other values than rank 0 .*torch\.manual_seed")
def _(e: Env) -> None:
    shardc.compile(_mlp(seed=1 if e.rank == 2 else 0), MESH, (e.x, e.t))


@case("one rank passed another mesh", shardc.ShardcError,
      r"rank 1 has mesh = x1y1z1d4, rank 0 has x2y1z1d2\. Pass the same mesh")
def _(e: Env) -> None:
    shardc.compile(_mlp(), "x1y1z1d4" if e.rank == 1 else MESH, (e.x, e.t))


@case("one rank passed another option", shardc.ShardcError,
      r"rank 3 has option overlap = False, rank 0 has True\. Pass the same compile options")
def _(e: Env) -> None:
    shardc.compile(_mlp(), MESH, (e.x, e.t), overlap=e.rank != 3)


@case("one rank passed another example shape", shardc.ShardcError,
      r"rank 2 compiled example input 0 with input shape \[16, 8\], rank 0 with input shape \[8, 8\]")
def _(e: Env) -> None:
    x, t = (torch.randn(16, 8), torch.randint(0, 4, (16,))) if e.rank == 2 else (e.x, e.t)
    shardc.compile(_mlp(), MESH, (x, t))


@case("forward takes another path on one rank", shardc.ShardcError,
      r"rank 1 has traced op #\d+ = call_function aten\.gelu\.default.*, rank 0 has call_function "
      r"aten\.relu\.default.*forward took a different path on this rank")
def _(e: Env) -> None:
    shardc.compile(_mlp(act="gelu" if e.rank == 1 else "relu"), MESH, (e.x, e.t))


@case("one rank alone fails to compile", shardc.ShardcError,
      # rank 2 raises its own error, the others name rank 2 and quote it
      r"^(shardc\.compile failed on rank 2, so no rank can go on\. Rank 2's error: ShardcError: )?"
      r"shardc\.compile: Mesh\(x=2, y=1, z=1, data=1\) has 2 ranks .* world size is 4")
def _(e: Env) -> None:
    shardc.compile(_mlp(), "x2y1z1d1" if e.rank == 2 else MESH, (e.x, e.t))


# --------------------------------------------------------- meant to work
@case("a frozen parameter (requires_grad=False)", None)
def _(e: Env) -> str:
    model = _mlp()
    model.fc1.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    sm = shardc.compile(model, MESH, (e.x, e.t))
    opt = torch.optim.SGD(sm.parameters(), lr=0.5)
    sm(e.lx, e.lt).backward()
    assert sm.get_parameter("fc1.weight").grad is None
    opt.step()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref(e.x, e.t).backward()
    opt_ref.step()
    got = sm.full_state_dict()
    assert torch.equal(got["fc1.weight"], model.fc1.weight)  # untouched, bit for bit
    assert not torch.equal(got["fc2.weight"], model.fc2.weight)  # the others trained
    # the same step as one device, up to the order fp32 sums are taken in (shards, ring)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, msg=k)
    return "trains the other parameters; the frozen one has no gradient and stays bit-identical"


@case("unused parameters", None)
def _(e: Env) -> str:
    model = _mlp(unused=True)
    sm = shardc.compile(model, MESH, (e.x, e.t))
    assert sm.unused_parameters == ["unused.weight", "unused.bias"]
    assert "parameters forward never reads" in shardc.explain(sm)
    opt = torch.optim.AdamW(sm.parameters(), lr=0.1)
    sm(e.lx, e.lt).backward()  # no reduction waits for a gradient that never comes
    opt.step()
    got = sm.full_state_dict()
    assert torch.equal(got["unused.weight"], model.unused.weight)
    assert not torch.equal(got["fc1.weight"], model.fc1.weight)
    return ("work: no gradient, the optimizer leaves them unchanged; explain lists them under "
            "\"parameters forward never reads\"")


@case("a model with no parameters: compile and forward", None)
def _(e: Env) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = shardc.compile(NoParams(), MESH, (e.x,))
    text = " ".join(str(w.message) for w in caught)
    assert re.search(r"NoParams has no parameter that requires grad and no example input requires "
                     r"grad: the program runs forward, but backward has nothing", text), text
    # the value one device computes on the global batch (a partial mean, reduced)
    torch.testing.assert_close(sm(shardc.shard_batch(e.x, MESH)), (e.x * e.x).mean())
    return text


@case("a model with no parameters: backward", RuntimeError,
      r"element 0 of tensors does not require grad and does not have a grad_fn")
def _(e: Env) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sm = shardc.compile(NoParams(), MESH, (e.x,))
    sm(shardc.shard_batch(e.x, MESH)).backward()


class TwoHeads(nn.Module):
    """Two heads computed in the order of ``order``: what a model iterating a set of strings
    does (Gemma 3's ``set(config.layer_types)``), whose order follows each process's hash
    seed. The rank decides the order here, so the test does not depend on the seeds."""

    def __init__(self, order: tuple[str, ...]) -> None:
        super().__init__()
        self.order = order
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = {}
        for name in self.order:
            h[name] = F.gelu(getattr(self, name)(x))
        return F.cross_entropy(self.out(h["a"] * h["b"]), t)


@case("the ranks trace the same ops in different orders (a set's order)", None)
def _(e: Env) -> str:
    torch.manual_seed(0)
    model = TwoHeads(("a", "b") if e.rank % 2 == 0 else ("b", "a"))
    sm = shardc.compile(copy.deepcopy(model), MESH, (e.x, e.t))
    loss = sm(e.lx, e.lt)
    loss.backward()
    ref = copy.deepcopy(model).double()
    want = ref(e.x.double(), e.t)
    want.backward()
    # fp32 against float64 over sums of 8-16 terms: ~1e-7 relative
    torch.testing.assert_close(shardc.global_mean(loss, MESH).double(), want, rtol=1e-5, atol=1e-6)
    grads = sm.full_grads()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-5, atol=1e-6, msg=name)
    return "compiles in rank 0's order on every rank and trains like one device"


# ------------------------------------------------------------------ the runner
def _compile_before_init(rank: int, world_size: int) -> dict:
    try:
        shardc.compile(_mlp(), MESH, (torch.randn(8, 8), torch.randint(0, 4, (8,))))
    except shardc.ShardcError as e:
        ok = bool(re.search(r"torch\.distributed is not initialised\. Call "
                            r"torch\.distributed\.init_process_group", str(e)))
        return {"ok": ok, "raised": "ShardcError", "message": str(e)}
    return {"ok": False, "raised": None, "message": "compile ran without a process group"}


def _run_case(c: Case, env: Env) -> dict:
    try:
        note = c.run(env)
    except BaseException as e:  # noqa: BLE001 - judged below
        msg = str(e)
        if c.raises is not None and isinstance(e, c.raises) and re.search(c.match, msg, re.S):
            return {"ok": True, "raised": type(e).__name__, "message": msg}
        return {"ok": False, "raised": type(e).__name__, "message": msg,
                "why": f"expected {c.raises.__name__ if c.raises else 'no error'} matching {c.match!r}"}
    if c.raises is not None:
        return {"ok": False, "raised": None, "message": "", "why": f"did not raise {c.raises.__name__}"}
    return {"ok": True, "raised": None, "message": str(note)}


def _matrix(rank: int, world_size: int, before_init: dict) -> dict:
    torch.manual_seed(0)
    x, t = torch.randn(8, 8), torch.randint(0, 4, (8,))
    model = _mlp()
    sm = shardc.compile(model, MESH, (x, t))
    env = Env(rank, model, sm, x, t, shardc.shard_batch(x, MESH), shardc.shard_batch(t, MESH))
    out = {"compile before init_process_group": before_init}
    for c in CASES:
        res = _run_case(c, env)
        ones = torch.ones(1)
        dist.all_reduce(ones)  # the group still works (raises or times out if not)
        assert ones.item() == world_size
        out[c.name] = res
    # and a whole step still trains after all of it
    opt = torch.optim.SGD(env.sm.parameters(), lr=0.1)
    before = env.sm.full_state_dict()["fc2.weight"]
    env.sm(env.lx, env.lt).backward()
    opt.step()
    assert not torch.equal(env.sm.full_state_dict()["fc2.weight"], before)
    return out


def test_bad_input_matrix() -> None:
    results = run_bounded(_matrix, WORLD, pg_timeout_s=30.0, deadline_s=400.0,
                          before_init=_compile_before_init)
    problems = []
    for r, res in sorted(results.items()):
        if not res.get("ok"):
            problems.append(f"rank {r}: " + ("hung" if res.get("hung") else str(res.get("error"))))
            continue
        for name, got in res["value"].items():
            if not got["ok"]:
                problems.append(f"rank {r}, {name}: {got.get('why')}; got {got['raised']}: "
                                f"{got['message'][:500]}")
    assert not problems, "\n".join(problems)
    cases = results[0]["value"]
    assert len(cases) >= 20
    path = os.environ.get("SHARDC_BAD_INPUTS_OUT")
    if path:
        with open(path, "w") as f:
            json.dump({k: {"raised": v["raised"], "message": v["message"]} for k, v in cases.items()},
                      f, indent=1)
