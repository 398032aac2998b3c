"""compile(shard_optimizer=True) (ZeRO-1/2 over data) on real gloo ranks (4, the module's
pool; each case its own test).

Each case runs test_train_gloo's checks with the option on: each step's gradients
against float64 (4x one fp32 device's error), 3 AdamW steps' losses within 1e-5 of one
device, the full state after them (one device's AdamW on the same gradients), and measured == reported over a step that follows an
optimizer step (so the all-gather of the stepped slices is in it). Beside those:
the optimizer's state is 1/G_data of what it is without the option; gradient
accumulation (no_sync) and clipping give one device's numbers; a checkpoint written with
the option loads into a program without it (and back) and training goes on identically.
The tolerances are test_train_gloo's and say why there; only the order of additions
differs from the all-reduce the option replaces (a reduce-scatter then an all-gather of
the stepped values, which are exact copies).
"""
from __future__ import annotations

import copy
import tempfile
import warnings
from typing import Callable

import pytest
import torch
from harness import drive_with
from models import GPT, llama
from test_train_gloo import EPS, LR, RTOL, _case_failures, _grad_failures

import shardc
import shardc.checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# every mesh of 4 with data > 1, each axis beside data, each with one of the two models
# (both on every mesh: 82 s here; one a mesh: 72 s)
CASES = [("gpt", "x1y1z1d4"), ("llama", "x1y1z2d2"), ("gpt", "x2y1z1d2"), ("llama", "x1y2z1d2")]


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
            for _ in range(n)]


def _step(sm: shardc.ShardedModule, opt: torch.optim.Optimizer, mesh: shardc.Mesh,
          batch: tuple) -> float:
    loss = sm(*[shardc.shard_batch(t, mesh) for t in batch])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return shardc.global_mean(loss, mesh).item()


