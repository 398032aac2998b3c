"""One device's random numbers in a pipeline (``pipe > 1``).

Without stages every rank draws each dropout mask for the whole global tensor, from the
default generator, in the program's order, and keeps its piece: the masks are one
device's (``runtime/ops.py``). A stage cannot do that by itself. One device draws each
mask once for the whole batch, every stage's draws in the model's order, while a stage
runs one micro-batch at a time, and only its own draws.

So at the start of each step every rank replays one device's draws: each draw of the
model (every stage's, in the model's order), at the whole batch's shape, from the default
generator. The generator then moves on exactly as one device's does, on every rank. A
rank keeps the draws of its own stage. When its program draws number ``site`` for
micro-batch ``k``, it is handed the rows of micro-batch ``k`` (``Runtime.draws``).
Micro-batch ``k`` is chunk ``k`` of every data x z shard, the way ``PipelineModule`` cuts
its inputs. A block recomputed in backward is handed the same rows again.

This holds only when the draws can be matched. Every draw must be of a kind the program
numbers: dropout, attention dropout in the math form, ``bernoulli``, a draw shaped like a
tensor. Each must be on a value whose dim 0 is the batch, sample-major, which is how its
rows map to micro-batches. Each stage program must number exactly its stage's draws,
with the same shapes. Otherwise ``plan`` says why, and each stage draws its own masks for
each micro-batch: the same distribution, not one device's values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from shardc.passes.rules.random import DRAWS_LIKE
from shardc.passes.stages import Stage
from shardc.runtime import ops as R

_aten = torch.ops.aten
_DROPOUTS = {_aten.dropout.default, _aten.native_dropout.default}
_SDPA = _aten.scaled_dot_product_attention.default
_SITES = (R.global_dropout, R.global_bernoulli, R.global_draw_like)


@dataclass(frozen=True)
class Draw:
    """One draw of the model, as one device makes it for one micro-batch's rows."""

    stage: int
    kind: str  # "dropout" (the scaled mask), "bernoulli" or "like"
    p: float
    op: Any  # "like": the op, its extra arguments
    args: tuple
    kwargs: tuple
    shape: tuple[int, ...]  # one micro-batch's (global) shape; dim 0 is the batch's rows
    dtype: torch.dtype

    def whole(self, microbatches: int, device: torch.device) -> torch.Tensor:
        """The draw one device makes for the whole batch (every micro-batch's rows)."""
        shape = (self.shape[0] * microbatches, *self.shape[1:])
        if self.kind == "dropout":
            return F.dropout(torch.ones(shape, dtype=self.dtype, device=device), self.p, True)
        if self.kind == "bernoulli":
            return torch.bernoulli(torch.empty(shape, dtype=self.dtype, device=device), self.p)
        return self.op(torch.empty(shape, dtype=self.dtype, device=device), *self.args, **dict(self.kwargs))


def _seeded(n: fx.Node) -> bool:
    """May ``n`` draw from a generator (torch's own tag on the op)?"""
    return isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags


def _no_draw(n: fx.Node) -> bool:
    """A dropout that draws nothing: probability 0, or not training."""
    args: list[Any] = list(n.args)
    return float(args[1]) == 0.0 or (len(args) > 2 and args[2] is not None and not bool(args[2]))


def _sdpa_dropout(n: fx.Node) -> float:
    args: list[Any] = list(n.args)
    p = n.kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    return float(p) if isinstance(p, (int, float)) else 0.0


def _draw_of(n: fx.Node, stage: int) -> Draw | None | str:
    """``n``'s draw, None if it draws nothing, or why it cannot be matched."""
    if n.op != "call_function":
        return None
    t = n.target
    args: list[Any] = list(n.args)
    if t in _DROPOUTS:
        if _no_draw(n):
            return None
        x = args[0].meta["val"]
        return Draw(stage, "dropout", float(args[1]), None, (), (), tuple(x.shape), x.dtype)
    if t is _SDPA:
        p = _sdpa_dropout(n)
        if p == 0.0:
            return None
        q, k = args[0].meta["val"], args[1].meta["val"]
        return Draw(stage, "dropout", p, None, (), (), (*q.shape[:-1], k.shape[-2]), q.dtype)
    if t is _aten.bernoulli.p and not n.kwargs.get("generator"):
        x = args[0].meta["val"]
        chance: Any = args[1] if len(args) > 1 else n.kwargs.get("p", 0.5)
        return Draw(stage, "bernoulli", float(chance), None, (), (), tuple(x.shape), x.dtype)
    if t in DRAWS_LIKE and not n.kwargs.get("generator") and \
            not any(isinstance(a, fx.Node) for a in args[1:]):
        x = args[0].meta["val"]
        return Draw(stage, "like", 0.0, t, tuple(args[1:]), tuple(sorted(n.kwargs.items())),
                    tuple(x.shape), x.dtype)
    if _seeded(n):
        return f"{t} at {n.name} is a draw a stage program does not number"
    return None


