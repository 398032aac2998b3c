"""An output of the step whose collective is still in flight (``passes/defer.py``).

A ``PendingOutput`` is a tensor of the output's shape, dtype and device that holds no
data yet. The first operation that reads it (``.item()``, printing, arithmetic,
``float()``, ``torch.save``) waits for the collective, runs the few ops after it, and
from then on every read sees that value; a detached copy stays pending and shares the
value. Operations that read only its shape (``torch.ones_like``, the seed of
``loss.backward()``) do not wait, which is the point: the wait moves past backward.
``StepRunner.backward`` settles the step's pending outputs when it ends, and the next
forward settles any left over, so no collective is left unwaited for long.

Like torch's ``AsyncCollectiveTensor``, but the pending part is a small program (the
wait and the ops after it, e.g. the global mean's division), and ``ones_like`` /
``is_same_size`` do not count as reads.
"""
from __future__ import annotations

import copy
import threading
import weakref
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten

# ops that read only metadata: answered from a stand-in of the same shape, dtype, device
_METADATA_ONLY = {aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default,
                  aten.full_like.default, aten.is_same_size.default}


class Cell:
    """The pending computation, run once, by whichever thread reads first."""

    def __init__(self, compute: Callable[[], torch.Tensor]) -> None:
        self._compute: Callable[[], torch.Tensor] | None = compute
        self._value: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        _OUTSTANDING.add(self)

    def get(self) -> torch.Tensor:
        with self._lock:
            if self._compute is not None:
                compute, self._compute = self._compute, None
                _OUTSTANDING.discard(self)
                try:
                    with torch.no_grad():
                        self._value = compute()
                except BaseException as e:  # noqa: BLE001 - kept and raised at every read
                    # the wait failed (a dead peer: CollectiveError): every later read
                    # of this output raises the same error, not a value
                    self._error = e
            if self._error is not None:
                raise self._error
            assert self._value is not None
            return self._value


_OUTSTANDING: weakref.WeakSet[Cell] = weakref.WeakSet()


def settle_all() -> None:
    """Wait for every output still pending in this process (a forward whose loss nobody
    read and that no backward followed): before the next step issues its collectives."""
    for cell in list(_OUTSTANDING):
        cell.get()


class PendingOutput(torch.Tensor):
    cell: Cell

    # every torch function reaches __torch_dispatch__ as for a plain tensor, instead of
    # re-wrapping its plain results in this class
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, like: Any, device: torch.device, cell: Cell) -> "PendingOutput":
        """``like``: anything with the output's shape, strides and dtype (a fake value)."""
        r = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=device,
            requires_grad=False)
        r.cell = cell
        return r

    def _stand_in(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device=self.device)

    def value(self) -> torch.Tensor:
        """The output's value (waits the first time)."""
        return self.cell.get()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _METADATA_ONLY:
            return func(*tree_map_only(PendingOutput, PendingOutput._stand_in, args),
                        **tree_map_only(PendingOutput, PendingOutput._stand_in, kwargs))
        if func is aten.detach.default:
            return PendingOutput(args[0], args[0].device, args[0].cell)
        return func(*tree_map_only(PendingOutput, PendingOutput.value, args),
                    **tree_map_only(PendingOutput, PendingOutput.value, kwargs))

    # the Python-level reads that do not go through the dispatcher
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        text = repr(self.value())
        if self.grad_fn is not None:
            text = f"{text[:-1]}, grad_fn=<{type(self.grad_fn).__name__}>)"
        return text

    def __format__(self, spec: str) -> str:
        return format(self.value(), spec)

    def tolist(self) -> Any:  # type: ignore[override]
        return self.value().tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        return self.value().numpy(force=force)

    def __reduce_ex__(self, proto: Any) -> Any:  # torch.save, pickle: the value
        return self.value().detach().__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return copy.deepcopy(self.value().detach(), memo)
