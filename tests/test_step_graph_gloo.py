"""The step program (forward and backward in one traced graph) and its passes, on
real gloo processes (4 ranks, the module's pool: each case, and each check after them, is
its own test).

For each model and mesh of ``CASES``, the same model is compiled with autograd's own backward
(``step_graph=False, bucket_mb=0``, the reference: one sum a gradient) and with the
step program under several
pass settings, and trained two SGD steps on the same batches:

* scheduling (``overlap``) only reorders nodes, and with ``bucket_mb=0`` every
  collective is the one autograd's backward issues: losses and gradients must be
  bitwise equal;
* bucketing packs the post-backward reductions; the sum of each element over the ranks
  is the same, but gloo's ring adds the ranks' values in an order that depends on the
  element's offset in the buffer. Two values add the same way in either order, so where
  the reduced axis has two ranks the result must still be bitwise equal; with four ranks
  it is one more summation order, judged against a float64 single-device gradient like
  every other order (as tests/test_train_gloo.py does, the same factor and floor);
* the bytes the runtime hands to torch.distributed equal the comm report's, exactly, in
  every setting, and so do the collectives issued per step (and the calls per axis the
  planner's step-time model counts on the step program traced offline); buckets issue
  fewer calls for the same bytes;
* with ``overlap``, a loss averaged over the data axis (the MLP's mean squared error) is
  returned before its all-reduce is waited (``PendingOutput``, waited on first read), and
  reads the same as autograd's; a cross-entropy mean is returned whole;
* the schedule overlaps: on a mesh with x > 1, some dI all-reduce of backward has a
  weight-gradient GEMM between its issue and its wait (the paper's OAR), and with
  ``overlap=False`` none does;
* ``gemm_modes``: a fixed form rewrites every GEMM into it, "auto" makes every rank
  take the same forms; gradients as accurate as autograd's, measured == reported;
* ``shardc.tools.timeline.trace_step`` records one span per collective issued, from issue to
  wait, with GEMMs in flight during backward.
"""
from __future__ import annotations

import copy

import pytest
import torch
from models import GPT, MLPChain, gpt2, litgpt_llama

import shardc
from shardc.core.compat import torch_version
from shardc.core.ir import DEFERRED
from shardc.planning.cost import step_shape
from shardc.runtime.functional import mm_into
from shardc.runtime.pending import PendingOutput

pytestmark: list = []  # the tests on ranks are slow and distributed, one by one

# every axis > 1 somewhere; the meshes whose axes all have <= 2 ranks (bitwise even with
# buckets), and one whose data axis has 4
MESHES = ["x2y2z1d1", "x1y1z2d2", "x2y1z1d2", "x1y1z1d4"]
TWO_RANK_AXES = {"x2y2z1d1", "x1y1z2d2", "x2y1z1d2"}

# Models whose step-program gradients are autograd's bitwise only from a torch release on
# (run: tools/torch_matrix.sh). LitGPT's grouped-query attention on torch 2.8 (and 2.6,
# 2.7): the step program calls the same kernels (_scaled_dot_product_flash_attention_for_cpu
# and its backward) on the same values and computes the same loss, yet its gradients
# differ from autograd's by rounding (3.7e-9 of entries ~0.03), as close to float64 as
# autograd's; from 2.11 they are bitwise equal. Before that release the model is judged
# against float64 like a bucketed sum.
NOT_BITWISE_BEFORE = {"litgpt_gqa": (2, 11)}

# see tests/test_train_gloo.py: one fp32 device's error against float64, times 4, plus
# a floor of one fp32 rounding of the largest gradient entry for exactly-zero gradients
GRAD_FACTOR = 4.0
FP32_UNIT_ROUNDOFF = 2.0 ** -24


def _lm(make, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    return make, [(torch.randint(0, 64, (8, seq), generator=g),
                   torch.randint(0, 64, (8, seq), generator=g)) for _ in range(2)]


def _mlp():
    g = torch.Generator().manual_seed(1)
    return MLPChain, [(torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g))
                      for _ in range(2)]


MODELS = {"mlp": _mlp, "gpt": lambda: _lm(GPT), "gpt2": lambda: _lm(gpt2),
          "gpt_dropout": lambda: _lm(lambda: GPT(dropout=0.1)),
          "litgpt_gqa": lambda: _lm(lambda: litgpt_llama(query_groups=2))}


