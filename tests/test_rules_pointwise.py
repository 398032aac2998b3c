"""Rule sweep, pointwise family: every ATen op tagged ``torch.Tag.pointwise`` that
torch.export emits from OpInfo's samples (``op_db``), plus hand-written cases for the
ops the rules table names (and the partial-sum traps: ``x * x``, ``x + 1.0``, ...), and
the factories (constants combined with an input). See ``rules_sweep.py``."""
from __future__ import annotations

import itertools
import sys
import types

import pytest
import rules_sweep as S
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

pytestmark = pytest.mark.sweep  # and slow, but for the fast tier's slice (rules_sweep)

aten = torch.ops.aten
MESHES_1 = ("x2", "y2", "z2", "d2")
_SPECS: list[S.OpSpec] | None = None


def _op_db():
    # torch's testing internals import expecttest (a test-only dependency of torch) for
    # an assertion helper the OpInfo database never uses
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            sys.modules["expecttest"] = types.SimpleNamespace(TestCase=object)
    from torch.testing._internal.common_methods_invocations import op_db
    return op_db


def _is_pointwise_packet(name: str) -> bool:
    pk = getattr(aten, name, None)
    if pk is None:
        return False
    try:
        return any(torch.Tag.pointwise in getattr(pk, o).tags for o in pk.overloads())
    except Exception:  # noqa: BLE001
        return False


def _sample_ok(ts: list[torch.Tensor]) -> bool:
    if not ts or any(t.numel() == 0 for t in ts) or ts[0].dim() == 0:
        return False
    if any(t.dtype not in (torch.float64, torch.bool, torch.int64) for t in ts):
        return False
    return any(n % 2 == 0 and n >= 2 for n in ts[0].shape) and ts[0].numel() <= 4096


def _opinfo_spec(op, k: int, sample) -> S.OpSpec:
    leaves, tree = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    pos = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    consts = list(leaves)
    f = op.op

    def fn(mod, *ts, _pos=pos, _consts=consts, _tree=tree, _f=f):
        vals = list(_consts)
        for i, t in zip(_pos, ts):
            vals[i] = t
        inp, args, kwargs = pytree.tree_unflatten(vals, _tree)
        return _f(inp, *args, **kwargs)

    ts = tuple(leaves[i].detach().clone().requires_grad_(
        leaves[i].is_floating_point() and op.supports_autograd) for i in pos)
    batch_ok = all(t.dim() == 0 or t.shape[0] % 2 == 0 for t in ts)
    meshes = (MESHES_1[k % 4] if batch_ok else MESHES_1[k % 2],)
    if k % 5 == 0 and all(t.dim() == 0 or t.shape[0] % 4 == 0 for t in ts):
        meshes += ("z2d2",)
    elif k % 5 == 2 and all(t.dim() == 0 or all(n % 2 == 0 for n in t.shape[-2:]) for t in ts):
        meshes += ("x2y2",)
    name = f"opinfo:{op.name}{'.' + op.variant_test_name if op.variant_test_name else ''}"
    return S.OpSpec("pointwise", name, fn, ts, meshes=meshes)


def opinfo_specs() -> list[S.OpSpec]:
    from shardc.passes.rules import RULES

    out = []
    k = 0
    for op in _op_db():
        if torch.float64 not in op.dtypes or not _is_pointwise_packet(op.aten_name or op.name):
            continue
        try:
            # sample_inputs_func directly: OpInfo.sample_inputs walks the whole call stack
            # (inspect.stack) on every call to find the test's name, seconds under pytest
            samples = op.sample_inputs_func(op, "cpu", torch.float64,
                                            requires_grad=op.supports_autograd)
        except Exception:  # noqa: BLE001
            continue
        for sample in samples:
            ts = [v for v in pytree.tree_flatten((sample.input, sample.args, sample.kwargs))[0]
                  if isinstance(v, torch.Tensor)]
            if not _sample_ok(ts):
                continue
            spec = _opinfo_spec(op, k, sample)
            try:
                S.prepare(spec)
                try:
                    S.reference(spec)
                except Exception:  # noqa: BLE001 - no derivative: forward only
                    spec.inputs = tuple(t.detach().requires_grad_(False) for t in spec.inputs)
                    S.reference(spec)
            except Exception:  # noqa: BLE001 - a sample torch.export cannot trace
                continue
            # keep it only if the traced graph runs a pointwise op through a rule
            if not any(isinstance(t, torch._ops.OpOverload) and (torch.Tag.pointwise in t.tags or t in RULES)
                       for t in spec.targets):
                continue
            out.append(spec)
            k += 1
            break
    return out


_ROT = iter(itertools.cycle(MESHES_1))


def _H(name, fn, *inputs, meshes=None, **kw) -> S.OpSpec:
    # one single-axis mesh per op, in turn, so every axis role appears; the partial-sum
    # traps and binary arithmetic get a second axis and a two-axis mesh too
    return S.OpSpec("pointwise", name, fn, tuple(inputs), meshes=meshes or (next(_ROT),), **kw)


