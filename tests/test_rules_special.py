"""Rule sweep, special values: every family's op samples again, with a block of -inf or
of nan in their first floating input, against one device in float64.

Masks written as ``masked_fill(mask, float("-inf"))`` are ordinary code (attention
masks, a masked vocabulary), and a sharded rule that multiplies by a 0/1 mask where one
device selects turns them into nan (vocabulary-parallel cross-entropy did: the target
logit it read on ranks that do not hold the target was -inf * 0). A nan must reach the
loss as it does on one device, or the run's divergence goes unseen.

The block covers the second half of the last dim in the first half of the rows, so on a
2-way cut of either dim one rank holds only special values in some rows and none in
others. Inputs arrive sharded or replicated, not partial: the pieces of a partial sum or
max of an infinite value are not defined (every split of -inf is -inf and nan).
See ``rules_sweep.py``."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import rules_sweep as S
import torch

pytestmark = pytest.mark.sweep  # and slow, but for the fast tier's slice (rules_sweep)

FAMILIES = ("pointwise", "view", "matrix", "reduction", "embedding", "attention", "conv")
VALUES = {"neginf": float("-inf"), "nan": float("nan")}
_SPECS: list[S.OpSpec] | None = None


def _with_block(x: torch.Tensor, value: float) -> torch.Tensor:
    y = x.detach().clone()
    y[: max(1, y.shape[0] // 2), ..., max(1, y.shape[-1] // 2):] = value
    return y.requires_grad_(x.requires_grad)


def _refused(spec: S.OpSpec) -> bool:
    """One device refuses these inputs outright (a Cholesky factor or a solve of a matrix
    holding -inf or nan raises torch's LinAlgError): there is no value to compare with,
    and the compiled program runs the same kernel on each sample's whole matrix."""
    try:
        S.reference(spec)
    except torch.linalg.LinAlgError:
        return True
    return False


def specs() -> list[S.OpSpec]:
    global _SPECS
    if _SPECS is not None:
        return _SPECS
    _SPECS = []
    for family in FAMILIES:
        for spec in importlib.import_module(f"test_rules_{family}").specs():
            at = next((i for i, x in enumerate(spec.inputs) if isinstance(x, torch.Tensor)
                       and x.is_floating_point() and x.dim() >= 2), None)
            if at is None:
                continue
            # the input with the block takes every cut; the others arrive whole (their
            # cuts, without special values, are the ordinary sweeps')
            kinds = {i: tuple(k for k in spec.kinds.get(i, S.default_kinds(x))
                              if k in (("S", "R") if i == at else ("R",)))
                     for i, x in enumerate(spec.inputs)}
            for tag, value in VALUES.items():
                inputs = list(spec.inputs)
                inputs[at] = _with_block(inputs[at], value)
                case = dataclasses.replace(spec, name=f"{spec.name}.{tag}", inputs=tuple(inputs),
                                           kinds=kinds, _module=None)
                if _refused(case):
                    continue
                _SPECS.append(case)
    return _SPECS


# the fast tier's slice: every third sample (the -inf and nan variants of the families'
# samples alternate), each in one of its cases or two
CASES, sweep_world, test_rule = S.threaded_family("special", specs, fast_spec_every=3)