# The MLP on every mesh; each language model on two, every mesh getting two of them, so
# that each pass setting runs on every mesh and every model meets the data axis (every
# model on every mesh took 6 minutes here; this, under 4). Dropout draws its masks from
# the generator: only the bitwise comparisons (same seed, same draws) apply to it, so it
# runs where buckets are bitwise too.
CASES = [("mlp", s) for s in MESHES] + [
    ("gpt", "x2y2z1d1"), ("gpt", "x1y1z1d4"),
    ("gpt2", "x1y1z2d2"), ("gpt2", "x2y1z1d2"),
    ("gpt_dropout", "x2y2z1d1"), ("gpt_dropout", "x1y1z2d2"),
    ("litgpt_gqa", "x2y1z1d2"), ("litgpt_gqa", "x1y1z1d4")]


def _train(model, mesh, batches, **kw):
    """Two SGD steps; the losses, the local gradients of each step, and per step the
    measured bytes, the call counts and the report."""
    torch.manual_seed(0)
    sm = shardc.compile(model, mesh, example_inputs=batches[0], **kw)
    # built before any step (reshard_after_forward: from the step program traced offline)
    sm.report_before_step = shardc.comm_report(sm).by_key()
    sm.model_for_tests, sm.batch_for_tests = model, batches[0]
    opt = torch.optim.SGD(sm.parameters(), lr=1e-2)
    losses, grads, comm = [], [], []
    torch.manual_seed(7)  # the same dropout masks in every setting
    for b in batches:
        sm.reset_measured_comm()
        loss = sm(*[shardc.shard_batch(x, mesh) for x in b])
        sm.loss_type = type(loss)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({k: p.grad.clone() for k, p in sm.named_parameters() if p.grad is not None})
        comm.append((sm.measured_comm(), dict(sm.runtime.calls)))
        opt.step()
        opt.zero_grad()
    return sm, losses, grads, comm


def _f64_grads(model, batch) -> dict:
    m = copy.deepcopy(model).double()
    m(*[x.double() if x.is_floating_point() else x for x in batch]).backward()
    return {k: p.grad for k, p in m.named_parameters() if p.grad is not None}


