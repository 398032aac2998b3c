"""Sharding rules, one per ATen op: the table the lowering pass looks ops up in.

A rule receives the lowering state and one node of the global graph. It reads the
placements its inputs already have, decides the placements it needs (the lowering
inserts the collectives that get them there) and the placement of its output, and emits
the local op. Ops without a rule fall back to ``fallback_rule``: inputs gathered, run
replicated, recorded so ``explain`` and the comm report name the op and its source line.

Tags: an ATen op tagged ``torch.Tag.pointwise`` uses the pointwise rule unless the table
names it.

One module per op family (``pointwise``, ``view``, ``matrix``, ``reduction`` for
norms/reductions/losses, ``embedding``, ``attention``, ``random``), each registering its
rules in the table of ``common``; importing this package fills the table.
"""
from __future__ import annotations

from shardc.passes.rules import (attention, embedding, matrix, pointwise, random,  # noqa: F401
                                 reduction, view)
from shardc.passes.rules.common import RULES, Rule, fallback_rule, register_rule

__all__ = ["RULES", "Rule", "fallback_rule", "register_rule"]
