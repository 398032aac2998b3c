"""Find the custom ``torch.autograd.Function`` calls a model makes while it is traced, and
check that each one's backward is the derivative of its forward; refuse gradient hooks.

``torch.export`` runs a Function's ``forward`` like any other code and keeps only the ops
it ran: its ``backward`` is gone, and the compiled program's gradient is the derivative of
those ops. For most Functions that is the same gradient (Bloom's GeLU, written out with its
derivative to save memory). For some it is not, by design: a straight-through estimator
(``round`` forward, identity backward) would get round's zero gradient, a gradient-reversal
layer the unreversed one, silently. So each Function class the trace meets is run once,
in float64, on random inputs of the shapes it was called with, both ways: through
``apply`` (its own backward) and through ``forward`` under autograd (what the compiled
program computes). Different gradients make compile refuse the model; a Function the
check cannot run (its forward rejects float64 or random values) gets a warning instead.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.nn.modules import module as M

from shardc.core.errors import ShardcError, ShardcWarning


@dataclass
class Call:
    """The first call of one Function class: where, and its arguments' shapes."""
    where: str
    args: list[Any] = field(default_factory=list)  # a tensor as (shape, dtype, needs grad)


def is_user_file(name: str) -> bool:
    """Is ``name`` the model's code, not torch's or shardc's?"""
    return "/torch/" not in name and "/shardc/" not in name and "/passes/" not in name


def _user_frame() -> str:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if is_user_file(name):
            return f"{name}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    return "?"