def _one(name: str, spec: str) -> list[str]:
    make, batches = MODELS[name]()
    torch.manual_seed(0)
    model = make()
    mesh = shardc.Mesh.parse(spec)
    where = f"{name}@{spec}"
    out: list[str] = []
    # the reference sums each gradient on its own (no buckets under autograd's backward
    # either), the collectives the step program issues with bucket_mb=0
    _, ref_losses, ref_grads, ref_comm = _train(model, mesh, batches, step_graph=False,
                                                bucket_mb=0)
    report = None
    settings: list[dict] = [{"bucket_mb": 0}, {"bucket_mb": 0, "overlap": False}, {}]
    if mesh.size("z") > 1:  # weights are gathered only over z
        settings.insert(2, {"bucket_mb": 0, "reshard_after_forward": True})
        # with coalescing: the report must still find the gathers packed per block
        settings.insert(3, {"reshard_after_forward": True})
    for kw in settings:
        sm, losses, grads, comm = _train(model, mesh, batches, **kw)
        report = shardc.comm_report(sm).by_key()
        label = f"{where} {kw or 'defaults'}"
        calls = shardc.comm_report(sm).calls
        if calls != comm[-1][1]:
            out.append(f"{label}: report's collectives per step {calls} != issued {comm[-1][1]}")
        # the planner's step-time model counts calls on the offline step program
        per_axis: dict[str, int] = {}
        for (_, axis, _), n in comm[-1][1].items():
            per_axis[axis] = per_axis.get(axis, 0) + n
        if step_shape(sm).calls != per_axis:
            out.append(f"{label}: offline step program's calls {step_shape(sm).calls} != "
                       f"issued {per_axis}")
        if report != sm.report_before_step:
            out.append(f"{label}: report before the first step {sm.report_before_step} != "
                       f"after {report}")
        if kw.get("reshard_after_forward"):
            out += _reshard_checks(label, sm, mesh)
        # a loss averaged over the data axis ends in an all-reduce: with overlap, the
        # step returns it unwaited (the bitwise checks below read it after backward)
        (jp,) = sm._joint.values()
        if not kw and mesh.size("data") > 1 and mesh.size("z") == 1:
            # weight gradients summed over data go into buckets: the GEMMs that make
            # them write there (into_bucket.py), under the comparisons below
            if not any(n.target is mm_into for n in jp.backward.graph.nodes):
                out.append(f"{label}: no weight-gradient GEMM writes into its bucket")
            elif "written there by the GEMM that makes them" not in shardc.explain(sm):
                out.append(f"{label}: explain does not say which gradients their GEMM wrote")
        deferred = any(d.index == 0 for d in jp.forward.meta[DEFERRED])
        # the MLP's mean squared error is a partial mean until the output's all-reduce,
        # which overlap defers; a cross-entropy mean is reduced with its target count in
        # one all-reduce that backward waits on (1/count is its seed), so it comes out
        # whole and nothing is left to defer
        partial_loss = name == "mlp"
        if deferred != (partial_loss and kw.get("overlap", True) and (deferred or mesh.size("data") > 1)):
            out.append(f"{label}: the loss's wait deferred: {deferred}")
        if sm.loss_type is not (PendingOutput if deferred else torch.Tensor):
            out.append(f"{label}: the loss is a {sm.loss_type.__name__}, deferred: {deferred}")
        for step, (m, _) in enumerate(comm):
            if m != report:
                out.append(f"{label}: step {step} measured {m} != reported {report}")
        bitwise = (kw.get("bucket_mb") == 0 or spec in TWO_RANK_AXES) and \
            not (name in NOT_BITWISE_BEFORE and torch_version() < NOT_BITWISE_BEFORE[name])
        if bitwise:
            for step, (a, b) in enumerate(zip(ref_losses, losses)):
                if not torch.equal(a, b):
                    out.append(f"{label}: step {step} loss {b.item()!r} != {a.item()!r}")
            for step, (ga, gb) in enumerate(zip(ref_grads, grads)):
                if sorted(ga) != sorted(gb):
                    out.append(f"{label}: step {step} gradient names differ")
                    continue
                diff = [k for k in ga if not torch.equal(ga[k], gb[k])]
                if diff:
                    out.append(f"{label}: step {step} gradients differ: {diff[:4]}")
        else:
            out += _against_f64(label, model, batches[0], mesh, ref_grads[0], grads[0],
                                sm.param_layouts)
        if not kw:
            # buckets: the same bytes in fewer step-phase calls, on meshes that reduce
            ref_calls = sum(c for k, c in ref_comm[0][1].items() if k[2] == "step")
            calls = sum(c for k, c in comm[0][1].items() if k[2] == "step")
            if ref_calls > 1 and not calls < ref_calls:
                out.append(f"{label}: {calls} step-phase calls with buckets, {ref_calls} without")
    return out


def _saved_bytes(jp) -> int:
    """Bytes forward keeps for backward (the forward graph's extra outputs)."""
    out = next(n for n in jp.forward.graph.nodes if n.op == "output")
    # after the saved values come the inputs of deferred outputs' tails (passes/defer.py)
    extra = sum(d.n_inputs for d in jp.forward.meta.get(DEFERRED, []))
    saved = list(out.args[0])[jp.n_outputs:len(out.args[0]) - extra]
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in saved)


def _reshard_checks(label: str, sm, mesh) -> list[str]:
    """Weights gathered over z are gathered again in backward (as many bytes as forward's
    weight gathers that backward reads), and forward saves less for backward."""
    out = []
    rep = shardc.comm_report(sm)
    again = rep.total_bytes(collective="all_gather", axis="z", phase="backward")
    if not again > 0:
        out.append(f"{label}: no weight gathered again in backward")
    (jp,) = sm._joint.values()
    keep = shardc.compile(sm.model_for_tests, mesh, example_inputs=sm.batch_for_tests,
                          bucket_mb=0)
    keep(*[shardc.shard_batch(x, mesh) for x in sm.batch_for_tests]).backward()
    (jp_keep,) = keep._joint.values()
    if not _saved_bytes(jp) < _saved_bytes(jp_keep):
        out.append(f"{label}: saves {_saved_bytes(jp)} B for backward, keeping gathered "
                   f"weights {_saved_bytes(jp_keep)} B")
    return out