def _batched(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose value depends on the model's inputs."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def stage_draws(stages: list[Stage], rows: int, shards: int) -> list[Draw] | str:
    """Every draw of the model in its order (stage by stage: a stage never reads a later
    one), or why one device's draws cannot be handed to the stages. ``rows``: one
    micro-batch's rows; ``shards``: data x z."""
    out: list[Draw] = []
    for st in stages:
        batched = _batched(st.module)
        for n in st.module.graph.nodes:
            d = _draw_of(n, st.index)
            if d is None:
                continue
            if isinstance(d, str):
                return d
            if not d.shape or d.shape[0] % rows or list(n.args)[0] not in batched:
                return (f"the draw at {n.name} is on a value of shape {list(d.shape)}, not one whose "
                        f"dim 0 holds the batch's {rows} rows a micro-batch")
            if d.shape[0] % shards:
                return f"the draw at {n.name} has {d.shape[0]} rows, which data x z = {shards} do not divide"
            out.append(d)
    return out


def program_sites(program: Any, mine: list[Draw]) -> str | None:
    """None when ``program`` numbers exactly the draws ``mine`` (its stage's, in order,
    same shapes) and draws nothing else; else why not."""
    sites: dict[int, list[int]] = {}
    for n in program.graph_module.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in _SITES and n.kwargs.get("site") is not None:
            args: list[Any] = list(n.args)
            sites[n.kwargs["site"]] = list(args[4] if n.target is R.global_draw_like else
                                           args[3] if n.target is R.global_dropout else args[2])
        elif _seeded(n) and not (n.target is _SDPA and _sdpa_dropout(n) == 0.0) and not (
                n.target in _DROPOUTS and _no_draw(n)):
            return f"the stage program draws at {n.name} ({n.target}) on its own"
    if sorted(sites) != list(range(len(mine))):
        return f"the stage program draws {len(sites)} times where its part of the model draws {len(mine)}"
    for i, d in enumerate(mine):
        if sites[i] != list(d.shape):
            return f"the stage program's draw {i} has shape {sites[i]}, the model's {list(d.shape)}"
    return None


class Draws:
    """A pipeline rank's share of one device's draws for one step: ``replay`` at the
    step's start, then ``site(number)`` for the stage and micro-batch ``at`` set last
    (a rank runs one stage, or one a chunk under the interleaved schedule)."""

    def __init__(self, every: list[Draw], stages: list[int], microbatches: int, shards: int) -> None:
        self.every = every
        self.mine = {s: [d for d in every if d.stage == s] for s in stages}
        self.stage = stages[0]
        self.m = microbatches
        self.shards = shards
        self.k = 0
        self._whole: dict[int, list[torch.Tensor]] = {}

    def at(self, stage: int, k: int) -> None:
        """Stage ``stage`` runs micro-batch ``k`` next."""
        self.stage, self.k = stage, k

    def replay(self, device: torch.device) -> None:
        """Draw every draw of the model, as one device does for the whole batch, keeping
        this rank's stages' (every rank's generator moves on as one device's)."""
        self._whole = {s: [] for s in self.mine}
        for d in self.every:
            t = d.whole(self.m, device)
            if d.stage in self._whole:
                self._whole[d.stage].append(t)

    def release(self) -> None:
        self._whole = {}

    def site(self, number: int) -> torch.Tensor:
        d, whole = self.mine[self.stage][number], self._whole[self.stage][number]
        # chunk k of each data x z shard's rows, shard after shard
        rows = whole.view(self.shards, self.m, d.shape[0] // self.shards, *d.shape[1:])[:, self.k]
        return rows.reshape(d.shape)
