"""Bytes one rank sends for one collective under the ring algorithm: the one place the
ring model is written.

This is the quantity equations 1-5 of the AxoNN paper divide by the bandwidth: for a
group of G ranks and an input of ``nbytes`` on each rank,
all-gather (G-1)*nbytes, reduce-scatter (G-1)/G*nbytes, all-reduce 2(G-1)/G*nbytes,
all-to-all and broadcast (G-1)/G*nbytes.
The compile-time report (its bytes, and its formulas in sympy symbols G_x, ...), the
planner and the runtime's counters all use it, each on its own sizes (graph shapes
there, the tensors actually handed to torch.distributed here).
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any, overload

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send")


@overload
def ring_factor(collective: str, group_size: int) -> Fraction: ...
@overload
def ring_factor(collective: str, group_size: Any) -> Any: ...
def ring_factor(collective: str, group_size: Any) -> Any:
    """Bytes one rank sends per byte of its input, for a group of ``group_size`` ranks.

    ``group_size`` is an int (the result is an exact Fraction, 0 for a group of one) or
    a symbol such as sympy's ``G_x`` (the result is an expression in it)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"ring_bytes: unknown collective {collective!r}; one of {COLLECTIVES}")
    g = group_size
    if isinstance(g, int):
        if g <= 1:
            return Fraction(0)
        g = Fraction(g)
    if collective == "send":  # a pipeline's point-to-point send: its bytes, once
        return Fraction(1) if isinstance(g, Fraction) else sympy_one(g)
    if collective == "all_gather":
        return g - 1
    if collective == "all_reduce":
        return 2 * (g - 1) / g
    return (g - 1) / g  # reduce_scatter, all_to_all, broadcast


@overload
def ring_bytes(collective: str, group_size: int, nbytes: int | Fraction) -> Fraction: ...
@overload
def ring_bytes(collective: str, group_size: Any, nbytes: Any) -> Any: ...
def ring_bytes(collective: str, group_size: Any, nbytes: Any) -> Any:
    """Bytes one rank sends in ``collective`` over ``group_size`` ranks when each holds an
    input of ``nbytes``: ``ring_factor(collective, group_size) * nbytes``. Exact (a
    Fraction) for integers; a sympy expression when either argument is symbolic."""
    return ring_factor(collective, group_size) * nbytes


def sympy_one(g: Any) -> Any:
    """1 in ``g``'s kind of number (a sympy expression stays one)."""
    return g / g


def as_number(v: Fraction) -> int | float:
    return int(v) if v.denominator == 1 else float(v)
