"""Peak memory per rank for each memory and precision option, beside FSDP2 at the same
configuration and beside shardc's estimate (``shardc.planning.memory.estimate``):

    python benchmarks/memory.py                      # 4 ranks, the default meshes
    python benchmarks/memory.py --layers 12 --meshes x1y1z4d1 x1y1z2d2 --options none blocks

A GPT (``--layers`` blocks, dim 64, 64 tokens, 16 sequences per data x z rank) trained
with AdamW on gloo CPU ranks. What one rank holds at the peak of a step is measured as

    resident (summed from the tensors a rank keeps between steps: its parameters, the
    program copies of shard_optimizer, the optimizer's state, after a warm-up step)
  + step peak (the most bytes live at once above that during a forward and backward:
    torch's profiler records every allocation and free; the smaller of two steps)

on rank 0 (measured: resident, step peak, total), beside the estimate of the same two
parts from the compiled program alone (``shardc.planning.memory.estimate``, what
``shardc.plan(..., memory="traced")`` uses) and the planner's fast formula (16 bytes per
parameter element plus every forward intermediate; ``plan(memory="formula")``). FSDP2 (``fully_shard`` per block and at the root; HSDP on a z x data mesh;
keeping gathered weights like shardc's default, ``reshard_after_forward=False``; with
``MixedPrecisionPolicy(bf16, fp32)`` for the bf16 row) is measured the same way where a
mesh has an FSDP2 counterpart (x = y = 1, z > 1).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402
from harness import run_on_ranks  # noqa: E402
from models import GPT  # noqa: E402

import shardc  # noqa: E402
from shardc.planning.memory import estimate, measured_peak  # noqa: E402

OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "blocks": {"activation_checkpoint": "blocks"},
    "selective": {"activation_checkpoint": "selective"},
    "bf16": {"precision": "bf16"},
    "shard_optimizer": {"shard_optimizer": True},
    "all": {"activation_checkpoint": "selective", "precision": "bf16", "shard_optimizer": True},
}


def _bytes(ts: Any) -> int:
    out = 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            out += t.numel() * t.element_size()
    return out


def _optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return _bytes(v for st in opt.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)


def _step_peak(model: Any, inputs: list[torch.Tensor]) -> int:
    """Most bytes live at once above the start during one forward and backward."""
    model.zero_grad(set_to_none=True)
    return measured_peak(lambda: model(*inputs).backward())


def _measure(model: Any, params: Any, inputs: list[torch.Tensor], extra: int = 0) -> tuple[int, int]:
    """(resident, step peak) after a warm-up step of AdamW."""
    opt = torch.optim.AdamW(params, lr=1e-3)
    model(*inputs).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    peak = min(_step_peak(model, inputs) for _ in range(2))
    resident = _bytes(p for p in model.parameters()) + extra + _optimizer_bytes(opt)
    return resident, peak


def _fsdp2(spec: str, model: torch.nn.Module, inputs: list[torch.Tensor], bf16: bool) -> tuple[int, int]:
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6 kept it here
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard  # type: ignore
    from torch.distributed.device_mesh import init_device_mesh

    mesh = shardc.Mesh.parse(spec)
    dm = (init_device_mesh("cpu", (mesh.z,)) if mesh.data == 1 else
          init_device_mesh("cpu", (mesh.data, mesh.z), mesh_dim_names=("replicate", "shard")))
    kw: dict[str, Any] = {"mesh": dm, "reshard_after_forward": False}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return _measure(model, model.parameters(), inputs)


def _run(rank: int, world: int, spec: str, layers: int, options: list[str], rows: list) -> None:
    warnings.simplefilter("ignore")
    mesh = shardc.Mesh.parse(spec)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (16 * mesh.data * mesh.z, 64), generator=g)
    local = [shardc.shard_batch(tokens, mesh)] * 2
    out = []
    for name in options:
        torch.manual_seed(0)
        model = GPT(dim=64, layers=layers, heads=8, seq=64)
        sm = shardc.compile(model, mesh, example_inputs=(tokens, tokens), **OPTIONS[name])
        est = estimate(sm)  # what plan(..., memory="traced") puts in its candidates
        # the planner's fast formula for the same mesh and options, for contrast
        cands = shardc.plan(model, world, "perlmutter", (tokens, tokens), verify=False,
                            exact_top=64, **OPTIONS[name])
        formula = next(c.memory_bytes_per_rank for c in cands if c.mesh == mesh)
        copies = _bytes(zp.full for zp in sm._zero.values())
        resident, peak = _measure(sm, sm.parameters(), local, copies)
        fsdp = None
        if mesh.x == mesh.y == 1 and mesh.z > 1 and name in ("none", "bf16"):
            torch.manual_seed(0)
            fsdp = _fsdp2(spec, GPT(dim=64, layers=layers, heads=8, seq=64), local, name == "bf16")
        out.append((name, resident, peak, est.resident, est.step_peak, formula, fsdp))
    if rank == 0:
        rows.extend((spec, *r) for r in out)
        _print(spec, layers, out)


def _print(spec: str, layers: int, out: list) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 2 ** 20
    t = Table(title=f"{spec}, GPT of {layers} blocks: MiB per rank (rank 0)")
    for c in ("option", "resident", "step peak", "total", "estimate (traced)", "/ measured",
              "planner formula", "/ measured", "FSDP2 total"):
        t.add_column(c, justify="right")
    for name, res, peak, eres, epeak, formula, fsdp in out:
        total = res + peak
        t.add_row(name, f"{res / mib:.2f}", f"{peak / mib:.2f}", f"{total / mib:.2f}",
                  f"{(eres + epeak) / mib:.2f}", f"{(eres + epeak) / total:.2f}",
                  f"{formula / mib:.2f}", f"{formula / total:.2f}",
                  "-" if fsdp is None else f"{sum(fsdp) / mib:.2f}")
    Console(width=150).print(t)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--meshes", nargs="+", default=["x1y1z1d4", "x1y1z4d1", "x1y1z2d2", "x2y1z1d2"])
    ap.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    args = ap.parse_args()
    for spec in args.meshes:
        run_on_ranks(_run, shardc.Mesh.parse(spec).world_size, spec, args.layers, args.options, [])