def _against_f64(label: str, model, batch, mesh, ref_local: dict, got_local: dict,
                 layouts: dict) -> list[str]:
    """Both local gradients (autograd's, bucketed) against the float64 one, each within
    GRAD_FACTOR of the other's error: bucketing adds one summation order, no more."""
    from shardc.core.placement import local_slice

    f64 = _f64_grads(model, batch)
    coords = mesh.coords(torch.distributed.get_rank())
    out = []
    big = max(g.abs().max().item() for g in f64.values())
    for k, g in got_local.items():
        want = local_slice(f64[k], layouts[k], coords, mesh)
        err = (g.double() - want).abs().max().item()
        err_ref = (ref_local[k].double() - want).abs().max().item()
        if err > GRAD_FACTOR * err_ref + FP32_UNIT_ROUNDOFF * big:
            out.append(f"{label}: {k}: bucketed error {err:.2e} vs autograd's {err_ref:.2e}")
    return out


def _overlap_check() -> list[str]:
    """OAR on x4: the dI reductions of backward overlap weight-gradient GEMMs (reduce-
    scatters under sequence parallelism, the default: the gradient of a GEMM input
    gathered over the tokens; all-reduces where a block's input is whole)."""
    from shardc.passes.schedule import SCHEDULE

    make, batches = _lm(GPT)
    torch.manual_seed(0)
    model = make()
    mesh = shardc.Mesh.parse("x4y1z1d1")
    out = []
    for overlap in (True, False):
        sm = shardc.compile(model, mesh, example_inputs=batches[0], overlap=overlap)
        sm(*[shardc.shard_batch(x, mesh) for x in batches[0]]).backward()
        (jp,) = sm._joint.values()
        back = [i for i in jp.backward.meta[SCHEDULE]
                if i["collective"] in ("all_reduce", "reduce_scatter") and i["axis"] == "x"]
        with_gemm = [i for i in back if i["gemms"]]
        if overlap and not with_gemm:
            out.append(f"overlap=True: no backward reduction over x overlaps a GEMM: {back}")
        if not overlap and with_gemm:
            out.append(f"overlap=False: reductions overlap GEMMs: {with_gemm}")
    return out


def _trace_check(tmp: str) -> list[str]:
    """shardc.trace_step: one span per collective the step issued, each from its issue to
    its wait, on the right axis, and backward spans with GEMMs running in flight."""
    import json

    from shardc.tools.timeline import collective_spans, trace_step

    make, batches = _lm(GPT)
    torch.manual_seed(0)
    mesh = shardc.Mesh.parse("x2y1z1d2")
    sm = shardc.compile(make(), mesh, example_inputs=batches[0], bucket_mb=0.005)
    inputs = tuple(shardc.shard_batch(x, mesh) for x in batches[0])
    sm(*inputs).backward()
    sm.reset_measured_comm()
    path = trace_step(sm, inputs, tmp, warmup=0)
    calls = dict(sm.runtime.calls)
    with open(path) as f:
        trace = json.load(f)
    spans = collective_spans(trace)
    out = []
    per_key: dict = {}
    for sp in spans:
        key = (sp["collective"], sp["axis"], sp["phase"])
        per_key[key] = per_key.get(key, 0) + 1
        if not sp["end"] >= sp["start"]:
            out.append(f"trace: span {sp} ends before it starts")
    if per_key != calls:
        out.append(f"trace: spans per (collective, axis, phase) {per_key} != calls {calls}")
    if not any(sp["phase"] == "backward" and any("mm" in n for n in sp["overlapped"])
               for sp in spans):
        out.append("trace: no backward collective has a GEMM in flight")
    shown = [e for e in trace["traceEvents"] if e.get("cat") == "shardc"]
    if len(shown) != len(spans):
        out.append(f"trace: {len(shown)} spans written, {len(spans)} collectives")
    return out