def handwritten_specs() -> list[S.OpSpec]:
    global _ROT
    _ROT = iter(itertools.cycle(MESHES_1))
    g = S.gen(1)
    x = lambda *s, lo=-2.0, hi=2.0: S._t(s or (4, 6), g, lo, hi)  # noqa: E731
    pos = lambda *s: S._t(s or (4, 6), g, 0.5, 2.0)  # noqa: E731
    mask = (S._t((4, 6), g, requires_grad=False) > 0)
    ints = torch.randint(0, 7, (4, 6), generator=g)
    both = ("x2", "z2", "x2y2")
    sp = [
        # partial-sum traps: not linear in x
        _H("x*x", lambda m, a: a * a, x(), meshes=both),
        _H("x+1.0", lambda m, a: a + 1.0, x(), meshes=both),
        _H("x-1.0", lambda m, a: a - 1.0, x()),
        _H("1.0-x", lambda m, a: 1.0 - a, x()),
        _H("x*2.0", lambda m, a: a * 2.0, x(), meshes=both),
        _H("x/3.0", lambda m, a: a / 3.0, x()),
        _H("3.0/x", lambda m, a: 3.0 / a, pos()),
        _H("x*y", lambda m, a, b: a * b, x(), x(), meshes=both),
        _H("x+y", lambda m, a, b: a + b, x(), x(), meshes=both),
        _H("x-y", lambda m, a, b: a - b, x(), x()),
        _H("x/y", lambda m, a, b: a / b, x(), pos()),
        _H("x+y[bcast]", lambda m, a, b: a + b, x(4, 6), x(6)),
        _H("x*y[bcast]", lambda m, a, b: a * b, x(4, 2, 6), x(2, 1), meshes=("x2", "d2", "x2y2")),
        _H("x+x", lambda m, a: a + a, x()),
        # complex numbers from magnitude and angle (or parts), back to real before the check
        _H("polar", lambda m, a, b: torch.view_as_real(torch.polar(a, b)), pos(), x(), meshes=both),
        _H("complex", lambda m, a, b: torch.view_as_real(torch.complex(a, b)) * 2.0, x(), x()),
        _H("add.Scalar", lambda m, a: aten.add.Scalar(a, 1.5), x()),
        _H("sub.Scalar", lambda m, a: aten.sub.Scalar(a, 1.5), x()),
        _H("mul.Scalar", lambda m, a: aten.mul.Scalar(a, 1.5), x()),
        _H("div.Scalar", lambda m, a: aten.div.Scalar(a, 1.5), x()),
        _H("add.Tensor[0-d]", lambda m, a, b: a + b, x(), x(2)[0].detach().requires_grad_()),
        _H("where", lambda m, c, a, b: torch.where(c, a, b), mask, x(), x()),
        _H("masked_fill.Scalar[0]", lambda m, a, c: a.masked_fill(c, 0.0), x(), mask),
        _H("masked_fill.Scalar[1.5]", lambda m, a, c: a.masked_fill(c, 1.5), x(), mask),
        _H("masked_fill.Tensor", lambda m, a, c, v: a.masked_fill(c, v), x(), mask,
           torch.tensor(0.5, dtype=torch.float64)),
        _H("gelu", lambda m, a: F.gelu(a), x()),
        _H("gelu.tanh", lambda m, a: F.gelu(a, approximate="tanh"), x()),
        _H("silu", lambda m, a: F.silu(a), x()),
        _H("relu", lambda m, a: F.relu(a), x()),
        _H("softplus", lambda m, a: F.softplus(a), x()),
        _H("tanh", lambda m, a: torch.tanh(a), x()),
        _H("sigmoid", lambda m, a: torch.sigmoid(a), x()),
        _H("pow.Tensor_Scalar", lambda m, a: a ** 2, x(), meshes=both),
        _H("pow.Tensor_Tensor", lambda m, a, b: a ** b, pos(), x()),
        _H("rsqrt", lambda m, a: torch.rsqrt(a), pos()),
        _H("exp", lambda m, a: torch.exp(a), x()),
        _H("log", lambda m, a: torch.log(a), pos()),
        _H("sqrt", lambda m, a: torch.sqrt(a), pos()),
        _H("abs", lambda m, a: torch.abs(a), x()),
        _H("neg", lambda m, a: -a, x()),
        _H("reciprocal", lambda m, a: torch.reciprocal(a), pos()),
        _H("clamp", lambda m, a: torch.clamp(a, -0.5, 0.5), x()),
        _H("erf", lambda m, a: torch.erf(a), x()),
        _H("sin", lambda m, a: torch.sin(a), x()),
        _H("cos", lambda m, a: torch.cos(a), x()),
        _H("maximum", lambda m, a, b: torch.maximum(a, b), x(), x()),
        _H("minimum", lambda m, a, b: torch.minimum(a, b), x(), x()),
        _H("log1p", lambda m, a: torch.log1p(a), pos()),
        _H("expm1", lambda m, a: torch.expm1(a), x()),
        _H("eq.Tensor", lambda m, a, b: a == b, ints, torch.randint(0, 7, (4, 6), generator=g)),
        _H("eq.Scalar", lambda m, a: a == 3, ints),
        _H("ne.Tensor", lambda m, a, b: a != b, ints, torch.randint(0, 7, (4, 6), generator=g)),
        _H("ne.Scalar", lambda m, a: a != 3, ints),
        _H("lt.Tensor", lambda m, a, b: a < b, x(), x()),
        _H("le.Tensor", lambda m, a, b: a <= b, x(), x()),
        _H("gt.Tensor", lambda m, a, b: a > b, x(), x()),
        _H("ge.Tensor", lambda m, a, b: a >= b, x(), x()),
        _H("lt.Scalar", lambda m, a: a < 0.25, x()),
        _H("le.Scalar", lambda m, a: a <= 0.25, x()),
        _H("gt.Scalar", lambda m, a: a > 0.25, x()),
        _H("ge.Scalar", lambda m, a: a >= 0.25, x()),
        _H("logical_not", lambda m, c: torch.logical_not(c), mask),
        _H("bitwise_not", lambda m, a: ~a, ints),
        _H("bitwise_and", lambda m, c, d: torch.bitwise_and(c, d), mask, ~mask),
        _H("bitwise_or", lambda m, c, d: torch.bitwise_or(c, d), mask, ~mask),
        _H("__and__", lambda m, c, d: aten.__and__.Tensor(c, d), mask, ~mask),
        _H("__or__", lambda m, c, d: aten.__or__.Tensor(c, d), mask, ~mask),
        _H("clone", lambda m, a: a.clone(), x()),
        _H("contiguous", lambda m, a: a.t().contiguous(), x()),
        _H("alias", lambda m, a: aten.alias.default(a) * 1.0, x()),
        _H("detach", lambda m, a: a.detach(), x()),
        _H("to.float32", lambda m, a: a.to(torch.float32), x()),
        _H("to.int64", lambda m, a: (a * 4).to(torch.int64), x()),
        _H("to.dtype", lambda m, a: aten.to.dtype(a, torch.float32), x()),
        _H("_to_copy", lambda m, a: aten._to_copy.default(a, dtype=torch.float32), x()),
        _H("to.dtype_layout", lambda m, a: aten.to.dtype_layout(a, dtype=torch.float32), x()),
        _H("to.device", lambda m, a: aten.to.device(a, torch.device("cpu"), torch.float32), x()),
        _H("type_as", lambda m, a, b: a.type_as(b), x(), x()),
        _H("view_as", lambda m, a, b: aten.view_as.default(a, b) + b, x(), x()),
        # other gives only its dtype: any shape, never broadcast into x (DeBERTa-v2 casts a
        # 0-d scalar by a matrix)
        _H("type_as.other_shape", lambda m, a, b: a.type_as(b) * b, x(1), x(4, 6)),
        _H("type_as.scalar_by_matrix", lambda m, a, b: (a.sum() * 2.0).type_as(b) + b, x(4, 6), x()),
        # a reshape, not elementwise: kept whole (fallback), the values still right
        _H("view_as.other_shape", lambda m, a, b: aten.view_as.default(a, b) * b, x(4, 6), x(6, 4)),
    ]
    return sp


