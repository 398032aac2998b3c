"""Activation checkpointing of the rank's program: ``compile(activation_checkpoint="blocks")``
(or ``"selective"`` / ``Selective(save=...)``).

Reads:  meta[SOURCE] (the module each node came from) of the rank's finished program, and
        the model's repeated blocks (children of a ModuleList/Sequential of >= 2 modules of
        one class)
Writes: meta[RECOMPUTE] = block name on every node re-run in backward; returns an
        executable copy of the program split into segments, each block's segment run
        under ``torch.utils.checkpoint`` (the program itself stays flat: the report,
        ``explain`` and the tests read it)
Keeps:  every rank splits identically, so collectives keep one order on every rank

Why: a block's activations are what training keeps from forward to backward; recomputing
them from the block's input frees them. In the rank's program the recompute also re-issues
the block's weight all-gathers (and its forward activation collectives), so gathered
weights are freed after forward too, as FSDP's reshard-after-forward does. Those re-issued
collectives move bytes in the backward phase: the runtime counts them there, and the comm
report adds a backward row for each (``RECOMPUTE``), so measured == reported still holds.

A collective's issue and its wait always go to the same segment (the issue follows its
wait): a recompute must never issue a collective it does not wait for. Early stopping of
the recompute is off for the same reason.

A selective policy (``Selective``) cuts the same segments but saves, inside them, the
outputs of the ops it names (by default the GEMMs and attention: the expensive ops whose
outputs are the large activations worth keeping) and recomputes the rest: the pointwise
and norm ops between them, as torch's selective activation checkpointing does (it is
that mechanism: ``torch.utils.checkpoint.create_selective_checkpoint_contexts``). Every
collective is recomputed (never saved): a segment's recompute re-issues all of them, so
the report's backward rows stay exact.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from shardc.core.compat import checkpoint_whole
from shardc.core.context import SOURCE
from shardc.core.ir import Selective
from shardc.runtime import collectives as C

RECOMPUTE = "shardc_recompute"  # node.meta: the block whose recompute re-runs this node


_STARTS = (C.all_gather_start, C.all_reduce_start, C.reduce_scatter_start, C.all_to_all_start)


def repeated_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks: the children of every
    ModuleList/Sequential with at least two children, all of one class."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2:
            kinds = {type(c) for c in m}
            if len(kinds) == 1:
                out += [f"{name}.{i}" if name else str(i) for i in range(len(m))]
    # a block inside a block (a list of lists) is covered by the outer one
    return [b for b in out if not any(b != o and b.startswith(o + ".") for o in out)]


def _block_of(n: fx.Node, blocks: list[str]) -> str | None:
    mod = getattr(n.meta.get(SOURCE), "module", None) or ""
    for b in blocks:
        if mod == b or mod.startswith(b + "."):
            return b
    return None


BLOCK = "shardc_block"  # node.meta: the repeated block a node of the program belongs to


def mark_blocks(gm: fx.GraphModule, blocks: list[str]) -> None:
    """Mark each node of the rank's program with its repeated block (``BLOCK``), for a
    selective policy applied inside the step program (``passes/remat.py``; the joint
    trace copies the mark to the ops each node becomes). A collective keeps its mark but
    is never recomputed there."""
    for n in gm.graph.nodes:
        b = _block_of(n, blocks) if n.op == "call_function" else None
        if b is not None:
            n.meta[BLOCK] = b


def mark_and_split(gm: fx.GraphModule, blocks: list[str], rt: str,
                   selective: Selective | None = None) -> fx.GraphModule:
    """Mark the nodes each block's recompute re-runs and return the program split into
    segments (outside-block segments plain, block segments checkpointed, with
    ``selective``'s policy where given)."""
    order = {b: i for i, b in enumerate(blocks)}
    part: dict[fx.Node, int] = {}  # segment index: 2*i+1 for block i, even between blocks
    seen = -1
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    for n in nodes:
        if n.target is C.wait or n.target is C.grad_all_reduce:
            # A wait (and a gradient all-reduce, identity in forward) runs where its data
            # is, whatever op the report attributes it to: the all-reduce completing a
            # partial sum is attributed to the op that made the partial (Llama's
            # vocabulary-parallel embedding), though it runs after the next block's
            # RMSNorm scaled it. A weight's gather (its data a parameter) keeps its block.
            start = n.args[0]
            data = [a for a in n.all_input_nodes if a in part]
            if n.target is C.wait and isinstance(start, fx.Node):
                data += [a for a in start.all_input_nodes if a in part]
            if data:
                part[n] = max(part[a] for a in data)
                continue
        b = _block_of(n, blocks)
        if b is not None:
            part[n] = 2 * order[b] + 1
            if n.target not in _STARTS:  # a prefetched gather does not open its block
                seen = max(seen, order[b])
        elif n.meta.get(SOURCE) is not None and n.target not in _STARTS:
            # outside every block (embeddings, the head, the loss): the segment between
            # the blocks it sits between, never recomputed
            part[n] = 2 * (seen + 1)
    for n in reversed(nodes):
        if n.target in _STARTS:
            waits = [u for u in n.users if u.target is C.wait]
            if waits and waits[0] in part:
                part[n] = part[waits[0]]
        users = [part[u] for u in n.users if u in part]
        if n not in part:
            # no block of its own: the segment of its earliest consumer (or the last)
            part[n] = min(users) if users else 2 * len(blocks)
        elif part[n] % 2 == 0 and users and min(users) < part[n]:
            # outside every block, but a block before the one it sits after reads it: a
            # layout change placed where block 0 first reads it (BigCode's token
            # embedding on x2y1z2d1: its partial sum is reduce-scattered, and the
            # `unmove` after the wait comes after block 0's first ops) moves to the
            # segment between the blocks before that reader, never recomputed; or into
            # the reader's block when its data is made there (on x2y2z1d1 the
            # reduce-scatter itself follows the data into block 0)
            first_use = min(users)
            made = max((part[a] for a in n.all_input_nodes if a in part), default=0)
            part[n] = max(made, first_use - first_use % 2)
    for n in nodes:
        for a in n.all_input_nodes:
            if a in part and part[a] > part[n]:
                raise NotImplementedError(
                    f"shardc.compile: block recompute (activation_checkpoint) cannot cut this "
                    f"program into blocks: {n.format_node()} (segment {part[n]}) reads "
                    f"{a.format_node()} (segment {part[a]}), computed after it.")
    for n in nodes:
        if part[n] % 2:
            n.meta[RECOMPUTE] = blocks[part[n] // 2]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first = min(part.values(), default=0)

    def callback(n: fx.Node) -> int:
        if n in part:
            return part[n]
        return first if n in placeholders else 2 * len(blocks)

    split = split_module(gm, gm, callback, keep_original_order=True)
    for name, sub in list(split.named_children()):
        idx = int(name.rsplit("_", 1)[1])
        if idx % 2:
            setattr(split, name, Checkpointed(sub, rt, selective))
    return split


class Checkpointed(nn.Module):
    """A block's segment run under non-reentrant ``torch.utils.checkpoint``, its recompute
    counted in the backward phase."""

    def __init__(self, inner: nn.Module, rt: str, selective: Selective | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.rt = rt
        self.selective = selective

    def forward(self, *args: Any) -> Any:
        r = C.get_runtime(self.rt)

        @contextlib.contextmanager
        def recomputing() -> Iterator[None]:
            prev = r.recomputing
            r.recomputing = True
            try:
                yield
            finally:
                r.recomputing = prev

        def contexts() -> tuple[Any, Any]:
            if self.selective is None:
                return contextlib.nullcontext(), recomputing()

            fwd, rec = create_selective_checkpoint_contexts(self.selective.policy())
            return fwd, _both(rec, recomputing())

        return checkpoint_whole(self.inner, *args, context_fn=contexts)


@contextlib.contextmanager
def _both(a: Any, b: Any) -> Iterator[None]:
    with a, b:
        yield
