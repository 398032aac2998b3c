"""Mixed precision: the policy ``compile(precision=...)`` takes, and the autocast guard.

A policy says in which dtype the model computes and in which the gradients are summed.
Parameters (and so the optimizer's state) stay in their own dtype, fp32: they are the
master copy. The compiler captures the policy in the trace itself: the model is traced
with each floating parameter cast to the compute dtype at its use and floating inputs
cast on entry (``passes/trace.py``), so the model's own dtype logic (Llama's RMSNorm
upcasting to fp32 and back, a loss computed in fp32) sees what it would see on one
device running the same policy. The lowering then moves each cast in front of the
weight's all-gather, so weights travel in the compute dtype, and the gather's backward
reduce-scatters the gradient in the reduce dtype (``runtime.collectives``). Activations
and their gradients are in the compute dtype, so the all-reduces of partial activations
and of dI move compute-dtype bytes; the post-backward reductions of parameter gradients
run in the reduce dtype. The comm report counts every collective in the dtype it sends.

``torch.autocast`` is different: around ``compile`` it is invisible to ``torch.export``
(the traced graph stays fp32), and around a compiled program's forward it recasts the
GEMMs at run time, so the collectives would move other dtypes than the report counts.
Both are refused, naming ``precision=`` instead. An autocast region inside the model's
own forward is fine: the trace records its casts as ops.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from shardc.core.errors import OptionError, ShardcError

_DEVICE_TYPES = ("cpu", "cuda")


def active_autocast() -> list[str]:
    """The device types on which ``torch.autocast`` is enabled here and now."""
    out = []
    for dev in _DEVICE_TYPES:
        try:
            on = torch.is_autocast_enabled(dev)
        except (RuntimeError, TypeError):  # a torch without this device type's autocast
            on = False
        if on:
            out.append(dev)
    return out


def check_no_autocast(where: str) -> None:
    devs = active_autocast()
    if devs:
        dtype = torch.get_autocast_dtype(devs[0])
        raise ShardcError(
            f"{where}: torch.autocast is active ({', '.join(devs)}, {dtype}). shardc compiles "
            "and reports its program in the dtypes it traced, so autocast would make the "
            "runtime move other bytes than the comm report counts. Run shardc.compile and "
            "the compiled module outside torch.autocast, and ask the compiler for mixed "
            "precision instead: shardc.compile(..., precision='bf16') computes and communicates "
            "in bf16 with fp32 parameters and gradient reductions.")


_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """A mixed-precision policy (FSDP2's ``MixedPrecisionPolicy`` in spirit).

    ``compute``: the dtype floating parameters are cast to at their use (before their
    all-gather) and floating inputs on entry; every activation follows from it.
    ``reduce``: the dtype in which parameter gradients are summed across ranks (the
    reduce-scatter of a gathered weight's gradient and the post-backward all-reduces).
    The parameters themselves, and so the optimizer state, keep their own dtype.

    ``precision="bf16"`` is ``Precision(torch.bfloat16, torch.float32)``;
    ``Precision(torch.bfloat16, torch.bfloat16)`` also sums gradients in bf16 (half the
    bytes, with bf16's 8-bit mantissa on each partial sum)."""

    compute: torch.dtype = torch.bfloat16
    reduce: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        ok = (torch.float32, torch.bfloat16)
        if self.compute not in ok or self.reduce not in ok:
            raise OptionError(
                f"shardc.Precision: compute and reduce must each be torch.float32 or "
                f"torch.bfloat16, got compute={self.compute}, reduce={self.reduce} (fp16 would "
                "need loss scaling, which shardc does not do).")
        if self.compute == torch.float32 and self.reduce != torch.float32:
            raise OptionError("shardc.Precision: reducing gradients in a narrower dtype than the "
                             "fp32 compute gains nothing a user would want; use "
                             "Precision(torch.bfloat16, torch.bfloat16) or precision='fp32'.")

    @property
    def mixed(self) -> bool:
        return self.compute != torch.float32

    def __str__(self) -> str:
        if not self.mixed:
            return "fp32"
        short = {torch.float32: "fp32", torch.bfloat16: "bf16"}
        return f"{short[self.compute]} compute, {short[self.reduce]} gradient reductions"


def as_precision(value: Any) -> Precision:
    """``compile``'s ``precision`` argument as a policy: "fp32", "bf16" or a Precision."""
    if isinstance(value, Precision):
        return value
    if isinstance(value, str) and value in _NAMES:
        return Precision(_NAMES[value], torch.float32)
    raise OptionError(f"shardc.compile: precision={value!r} is not one of ('fp32', 'bf16') or a "
                     "shardc.Precision(compute=..., reduce=...).")


def reduce_dtype(grad: torch.dtype, policy: "Precision") -> torch.dtype | None:
    """The dtype a gradient of dtype ``grad`` is summed in under ``policy``; None: its
    own. Only a mixed policy changes it, and never to a wider dtype (a float64 model
    under the default policy reduces in float64)."""
    if not policy.mixed:
        return None
    return policy.reduce if narrows(grad, policy.reduce) else None


def narrows(src: torch.dtype, dst: torch.dtype) -> bool:
    """Is a cast from ``src`` to ``dst`` a floating cast to fewer bytes (worth doing
    before a collective rather than after it)?"""
    return (src.is_floating_point and dst.is_floating_point
            and torch.empty((), dtype=dst).element_size() < torch.empty((), dtype=src).element_size())


class CastAtUse(torch.nn.Module):
    """``model`` run as one device runs it under a policy's compute dtype: what
    ``compile(precision=...)`` traces, and the one-device baseline to compare a compiled
    mixed-precision model with (``CastAtUse(model, torch.bfloat16)(*batch)``).

    It has the model's parameters, buffers and submodules under the same names (the
    dicts are shared, not copied), so torch.export lifts them with the model's own names
    and module paths, and an optimizer over either steps the same fp32 tensors. Forward
    reads every floating parameter through a cast, casts floating inputs, and runs the
    model's own forward (its hooks included)."""

    _inner: torch.nn.Module
    _dtype: torch.dtype
    _sig: inspect.Signature | None

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        for attr in ("_parameters", "_buffers", "_modules"):
            object.__setattr__(self, attr, getattr(model, attr))
        object.__setattr__(self, "_inner", model)
        object.__setattr__(self, "_dtype", dtype)
        self.training = model.training
        # the model's own signature, so the traced inputs keep their names (error
        # messages name 'tokens', not 'args_0')
        try:
            self._sig = inspect.signature(model.forward)
        except (TypeError, ValueError):
            self._sig = None

    def _cast(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != self._dtype:
            return t.to(self._dtype)
        return t

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        params = {n: self._cast(p) for n, p in self._inner.named_parameters()}
        args, kwargs = pytree.tree_map(self._cast, (args, kwargs))
        return torch.func.functional_call(self._inner, params, args, kwargs)

    @property
    def forward(self) -> Any:  # type: ignore[override]
        run = self._run
        if self._sig is not None:
            def bound(*args: Any, **kwargs: Any) -> Any:
                return run(*args, **kwargs)
            bound.__signature__ = self._sig  # type: ignore[attr-defined]
            return bound
        return run
