"""Rule sweep, attention: ``scaled_dot_product_attention`` plain, causal, with a float
mask and with grouped-query heads. See ``rules_sweep.py``."""
from __future__ import annotations

import pytest
import rules_sweep as S
import torch.nn.functional as F

pytestmark = pytest.mark.sweep  # and slow, but for the fast tier's slice (rules_sweep)

_SPECS: list[S.OpSpec] | None = None
MESHES = ("x2", "y2", "z2", "d2", "x2y2")


def specs() -> list[S.OpSpec]:
    global _SPECS
    if _SPECS is not None:
        return _SPECS
    g = S.gen(7)
    x = lambda *s: S._t(s, g)  # noqa: E731
    q, k, v = x(2, 4, 8, 4), x(2, 4, 8, 4), x(2, 4, 8, 4)
    mask = S._t((8, 8), g, -1.0, 0.0, requires_grad=False)
    _SPECS = [
        S.OpSpec("attention", "sdpa", lambda m, a, b, c: F.scaled_dot_product_attention(a, b, c),
                 (q, k, v), meshes=MESHES),
        S.OpSpec("attention", "sdpa.causal",
                 lambda m, a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                 (q, k, v), meshes=("x2", "z2", "x2y2")),
        S.OpSpec("attention", "sdpa.mask",
                 lambda m, a, b, c, mk: F.scaled_dot_product_attention(a, b, c, attn_mask=mk),
                 (q, k, v, mask), meshes=("x2", "d2")),
        S.OpSpec("attention", "sdpa.gqa",
                 lambda m, a, b, c: F.scaled_dot_product_attention(a, b, c, enable_gqa=True),
                 (q, x(2, 2, 8, 4), x(2, 2, 8, 4)), meshes=("x2", "y2", "x2y2")),
    ]
    return _SPECS


CASES, sweep_world, test_rule = S.threaded_family("attention", specs)