@contextlib.contextmanager
def record_autograd_functions(found: dict[type, Call]) -> Iterator[None]:
    """While active, note in ``found`` each custom Function class ``apply`` is called on
    (torch's own, such as the reentrant checkpoint, are left out)."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not cls.__module__.startswith("torch.") and cls not in found:
            found[cls] = Call(_user_frame(), [
                (tuple(a.shape), a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else a
                for a in args])
        # ``__get__`` binds both forms ``apply`` has had: a Python classmethod, and from
        # torch 2.14 a C classmethod descriptor (which has no ``__func__``)
        return original.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]


class _Ctx:
    """What ``forward(ctx, ...)`` may call on its context, doing nothing."""

    def save_for_backward(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def mark_dirty(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _tensors(out: Any) -> list[torch.Tensor]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]


def _gradients(cls: type, call: Call, own: bool, wide: bool) -> list[torch.Tensor]:
    """Gradients of ``sum(out * v)`` for the float inputs (seed 0; float64 if ``wide``, else
    each input's own dtype): through the Function's own backward (``own``) or through its
    forward's ops."""
    g = torch.Generator().manual_seed(0)
    args: list[Any] = []
    for a in call.args:
        if isinstance(a, tuple) and len(a) == 3 and isinstance(a[1], torch.dtype):
            shape, dtype, grad = a
            if dtype.is_floating_point:
                args.append(torch.randn(shape, generator=g, dtype=torch.float64 if wide else dtype)
                            .requires_grad_(grad))
            else:
                args.append(torch.zeros(shape, dtype=dtype))
        else:
            args.append(a)
    if own:
        out = cls.apply(*args)  # type: ignore[attr-defined]
    else:
        base = torch.autograd.Function
        new_style = getattr(cls, "setup_context", None) is not getattr(base, "setup_context", None)
        out = cls.forward(*args) if new_style else cls.forward(_Ctx(), *args)  # type: ignore[attr-defined]
    outs = _tensors(out)
    ins = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not outs or not ins:
        return []
    vs = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    got = torch.autograd.grad(outs, ins, vs, allow_unused=True)
    return [torch.zeros_like(i) if d is None else d for i, d in zip(ins, got)]


def check_backwards(found: dict[type, Call], model_name: str) -> None:
    """Refuse the model if a Function's backward is not its forward's derivative."""
    for cls, call in found.items():
        name = f"{cls.__module__}.{cls.__qualname__}"
        worst, why = None, ""
        # float64 where the forward takes it: a backward written out as the derivative
        # (Bloom's GeLU) agrees to its constants' rounding, ~1e-10 relative, so 1e-6 is
        # loose. A forward tied to its module's fp32 weights (Reformer's reversible
        # blocks) runs in its own dtype, where rounding alone reaches ~1e-5: 1e-3. A
        # backward that is not the derivative (round's zero against an identity) is off
        # by the gradient itself, 1 relative.
        for wide, tolerance in ((True, 1e-6), (False, 1e-3)):  # noqa: B007 - read after the loop
            inputs = "float64" if wide else "its own dtype's"
            try:
                with torch.enable_grad():
                    own = _gradients(cls, call, own=True, wide=wide)
                    derived = _gradients(cls, call, own=False, wide=wide)
            except Exception as e:  # noqa: BLE001 - a check that cannot run is said so
                why = f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                continue
            if not all(bool(t.isfinite().all()) for t in own + derived):
                why = "gave gradients that are not finite"
                continue
            worst = max((((a - b).abs().max() / torch.maximum(a.abs().max(), b.abs().max())
                          .clamp_min(1e-12)).item() for a, b in zip(own, derived)), default=0.0)
            break
        if worst is None:
            warnings.warn(
                f"shardc.compile: {model_name} calls the torch.autograd.Function {name} at "
                f"{call.where}. torch.export keeps only its forward, so the compiled "
                "program differentiates the forward's ops instead of calling its backward, "
                "and shardc could not check that the two agree (running it on random "
                f"inputs {why}). If its backward is not the derivative of its forward (a "
                "straight-through estimator), the gradients will differ from one device's.",
                ShardcWarning, stacklevel=4)
            continue
        if worst > tolerance:
            raise ShardcError(
                f"shardc.compile: {model_name} calls the torch.autograd.Function {name} at "
                f"{call.where}, whose backward is not the derivative of its forward (they "
                f"differ by {worst:.2g} relative on random {inputs} inputs: a straight-through "
                "estimator or a gradient reversal, say). torch.export keeps only the forward, "
                "so shardc would differentiate the forward's ops and its gradients would "
                "silently differ from one device's. Write the estimator with detach, which "
                "export keeps: x + (f(x) - x).detach() has f's value and x's gradient.")


@contextlib.contextmanager
def record_gradient_hooks(found: list[str]) -> Iterator[None]:
    """While active, note in ``found`` where forward calls ``tensor.register_hook``."""
    original = torch.Tensor.register_hook

    def register_hook(self: torch.Tensor, hook: Any) -> Any:
        found.append(_user_frame())
        return original(self, hook)

    torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook = original  # type: ignore[method-assign]


def refuse_gradient_hooks(model: torch.nn.Module, found: list[str]) -> None:
    """A gradient hook changes the gradient where autograd passes it. The compiled
    program's backward is traced from the forward's ops, and export keeps no hook:
    forward's ``register_hook`` and a module's backward hooks would be dropped, silently."""

    modules = [n or "<root>" for n, m in model.named_modules()
               if getattr(m, "_backward_hooks", None) or getattr(m, "_backward_pre_hooks", None)]
    if getattr(M, "_global_backward_hooks", None) or getattr(M, "_global_backward_pre_hooks", None):
        modules.append("every module (torch.nn.modules.module.register_module_full_backward_hook)")
    where = [f"tensor.register_hook at {w}" for w in dict.fromkeys(found)] + \
        [f"a backward hook on {m}" for m in modules]
    if where:
        raise ShardcError(
            f"shardc.compile: {type(model).__name__} changes gradients with hooks "
            f"({'; '.join(where)}). The compiled program's backward is derived from the "
            "forward's ops, where torch.export keeps no hook, so its gradients would silently "
            "differ from one device's. Write the change into forward instead: "
            "h * s + h.detach() * (1 - s) has h's value and s times its gradient.")
