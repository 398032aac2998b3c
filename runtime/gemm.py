"""The forms of a GEMM, timed on this rank's device, and the ranks' agreement on them.

A matrix product C = A @ B reaches BLAS (MKL, cuBLAS, rocBLAS) as one of its forms by
the memory layout of its operands: an operand stored row by row is "N", one stored
column by column (a transposed view of a row-major tensor) is "T". PyTorch hands the
library whatever layout autograd produced: a weight gradient dW = x^T g is usually TN, a
forward x @ W^T is NT. Libraries tune their forms unevenly (the AxoNN paper measured a TN
product at 6% of peak on MI250X where NN ran at 55%), so ``gemm_modes`` may copy an
operand into the other layout before the product when that is faster in total.

``passes/gemm_modes.py`` decides; this module measures (``time_forms``) and makes every
rank take the same decision (``agree``): the forms add the same products in different
orders, and ranks that hold replicas of one value must compute it the same way.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

MODES = ("NN", "NT", "TN")
WANT = {"NN": ("N", "N"), "NT": ("N", "T"), "TN": ("T", "N")}


def layout(t: torch.Tensor) -> str:
    """"N" (rows contiguous), "T" (columns contiguous: a transposed row-major matrix) or
    "S" (any other strides) of a matrix or a batch of matrices."""
    if t.is_contiguous():
        return "N"
    if t.transpose(-2, -1).is_contiguous():
        return "T"
    return "S"


def form(a: torch.Tensor, b: torch.Tensor) -> str:
    return layout(a) + layout(b)


def as_layout(t: torch.Tensor, want: str) -> torch.Tensor:
    """``t`` stored as ``want`` ("N" or "T"): itself when it already is, else a copy."""
    if layout(t) == want:
        return t
    if want == "N":
        return t.contiguous()
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _like(v: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor with ``v``'s shape, strides and dtype (``v`` may be fake)."""
    need = 1 + sum((s - 1) * st for s, st in zip(v.shape, v.stride()) if s > 0)
    base = torch.randn(max(need, 1), dtype=v.dtype, device=device)
    return base.as_strided(tuple(v.shape), tuple(v.stride()))


def _sync(device: torch.device) -> None:
    mod = getattr(torch, device.type, None)
    fn = getattr(mod, "synchronize", None)
    if fn is not None and device.type != "cpu":
        fn()


def _seconds(fn: Callable[[], Any], device: torch.device, min_total: float = 2e-3) -> float:
    """Seconds per call of ``fn``: the best of three runs of a loop long enough to time
    (at least ``min_total`` seconds, or 256 calls)."""
    fn()
    fn()
    _sync(device)
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        dt = time.perf_counter() - t0
        if dt >= min_total or n >= 256:
            break
        n *= 4
    best = dt / n
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def time_forms(op: Any, vals: list[torch.Tensor], device: torch.device) -> dict[str, float]:
    """Seconds of the product ``op`` (aten mm, bmm or addmm) on operands shaped, strided
    and typed like ``vals`` (for addmm: bias, A, B), run as traced ("traced") and in
    each form of ``MODES`` that differs from it, the copies into that form included."""
    real = [_like(v, device) for v in vals]
    *head, a, b = real
    out: dict[str, float] = {"traced": _seconds(lambda: op(*head, a, b), device)}
    traced = form(a, b)
    for mode in MODES:
        if mode == traced:
            continue
        wa, wb = WANT[mode]
        out[mode] = _seconds(lambda: op(*head, as_layout(a, wa), as_layout(b, wb)), device)
    return out


def agree(local: dict[tuple, dict[str, float]]) -> dict[tuple, str]:
    """Every rank's timings summed per GEMM and form; the fastest form of each (the
    traced one on a tie). One collective over all ranks; every rank must call it,
    with its own timings (possibly none), once per step program built."""
    merged: dict[tuple, dict[str, float]] = {}
    if dist.is_initialized() and dist.get_backend() != "fake" and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
    else:
        everyone = [local]
    for times in everyone:
        for key, per in (times or {}).items():
            acc = merged.setdefault(key, {})
            for mode, s in per.items():
                acc[mode] = acc.get(mode, 0.0) + s
    chosen = {}
    for key, per in merged.items():
        best = min(per, key=lambda m: (per[m], m != "traced"))
        chosen[key] = best
    return chosen
