"""Rule sweep on real gloo processes: dropout, attention dropout and draws shaped like a
tensor (randn_like, Gumbel noise, ...: against one device drawing from the same seed), and
a representative subset of every other family.

Dropout cannot run on the threaded process group: its mask is drawn from the
process-wide default generator, which the rank threads share, so each would draw a
different part of the stream. Each case is its own test, run on the module's pool of ranks
of its world size (the ``ranks`` fixture). See ``rules_sweep.py``."""
from __future__ import annotations

import pytest
import rules_sweep as S
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.sweep, pytest.mark.slow, pytest.mark.distributed]

_SPECS: list[S.OpSpec] | None = None
# (module, function) whose specs the gloo ranks rebuild; the subset is a slice of each
FAMILIES = (("test_rules_random", "dropout_specs"), ("test_rules_pointwise", "handwritten_specs"),
            ("test_rules_view", "specs"), ("test_rules_reduction", "specs"),
            ("test_rules_matrix", "specs"), ("test_rules_embedding", "specs"),
            ("test_rules_attention", "specs"), ("test_rules_conv", "specs"))
SUBSET_EVERY = 23  # every 23rd case of the other families (about 5%)


def dropout_specs() -> list[S.OpSpec]:
    global _SPECS
    if _SPECS is not None:
        return _SPECS
    g = S.gen(8)
    _SPECS = [
        S.OpSpec("random", "dropout", lambda m, a: F.dropout(a, 0.3, training=True),
                 (S._t((4, 6), g),), meshes=("x2", "y2", "z2", "d2", "x2y2"), seed=11),
        S.OpSpec("random", "dropout.3d", lambda m, a: F.dropout(a, 0.5, training=True) * 2.0,
                 (S._t((4, 2, 6), g),), meshes=("x2", "z2d2"), seed=12),
        S.OpSpec("random", "native_dropout",
                 lambda m, a: torch.ops.aten.native_dropout.default(a, 0.3, True)[0],
                 (S._t((4, 6), g),), meshes=("x2", "d2"), seed=14),
        # in-place dropout decomposes into bernoulli(empty_permuted(global shape), 1 - p);
        # a Bernoulli draw on empty_like(a) takes a's layout (passes/rules/random.py)
        S.OpSpec("random", "dropout.inplace",
                 lambda m, a: F.dropout(a * 1.0, 0.3, training=True, inplace=True),
                 (S._t((4, 6), g),), meshes=("x2", "d2"), seed=18),
        S.OpSpec("random", "bernoulli.p",
                 lambda m, a: a * torch.bernoulli(torch.empty_like(a), 0.6),
                 (S._t((4, 2, 6), g),), meshes=("x2", "z2d2", "x2y2"), seed=19),
        # draws shaped like a tensor, drawn for the global shape and cut to its layout
        S.OpSpec("random", "randn_like", lambda m, a: a + torch.randn_like(a) * a.exp(),
                 (S._t((4, 2, 6), g),), meshes=("x2", "d2", "x2y2"), seed=21),
        S.OpSpec("random", "rand_like", lambda m, a: a * torch.rand_like(a),
                 (S._t((4, 6), g),), meshes=("y2", "z2d2"), seed=22),
        S.OpSpec("random", "randint_like", lambda m, a: a * torch.randint_like(a, 1, 5),
                 (S._t((4, 6), g),), meshes=("x2", "d2"), seed=23),
        S.OpSpec("random", "gumbel_softmax", lambda m, a: F.gumbel_softmax(a, tau=0.5),
                 (S._t((4, 6), g),), meshes=("d2", "x2y2"), seed=24),
        S.OpSpec("random", "uniform_", lambda m, a: a * torch.empty_like(a).uniform_(-1, 1),
                 (S._t((4, 6), g),), meshes=("x2", "d2"), seed=25),
        S.OpSpec("random", "normal_", lambda m, a: a + torch.empty_like(a).normal_(0, 2),
                 (S._t((4, 6), g),), meshes=("z2d2",), seed=26),
        S.OpSpec("random", "dropout.eval", lambda m, a: F.dropout(a, 0.3, training=False),
                 (S._t((4, 6), g),), meshes=("y2",), seed=13),
        # attention dropout: the CPU kernel's mask, drawn whole and cut per sample and head
        S.OpSpec("random", "sdpa.dropout",
                 lambda m, a, b, c: F.scaled_dot_product_attention(a, b, c, dropout_p=0.25),
                 (S._t((4, 4, 6, 8), g), S._t((4, 4, 6, 8), g), S._t((4, 4, 6, 8), g)),
                 meshes=("x2", "d2", "x2y2"), seed=15),
        S.OpSpec("random", "sdpa.dropout.causal",
                 lambda m, a, b, c: F.scaled_dot_product_attention(a, b, c, dropout_p=0.25,
                                                                   is_causal=True, scale=0.3),
                 (S._t((4, 4, 6, 8), g), S._t((4, 4, 6, 8), g), S._t((4, 4, 6, 8), g)),
                 meshes=("z2d2",), seed=16),
        S.OpSpec("random", "sdpa.dropout.mask",
                 lambda m, a, b, c, mk: F.scaled_dot_product_attention(a, b, c, attn_mask=mk,
                                                                       dropout_p=0.25),
                 (S._t((4, 4, 6, 8), g), S._t((4, 4, 6, 8), g), S._t((4, 4, 6, 8), g),
                  S._t((4, 1, 6, 6), g)), meshes=("d2",), seed=17),
    ]
    return _SPECS


def _cases() -> list[S.Case]:
    import importlib

    out = [c for s in dropout_specs() for c in S.cases_of(s)]
    for mod, fn in FAMILIES[1:]:
        specs = getattr(importlib.import_module(mod), fn)()
        cs = [c for s in specs for c in S.cases_of(s)]
        out += cs[::SUBSET_EVERY]
    return out


CASES = [] if S.IN_WORKER else _cases()
S.report_count("gloo (dropout + subset)", CASES)


@pytest.mark.parametrize("case", S.params(CASES, prefix="gloo:"))
def test_rule_gloo(case, ranks):
    err = S.run_gloo(ranks, FAMILIES, case)
    if err is not None:
        raise AssertionError(f"{case.id}: {err}")
