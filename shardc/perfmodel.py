"""The communication and memory model the planner ranks meshes with (AxoNN SC'24, V-B).

Why a model and not a measurement: a job of G ranks has many factorizations into
(G_data, G_z, G_y, G_x); timing each one costs a full launch. The paper shows that
counting the bytes of the ring collectives of Algorithm 1 (equations 1-5) and dividing
by the bandwidth of the group that carries them (equation 7, :mod:`shardc.machine`)
orders the configurations well enough to pick the fast ones: nine of the model's top
ten were among the ten fastest measured.

Volumes are kept per ``(collective, axis, phase)`` rather than as one number so the
compiler can compare them with the bytes its rewritten graph really moves, and so CI
can regress each separately.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shardc.machine import Machine
from shardc.mesh import AXES, Mesh

__all__ = [
    "Gemm",
    "VolumeKey",
    "BYTES_PER_PARAMETER",
    "gemm_volumes",
    "network_volumes",
    "replica_gemm",
    "local_weight_elements",
    "predict_comm_seconds",
    "predict_gemms_seconds",
    "memory_per_rank",
    "activation_bytes",
    "enumerate_meshes",
]

VolumeKey = tuple[str, str, str]
"""``(collective, axis, phase)``: collective in {"all_gather", "reduce_scatter",
"all_reduce"}, axis in :data:`shardc.mesh.AXES`, phase in {"forward", "backward",
"step"} ("step": once per optimizer step, after the whole backward pass)."""

BYTES_PER_PARAMETER = 16
"""Bytes of training state per parameter element with AdamW: fp32 weight (4) + fp32
gradient (4) + first moment (4) + second moment (4). Mixed-precision training with fp32
master weights also comes to 16 (2 + 2 + 4 + 4 + 4), the ZeRO paper's figure."""


@dataclass(frozen=True)
class Gemm:
    """One fully connected layer O = I x W as Algorithm 1 sees it.

    m: rows of I = tokens processed by ONE data-parallel replica (the global batch's
       tokens divided by G_data; :func:`replica_gemm` does that division), because the
       equations have no G_data in their activation terms.
    k: in-features (rows of W); n: out-features (columns of W).
    transposed: True for the layers whose weight is laid out with rows over x and
       columns over y (every other layer of a chain), which swaps the roles of x and y.
    bytes_per_element: of the communicated tensors (4 for fp32, 2 for bf16).
    """

    name: str
    m: int
    k: int
    n: int
    transposed: bool
    bytes_per_element: int = 4

    def __post_init__(self) -> None:
        for fld in ("m", "k", "n", "bytes_per_element"):
            v = getattr(self, fld)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(
                    f"Gemm {self.name!r}: {fld} must be a positive integer, got {v!r}."
                )
        if not isinstance(self.transposed, bool):
            raise ValueError(
                f"Gemm {self.name!r}: transposed must be True or False, got {self.transposed!r}."
            )


