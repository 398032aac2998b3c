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

import functools
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge, get_gradient_edge

from shardc.core.mesh import PIPE, Mesh
from shardc.core.options import SCHEDULES
from shardc.runtime.collectives import guarded

Action = tuple[str, int]  # ("F", "B" or "W", micro-batch)
# (kind, micro-batch, chunk): chunk c of pipe rank r runs stage c * pipe + r
Step = tuple[str, int, int]


def actions(schedule: str, stages: int, stage: int, microbatches: int) -> list[Action]:
    """The order in which ``stage`` runs its micro-batches' forwards and backwards, for
    the schedules that hold one stage a rank (``chunk_actions`` has every schedule's).

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
    if schedule == "zero_bubble":
        return _zero_bubble(stages, microbatches)[stage]
    raise ValueError(f"no one-chunk order for schedule {schedule!r}; shardc runs {SCHEDULES}")


def chunk_actions(schedule: str, stages: int, stage: int, microbatches: int, chunks: int = 1) -> list[Step]:
    """Every schedule's order for pipe rank ``stage``, as (kind, micro-batch, chunk)."""
    if schedule == "interleaved":
        return _interleaved(stages, stage, microbatches, chunks)
    return [(kind, k, 0) for kind, k in actions(schedule, stages, stage, microbatches)]


