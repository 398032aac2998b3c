"""The planner's pipeline terms: what a mesh with ``pipe = p`` stages costs, from the 4D
prediction of its stage mesh (the same model on ``world / p`` ranks) and the stage cut
the compiler would make (``passes/stages.py``).

A stage holds its blocks' share of the model: the heaviest stage's share of the forward
FLOPs (``flops``) scales its compute and the collectives that move activations (x and y,
whose bytes follow the rows the stage computes), the largest stage's share of the
parameter bytes (``params``) scales the parameters, their gradient reduction over data
and their optimizer state. Three terms are the pipeline's own:

- **weights gathered once a micro-batch.** A z axis gathers each weight in forward and
  again in backward for every micro-batch, and reduce-scatters its gradient once a step:
  with the three equal in bytes, z moves ``(2m + 1) / 3`` times the 4D program's share;
- **the bubble.** With equal stages, GPipe and 1F1B run ``(m + p - 1) / m`` times the
  work of the stage's micro-batches: the bubble term is ``(p - 1) / m`` of the stage's
  compute and its per-micro-batch communication (zero bubble is not modelled: it is
  planned as 1F1B, an upper bound); the interleaved schedule, ``v`` chunks a rank,
  fills and drains the pipe ``v`` times faster: ``(p - 1) / (v m)``;
- **the sends between stages.** Every boundary value crosses once forward and its
  gradient once back, each rank sending its data x z share, over the link between
  stage ``s`` and ``s + 1``: the node's links when a stage fills a node or more (pipe is
  the outermost axis), the measured table otherwise. Interleaved, each of a rank's ``v``
  chunks sends its boundary: ``v`` times the bytes (the cut into ``v p`` stages taken
  as the ``p``-stage cut's boundary, each stage holding ``1 / v`` of a rank's blocks).

Activation memory: 1F1B keeps at most ``p`` micro-batches of activations on the first
stage (``min(p, m) / m`` of the batch), GPipe all ``m``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from shardc.core.errors import ShardcError
from shardc.core.machine import Machine
from shardc.core.mesh import Mesh
from shardc.passes.stages import cut_stages, unlifted_graph


@dataclass(frozen=True)
class StageShares:
    """How ``cut_stages`` spreads one model over ``p`` stages."""

    p: int
    flops: float  # the heaviest stage's share of the forward FLOPs
    params: float  # the largest stage's share of the parameter bytes
    boundary_bytes: float  # the most bytes one stage sends forward a step (global batch)


def stage_shares(model: torch.nn.Module, inputs: tuple, ps: list[int],
                 chunks: int = 1) -> dict[int, StageShares | str]:
    """For each stage count of ``ps``: the shares of the compiler's cut, or why the model
    cannot be cut so (too few repeated blocks, a graph export could not take); with
    ``chunks`` a rank (interleaved), the cut must also hold ``p * chunks`` stages."""
    out: dict[int, StageShares | str] = {}
    try:
        gm = unlifted_graph(model, inputs)
    except Exception as e:  # noqa: BLE001 - every stage count is then dropped with the reason
        return {p: f"the model could not be exported whole ({type(e).__name__})" for p in ps}
    for p in ps:
        try:
            if chunks > 1:
                cut_stages(model, gm, p * chunks, per_rank=chunks)  # enough blocks for every chunk
            stages = cut_stages(model, gm, p)
        except ShardcError as e:
            out[p] = str(e).split(": ", 1)[-1].split(". ")[0]
            continue
        flops = sum(st.flops for st in stages) or 1.0
        params = sum(st.param_bytes for st in stages) or 1
        sent = [sum(_nbytes(v) for v, cons in zip(st.output_vals, st.consumers) if any(c >= 0 for c in cons))
                for st in stages]
        out[p] = StageShares(p, max(st.flops for st in stages) / flops,
                             max(st.param_bytes for st in stages) / params, float(max(sent)))
    return out


def _nbytes(v: Any) -> int:
    if not isinstance(v, torch.Tensor):
        return 0
    return math.prod(v.shape) * v.element_size()


def p2p_bandwidth(machine: Machine, mesh: Mesh) -> float:
    """Bytes/s a rank's send to the next stage sees: ``stage_size`` pairs cross between
    two stages at once. Stages a node or larger cross between nodes (equation 7: the
    node's links shared by at most ``gpus_per_node`` pairs); smaller ones stay inside a
    node, at the measured rate of a pair at that stride, or the slowest rate the table
    has when it has no such entry (a conservative guess, never a faster one)."""
    inner = mesh.stage_size
    if inner * 2 > machine.gpus_per_node or not machine.intra_node_bandwidth:
        return machine.inter_node_bandwidth / min(machine.gpus_per_node, inner)
    return machine.intra_node_bandwidth.get((inner, 2), min(machine.intra_node_bandwidth.values()))


@dataclass(frozen=True)
class PipelineTerms:
    """The seconds and bytes the pipeline adds to or scales in a stage mesh's step."""

    bandwidth: dict[str, float]
    latency: dict[str, float]
    compute: float
    hidden: float
    bubble: float
    bytes_per_axis: dict[str, float]
    param_bytes: float
    activation_bytes: float


def pipeline_terms(shares: StageShares, m: int, schedule: str, mesh: Mesh, machine: Machine,
                   bandwidth: dict[str, float], latency: dict[str, float], compute: float,
                   hidden: float, bytes_per_axis: dict[str, float], param_bytes: float,
                   activation_bytes: float, chunks: int = 1) -> PipelineTerms:
    """The step of ``mesh`` (``pipe > 1``) from its stage mesh's 4D prediction (the
    seconds and bytes the whole model costs on the stage's ranks): see the module's text."""
    p, f, fp = shares.p, shares.flops, shares.params
    z_times = (2 * m + 1) / 3
    scale = {"x": f, "y": f, "z": f * z_times, "data": fp}
    bw = {a: bandwidth.get(a, 0.0) * s for a, s in scale.items()}
    # a collective call is made once a micro-batch (on a stage's share of the calls), the
    # gradient reductions once a step
    lat = {a: latency.get(a, 0.0) * (fp if a == "data" else f * m) for a in scale}
    n = mesh.data * mesh.z
    sends = 2 * shares.boundary_bytes / n * chunks  # activations forward, their gradients back
    bw["pipe"] = sends / p2p_bandwidth(machine, mesh) if sends else 0.0
    lat["pipe"] = 0.0
    work = compute * f + sum(bw[a] + lat[a] for a in ("x", "y", "z")) - hidden * f
    bubble = max(work, 0.0) * (p - 1) / (m * chunks)
    in_flight = 1.0 if schedule == "gpipe" else min(p, m) / m
    moved = {a: bytes_per_axis.get(a, 0.0) * s for a, s in scale.items()}
    moved["pipe"] = sends
    return PipelineTerms(bw, lat, compute * f, hidden * f, bubble, moved, param_bytes * fp,
                         activation_bytes * f * in_flight)
