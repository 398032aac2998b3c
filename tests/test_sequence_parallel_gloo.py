"""Sequence parallelism (``sequence_parallel=True``, the default) on real gloo processes:
between the tensor-parallel GEMMs, norms, dropout and residual adds run on the tokens cut
over x (or y), the row-parallel GEMM's partial sum reduce-scattered onto them and the
next GEMM's input all-gathered.

Each case trains three AdamW steps beside one device exactly as ``test_train_gloo``
judges every mesh (``harness.train_side_by_side``, same tolerances, explained there):
every parameter's gradient against float64 at each step (the norm's scale and shift now
summed over x, the cut tokens' dropout masks cut from one device's), the losses, the
weights after the steps, and the bytes handed to torch.distributed equal to the comm
report's. Each case also checks that the program did cut its tokens (a reduce-scatter
over the tensor axis in forward). The cases: the GPT (with dropout), transformers' Llama
(RMS norms) and GPT-2 (Conv1D's flattened rows) on x alone and beside data, z, y and
context, and with the options that change the step program (block recompute,
shard_optimizer, autograd's backward, inductor, resharding after forward, bf16 in
tests/test_precision_gloo.py).
"""
from __future__ import annotations

import traceback
from typing import Any, Callable

import pytest
import torch
from harness import built_once, lm_batches, train_side_by_side
from models import GPT, gpt2, llama
from test_train_gloo import EPS, LR, _run_failures

import shardc

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt": lambda: GPT(layers=2), "gpt_drop": lambda: GPT(layers=2, dropout=0.1),
    "llama": lambda: llama(layers=2), "gpt2": lambda: gpt2(layers=2)}
_model = built_once(MODELS)


def _train_failures(name: str, spec: str, opts: dict | None = None) -> list[str]:
    mesh = shardc.Mesh.parse(spec)
    opts = opts or {}
    where = f"{name}@{spec}" + "".join(f" {k}={v}" for k, v in opts.items())
    batches = lm_batches()
    try:
        run = train_side_by_side(_model(name), batches, mesh, lr=LR, eps=EPS, **opts)
        out = _run_failures(where, run, mesh, batches)
    except Exception:  # noqa: BLE001 - a compile or runtime error is this case's failure
        return [f"{where}: raised\n{traceback.format_exc()}"]
    axis = "x" if mesh.x > 1 else "y"
    if not any("sequence parallel" in d for d in run.sm.decisions):
        out.append(f"{where}: no sequence parallel decision: {run.sm.decisions}")
    if ("reduce_scatter", axis, "forward") not in run.sm.measured_comm():
        out.append(f"{where}: no reduce-scatter over {axis} in forward: {run.sm.measured_comm()}")
    return out


CASES = {
    2: [("gpt_drop", "x2y1z1d1"), ("llama", "x2y1z1d1"), ("gpt2", "x2y1z1d1")],
    4: [("gpt", "x4y1z1d1"), ("llama", "x2y1z1d2"), ("gpt2", "x2y1z2d1"), ("gpt_drop", "x2y1z1d2"),
        ("llama", "x2y2z1d1"), ("gpt", "x2y2z1d1"),
        # the sequence cut over context and, inside that, over x
        ("llama", "x2y1c2z1d1", {"context_layout": "contiguous"}), ("gpt", "x2y1c2z1d1"),
        # the options, each on a mesh with two axes > 1
        ("llama", "x2y1z1d2", {"activation_checkpoint": "blocks"}),
        ("gpt", "x2y1z1d2", {"shard_optimizer": True}),
        ("gpt2", "x2y1z2d1", {"step_graph": False}),
        ("gpt", "x2y1z1d2", {"backend": "inductor"}),
        ("llama", "x2y1z2d1", {"reshard_after_forward": True}),
        ("gpt_drop", "x2y1z2d1", {"activation_checkpoint": "selective"})],
}


def _run_cases(rank: int, world: int, cases: list[tuple]) -> None:
    failures = [line for case in cases for line in _train_failures(*case)]
    if failures:
        raise AssertionError("\n".join(failures))


@pytest.mark.parametrize("case", [c for w in sorted(CASES) for c in CASES[w]],
                         ids=lambda c: "-".join([*c[:2], *(f"{k}.{v}" for k, v in (c[2] if len(c) > 2 else {}).items())]))
def test_trains_like_one_device(ranks: Any, case: tuple) -> None:
    ranks.run(_run_cases, shardc.Mesh.parse(case[1]).world_size, [case])


def _on_and_off_agree(rank: int, world: int) -> None:
    """The same steps with and without it: one device's loss, and gradients that agree to
    fp32 reduction order (the sums run in another order, nothing else differs)."""
    mesh = shardc.Mesh.parse("x2y1z1d2")
    batches = lm_batches()
    grads = []
    for sp in (True, False):
        sm = shardc.compile(_model("llama")(), mesh, example_inputs=batches[0], sequence_parallel=sp)
        sm(*(shardc.shard_batch(t, mesh) for t in batches[0])).backward()
        grads.append(sm.full_grads())
        assert any("sequence parallel" in d for d in sm.decisions) == sp
    for k, a in grads[0].items():
        b = grads[1][k]
        # a few fp32 roundings of sums over 128 tokens apart: well inside 1e-5 of the
        # gradient's scale, far below any misplaced or missing term
        scale = b.abs().max().item() or 1.0
        assert (a - b).abs().max().item() <= 1e-5 * scale, k


def test_on_and_off_agree(ranks: Any) -> None:
    ranks.run(_on_and_off_agree, 4)