def _state_elements(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def _state_failures(spec: str) -> list[str]:
    """AdamW's state under the option is 1/G_data of its size without it (every
    parameter of the GPT has a dim that G_data divides)."""
    mesh = shardc.Mesh.parse(spec)
    batch = _batches(1)[0]
    torch.manual_seed(0)
    model = GPT()
    sizes = []
    for zero in (False, True):
        sm = shardc.compile(model, mesh, example_inputs=batch, shard_optimizer=zero)
        opt = torch.optim.AdamW(sm.parameters(), lr=LR, eps=EPS)
        _step(sm, opt, mesh, batch)
        sizes.append(_state_elements(opt))
    if sizes[1] * mesh.size("data") != sizes[0]:
        return [f"state@{spec}: AdamW state {sizes[1]} elements with shard_optimizer, "
                f"{sizes[0]} without; want 1/{mesh.size('data')}"]
    return []


def _accumulate_clip_failures(spec: str) -> list[str]:
    """Two micro-batches under no_sync then a synced one, clipped, twice: each step's
    gradients against float64, one device's clipped norm (within fp32 reduction-order
    noise) and the weights of one device's AdamW on the same gradients (within RTOL)."""
    where = f"no_sync+clip@{spec}"
    mesh = shardc.Mesh.parse(spec)
    micro = _batches(3, seed=5)
    torch.manual_seed(0)
    model = llama()
    ref = copy.deepcopy(model)
    ref64 = copy.deepcopy(model).double()
    sm = shardc.compile(model, mesh, example_inputs=micro[0], shard_optimizer=True)
    opt = torch.optim.AdamW(sm.parameters(), lr=LR, eps=EPS)
    oref = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    out: list[str] = []
    for step in range(2):
        with sm.no_sync():
            for b in micro[:2]:
                sm(*[shardc.shard_batch(t, mesh) for t in b]).backward()
        if sm.pending_reductions() == 0:
            out.append(f"{where}: no_sync deferred nothing")
        sm(*[shardc.shard_batch(t, mesh) for t in micro[2]]).backward()
        if sm.pending_reductions() != 0:
            out.append(f"{where}: {sm.pending_reductions()} reductions still pending")
        # judged as test_train_gloo judges a step (harness.train_side_by_side says why):
        # the accumulated gradients against float64 at the same weights, the clipped
        # norm, then one device's AdamW driven by the compiled model's clipped gradients
        ref64.load_state_dict(ref.state_dict())
        for b in micro:
            ref(*b).backward()
            ref64(*b).backward()
        out += _grad_failures(where, sm.full_grads(), {n: p.grad for n, p in ref.named_parameters()},
                              {n: p.grad for n, p in ref64.named_parameters()}, step=step)
        ref64.zero_grad(set_to_none=True)
        norm = shardc.clip_grad_norm_(sm, 0.05).item()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
        if abs(norm - ref_norm) > RTOL * ref_norm:
            out.append(f"{where}: norm {norm} vs one device {ref_norm}")
        drive_with(ref, sm.full_grads())
        for o in (opt, oref):
            o.step()
            o.zero_grad()
    got, want = sm.full_state_dict(), ref.state_dict()
    for k, w in want.items():
        if not torch.allclose(got[k], w, rtol=RTOL, atol=RTOL):
            out.append(f"{where}: {k} max-abs diff {(got[k] - w).abs().max().item():.3e}")
    return out


def _bucket_failures(spec: str) -> list[str]:
    """The optimizer slices move in buckets: each one reduce-scatter after backward and
    one all-gather before the next forward. The default 25 MiB takes all of the GPT's
    (well under 1 MiB) in one; ``bucket_mb=0`` gives each parameter its own; a cap of a
    third of the total gives several. The runtime issues that many, the report's ``calls``
    says that many, ``explain`` names them, and the bytes are the report's."""
    mesh = shardc.Mesh.parse(spec)
    batches = _batches(4, seed=3)
    torch.manual_seed(0)
    model = GPT()
    out: list[str] = []
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for kw in ({}, {"bucket_mb": 0}, {"bucket_mb": total / 3 / 2 ** 20}):
        where = f"buckets@{spec} {kw}"
        sm = shardc.compile(model, mesh, example_inputs=batches[0], shard_optimizer=True, **kw)
        buckets = sm._zero_buckets.buckets
        n = {(): 1, (0,): len(sm._zero)}.get(tuple(kw.values()))
        if n is not None and len(buckets) != n:
            out.append(f"{where}: {len(buckets)} buckets, want {n}")
        if kw.get("bucket_mb") and not 2 <= len(buckets) < len(sm._zero):
            out.append(f"{where}: {len(buckets)} buckets of {len(sm._zero)} slices")
        opt = torch.optim.AdamW(sm.parameters(), lr=LR, eps=EPS)
        for b in batches[:3]:
            _step(sm, opt, mesh, b)
        sm.reset_measured_comm()
        _step(sm, opt, mesh, batches[3])  # after a step: the gather is in it
        issued = {c: sm.runtime.calls.get((c, "data", "step"), 0)
                  for c in ("reduce_scatter", "all_gather")}
        if issued != {"reduce_scatter": len(buckets), "all_gather": len(buckets)}:
            out.append(f"{where}: issued {issued} for {len(buckets)} buckets")
        report = shardc.comm_report(sm)
        said = {c: (report.calls or {}).get((c, "data", "step")) for c in issued}
        if said != issued:
            out.append(f"{where}: the report's calls {said} != issued {issued}")
        if sm.measured_comm() != report.by_key():
            out.append(f"{where}: measured {sm.measured_comm()} != reported {report.by_key()}")
        if f"optimizer slices in {len(buckets)} bucket(s)" not in shardc.explain(sm):
            out.append(f"{where}: explain does not name the {len(buckets)} buckets")
    return out


def _checkpoint_failures(path: str) -> list[str]:
    """Save with the option, load without it on another mesh (and the reverse): the next
    step's loss and the state after it agree with the run that was not interrupted."""
    out = []
    batches = _batches(3)
    for a, za, b, zb in (("x1y1z1d4", True, "x1y1z2d2", False), ("x1y1z2d2", False, "x2y1z1d2", True)):
        ma, mb = shardc.Mesh.parse(a), shardc.Mesh.parse(b)
        torch.manual_seed(0)
        model = GPT()
        sa = shardc.compile(model, ma, example_inputs=batches[0], shard_optimizer=za)
        oa = torch.optim.AdamW(sa.parameters(), lr=1e-2, eps=EPS)
        _step(sa, oa, ma, batches[0])
        where = f"checkpoint {a} shard_optimizer={za} -> {b} shard_optimizer={zb}"
        shardc.checkpoint.save(sa, oa, f"{path}/{a}", step=1)
        la = _step(sa, oa, ma, batches[1])
        sb = shardc.compile(model, mb, example_inputs=batches[0], shard_optimizer=zb)
        ob = torch.optim.AdamW(sb.parameters(), lr=1e-2, eps=EPS)
        shardc.checkpoint.load(sb, ob, f"{path}/{a}")
        lb = _step(sb, ob, mb, batches[1])
        if abs(la - lb) > RTOL * abs(la):
            out.append(f"{where}: loss after resuming {lb} vs uninterrupted {la}")
        fa, fb = sa.full_state_dict(), sb.full_state_dict()
        for k in fa:
            if not torch.allclose(fa[k], fb[k], rtol=RTOL, atol=RTOL):
                out.append(f"{where}: {k} max-abs diff {(fa[k] - fb[k]).abs().max().item():.3e}")
    return out


# every case a test: name -> its checks on one rank given a directory (the failures)
CHECKS: dict[str, Callable[[str], list[str]]] = {
    **{f"{name}-{spec}": (lambda path, name=name, spec=spec: _case_failures(
        name, shardc.Mesh.parse(spec), shard_optimizer=True)) for name, spec in CASES},
    "gpt-x1y1z1d4-autograd": lambda path: _case_failures(
        "gpt", shardc.Mesh.parse("x1y1z1d4"), shard_optimizer=True, step_graph=False),
    "llama-x1y1z2d2-reshard": lambda path: _case_failures(
        "llama", shardc.Mesh.parse("x1y1z2d2"), shard_optimizer=True, reshard_after_forward=True),
    # several buckets, issued in order as backward fills them (autograd's backward)
    "llama-x1y1z1d4-autograd-buckets": lambda path: _case_failures(
        "llama", shardc.Mesh.parse("x1y1z1d4"), shard_optimizer=True, step_graph=False,
        bucket_mb=0.02),
    "buckets-x1y1z2d2": lambda path: _bucket_failures("x1y1z2d2"),
    "state-x1y1z1d4": lambda path: _state_failures("x1y1z1d4"),
    "accumulate-clip-x1y1z2d2": lambda path: _accumulate_clip_failures("x1y1z2d2"),
    "checkpoint": _checkpoint_failures,
}


def _case(rank: int, world_size: int, name: str, path: str) -> None:
    failures = CHECKS[name](path)
    if failures:
        raise AssertionError(f"{len(failures)} failures:\n" + "\n".join(failures))


@pytest.mark.parametrize("name", list(CHECKS))
def test_shard_optimizer_trains_like_one_device_on_4_ranks(ranks, name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tempfile.TemporaryDirectory() as d:
            ranks.run(_case, 4, name, d)
