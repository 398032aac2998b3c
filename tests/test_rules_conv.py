"""Rule sweep, convolution family: conv1d/2d/3d (bias, stride, padding, dilation, groups),
transposed convolution, max/avg/adaptive pooling (with and without indices), interpolation
(nearest, linear, bilinear, bicubic, trilinear), batch norm in training and group norm,
each against one device with its input in every placement (the weights are parameters,
used whole). See ``rules_sweep.py``."""
from __future__ import annotations

import itertools

import pytest
import rules_sweep as S
import torch.nn.functional as F

pytestmark = pytest.mark.sweep  # and slow, but for the fast tier's slice (rules_sweep)

_SPECS: list[S.OpSpec] | None = None


def specs() -> list[S.OpSpec]:
    global _SPECS
    if _SPECS is not None:
        return _SPECS
    g = S.gen(9)
    x = lambda *s: S._t(s, g)  # noqa: E731
    rot = itertools.cycle(("x2", "y2", "z2", "d2"))

    def C(name, fn, *inputs, params=None, two=False):
        meshes = (next(rot),) + (("z2d2",) if two else ())
        return S.OpSpec("conv", name, fn, tuple(inputs), params=params or {}, meshes=meshes)

    w2 = {"weight": x(4, 4, 3, 3), "bias": x(4)}
    _SPECS = [
        C("conv2d", lambda m, a: F.conv2d(a, m.weight, m.bias, padding=1), x(4, 4, 6, 6),
          params=w2, two=True),
        C("conv2d.stride_nobias", lambda m, a: F.conv2d(a, m.weight, stride=2), x(4, 4, 6, 6),
          params={"weight": x(2, 4, 3, 3)}),
        C("conv2d.groups_dilation", lambda m, a: F.conv2d(a, m.weight, m.bias, padding=2, dilation=2,
                                                           groups=2), x(4, 4, 6, 6),
          params={"weight": x(4, 2, 3, 3), "bias": x(4)}),
        C("conv2d.padding_same", lambda m, a: F.conv2d(a, m.weight, padding="same"), x(4, 4, 6, 6),
          params={"weight": x(4, 4, 3, 3)}),
        C("conv2d.unbatched", lambda m, a: F.conv2d(a, m.weight, padding=1), x(4, 6, 6),
          params={"weight": x(2, 4, 3, 3)}),
        C("conv2d.weight_is_input", lambda m, a, w: F.conv2d(a, w), x(4, 4, 6, 6), x(2, 4, 3, 3)),
        C("conv1d", lambda m, a: F.conv1d(a, m.weight, m.bias, padding=1), x(4, 4, 8),
          params={"weight": x(6, 4, 3), "bias": x(6)}, two=True),
        C("conv3d", lambda m, a: F.conv3d(a, m.weight), x(4, 2, 4, 4, 4),
          params={"weight": x(2, 2, 3, 3, 3)}),
        C("conv_transpose2d", lambda m, a: F.conv_transpose2d(a, m.weight, stride=2), x(4, 4, 4, 4),
          params={"weight": x(4, 2, 3, 3)}),
        C("max_pool2d", lambda m, a: F.max_pool2d(a, 2), x(4, 4, 6, 6), two=True),
        C("max_pool2d.indices", lambda m, a: F.max_pool2d(a, 3, stride=2, padding=1,
                                                          return_indices=True)[0] * 1.0, x(4, 4, 6, 6)),
        C("max_pool1d", lambda m, a: F.max_pool1d(a, 2), x(4, 4, 8)),
        C("avg_pool2d", lambda m, a: F.avg_pool2d(a, 3, stride=1, padding=1, count_include_pad=False),
          x(4, 4, 6, 6)),
        C("avg_pool1d", lambda m, a: F.avg_pool1d(a, 2), x(4, 4, 8)),
        C("adaptive_avg_pool2d", lambda m, a: F.adaptive_avg_pool2d(a, 2), x(4, 4, 6, 6), two=True),
        C("adaptive_max_pool2d", lambda m, a: F.adaptive_max_pool2d(a, 3), x(4, 4, 6, 6)),
        # grid_sample: the batch cut alike in input and grid, the input's channels keep theirs
        C("grid_sample.bilinear", lambda m, a, g_: F.grid_sample(a, g_, align_corners=False),
          x(4, 4, 3, 3), S._t((4, 2, 5, 2), g, -1.2, 1.2), two=True),
        C("grid_sample.nearest_border", lambda m, a, g_: F.grid_sample(a, g_, mode="nearest",
                                                                      padding_mode="border"),
          x(4, 4, 3, 3), S._t((4, 3, 2, 2), g, -1.2, 1.2)),
        C("grid_sample.3d", lambda m, a, g_: F.grid_sample(a, g_, align_corners=True),
          x(2, 4, 2, 3, 3), S._t((2, 2, 2, 2, 3), g, -1.0, 1.0)),
        C("interpolate.nearest", lambda m, a: F.interpolate(a, scale_factor=2), x(4, 4, 3, 3), two=True),
        C("interpolate.bilinear", lambda m, a: F.interpolate(a, size=(5, 7), mode="bilinear",
                                                             align_corners=False), x(4, 4, 3, 3)),
        C("interpolate.bicubic", lambda m, a: F.interpolate(a, scale_factor=2, mode="bicubic",
                                                            align_corners=True), x(4, 4, 3, 3)),
        C("interpolate.linear1d", lambda m, a: F.interpolate(a, size=7, mode="linear"), x(4, 4, 5)),
        C("interpolate.trilinear", lambda m, a: F.interpolate(a, scale_factor=2, mode="trilinear"),
          x(4, 2, 2, 2, 2)),
        # training batch norm: statistics over the global batch (running ones are
        # local tensors here: only the output and the gradients are compared)
        C("batch_norm2d", lambda m, a: F.batch_norm(a, a.new_zeros(4), a.new_ones(4), m.weight, m.bias,
                                                    training=True), x(4, 4, 3, 3),
          params={"weight": x(4), "bias": x(4)}, two=True),
        C("batch_norm1d", lambda m, a: F.batch_norm(a, a.new_zeros(4), a.new_ones(4), training=True,
                                                    momentum=0.2), x(4, 4)),
        C("batch_norm1d.seq", lambda m, a: F.batch_norm(a, a.new_zeros(4), a.new_ones(4), m.weight,
                                                        training=True), x(4, 4, 5),
          params={"weight": x(4)}),
        C("batch_norm2d.no_running_stats", lambda m, a: F.batch_norm(a, None, None, m.weight,
                                                                     training=True), x(4, 4, 3, 3),
          params={"weight": x(4)}),
        C("group_norm", lambda m, a: F.group_norm(a, 2, m.weight, m.bias), x(4, 4, 6, 6),
          params={"weight": x(4), "bias": x(4)}, two=True),
        C("group_norm.noaffine", lambda m, a: F.group_norm(a, 4), x(4, 4, 8)),
    ]
    return _SPECS


CASES, sweep_world, test_rule = S.threaded_family("conv", specs)