def _gemm_check() -> list[str]:
    """gemm_modes: a fixed form puts every GEMM of both parts in it (copying operands
    where the traced layout differs), "auto" times the forms and every rank takes the
    same; either way the gradients are as accurate as autograd's (a BLAS kernel of another
    form adds a product's terms in another order: judged against float64 like any other
    order) and measured == reported (the forms move no bytes)."""
    from shardc.passes.gemm_modes import GEMM, gemm_nodes

    out: list[str] = []
    for name, spec in (("gpt2", "x2y2z1d1"), ("litgpt_gqa", "x1y1z2d2")):
        make, batches = MODELS[name]()
        torch.manual_seed(0)
        model = make()
        mesh = shardc.Mesh.parse(spec)
        _, _, ref_grads, _ = _train(model, mesh, batches, step_graph=False)
        for mode in ("TN", "auto"):
            label = f"{name}@{spec} gemm_modes={mode}"
            sm, _, grads, comm = _train(model, mesh, batches, gemm_modes=mode)
            out += _against_f64(label, model, batches[0], mesh, ref_grads[0], grads[0],
                                sm.param_layouts)
            report = shardc.comm_report(sm).by_key()
            out += [f"{label}: step {i} measured {m} != reported {report}"
                    for i, (m, _) in enumerate(comm) if m != report]
            (jp,) = sm._joint.values()
            nodes = gemm_nodes(jp.forward.graph) + gemm_nodes(jp.backward.graph)
            forms = [n.meta.get(GEMM) for n in nodes]
            if not nodes or None in forms:
                out.append(f"{label}: {len(nodes)} GEMMs, some without a form: {forms}")
                continue
            if mode == "TN":
                if any(f["mode"] != "TN" for f in forms):
                    out.append(f"{label}: forms run {sorted({f['mode'] for f in forms})}")
                if all(f["traced"] == "TN" for f in forms):
                    out.append(f"{label}: every GEMM was traced TN: nothing was rewritten")
                copies = [n for n in jp.forward.graph.nodes if n.target is torch.ops.aten.clone.default
                          and any(u in nodes for u in n.users)
                          or n.target is torch.ops.aten.transpose.int
                          and any(u in nodes for u in n.users)]
                if not copies:
                    out.append(f"{label}: no operand copied into the TN form in forward")
            else:
                mine = sorted(sm.runtime.gemm_forms.items())
                everyone: list = [None] * torch.distributed.get_world_size()
                torch.distributed.all_gather_object(everyone, mine)
                if any(e != mine for e in everyone):
                    out.append(f"{label}: ranks chose different forms")
                if not all(f["key"] in sm.runtime.gemm_forms for f in forms):
                    out.append(f"{label}: a GEMM without an agreed form")
            if f"GEMM forms (gemm_modes={mode})" not in shardc.explain(sm):
                out.append(f"{label}: explain does not show the GEMM forms")
    return out