def replica_gemm(g: Gemm, mesh: Mesh) -> Gemm:
    """``g`` with ``m`` given for the whole global batch, turned into one data replica's
    share (``m / G_data``), which is what :func:`gemm_volumes` expects.

    Raises ValueError when G_data does not divide the batch's tokens: such a mesh cannot
    run this batch and the planner should drop it.
    """
    gd = mesh.size("data")
    if g.m % gd:
        raise ValueError(
            f"replica_gemm: layer {g.name!r} has m={g.m} tokens, which G_data={gd} of "
            f"{mesh.spec()} does not divide; choose a batch that is a multiple of {gd} "
            "or a mesh with a smaller data axis."
        )
    return Gemm(g.name, g.m // gd, g.k, g.n, g.transposed, g.bytes_per_element)


def _roles(g: Gemm) -> tuple[str, str]:
    """(axis that splits W's rows / I's columns, axis that splits W's columns / O's
    columns): (y, x) for a normal layer, (x, y) for a transposed one."""
    return ("x", "y") if g.transposed else ("y", "x")


def gemm_volumes(g: Gemm, mesh: Mesh) -> dict[VolumeKey, float]:
    """Bytes ONE rank sends in each collective of layer ``g`` on ``mesh`` (eqs. 1-5).

    With the row axis r (y, or x when transposed) and the column axis c (x, or y):
      all_gather  z    forward : (Gz-1) * k*n/(Gc*Gr*Gz)          (eq. 1, weight gather)
      reduce_scatter z backward: (Gz-1)/Gz * k*n/(Gc*Gr)          (eq. 2, weight grads)
      all_reduce  r    forward : 2(Gr-1)/Gr * m*n/(Gz*Gc)         (eq. 3, partial outputs)
      all_reduce  c    backward: 2(Gc-1)/Gc * m*k/(Gz*Gr)         (eq. 4, input grads)
      all_reduce  data step    : 2(Gd-1)/Gd * k*n/(Gc*Gr*Gz)      (eq. 5, gradient sync)
    each times ``bytes_per_element``. Entries of an axis of size 1 are omitted: such a
    collective is a no-op and moves nothing.
    """
    row, col = _roles(g)
    gr, gc = mesh.size(row), mesh.size(col)
    gz, gd = mesh.size("z"), mesh.size("data")
    kn, mn, mk = float(g.k) * g.n, float(g.m) * g.n, float(g.m) * g.k
    b = g.bytes_per_element
    out: dict[VolumeKey, float] = {}
    if gz > 1:
        out[("all_gather", "z", "forward")] = (gz - 1) * kn / (gc * gr * gz) * b
        out[("reduce_scatter", "z", "backward")] = (gz - 1) / gz * kn / (gc * gr) * b
    if gr > 1:
        out[("all_reduce", row, "forward")] = 2 * (gr - 1) / gr * mn / (gz * gc) * b
    if gc > 1:
        out[("all_reduce", col, "backward")] = 2 * (gc - 1) / gc * mk / (gz * gr) * b
    if gd > 1:
        out[("all_reduce", "data", "step")] = 2 * (gd - 1) / gd * kn / (gc * gr * gz) * b
    return out


def network_volumes(gemms: Iterable[Gemm], mesh: Mesh) -> dict[VolumeKey, float]:
    """Sum of :func:`gemm_volumes` over the layers of a network (the paper's "apply
    Equation 6 to all of its layers, and take a sum")."""
    total: dict[VolumeKey, float] = {}
    for g in gemms:
        for key, v in gemm_volumes(g, mesh).items():
            total[key] = total.get(key, 0.0) + v
    return total


def local_weight_elements(g: Gemm, mesh: Mesh) -> float:
    """Elements of ``g``'s weight one rank stores: k*n/(Gx*Gy*Gz) (the z-shard of its
    (x, y) block; replicated over data). Fractional when the mesh does not divide the
    weight: the planner should check divisibility separately."""
    return float(g.k) * g.n / (mesh.size("x") * mesh.size("y") * mesh.size("z"))


def predict_comm_seconds(
    volumes: Mapping[VolumeKey, float], mesh: Mesh, machine: Machine
) -> dict[str, float]:
    """Seconds of communication per axis: each volume divided by the bandwidth of the
    group that carries it (:meth:`Machine.axis_bandwidth`), summed per axis.

    Every axis of :data:`AXES` is present (0.0 when nothing moves on it), so
    ``sum(result.values())`` is the paper's t_comm for the given volumes.
    """
    out = {a: 0.0 for a in AXES}
    bw_cache: dict[str, float] = {}
    for key, nbytes in volumes.items():
        if not (isinstance(key, tuple) and len(key) == 3):
            raise ValueError(
                f"predict_comm_seconds: volume key {key!r} is not (collective, axis, "
                "phase); pass the output of gemm_volumes/network_volumes."
            )
        axis = key[1]
        if axis not in out:
            raise ValueError(
                f"predict_comm_seconds: volume key {key!r} names unknown axis {axis!r}; "
                f"the axes are {AXES}."
            )
        if nbytes < 0 or math.isnan(nbytes):
            raise ValueError(
                f"predict_comm_seconds: volume {key!r} = {nbytes!r} bytes; volumes must "
                "be non-negative numbers."
            )
        if nbytes == 0:
            continue
        if axis not in bw_cache:
            bw_cache[axis] = machine.axis_bandwidth(mesh, axis)
        out[axis] += nbytes / bw_cache[axis]
    return out


def predict_gemms_seconds(
    gemms: Iterable[Gemm], mesh: Mesh, machine: Machine
) -> dict[str, float]:
    """:func:`predict_comm_seconds` of :func:`network_volumes`: per-axis seconds of a
    whole network of layers whose ``m`` is already per data replica."""
    return predict_comm_seconds(network_volumes(gemms, mesh), mesh, machine)


def memory_per_rank(
    local_param_elements: float,
    activation_bytes: float = 0.0,
    *,
    transient_bytes: float = 0.0,
    bytes_per_parameter: int = BYTES_PER_PARAMETER,
) -> float:
    """Bytes one rank needs: training state of the parameters it stores plus activations.

    ``local_param_elements`` is the number of parameter elements this rank stores, after
    dividing each tensor over the axes it is sharded on (for a linear layer that is
    :func:`local_weight_elements`; replicated tensors such as norms count in full). Each
    costs ``bytes_per_parameter`` (16 for AdamW: weight, gradient, two moments).
    ``activation_bytes`` comes from :func:`activation_bytes`. ``transient_bytes`` is what
    is alive only briefly at the peak, e.g. the largest all-gathered weight block
    k*n/(Gx*Gy) * bytes_per_element (and the prefetched next one) in the forward pass.
    """
    for name, v in (("local_param_elements", local_param_elements),
                    ("activation_bytes", activation_bytes),
                    ("transient_bytes", transient_bytes)):
        if v < 0 or math.isnan(v):
            raise ValueError(f"memory_per_rank: {name} must be >= 0, got {v!r}.")
    if bytes_per_parameter < 1:
        raise ValueError(
            f"memory_per_rank: bytes_per_parameter must be positive, got {bytes_per_parameter!r}."
        )
    return local_param_elements * bytes_per_parameter + activation_bytes + transient_bytes


def activation_bytes(
    tokens_per_rank: int,
    hidden: int,
    layers: int,
    *,
    tensor_parallel: int = 1,
    checkpointing: bool = False,
    bytes_per_element: int = 2,
    heads: int = 0,
    seq_len: int = 0,
) -> float:
    """Activation memory of a transformer stack on one rank (Korthikanti et al., 2022,
    "Reducing Activation Recomputation in Large Transformer Models").

    Their per-layer figure with 16-bit activations is ``s*b*h*(34 + 5*a*s/h)`` bytes; with
    tensor and sequence parallelism of degree t every term is divided by t. We use that
    form because in the 4D layout every activation is split: rows (tokens) over data and
    z, columns (hidden) over x or y, never fully replicated.

    - ``tokens_per_rank`` = s*b held by this rank = global tokens / (G_data * G_z).
    - ``tensor_parallel`` = t, the split of the hidden dimension; activations alternate
      between being split over x and over y, so pass ``min(Gx, Gy)`` for a conservative
      (larger) estimate.
    - ``heads``/``seq_len``: when both are given, add the attention-score term
      ``5*a*s/h`` (softmax input/output and dropout mask of materialized scores); leave
      them 0 for fused/flash attention, which never stores the s x s scores.
    - ``bytes_per_element``: the 34 assumes 2-byte activations; the result is scaled by
      ``bytes_per_element / 2`` (approximate: 1-byte dropout masks scale too).
    - ``checkpointing=True`` (full activation recomputation per layer): only each layer's
      input is kept, ``2*s*b*h/t`` per layer, plus one layer's full activations alive
      while it is recomputed in the backward pass.

    Embedding, LM-head and loss activations are not included.
    """
    for name, v in (("tokens_per_rank", tokens_per_rank), ("hidden", hidden),
                    ("layers", layers), ("tensor_parallel", tensor_parallel),
                    ("bytes_per_element", bytes_per_element)):
        least = 0 if name == "layers" else 1
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(
                f"activation_bytes: {name} must be an integer >= {least}, got {v!r}."
            )
    if heads < 0 or seq_len < 0:
        raise ValueError(
            f"activation_bytes: heads and seq_len must be >= 0, got {heads!r}, {seq_len!r}."
        )
    sbh = float(tokens_per_rank) * hidden
    per_layer = 34.0 * sbh
    if heads and seq_len:
        per_layer += 5.0 * heads * seq_len * tokens_per_rank
    per_layer /= tensor_parallel
    scale = bytes_per_element / 2.0
    if layers == 0:
        return 0.0
    if checkpointing:
        return (layers * 2.0 * sbh / tensor_parallel + per_layer) * scale
    return layers * per_layer * scale


def enumerate_meshes(world_size: int) -> list[Mesh]:
    """Every factorization of ``world_size`` into (G_data, G_z, G_y, G_x), the planner's
    search space (:meth:`Mesh.all`); the planner filters by divisibility and memory."""
    return Mesh.all(world_size)
