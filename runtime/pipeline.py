"""What a pipeline rank runs between its stage's programs: the schedule's order of
micro-batch forwards and backwards, and the point-to-point sends that carry activations
forward and their gradients back (``shardc/program/pipeline.py`` drives them).

A rank talks only to the ranks of other stages that share its x, y, z and data
coordinates: its stage's program and theirs hold the same piece of every boundary value,
so each pair exchanges exactly that piece (no re-layout at the boundary).

Sends are ``isend`` (never blocking: a rank never waits for a peer to reach the matching
receive, so no schedule can deadlock on a send); receives block. Between two ranks the
messages of one direction are sent and received in one order on both sides (micro-batch,
then the producer's output index), which is what NCCL (which ignores tags) needs; gloo
gets the same order.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from shardc.core.mesh import PIPE, Mesh
from shardc.core.options import SCHEDULES
from shardc.runtime.collectives import guarded

Action = tuple[str, int]  # ("F" or "B", micro-batch)


def actions(schedule: str, stages: int, stage: int, microbatches: int) -> list[Action]:
    """The order in which ``stage`` runs its micro-batches' forwards and backwards.

    GPipe: every forward, then every backward (m micro-batches' activations live at once).
    1F1B: ``stages - stage - 1`` forwards to fill the pipe, then one forward and one
    backward in turn, then the backwards left: at most ``stages - stage`` micro-batches'
    activations live at once, the same bubble as GPipe's, (p-1)/(m+p-1) of the step."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    if schedule == "1f1b":
        warm = min(stages - stage - 1, m)
        out: list[Action] = [("F", k) for k in range(warm)]
        for k in range(m - warm):
            out += [("F", warm + k), ("B", k)]
        out += [("B", k) for k in range(m - warm, m)]
        return out
    raise ValueError(f"unknown schedule {schedule!r}; shardc runs {SCHEDULES}")


def bubble_fraction(schedule: str, stages: int, microbatches: int) -> float:
    """The schedule's idle share of a step with equal stages and a backward twice a
    forward: (p-1)/(m+p-1) for GPipe and 1F1B (1F1B saves memory, not time)."""
    del schedule
    return (stages - 1) / (microbatches + stages - 1)


class P2P:
    """This rank's sends and receives to the same coordinates in other stages, counted
    per phase in bytes (what the comm report's ``pipe`` rows predict)."""

    def __init__(self, mesh: Mesh, rank: int) -> None:
        self.mesh = mesh
        self.rank = rank
        self.coords = mesh.coords(rank)
        self.sent: Counter[tuple[str, str, str]] = Counter()
        self.calls: Counter[tuple[str, str, str]] = Counter()
        self._works: list[tuple[Any, torch.Tensor]] = []
        self.waited = 0.0  # seconds blocked in receives since the last reset_wait()

    def peer(self, stage: int) -> int:
        return self.mesh.rank({**self.coords, PIPE: stage})

    def send(self, t: torch.Tensor, stage: int, phase: str) -> None:
        t = t.detach().contiguous()
        key = ("send", PIPE, phase)
        self.sent[key] += t.numel() * t.element_size()
        self.calls[key] += 1
        with guarded(None, "isend", None, f"pipeline {phase} to stage {stage}"):
            work = dist.isend(t, self.peer(stage))
        self._works.append((work, t))  # the buffer must live until the send completes

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, stage: int,
             phase: str) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        t0 = time.perf_counter()
        with guarded(None, "recv", None, f"pipeline {phase} from stage {stage}"):
            dist.recv(buf, self.peer(stage))
        self.waited += time.perf_counter() - t0
        return buf

    def finish(self) -> None:
        """Wait for every send of the step (their receivers have them by now or soon)."""
        for work, _ in self._works:
            work.wait()
        self._works.clear()

    def reset(self) -> None:
        self.sent.clear()
        self.calls.clear()