def _runtime_ops_check() -> list[str]:
    """At training time the step program issues its collectives through torch.distributed
    (``c10d`` ops), never the functional ops it was traced with: on gloo the functional
    all-gather corrupted the heap within a few hundred steps (runtime/functional.py;
    benchmarks/soak_step.py is the soak that showed it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Namespaces(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(f"{func.namespace}.{func.__name__}")
            return func(*args, **(kwargs or {}))

    make, batches = _lm(GPT)
    torch.manual_seed(0)
    mesh = shardc.Mesh.parse("x2y1z2d1")  # gathers weights on z, reduces on x
    sm = shardc.compile(make(), mesh, example_inputs=batches[0])
    inputs = tuple(shardc.shard_batch(x, mesh) for x in batches[0])
    sm(*inputs).backward()  # builds the step program (its tracing uses functional ops)
    with Namespaces() as mode:
        sm(*inputs).backward()
    functional = sorted(n for n in mode.seen if n.startswith("_c10d_functional."))
    issued = sorted(n for n in mode.seen if n.startswith("c10d."))
    out = []
    if functional:
        out.append(f"runtime ops: a training step ran functional collectives {functional}")
    if not any("allgather" in n for n in issued) or not any("allreduce" in n for n in issued):
        out.append(f"runtime ops: the step's all-gathers and all-reduces were not seen as "
                   f"c10d ops (seen: {issued})")
    return out


def _share_check() -> list[str]:
    """``shardc/program/share.py`` on 4 processes: on a pure data mesh and on x2d2 the ranks
    of a class trace once and the others decode the tracer's program (``share.COUNTS``);
    losses, gradients and the bytes moved are bitwise those of every rank tracing its own,
    and the gradients float64's (within the judge's bound)."""
    import torch.distributed as dist

    from shardc.program import share

    out = []
    for name, spec, tracers in (("gpt", "x1y1z1d4", 1), ("litgpt_gqa", "x2y1z1d2", 2)):
        make, batches = MODELS[name]()
        torch.manual_seed(0)
        model = make()
        mesh = shardc.Mesh.parse(spec)
        runs = {}
        for enabled in (True, False):
            share.ENABLED = enabled
            before = dict(share.COUNTS)
            try:
                sm, losses, grads, comm = _train(model, mesh, batches)
            finally:
                share.ENABLED = True
            got = {k: share.COUNTS[k] - before.get(k, 0) for k in ("traced", "received", "retraced")}
            runs[enabled] = (losses, grads, comm, sm)
            counts = [None] * dist.get_world_size()
            dist.all_gather_object(counts, got)
            want = ({"traced": tracers, "received": 4 - tracers, "retraced": 0} if enabled
                    else {"traced": 0, "received": 0, "retraced": 0})
            total = {k: sum(c[k] for c in counts) for k in want}
            if total != want:
                out.append(f"share {name}@{spec} enabled={enabled}: {total}, expected {want}")
        (l1, g1, c1, sm), (l0, g0, c0, _) = runs[True], runs[False]
        if any(not torch.equal(a, b) for a, b in zip(l1, l0)):
            out.append(f"share {name}@{spec}: losses {l1} against {l0} traced by every rank")
        for step, (a, b) in enumerate(zip(g1, g0)):
            bad = [k for k in b if not torch.equal(a[k], b[k])]
            if bad or a.keys() != b.keys():
                out.append(f"share {name}@{spec} step {step}: gradients differ: {bad[:4]}")
        if [c for c, _ in c1] != [c for c, _ in c0] or [k for _, k in c1] != [k for _, k in c0]:
            out.append(f"share {name}@{spec}: measured bytes or calls differ")
        out += _against_f64(f"share {name}@{spec}", model, batches[0], mesh, g0[0], g1[0],
                            sm.param_layouts)
    return out


def _case(rank: int, world_size: int, name: str, spec: str) -> None:
    failures = _one(name, spec)
    if failures:
        raise AssertionError(f"{len(failures)} failures:\n" + "\n".join(failures))


CHECKS = {"overlap": lambda tmp: _overlap_check(), "gemm_modes": lambda tmp: _gemm_check(),
          "trace": lambda tmp: _trace_check(f"{tmp}/trace"),
          "runtime_ops": lambda tmp: _runtime_ops_check(), "share": lambda tmp: _share_check()}


def _check(rank: int, world_size: int, which: str, tmp: str) -> None:
    failures = CHECKS[which](tmp)
    if failures:
        raise AssertionError(f"{len(failures)} failures:\n" + "\n".join(failures))


def test_cases_cover_every_mesh_and_model() -> None:
    lms = [n for n in MODELS if n != "mlp"]
    assert sorted(s for n, s in CASES if n == "mlp") == sorted(MESHES)
    for spec in MESHES:
        assert len([n for n, s in CASES if s == spec and n != "mlp"]) == 2, spec
    for name in lms:
        specs = [s for n, s in CASES if n == name]
        assert len(specs) == 2 and any(shardc.Mesh.parse(s).size("data") > 1 for s in specs)
    assert all(s in TWO_RANK_AXES for n, s in CASES if n == "gpt_dropout")
    assert len(set(CASES)) == len(CASES)


@pytest.mark.parametrize("name, spec", [pytest.param(n, s, id=f"{n}-{s}") for n, s in CASES])
@pytest.mark.sweep
@pytest.mark.slow
@pytest.mark.distributed
def test_step_graph_matches_autograd_on_gloo(ranks, name: str, spec: str) -> None:
    ranks.run(_case, 4, name, spec)


@pytest.mark.parametrize("which", list(CHECKS))
@pytest.mark.slow
@pytest.mark.distributed
def test_step_program_on_gloo(ranks, which: str, tmp_path) -> None:
    """The schedule's overlap on x4, gemm_modes, trace_step's spans, and the c10d ops a
    training step issues (the docstring above)."""
    ranks.run(_check, 4, which, str(tmp_path))
