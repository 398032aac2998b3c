"""Gradient reductions in buckets under autograd's backward (runtime/grad_buckets.py), on
real gloo ranks (4, the module's pool; each case its own test).

The forward program with autograd's backward (``step_graph=False``, block recompute)
used to reduce each parameter's gradient on its own: one blocking all-reduce a
parameter in a hook, or one blocking reduce-scatter a weight in its all-gather's
backward (FSDP). Now both go in buckets, issued while backward runs. Checked here:

- training against one device (test_train_gloo's checks and tolerances: each step's
  gradients against float64, the losses, the AdamW state) with several buckets a step:
  data parallel with ``step_graph=False`` and with block recompute, FSDP with
  ``step_graph=False``, TP x FSDP with block recompute;
- on an axis of 2 ranks, every path gives bitwise the gradients of the per-parameter
  reductions (``bucket_mb=0``): two values add the same way in either order, so a
  bucket's sum is the per-parameter one bit for bit. On data parallel (all-reduce
  buckets), TP x FSDP (reduce-scatter buckets) and HSDP with block recompute
  (reduce-scatter buckets whose shards are then all-reduced over data). The paths:
  ``.grad`` empty; a second synced backward into ``.grad`` that holds a sum;
  ``torch.autograd.grad``; ``no_sync`` then a synced backward; the backward after one
  that raised;
- the runtime issues one collective per bucket (and per HSDP bucket one more), the
  bytes and the number of collectives are the report's, and ``explain`` and the
  step-time model count the buckets.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
from models import GPT
from test_train_gloo import _case_failures

import shardc
from shardc.planning.cost import step_shape

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
            for _ in range(n)]


def _grads(sm: shardc.ShardedModule) -> dict[str, torch.Tensor | None]:
    return {k: None if p.grad is None else p.grad.clone() for k, p in sm.named_parameters()}


def _paths(sm: shardc.ShardedModule, mesh: shardc.Mesh, batches: list) -> dict[str, Any]:
    """Every path's gradients, and the collectives the first backward issued."""
    def loss(b: tuple) -> torch.Tensor:
        return sm(*[shardc.shard_batch(t, mesh) for t in b])

    out: dict[str, Any] = {}
    sm.reset_measured_comm()
    loss(batches[0]).backward()
    out["calls"] = dict(sm.runtime.calls)
    out["measured"] = sm.measured_comm()
    out["fresh"] = _grads(sm)
    loss(batches[1]).backward()  # into .grad that holds the first step's sums
    out["accumulated"] = _grads(sm)
    sm.zero_grad(set_to_none=True)
    names, params = zip(*sm.named_parameters())
    got = torch.autograd.grad(loss(batches[2]), params)
    out["autograd.grad"] = {k: g.clone() for k, g in zip(names, got)}
    out["left .grad alone"] = all(p.grad is None for p in params)
    with sm.no_sync():
        loss(batches[0]).backward()
    loss(batches[1]).backward()
    out["no_sync then synced"] = _grads(sm)
    sm.zero_grad(set_to_none=True)
    # a backward that raises after some buckets went out (the first registered parameter
    # is the embedding: its gradient comes last, after this hook's)
    first = next(iter(params))

    def boom(g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")
    h = first.register_hook(boom)
    try:
        loss(batches[2]).backward()
        raise AssertionError("the raising hook did not raise")
    except RuntimeError as e:
        if "boom" not in str(e):
            raise
    h.remove()
    sm.zero_grad(set_to_none=True)
    loss(batches[2]).backward()
    out["after a raise"] = _grads(sm)
    # two forwards before one backward (a loss over two batches): each call's all-gather
    # brings the weight its own gradient, the second after its bucket went out
    sm.zero_grad(set_to_none=True)
    (loss(batches[0]) + loss(batches[1])).backward()
    out["two forwards, full"] = sm.full_grads()
    return out


def _bitwise_failures(spec: str, collectives: tuple[str, ...] = ("all_reduce",), **kw: Any
                      ) -> list[str]:
    mesh = shardc.Mesh.parse(spec)
    batches = _batches(3)
    torch.manual_seed(0)
    model = GPT()
    runs = {}
    for mb in (0, 0.02):
        sm = shardc.compile(model, mesh, example_inputs=batches[0], step_graph=False,
                            bucket_mb=mb, **kw)
        runs[mb] = (sm, _paths(sm, mesh, batches))
    (per_param, a), (bucketed, b) = runs[0], runs[0.02]
    where = f"grad buckets@{spec} {kw}"
    out: list[str] = []
    n = len(bucketed._grad_buckets.buckets)
    if not 2 <= n < len(bucketed._grad_buckets.members):
        out.append(f"{where}: {n} buckets of {len(bucketed._grad_buckets.members)} gradients")
    if per_param._grad_buckets.buckets:
        out.append(f"{where}: bucket_mb=0 made {len(per_param._grad_buckets.buckets)} buckets")
    # (not two forwards before one backward: there the bucketed path adds the two calls'
    # sums in another order than autograd adds the per-parameter ones, an ulp apart)
    for path in ("fresh", "accumulated", "autograd.grad", "no_sync then synced", "after a raise"):
        for k, g in a[path].items():
            h = b[path].get(k)
            if (g is None) != (h is None) or (g is not None and not torch.equal(g, h)):
                diff = "None" if g is None or h is None else f"{(g - h).abs().max().item():.3e}"
                out.append(f"{where}: {path}: {k} differs from the per-parameter sum ({diff})")
    # and against one device in float64 (the bucketed reduce-scatters once copied the
    # second call's gradient over the first's, or missed a bucket already issued: errors
    # of the gradient's own size). fp32 against float64 over the GPT's sums of 256 tokens:
    # measured 6e-7 of each tensor's largest element; 1e-5 of it leaves room, and an error
    # of the kind fixed is ~1x
    ref = copy.deepcopy(model).double()
    (ref(*batches[0]) + ref(*batches[1])).backward()
    for k, p in ref.named_parameters():
        got = b["two forwards, full"][k]
        if got is None or (got.double() - p.grad).abs().max() > 1e-5 * p.grad.abs().max() + 1e-9:
            err = "None" if got is None else f"{((got.double() - p.grad).abs().max() / p.grad.abs().max()).item():.2e}"
            out.append(f"{where}: two forwards, one backward: {k} off one device's float64 by {err}")
    if not b["left .grad alone"]:
        out.append(f"{where}: torch.autograd.grad wrote .grad")
    gb = bucketed._grad_buckets
    kinds = {bk.collective for bk in gb.buckets}
    if kinds != set(collectives):
        out.append(f"{where}: buckets of {sorted(kinds)}, expected {collectives}")
    # one call a bucket where the per-parameter run made one a member (a reduce-scatter
    # bucket's all-reduce over the replicas too, under HSDP)
    want = dict(a["calls"])
    for bk in gb.buckets:
        keys = [(bk.collective, bk.axis, "backward" if bk.collective == "reduce_scatter" else "step")]
        if bk.then is not None:
            keys.append(("all_reduce", bk.then, "step"))
        for key in keys:
            want[key] = want.get(key, 0) - len(bk.members) + 1
    # one all-gather a block's weights in forward (collectives.GatherGroup)
    together = {id(g_): g_ for g_ in bucketed.runtime.gather_groups.values()}
    if not together and "reduce_scatter" in collectives:
        out.append(f"{where}: no weight gathered together with another")
    for g_ in together.values():
        key = ("all_gather", g_.axis, "forward")
        want[key] = want.get(key, 0) - len(g_.members) + 1
    for key in sorted(set(want) | set(b["calls"])):
        if key[0] == "all_gather" and key[2] == "backward":
            continue  # recompute's gathers: against the report below
        if want.get(key, 0) != b["calls"].get(key, 0):
            out.append(f"{where}: {b['calls'].get(key, 0)} {key} issued, {want.get(key, 0)} "
                       "expected from the buckets")
    for sm, run in ((per_param, a), (bucketed, b)):
        report = shardc.comm_report(sm)
        if run["measured"] != report.by_key():
            out.append(f"{where}: measured {run['measured']} != reported {report.by_key()}")
        # the report counts the collectives a step issues, buckets included
        if report.calls != run["calls"]:
            out.append(f"{where}: the report's calls {report.calls} != issued {run['calls']}")
    if f"gradient sums in {n} bucket(s)" not in shardc.explain(bucketed):
        out.append(f"{where}: explain does not name the {n} buckets")
    # the step-time model counts a bucket as one call where it counted a row a gradient
    calls = {mb: step_shape(sm).calls for mb, (sm, _) in runs.items()}
    saved = {ax: calls[0].get(ax, 0) - calls[0.02].get(ax, 0) for ax in calls[0]}
    saves: dict[str, int] = {}
    for (_, ax, _), k in a["calls"].items():
        saves[ax] = saves.get(ax, 0) + k
    for (_, ax, _), k in b["calls"].items():
        saves[ax] = saves.get(ax, 0) - k
    if {a_: s for a_, s in saved.items() if s} != {a_: s for a_, s in saves.items() if s}:
        out.append(f"{where}: the step-time model saves {saved} calls, the runtime {saves}")
    return out


# every case a test: name -> its checks on one rank (the failures as lines)
CHECKS: dict[str, Callable[[], list[str]]] = {
    # several buckets a step against one device, under autograd's backward
    "gpt-x1y1z1d4-autograd": lambda: _case_failures(
        "gpt", shardc.Mesh.parse("x1y1z1d4"), step_graph=False, bucket_mb=0.02),
    "llama-x2y1z1d2-autograd": lambda: _case_failures(
        "llama", shardc.Mesh.parse("x2y1z1d2"), step_graph=False, bucket_mb=0.02),
    "gpt-x1y1z1d4-blocks": lambda: _case_failures(
        "gpt", shardc.Mesh.parse("x1y1z1d4"), activation_checkpoint="blocks", bucket_mb=0.02),
    # FSDP: the weights' reduce-scatters in buckets (the norms' all-reduces over z too)
    "gpt-x1y1z4d1-autograd": lambda: _case_failures(
        "gpt", shardc.Mesh.parse("x1y1z4d1"), step_graph=False, bucket_mb=0.02),
    "llama-x2y1z2d1-blocks": lambda: _case_failures(
        "llama", shardc.Mesh.parse("x2y1z2d1"), activation_checkpoint="blocks", bucket_mb=0.02),
    "bitwise-x2y1z1d2": lambda: _bitwise_failures("x2y1z1d2"),
    # HSDP: each bucket reduce-scattered over z, then its shards all-reduced over data
    "bitwise-x1y1z2d2-blocks": lambda: _bitwise_failures(
        "x1y1z2d2", ("reduce_scatter",), activation_checkpoint="blocks"),
    "bitwise-x2y1z2d1": lambda: _bitwise_failures("x2y1z2d1", ("reduce_scatter",)),
}


def _case(rank: int, world_size: int, name: str) -> None:
    failures = CHECKS[name]()
    if failures:
        raise AssertionError(f"{len(failures)} failures:\n" + "\n".join(failures))


@pytest.mark.parametrize("name", list(CHECKS))
def test_gradient_buckets_under_autograds_backward_on_4_ranks(ranks, name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks.run(_case, 4, name)