def _interleaved(p: int, r: int, m: int, v: int) -> list[Step]:
    """Interleaved 1F1B (Megatron's virtual pipeline): rank r holds the model's chunks r,
    r + p, ..., r + (v-1)p, so a micro-batch visits every rank v times and the pipe
    fills and drains v times faster: the bubble falls to (p-1)/(v*m + p-1).

    Micro-batches go in groups of p. The forwards take each group chunk by chunk (all p
    of the group through chunk 0, then chunk 1, ...); the backwards take the groups in
    the same order, chunks last to first. Rank r runs 2(p-r-1) + (v-1)p forwards to
    fill the pipe, then one forward and one backward in turn, then the backwards left.
    That needs m to be a multiple of p (``compile`` checks it)."""
    if m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) a multiple of stages ({p})")
    total = m * v

    def nth(i: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(i, p * v)
        chunk = within // p
        return group * p + within % p, (chunk if forward else v - 1 - chunk)

    warm = min(2 * (p - r - 1) + (v - 1) * p, total)
    out: list[Step] = [("F", *nth(i, True)) for i in range(warm)]
    for i in range(total - warm):
        out += [("F", *nth(warm + i, True)), ("B", *nth(i, False))]
    out += [("B", *nth(i, False)) for i in range(total - warm, total)]
    return out


@functools.lru_cache(maxsize=64)
def _zero_bubble(stages: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1 (arXiv 2401.10241): each backward split into B (the input gradient, which
    the previous stage waits for) and W (the weight gradients, which nobody waits for),
    and the W passes moved into what would be 1F1B's bubbles.

    The order comes from simulating every stage at once with unit costs (F = B = W = 1):
    at each tick a free stage runs a ready B first (it unblocks the stage before), else a
    ready F, else its oldest pending W. Stage s starts at most ``stages - s`` forwards
    ahead of its B passes (1F1B's bound) and holds at most ``stages`` micro-batches'
    activations (F done, W not), the most 1F1B's first stage holds: ZB-H1's memory. With
    equal stages the bubble falls from 1F1B's 3(p-1) units to about (p-1) + a few."""
    p, m = stages, microbatches
    done: dict[tuple[str, int, int], int] = {}
    orders: list[list[Action]] = [[] for _ in range(p)]
    nf, nb, nw, busy = [0] * p, [0] * p, [0] * p, [0] * p
    t = 0
    never = 1 << 60
    while sum(len(o) for o in orders) < 3 * p * m:
        for s in range(p):
            if busy[s] > t:
                continue
            pick: Action | None = None
            k = nb[s]
            if k < nf[s] and done.get(("F", s, k), never) <= t and (
                    s == p - 1 or done.get(("B", s + 1, k), never) <= t):
                pick = ("B", k)
            elif nf[s] < m and nf[s] - nb[s] < p - s and nf[s] - nw[s] < p and (
                    s == 0 or done.get(("F", s - 1, nf[s]), never) <= t):
                pick = ("F", nf[s])
            elif nw[s] < nb[s]:
                pick = ("W", nw[s])
            if pick is None:
                continue
            done[(pick[0], s, pick[1])] = busy[s] = t + 1
            orders[s].append(pick)
            if pick[0] == "F":
                nf[s] += 1
            elif pick[0] == "B":
                nb[s] += 1
            else:
                nw[s] += 1
        t += 1
    return orders


def bubble_fraction(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """The schedule's idle share of a step with equal stages and a backward twice a
    forward: (p-1)/(m+p-1) for GPipe and 1F1B (1F1B saves memory, not time); for the
    zero-bubble and interleaved orders, their simulated share (``simulate``; zero bubble
    with F = B = W)."""
    p, m = stages, microbatches
    if schedule == "zero_bubble":
        orders = [[(kind, k, 0) for kind, k in o] for o in _zero_bubble(p, m)]
        return 1 - 3 * m / simulate(orders, p, 1, {"F": 1, "B": 1, "W": 1})
    if schedule == "interleaved":
        orders = [_interleaved(p, r, m, chunks) for r in range(p)]
        return 1 - 3 * m * chunks / simulate(orders, p, chunks, {"F": 1, "B": 2})
    return (p - 1) / (m + p - 1)


def simulate(orders: list[list[Step]], p: int, chunks: int, cost: dict[str, float]) -> float:
    """The time ``orders`` (one list a pipe rank) take when each rank runs its actions in
    its order, each action waiting for its inputs (sends never block: a rank waits only in
    a receive), with ``cost`` per kind of action; ``RuntimeError`` if they deadlock."""
    last = p * chunks - 1
    done: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * p, [0.0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, k, c = orders[r][pos[r]]
                j = c * p + r
                deps = [("F", j - 1, k)] if kind == "F" and j > 0 else []
                if kind == "B":
                    deps += [("F", j, k)] + ([("B", j + 1, k)] if j < last else [])
                if kind == "W":
                    deps.append(("B", j, k))
                if not all(d in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                done[(kind, j, k)] = free[r] = start + cost[kind]
                pos[r] += 1
                moved = True
    stuck = [r for r in range(p) if pos[r] < len(orders[r])]
    if stuck:
        raise RuntimeError(f"the pipeline orders deadlock: ranks {stuck} wait at "
                           f"{[orders[r][pos[r]] for r in stuck]}")
    return max(free)


class P2P:
    """This rank's sends and receives to the same coordinates in other stages, counted
    per phase in bytes (what the comm report's ``pipe`` rows predict).

    The schedule's messages are named (``key``) and received by name. Both sides know, from
    every rank's action list, the order in which a peer sends this rank its messages
    (``expect``); a receive takes the peer's messages in that order and keeps any that
    come before the one asked for until it is asked for. So the link's order is the
    sender's, whatever the receiver's order of asking (with interleaved chunks on two
    ranks, one link carries activations and gradients in orders the two ranks' actions
    do not share), which NCCL (blind to tags) needs. A message to a chunk of this same
    rank is handed over in memory and counts no bytes."""

    def __init__(self, mesh: Mesh, rank: int) -> None:
        self.mesh = mesh
        self.rank = rank
        self.coords = mesh.coords(rank)
        self.sent: Counter[tuple[str, str, str]] = Counter()
        self.calls: Counter[tuple[str, str, str]] = Counter()
        self._works: list[tuple[Any, torch.Tensor]] = []
        self.waited = 0.0  # seconds blocked in receives since the last reset_wait()
        # per peer (pipe index): the keys, shapes and dtypes it sends this rank, in its order
        self._plan: dict[int, list[tuple[Any, tuple[int, ...], torch.dtype]]] = {}
        self._next: dict[int, int] = {}
        self._held: dict[Any, torch.Tensor] = {}

    def peer(self, stage: int) -> int:
        return self.mesh.rank({**self.coords, PIPE: stage})

    def expect(self, plan: dict[int, list[tuple[Any, tuple[int, ...], torch.dtype]]]) -> None:
        """Start a step whose named messages from each peer come in ``plan``'s order."""
        self._held.clear()  # (empty after a step that ran to its end)
        self._plan = plan
        self._next = {q: 0 for q in plan}

    def send(self, t: torch.Tensor, stage: int, phase: str, key: Any = None) -> None:
        if key is not None and stage == self.coords[PIPE]:
            # another chunk of this rank: a copy, so the reader's in-place ops and the
            # writer's saved tensor never share memory
            self._held[key] = t.detach().clone()
            return
        t = t.detach().contiguous()
        key_ = ("send", PIPE, phase)
        self.sent[key_] += t.numel() * t.element_size()
        self.calls[key_] += 1
        with guarded(None, "isend", None, f"pipeline {phase} to stage {stage}"):
            work = dist.isend(t, self.peer(stage))
        self._works.append((work, t))  # the buffer must live until the send completes

    def take(self, key: Any, stage: int, device: torch.device, phase: str) -> torch.Tensor:
        """The message ``key`` from pipe rank ``stage`` (receiving the ones it sends before)."""
        if key in self._held:
            return self._held.pop(key)
        plan = self._plan.get(stage, [])
        while True:
            i = self._next.get(stage, 0)
            if i >= len(plan):
                raise RuntimeError(f"shardc pipeline: stage {stage} sends no message {key} to this rank")
            got, shape, dtype = plan[i]
            self._next[stage] = i + 1
            buf = self.recv(shape, dtype, device, stage, phase)
            if got == key:
                return buf
            self._held[got] = buf

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, stage: int,
             phase: str) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        t0 = time.perf_counter()
        # a profiler range (shardc trace): the time this rank waited on another stage
        with torch.profiler.record_function(f"shardc.pipe wait {phase} from stage {stage}"), \
                guarded(None, "recv", None, f"pipeline {phase} from stage {stage}"):
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


class SplitBackward:
    """A micro-batch's backward in two parts, for the zero-bubble schedule: ``inputs()``
    now (the gradients the previous stage waits for), ``weights()`` later (the parameter
    gradients nobody waits for), without computing anything twice.

    Autograd runs the first part as a gradient with respect to the stage's inputs only:
    its engine skips every branch that leads to parameters alone. Where such a branch
    leaves the input path (a GEMM's node, whose input gradient is on the path and whose
    weight gradient is not), a pre-hook keeps the gradient arriving at that node. The
    second part starts from those nodes with those gradients, asking for the parameters
    only, so each node computes just its weight branch; it accumulates into ``.grad`` as
    any backward does (gradient hooks, reductions). Parameters whose branches leave the
    input path at the same nodes go in one call."""

    def __init__(self, roots: list[torch.Tensor], seeds: list[torch.Tensor], inputs: list[torch.Tensor],
                 params: list[torch.Tensor]) -> None:
        self.roots, self.seeds, self.inputs, self.params = roots, seeds, inputs, params
        root_nodes = [get_gradient_edge(r).node for r in roots]
        input_nodes = {get_gradient_edge(x).node for x in inputs}
        # every node under the roots, and which of them lead to an input
        children: dict[Any, list[Any]] = {}
        post: list[Any] = []  # children before their parents
        stack: list[tuple[Any, bool]] = [(n, False) for n in root_nodes]
        while stack:
            n, expanded = stack.pop()
            if expanded:
                post.append(n)
                continue
            if n in children:
                continue
            children[n] = [c for c, _ in n.next_functions if c is not None]
            stack.append((n, True))
            stack += [(c, False) for c in children[n] if c not in children]
        on_path: set[Any] = {n for n in input_nodes if n in children}
        for n in post:
            if n not in on_path and any(c in on_path for c in children[n]):
                on_path.add(n)
        parents: dict[Any, list[Any]] = {}
        for n, cs in children.items():
            for c in cs:
                parents.setdefault(c, []).append(n)
        # each parameter: the nodes where its branch leaves the input path (or the roots
        # off it), found by walking up from its accumulator through nodes off the path
        groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self.starts: dict[int, Any] = {}
        for p in params:
            acc = get_gradient_edge(p).node
            if acc not in children:
                continue  # no gradient reaches it in this micro-batch
            seen, todo, starts = {acc}, [acc], set()
            while todo:
                n = todo.pop()
                if n in on_path or n in root_nodes:
                    starts.add(n)
                    if n in on_path:
                        continue
                for q in parents.get(n, []):
                    if q not in seen:
                        seen.add(q)
                        todo.append(q)
            key = tuple(sorted(id(s) for s in starts))
            for s in starts:
                self.starts[id(s)] = s
            groups.setdefault(key, []).append(p)
        self.groups = groups
        self.kept: dict[int, tuple] = {}
        self._root_nodes = root_nodes
        self._on_path = on_path

    def inputs_grad(self) -> list[torch.Tensor | None]:
        """The gradients of the stage's inputs (the first part); keeps what the second
        part starts from."""
        handles = []
        for key, node in self.starts.items():
            if node in self._on_path:
                def keep(grads: tuple, key: int = key) -> None:
                    self.kept[key] = grads
                handles.append(node.register_prehook(keep))
        try:
            if not self.inputs:
                return []
            grads = torch.autograd.grad(self.roots, self.inputs, self.seeds, retain_graph=True,
                                        allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        return list(grads)

    def weights_grad(self) -> None:
        """Accumulate every parameter's gradient (the second part)."""
        seeds_of = {id(get_node(r)): s for r, s in zip(self.roots, self.seeds)}
        for key, params in self.groups.items():
            edges, grads = [], []
            handles = []
            for nid in key:
                node = self.starts[nid]
                if nid in self.kept:
                    kept = self.kept[nid]
                    for i, g in enumerate(kept):
                        if g is not None:
                            edges.append(GradientEdge(node, i))
                            grads.append(g)
                    # a start below another start of the group gets exactly what it had
                    # in the first part, not that again plus what flows from above
                    handles.append(node.register_prehook(lambda _g, kept=kept: kept))
                elif nid in seeds_of:  # a root off the input path: its seed
                    edges.append(GradientEdge(node, 0))
                    grads.append(seeds_of[nid])
            try:
                if edges:
                    torch.autograd.backward(edges, grads, retain_graph=True, inputs=params)
            finally:
                for h in handles:
                    h.remove()
        self.kept.clear()
        self.starts.clear()


def get_node(t: torch.Tensor) -> Any:
    return get_gradient_edge(t).node
