"""Rule sweep, reductions: sum/mean/amax/amin, argmax/argmin, vector norms, softmax/log_softmax, cumsum, cumprod, var/std (and var_mean), layer_norm,
cross_entropy. See ``rules_sweep.py``."""
from __future__ import annotations

import itertools

import pytest
import rules_sweep as S
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.sweep  # and slow, but for the fast tier's slice (rules_sweep)

aten = torch.ops.aten
_SPECS: list[S.OpSpec] | None = None


def specs() -> list[S.OpSpec]:
    global _SPECS
    if _SPECS is not None:
        return _SPECS
    g = S.gen(4)
    x = lambda *s: S._t(s, g)  # noqa: E731
    rot = itertools.cycle(("x2", "y2", "z2", "d2"))

    def Rd(name, fn, *inputs, two=False, params=None, kinds=None):
        meshes = (next(rot),) + (("x2y2",) if two else ())
        return S.OpSpec("reduction", name, fn, tuple(inputs), meshes=meshes, params=params or {},
                        kinds=kinds or {})

    tgt = torch.randint(0, 6, (8,), generator=g)
    tgt_ign = tgt.clone()
    tgt_ign[[1, 4, 5]] = -100
    vmask = torch.zeros(8, 6, dtype=torch.bool)
    vmask[:4, 3:] = True
    vmask[6:, :3] = True
    tgt_masked = torch.tensor([0, 2, 1, 0, 4, 3, 5, 4])
    tgt3 = torch.randint(0, 6, (4, 3), generator=g)
    tgt3_ign = tgt3.clone()
    tgt3_ign[1, 2] = tgt3_ign[3, 0] = -100
    tgt4 = torch.randint(0, 6, (2, 2, 2), generator=g)
    cw = S._t((6,), g, 0.5, 1.5).detach()  # class weights, a constant
    probs = torch.softmax(S._t((8, 6), g), 1).detach()
    probs3 = torch.softmax(S._t((4, 6, 3), g), 1).detach()
    ln = {"weight": S._t((6,), g, 0.5, 1.5), "bias": S._t((6,), g)}
    int_only = {1: ("S", "R")}
    _SPECS = [
        Rd("sum.default", lambda m, a: a.sum(), x(4, 6), two=True),
        Rd("sum.dim1", lambda m, a: a.sum(1), x(4, 6), two=True),
        Rd("sum.dim0.keepdim", lambda m, a: a.sum(0, keepdim=True), x(4, 6)),
        Rd("sum.dims", lambda m, a: a.sum([0, 2]), x(4, 2, 6)),
        Rd("mean.default", lambda m, a: a.mean(), x(4, 6), two=True),
        Rd("mean.dim1", lambda m, a: a.mean(1), x(4, 6)),
        Rd("mean.dim0.keepdim", lambda m, a: a.mean(0, keepdim=True), x(4, 6)),
        Rd("amax.dim1", lambda m, a: a.amax(1), x(4, 6), two=True),
        Rd("amax.dim0", lambda m, a: a.amax(0), x(4, 6)),
        Rd("amin.dim1", lambda m, a: a.amin(1), x(4, 6)),
        Rd("amin.keepdim", lambda m, a: a.amin(0, keepdim=True), x(4, 6)),
        # indices of the max/min and vector norms: the reduced dims whole, the rest keep
        # their cuts (CLIP's end-of-text position, F.normalize, ConvNeXt-V2's GRN)
        Rd("argmax.dim1", lambda m, a: a.argmax(1), x(4, 6), two=True),
        Rd("argmax.all", lambda m, a: a.argmax(), x(4, 6)),
        Rd("argmin.keepdim", lambda m, a: a.argmin(0, keepdim=True), x(4, 6)),
        Rd("vector_norm.dim1", lambda m, a: torch.linalg.vector_norm(a, dim=1), x(4, 6), two=True),
        Rd("vector_norm.all", lambda m, a: torch.linalg.vector_norm(a), x(4, 6)),
        Rd("vector_norm.ord1_keepdim", lambda m, a: torch.linalg.vector_norm(a, 1, dim=0, keepdim=True),
           x(4, 6)),
        Rd("vector_norm.dims", lambda m, a: torch.linalg.vector_norm(a, dim=(1, 2), keepdim=True) * a,
           x(4, 3, 2), two=True),
        Rd("normalize", lambda m, a: F.normalize(a, dim=-1), x(4, 6)),
        Rd("max.all", lambda m, a: a.max() * a, x(4, 6), two=True),
        Rd("min.all", lambda m, a: a.min() + a, x(4, 6)),
        Rd("softmax.last", lambda m, a: F.softmax(a, -1), x(4, 6), two=True),
        Rd("softmax.dim0", lambda m, a: F.softmax(a, 0), x(4, 6)),
        Rd("_softmax", lambda m, a: aten._softmax.default(a, 1, False), x(4, 6)),
        Rd("log_softmax.last", lambda m, a: F.log_softmax(a, -1), x(4, 6)),
        Rd("_log_softmax", lambda m, a: aten._log_softmax.default(a, 0, False), x(4, 6)),
        Rd("cumsum", lambda m, a: torch.cumsum(a, 1), x(4, 6)),
        Rd("cumsum.dim0", lambda m, a: torch.cumsum(a, 0), x(4, 6)),
        Rd("cumprod", lambda m, a: torch.cumprod(a, 1), x(4, 6), two=True),
        # a histogram over a fixed range: each rank counts its piece, a partial sum
        Rd("histc", lambda m, a: a.sum(0) * torch.histc(a.detach(), 6, -2, 2), x(4, 6), two=True),
        # any / all leave a partial max / min over the axes that cut the reduced dims
        Rd("any.all_dims", lambda m, a: a * (a > 1.5).any(), x(4, 6), two=True),
        Rd("any.dim", lambda m, a: torch.where((a > 1).any(1, keepdim=True), a, -a), x(4, 6), two=True),
        Rd("all.dims", lambda m, a: a.sum(0) * (a > -1.8).all(0), x(4, 6)),
        Rd("all.default", lambda m, a: a * (a < 1.9).all(), x(4, 6)),
        Rd("var.last", lambda m, a: a.var(-1), x(4, 6), two=True),
        Rd("var.dim0_keepdim", lambda m, a: a.var(0, keepdim=True, correction=0), x(4, 6)),
        Rd("std.all", lambda m, a: a.std() * a, x(4, 6)),
        Rd("var_mean", lambda m, a: torch.var_mean(a, -1, keepdim=True), x(4, 3, 6), two=True),
        Rd("std_mean.dims", lambda m, a: torch.std_mean(a, (1, 2), correction=0), x(4, 3, 6)),
        Rd("layer_norm", lambda m, a: F.layer_norm(a, (6,), m.weight, m.bias), x(4, 6), two=True,
           params=ln),
        Rd("layer_norm.3d", lambda m, a: F.layer_norm(a, (6,), m.weight, m.bias), x(4, 2, 6),
           params=ln),
        Rd("layer_norm.noaffine", lambda m, a: F.layer_norm(a, (6,)), x(4, 6)),
        Rd("layer_norm.2dims", lambda m, a: F.layer_norm(a, (2, 6)), x(4, 2, 6)),
        Rd("cross_entropy.mean", lambda m, a, t: F.cross_entropy(a, t), x(8, 6), tgt, two=True,
           kinds=int_only),
        Rd("cross_entropy.sum", lambda m, a, t: F.cross_entropy(a, t, reduction="sum"), x(8, 6), tgt,
           kinds=int_only),
        Rd("cross_entropy.none", lambda m, a, t: F.cross_entropy(a, t, reduction="none"), x(8, 6), tgt,
           kinds=int_only),
        Rd("cross_entropy.ignore", lambda m, a, t: F.cross_entropy(a, t), x(8, 6), tgt_ign,
           kinds=int_only),
        # whole blocks of classes at -inf (a masked vocabulary): on x2 or y2 one rank holds
        # only -inf in those rows, where shifting by its own max would give nan
        # classes on dim 1 of a sequence or image batch, weights, label smoothing and
        # probability targets: each once ran whole on a gathered batch
        Rd("cross_entropy.ncl", lambda m, a, t: F.cross_entropy(a, t), x(4, 6, 3), tgt3, two=True,
           kinds=int_only),
        Rd("cross_entropy.nchw.none", lambda m, a, t: F.cross_entropy(a, t, reduction="none"),
           x(2, 6, 2, 2), tgt4, kinds=int_only),
        Rd("cross_entropy.smooth", lambda m, a, t: F.cross_entropy(a, t, label_smoothing=0.2),
           x(8, 6), tgt_ign, two=True, kinds=int_only),
        Rd("cross_entropy.smooth.none", lambda m, a, t: F.cross_entropy(a, t, reduction="none",
                                                                         label_smoothing=0.2),
           x(8, 6), tgt_ign, kinds=int_only),
        Rd("cross_entropy.weight", lambda m, a, t: F.cross_entropy(a, t, weight=cw), x(8, 6), tgt_ign,
           two=True, kinds=int_only),
        Rd("cross_entropy.weight.sum", lambda m, a, t: F.cross_entropy(a, t, weight=cw, reduction="sum"),
           x(8, 6), tgt, kinds=int_only),
        Rd("cross_entropy.weight_smooth.ncl",
           lambda m, a, t: F.cross_entropy(a, t, weight=cw, label_smoothing=0.1), x(4, 6, 3), tgt3_ign,
           two=True, kinds=int_only),
        Rd("cross_entropy.probs", lambda m, a, p: F.cross_entropy(a, p), x(8, 6), probs, two=True),
        Rd("cross_entropy.probs.smooth_weight.none",
           lambda m, a, p: F.cross_entropy(a, p, weight=cw, label_smoothing=0.1, reduction="none"),
           x(8, 6), probs),
        Rd("cross_entropy.probs.ncl.sum", lambda m, a, p: F.cross_entropy(a, p, reduction="sum"),
           x(4, 6, 3), probs3),
        Rd("cross_entropy.masked_block", lambda m, a, t: F.cross_entropy(a.masked_fill(vmask, float("-inf")), t),
           x(8, 6), tgt_masked, two=True, kinds=int_only),
    ]
    return _SPECS


CASES, sweep_world, test_rule = S.threaded_family("reduction", specs)
