"""Bytes one rank sends for one collective under the ring algorithm.

This is the quantity equations 1-5 of the AxoNN paper divide by the bandwidth: for a
group of G ranks and an input of ``nbytes`` on each rank,
all-gather (G-1)*nbytes, reduce-scatter (G-1)/G*nbytes, all-reduce 2(G-1)/G*nbytes.
The compile-time report and the runtime's counters both use it, each on its own sizes
(graph shapes there, the tensors actually handed to torch.distributed here).
"""
from __future__ import annotations

from fractions import Fraction

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


def ring_bytes(collective: str, group_size: int, nbytes: int) -> Fraction:
    g = group_size
    if g <= 1:
        return Fraction(0)
    if collective == "all_gather":
        return Fraction((g - 1) * nbytes)
    if collective == "reduce_scatter":
        return Fraction((g - 1) * nbytes, g)
    if collective == "all_reduce":
        return Fraction(2 * (g - 1) * nbytes, g)
    if collective in ("all_to_all", "broadcast"):
        return Fraction((g - 1) * nbytes, g)
    raise ValueError(f"ring_bytes: unknown collective {collective!r}; one of {COLLECTIVES}")


def as_number(v: Fraction) -> int | float:
    return int(v) if v.denominator == 1 else float(v)
