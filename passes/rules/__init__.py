"""Sharding rules, one per ATen op: the table the lowering pass looks ops up in.

A rule receives the lowering state and one node of the global graph and returns the
node's value on this rank. Where the decision can be made from layouts alone it is a
*strategy* (``STRATEGIES``, ``@strategy``): a pure function from the node and its
inputs' layouts and shapes to the layout each input must arrive in and the layout of the
output; ``apply_strategy`` then does the one lowering step (redistribute, emit). Rules
that emit more than one op (GEMMs with Algorithm 1's weight storage, layer norm's
distributed statistics, vocabulary-parallel embedding and cross-entropy, dropout) decide
and emit in one function. Ops without a rule fall back to ``fallback_rule``: inputs gathered, run
replicated, recorded so ``explain`` and the comm report name the op and its source line.

Tags: an ATen op tagged ``torch.Tag.pointwise`` uses the pointwise rule unless the table
names it.

One module per op family (``pointwise``, ``view``, ``matrix``, ``reduction`` for
norms/reductions/losses, ``embedding``, ``attention``, ``random``, ``conv`` for
convolutions, pooling and group norm), each registering its
rules in the table of ``common``; importing this package fills the table. ``routing``
is the exception: its rules replace the table's on the nodes of a region (a sort of the
batch's rows undone before its order is read) that the lowering finds before it starts.
``sequence`` holds no rule: it decides, for the GEMM rule and the lowering, which partial
sums over x or y are reduce-scattered onto the tokens (sequence parallelism).
"""
from __future__ import annotations

from shardc.passes.rules import (  # noqa: F401
                                 attention,
                                 conv,
                                 embedding,
                                 matrix,
                                 pointwise,
                                 random,
                                 reduction,
                                 view,
)
from shardc.passes.rules.common import (
                                 RULES,
                                 STRATEGIES,
                                 Rule,
                                 Strategy,
                                 fallback_rule,
                                 register_rule,
                                 strategy,
)

__all__ = ["RULES", "STRATEGIES", "Rule", "Strategy", "fallback_rule", "register_rule", "strategy"]