def factory_specs() -> list[S.OpSpec]:
    g = S.gen(2)
    x = lambda: S._t((4, 6), g)  # noqa: E731
    f = torch.float64
    return [
        _H("arange", lambda m, a: a + torch.arange(6, dtype=f), x()),
        _H("arange.start", lambda m, a: a * torch.arange(1, 7, dtype=f), x()),
        _H("arange.start_step", lambda m, a: a + torch.arange(0, 12, 2, dtype=f), x()),
        _H("full", lambda m, a: a + torch.full((4, 6), 0.5, dtype=f), x()),
        _H("zeros", lambda m, a: a + torch.zeros(4, 6, dtype=f), x()),
        _H("ones", lambda m, a: a * torch.ones(4, 6, dtype=f), x()),
        _H("empty", lambda m, a: a + torch.empty(4, 6, dtype=f).fill_(0.25), x()),
        _H("scalar_tensor", lambda m, a: a * aten.scalar_tensor.default(2.0, dtype=f), x()),
        _H("new_ones", lambda m, a: a + a.new_ones(4, 6), x()),
        _H("new_zeros", lambda m, a: a + a.new_zeros(6), x()),
        _H("new_full", lambda m, a: a * a.new_full((4, 6), 3.0), x()),
        _H("new_empty", lambda m, a: a + a.new_empty(4, 6).fill_(1.0), x()),
        _H("lift_fresh_copy", lambda m, a: a * torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=f), x()),
        _H("tril", lambda m, a: torch.tril(a), x()),
        _H("triu", lambda m, a: torch.triu(a, 1), x()),
        _H("tril[ones]", lambda m, a: a * torch.tril(torch.ones(4, 6, dtype=f)), x()),
    ]


def specs() -> list[S.OpSpec]:
    global _SPECS
    if _SPECS is None:
        _SPECS = handwritten_specs() + factory_specs() + opinfo_specs()
    return _SPECS


CASES, sweep_world, test_rule = S.threaded_family("pointwise", specs)
