"""Rule sweep, embeddings: the table an ``nn.Parameter`` (vocabulary-parallel over x,
feature-parallel over y), with and without ``padding_idx``, and the table an activation.
See ``rules_sweep.py``."""
from __future__ import annotations

import pytest
import rules_sweep as S
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.sweep  # and slow, but for the fast tier's slice (rules_sweep)

_SPECS: list[S.OpSpec] | None = None
MESHES = ("x2", "y2", "z2", "d2", "x2y2")


def specs() -> list[S.OpSpec]:
    global _SPECS
    if _SPECS is not None:
        return _SPECS
    g = S.gen(6)
    ids = torch.randint(0, 16, (4, 6), generator=g)
    ids_pad = ids.clone()
    ids_pad[0, :3] = 3
    table = {"weight": S._t((16, 8), g)}
    _SPECS = [
        S.OpSpec("embedding", "embedding", lambda m, i: F.embedding(i, m.weight), (ids,),
                 params=table, meshes=MESHES),
        S.OpSpec("embedding", "embedding.padding_idx",
                 lambda m, i: F.embedding(i, m.weight, padding_idx=3), (ids_pad,),
                 params=table, meshes=MESHES),
        S.OpSpec("embedding", "embedding.1d", lambda m, i: F.embedding(i, m.weight),
                 (ids[0].clone(),), params=table, meshes=("x2", "y2", "d2")),
        S.OpSpec("embedding", "embedding.act_table", lambda m, w, i: F.embedding(i, w),
                 (S._t((16, 8), g), ids), meshes=MESHES),
    ]
    return _SPECS


CASES, sweep_world, test_rule = S.threaded_family("embedding", specs)
