"""The step program's collectives and random draws as ``torch.library`` custom ops, so
that a compiler can take a whole part of the step program (``backend="inductor"``) with
its collectives and draws inside, in the program's order.

The ``run_*`` functions of ``runtime.functional`` hand the async ``Work`` from the issue
to the wait through a Python dict keyed by the in-flight buffer; a compiler can neither
trace that nor see the hand-off. Here the two ends are ops with schemas inductor reads:

- ``shardc::issue(x, after, slot, ...) -> token``: counts and issues the collective (the
  same ``run_*`` call the eager program makes) and parks its flight under ``slot``. The
  token is an empty tensor: the data dependence that puts the wait after the issue.
- ``shardc::wait(token, keep, after, slot, shape, dtype) -> (out, token)``: waits and
  returns the collective's result as a tensor the compiled code has never seen before, so
  no compiled kernel can read it while the collective still writes it.
- ``shardc::hand_off(token, keep, slot, shape, dtype) -> out``: an issue whose wait is in
  another graph (a deferred output, ``passes/defer.py``): the in-flight buffer leaves the
  compiled graph without a wait, and its flight goes back to ``functional.STATE.flight``
  where the eager ``run_wait`` finds it.

Why not torch's functional collectives (``_c10d_functional.*``, which inductor lowers
itself): on gloo their all-gather corrupted the heap (``runtime.functional`` says how it
was found), and the runtime's own calls count the bytes the comm report checks.

Two hazards of an opaque async op, and what closes each:
- the collective reads ``x`` after the issue returns (gloo runs it on its own thread).
  ``keep`` hands ``x`` to the wait, so the compiled code keeps ``x``'s buffer alive, and
  never reuses it, until the collective is done. An all-reduce works on a copy made at
  the issue, so it keeps nothing.
- every rank must issue the collectives of a group in the same order, and the compiled
  code must not reorder them. ``after`` chains every issue and wait, in the program's
  order, through the previous one's token: no order of the compiled code can swap two.

Random draws are in the chain too: ``shardc::draw(tensors, after, key)`` runs the random
op registered under ``key`` (``DRAWS``) and returns a fresh tensor. The program's draws
take the default generator's numbers in the order one device takes them (that is how
every rank draws one device's dropout masks), so their order is part of the result.
Inductor does not keep it: with ``fallback_random`` it calls torch's kernel for an in-place
``bernoulli_``, but it emitted the third of a GPT block's three after the kernel that read
its mask (torch 2.13), which read uninitialised memory.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from shardc.runtime import functional as F


class _Slots(threading.local):
    """Per thread, as ``functional.STATE``: a threaded world runs each rank as a thread."""

    def __init__(self) -> None:
        self.flight: dict[int, tuple] = {}


SLOTS = _Slots()


def _token(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=like.device)


@torch.library.custom_op("shardc::issue", mutates_args=())
def issue(x: torch.Tensor, after: torch.Tensor, slot: int, collective: str, op: str,
          group_size: int, out_splits: list[int], in_splits: list[int], rt: str, axis: str,
          ph: str) -> torch.Tensor:
    if collective == "all_gather":
        out = F.run_all_gather(x, group_size, "", rt, axis, ph)
    elif collective == "reduce_scatter":
        out = F.run_reduce_scatter(x, op, group_size, "", rt, axis, ph)
    elif collective == "all_reduce":
        out = F.run_all_reduce(x, op, "", rt, axis, ph)
    elif collective == "all_to_all":
        out = F.run_all_to_all(x, out_splits, in_splits, "", rt, axis, ph)
    elif collective == "restripe":  # an all-to-all of a re-cut (functional.run_restripe)
        out = F.run_restripe(x, out_splits, in_splits, "", rt, axis, ph)
    else:
        raise ValueError(f"shardc::issue: no collective {collective!r}")
    SLOTS.flight[slot] = F.STATE.flight.pop(id(out))
    return _token(x)


@issue.register_fake
def _(x, after, slot, collective, op, group_size, out_splits, in_splits, rt, axis, ph):  # type: ignore[no-untyped-def]
    return _token(x)


def _claim(slot: int) -> tuple:
    flight = SLOTS.flight.pop(slot, None)
    if flight is None:
        raise RuntimeError(f"shardc::wait: no collective in flight under slot {slot}: the compiled "
                           "step program waits on a collective it did not issue")
    return flight


@torch.library.custom_op("shardc::wait", mutates_args=())
def wait(token: torch.Tensor, keep: Optional[torch.Tensor], after: torch.Tensor, slot: int,
         shape: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    flight = _claim(slot)
    out = flight[6]
    F.STATE.flight[id(out)] = flight
    return F.run_wait(out).view(shape), _token(token)


@wait.register_fake
def _(token, keep, after, slot, shape, dtype):  # type: ignore[no-untyped-def]
    return token.new_empty(shape, dtype=dtype), _token(token)


@torch.library.custom_op("shardc::issue_in_place", mutates_args=("x",))
def issue_in_place(x: torch.Tensor, after: torch.Tensor, slot: int, op: str, rt: str, axis: str,
                   ph: str) -> torch.Tensor:
    """The all-reduce of a buffer nothing else reads into itself, with no copy: a packed
    gradient bucket (``passes/ordered_ops.py`` gives this op no other all-reduce)."""
    out = F.run_all_reduce(x, op, "", rt, axis, ph, inplace=True)
    SLOTS.flight[slot] = F.STATE.flight.pop(id(out))
    return _token(x)


@issue_in_place.register_fake
def _(x, after, slot, op, rt, axis, ph):  # type: ignore[no-untyped-def]
    return _token(x)


@torch.library.custom_op("shardc::wait_in_place", mutates_args=("x",))
def wait_in_place(token: torch.Tensor, x: torch.Tensor, after: torch.Tensor, slot: int) -> torch.Tensor:
    """Wait for ``issue_in_place``'s all-reduce; ``x`` then holds its result. The compiler
    passes the buffer the issue reduces, unless it could not reuse it in place: then a copy
    of it, made before this wait (so of bytes still being written), which the result
    overwrites here. Either way ``x`` ends with the reduced value."""
    flight = _claim(slot)
    out = flight[6]
    F.STATE.flight[id(out)] = flight
    F.run_wait(out)
    if x.data_ptr() != out.data_ptr():
        x.copy_(out.view_as(x))
    return _token(token)


@wait_in_place.register_fake
def _(token, x, after, slot):  # type: ignore[no-untyped-def]
    return _token(token)


class _Done:
    """The Work of a collective already waited for."""

    def wait(self) -> bool:
        return True


@torch.library.custom_op("shardc::hand_off", mutates_args=())
def hand_off(token: torch.Tensor, keep: Optional[torch.Tensor], slot: int, shape: list[int],
             dtype: torch.dtype) -> torch.Tensor:
    flight = _claim(slot)
    out = flight[6]
    if keep is not None:
        # the collective still reads ``keep``, and once this op returns the compiled code
        # takes ``keep`` for dead and may reuse its memory: wait here (the eager tail's
        # wait then finds it done). Only an all-reduce, which works on its own copy,
        # stays in flight past the graph: the deferred loss's case.
        F.STATE.flight[id(out)] = flight
        F.run_wait(out)
        flight = (*flight[:5], _Done(), out, None)
    view = out.view(shape)
    F.STATE.flight[id(view)] = flight  # where the eager tail's run_wait looks
    return view


@hand_off.register_fake
def _(token, keep, slot, shape, dtype):  # type: ignore[no-untyped-def]
    return token.new_empty(shape, dtype=dtype)


# key -> (op, args, kwargs, shape, strides, dtype, inplace): a random op of a program, its tensor
# arguments replaced by ``Arg(i)`` (the i-th tensor the draw op receives); registered
# by passes/ordered_ops.py, once per node, and read on every call
DRAWS: dict[int, tuple] = {}


class Arg:
    """The place of the draw's ``i``-th tensor argument among the op's arguments."""

    def __init__(self, i: int) -> None:
        self.i = i


def _fill(v: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(v, Arg):
        return tensors[v.i]
    if isinstance(v, (list, tuple)):
        return type(v)(_fill(a, tensors) for a in v)
    return v


@torch.library.custom_op("shardc::draw", mutates_args=())
def draw(tensors: list[torch.Tensor], after: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    op, args, kwargs, shape, strides, dtype, inplace = DRAWS[key]
    args, kwargs = _fill(args, tensors), _fill(kwargs, tensors)
    if inplace:
        # an in-place draw (``bernoulli_``) writes every element whatever was there; it
        # writes a new tensor here, and the program reads that one from now on
        args = [torch.empty_like(args[0]), *args[1:]]
    out = op(*args, **kwargs)
    if tuple(out.stride()) != tuple(strides):
        out = torch.empty_strided(shape, strides, dtype=out.dtype, device=out.device).copy_(out)
    return out, _token(after)


@draw.register_fake
def _(tensors, after, key):  # type: ignore[no-untyped-def]
    _, _, _, shape, strides, dtype, _ = DRAWS[key]
    return torch.empty_strided(shape, strides, dtype=dtype, device=after.device), _token(after)


OPS = (torch.ops.shardc.issue.default, torch.ops.shardc.wait.default,
       torch.ops.shardc.issue_in_place.default, torch.ops.shardc.wait_in_place.default,
       torch.ops.shardc.hand_off.default, torch.ops.shardc.draw.default)
