"""Recompute in backward what is cheaper to recompute than to save (``backend="inductor"``).

Reads:  a built ``StepProgram`` (after the step passes): forward returns
        ``(*outputs, *saved, *deferred outputs' inputs)``, backward takes
        ``(*saved, *tangents)``
Writes: the same program with fewer bytes saved: a saved value made from other saved
        values (or from the primals) by cheap ops is dropped from forward's outputs and
        its ops are copied into backward, before its first use there; a saved value
        backward never reads is dropped
Keeps:  the arithmetic (the same ops on the same values), the collectives and their
        order, the random draws (never recomputed)

Why: ``joint.py`` saves what autograd would save, and autograd saves outputs: a GELU's
output for the next GEMM's weight gradient beside its input for its own backward, the
fp32 log-softmax of the whole vocabulary for the loss's backward. ``torch.compile``'s
partitioner (AOTAutograd's min-cut) recomputes such values from what is saved anyway,
and inductor fuses the recompute into the backward kernels that read it; measured on
one H100 (GPT-2 small, bf16, torch 2.11), that was most of the gap between shardc's
inductor step and ``torch.compile``'s: 1 GiB more activations, 1.6 ms more kernel time
a step. Only under inductor: the eager program would pay a kernel for each recomputed op.

How: for each saved value, in forward's order, the cheapest way to have it in backward
is either to save it (its bytes) or to recompute it from its inputs, each of them in turn
saved or recomputed (a small tree search over cheap ops: pointwise, views, casts,
softmax and log-softmax, to a depth of ``DEPTH``); values already saved or already
recomputed cost nothing. Where recomputing costs fewer bytes than the value, forward
stops returning it. A tie keeps the value saved: recomputing at equal bytes (a GEMM's
output saved in place of the log-softmax made from it, 296 ops moved for a GPT-2 small
instead of 110) made the CPU step 2-3% slower, measured side by side. A value that
backward reads with anything but such cheap ops (a GEMM: a GELU's output for the next
layer's weight gradient) is never recomputed (``_materialized``): backward would write it
whole again, a kernel's output with nothing to fuse into, where forward has it already;
torch's partitioner keeps such values too. A value that anything writes in place is never
read by a recompute: it may hold another value by then.

A selective policy (``activation_checkpoint="selective"`` or ``Selective(save=...)`` under
inductor) is applied here too, in place of torch's per-op checkpoint policy that compiled
code would never consult: every saved value that a repeated block made (``meta[BLOCK]``,
copied from the rank's program by ``joint.py``) with an ATen op the policy does not save
is recomputed, back to the block's saved ops' outputs, its input and the primals, whatever
the bytes, unless what it would save instead keeps more storage than the value frees (then
the value stays saved: the policy never makes forward keep more). Collectives and random
draws are never recomputed: their outputs (a gathered weight, a partial sum's total, a
dropout mask) stay saved, so the step moves the bytes it moves without the policy and the
masks stay one device's. Eager selective recompute re-runs
a block's collectives in backward instead (``passes/recompute.py``). Block recompute
(``activation_checkpoint="blocks"`` under inductor) is the policy that saves no op: a
block's values are recomputed from its inputs, and ``reshard.py`` gathers its weights
again in backward, as the eager recompute re-issues their gathers.
"""
from __future__ import annotations

import operator
from typing import Iterable

import torch
import torch.fx as fx

from shardc.core.context import COMM, CompileContext
from shardc.core.ir import DEFERRED, Selective, StepProgram, op_named
from shardc.passes.aliases import view_of, written
from shardc.passes.recompute import BLOCK
from shardc.passes.reshard import COPY_OF
from shardc.passes.step_nodes import PART
from shardc.runtime.ops import MESH_COORD

aten = torch.ops.aten
DEPTH = 6  # how far back a recompute may reach: a GELU's tanh form is 6 ops deep
# ops that are not pointwise but cheap to recompute from a saved input: one pass of reads
CHEAP = frozenset({aten._to_copy.default, aten._log_softmax.default, aten._softmax.default,
                   aten.clone.default})
_FREE = 0  # a value backward already has


def _bytes(n: fx.Node) -> int:
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return -1
    return v.numel() * v.element_size()


def _cheap(n: fx.Node) -> bool:
    t = n.target
    if t is MESH_COORD:  # a constant of the rank, read again for free
        return True
    if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t.namespace != "aten":
        return False
    if COMM in n.meta or t._schema.is_mutable or _bytes(n) < 0:
        return False
    if torch.Tag.nondeterministic_seeded in t.tags:
        return False
    return t in CHEAP or torch.Tag.pointwise in t.tags or view_of(n) is not None


# reductions inductor fuses with the pointwise work that feeds them (a bias's gradient)
_FUSED_REDUCTIONS = frozenset({aten.sum.dim_IntList, aten.sum.default, aten.mean.dim,
                               aten.amax.default, aten.amin.default})


def _materialized(p: fx.Node) -> bool:
    """Does backward need ``p`` (a saved value's placeholder) in memory whole: does an op
    other than a pointwise, cheap or reducing one (a GEMM, attention, a collective, the
    output) read it, directly or through views? Then recomputing it writes the same bytes
    again in backward, with no kernel to fuse into, while saving it costs forward nothing
    (it wrote it already). AOTAutograd's min-cut partitioner bans such recomputes too
    (``ban_if_materialized_backward``): measured on one CPU process (GPT, ``peer`` shape),
    recomputing a GELU's output for the next GEMM's weight gradient made the backward's
    GELU kernel 2.4x slower than ``torch.compile``'s, which saves it."""
    stack, seen = list(p.users), set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op != "call_function":
            return True
        if view_of(u) is not None or u.target is operator.getitem:
            stack.extend(u.users)
            continue
        if not (u.target in _FUSED_REDUCTIONS or _cheap(u)):
            return True
    return False


class _Plan:
    """The cheapest way to have a forward value in backward: cost in bytes newly saved,
    the values to save, the values to recompute (inputs before users)."""

    def __init__(self, cost: int, save: list[fx.Node], compute: list[fx.Node]) -> None:
        self.cost, self.save, self.compute = cost, save, compute


class _Search:
    def __init__(self, have: set[fx.Node], touched: set[fx.Node]) -> None:
        self.have = have          # forward values backward has (saved or recomputed)
        self.touched = touched    # values something writes in place: never re-read

    def plan(self, n: fx.Node, depth: int) -> _Plan | None:
        if n in self.touched:
            return None
        if n in self.have:
            return _Plan(_FREE, [], [])
        if n.op == "placeholder":
            # a primal: the caller holds it through the step (a parameter, an input)
            return _Plan(_FREE, [n], [])
        size = _bytes(n)
        if size < 0 or n.op != "call_function":
            return None
        save = _Plan(size, [n], [])
        if depth == 0 or not _cheap(n):
            return save
        total, saves, computes = 0, [], []
        for a in n.all_input_nodes:
            p = self.plan(a, depth - 1)
            if p is None:
                return save
            total += p.cost
            saves += p.save
            computes += p.compute
        if total < size:
            return _Plan(total, saves, [*computes, n])
        return save


def _recomputable(n: fx.Node, keep: frozenset) -> bool:
    """May a selective policy recompute ``n`` (an ATen op whose packet it does not save,
    neither a collective nor a random draw nor a write, or an element of such an op's
    tuple)?"""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and _recomputable(src, keep)
    t = n.target
    if t is MESH_COORD:
        return True
    if not isinstance(t, torch._ops.OpOverload) or t.namespace != "aten":
        return False
    if COMM in n.meta or t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags:
        return False
    if t.overloadpacket in keep:
        return False
    v = n.meta.get("val")
    vals = v if isinstance(v, (tuple, list)) else (v,)
    return all(isinstance(x, torch.Tensor) for x in vals) and len(vals) > 0


class _Selective:
    """A selective policy's plan for a value of a block: recompute every op of the block
    the policy does not save, back to what the policy saves, what another block (or no
    block) made, and the primals; those are saved. The policy decides, not the bytes
    (``cost`` only vetoes a plan that would save more than the value)."""

    def __init__(self, have: set[fx.Node], touched: set[fx.Node], keep: frozenset) -> None:
        self.have, self.touched, self.keep = have, touched, keep
        self.memo: dict[fx.Node, _Plan | None] = {}

    def applies(self, n: fx.Node) -> bool:
        block = n.meta.get(BLOCK)
        # a block's output (what another block, or the code after the blocks, reads) stays
        # saved, as a checkpoint keeps its block's input: recomputed, it would be needed
        # by the next block's recompute, which backward runs first, so every block's
        # recompute would run at the start of backward and hold all of them at once
        return block is not None and _recomputable(n, self.keep) and not any(
            u.op != "output" and u.meta.get(BLOCK) != block for u in n.users)

    def cost(self, plan: _Plan) -> int:
        """Bytes of storage the plan newly keeps: a saved view keeps its base, and a base
        something backward has already, or a primal, costs nothing."""
        held = {_root(h) for h in self.have}
        roots = dict.fromkeys(_root(n) for n in plan.save)
        return sum(max(_bytes(r), 0) for r in roots if r.op != "placeholder" and r not in held)

    def plan(self, n: fx.Node, block: str) -> _Plan | None:
        if n not in self.memo:
            self.memo[n] = self._plan(n, block)
        return self.memo[n]

    def _plan(self, n: fx.Node, block: str) -> _Plan | None:
        if n in self.touched:
            return None
        if n in self.have or n.op == "placeholder":
            return _Plan(_FREE, [] if n in self.have else [n], [])
        size = _bytes(n)
        save = _Plan(size, [n], []) if size >= 0 else None
        if n.meta.get(BLOCK) != block or not _recomputable(n, self.keep):
            return save
        saves: list[fx.Node] = []
        computes: list[fx.Node] = []
        for a in n.all_input_nodes:
            p = self.plan(a, block)
            if p is None:
                return save
            saves += p.save
            computes += p.compute
        return _Plan(_FREE, saves, [*computes, n])


def _root(n: fx.Node) -> fx.Node:
    """The node whose storage ``n`` shares (itself, unless it is a view)."""
    seen = {n}
    while (v := _view_of(n)) is not None and v not in seen:
        seen.add(v)
        n = v
    return n


def _stored(saved: Iterable[fx.Node]) -> int:
    """Bytes of storage forward keeps for backward: each saved view's base once; the
    primals (held by the caller anyway) not."""
    roots = dict.fromkeys(_root(s) for s in saved)
    return sum(max(_bytes(r), 0) for r in roots if r.op != "placeholder")


def _view_of(n: fx.Node) -> fx.Node | None:
    # an element of a view op's tuple (a split's piece) shares its input's storage too
    if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        return n.args[0] if view_of(n.args[0]) is not None else None
    return view_of(n)


def _touched(fg: fx.Graph, bg: fx.Graph, forward_of: dict[fx.Node, fx.Node]) -> set[fx.Node]:
    """Forward values whose storage something writes in place, in either part (a backward
    placeholder stands for the forward value it receives), every view of it included."""
    roots: set[fx.Node] = set()
    for g in (fg, bg):
        for n in g.nodes:
            for w in written(n):
                w = _root(w)
                roots.add(forward_of.get(w, w))
    return {n for n in fg.nodes if _root(n) in roots}


REMAT = "shardc_remat"  # forward part's gm.meta: a Remat


class Remat:
    """What ``remat_pass`` did to a step program: bytes saved for backward before and
    after (a rank's, one step), how many ops backward recomputes, and how many of those
    a selective policy chose (ops of the repeated blocks)."""

    def __init__(self, before: int, after: int, ops: int, blocks: int = 0) -> None:
        self.before, self.after, self.ops, self.blocks = before, after, ops, blocks

    def describe(self) -> str:
        mib = 2 ** 20
        policy = f", {self.blocks} of them by the selective policy" if self.blocks else ""
        return (f"saved for backward: {self.after / mib:,.1f} MiB ({self.before / mib:,.1f} MiB before "
                f"{self.ops} ops were moved to backward to recompute there{policy})")


def remat_pass(jp: StepProgram, ctx: CompileContext) -> StepProgram:
    """``jp`` with what is cheaper to recompute than to save recomputed in backward
    (``backend="inductor"`` only)."""
    if ctx.options.backend != "inductor":
        return jp
    # a selective policy (activation_checkpoint="selective" under inductor): the packets
    # whose outputs it saves; every other op of a block is recomputed
    policy = ctx.options.activation_checkpoint
    keep: frozenset | None = None
    if ctx.options.recompute_in_step:
        # "blocks" saves nothing a block makes but what cannot be recomputed (collectives'
        # outputs, draws): every ATen op of it is recomputed from the block's inputs
        keep = frozenset(op_named(n) for n in policy.save) if isinstance(policy, Selective) else frozenset()
    fg, bg = jp.forward.graph, jp.backward.graph
    f_out = next(n for n in fg.nodes if n.op == "output")
    vals = list(f_out.args[0])
    extra = sum(d.n_inputs for d in jp.forward.meta.get(DEFERRED, []))
    head, saved, tail = vals[:jp.n_outputs], vals[jp.n_outputs:len(vals) - extra], vals[len(vals) - extra:]
    b_ph = [n for n in bg.nodes if n.op == "placeholder"]
    saved_ph, tangents = b_ph[:len(saved)], b_ph[len(saved):]
    if not all(isinstance(s, fx.Node) for s in saved) or not tangents and not saved_ph:
        return jp
    # forward value -> backward node that holds it (a placeholder, or a recomputed copy);
    # a forward value saved twice (two entries) keeps one placeholder
    held: dict[fx.Node, fx.Node] = {}
    for s, p in zip(saved, saved_ph):
        if s in held:
            p.replace_all_uses_with(held[s])
        else:
            held[s] = p
    touched = _touched(fg, bg, {p: s for s, p in zip(saved, saved_ph)})
    before = _stored(held)
    # what backward gathers again (reshard.py) it has already: a recompute reads the copy
    by_name = {n.name: n for n in fg.nodes}
    regathered = set()
    for b in bg.nodes:
        f = by_name.get(b.meta.get(COPY_OF))  # type: ignore[arg-type]
        if f is not None and f not in held:
            held[f] = b
            regathered.add(f)
    changed = True
    while changed:
        changed = False
        for s in list(held):
            p = held[s]
            if p.op != "placeholder":
                continue
            if not p.users:
                del held[s]
                changed = True
                continue
            have = set(held) - {s}
            selective = _Selective(have, touched, keep) if keep is not None else None
            if selective is not None and selective.applies(s):
                plan = selective.plan(s, s.meta[BLOCK])
                if plan is not None and selective.cost(plan) > _bytes(_root(s)):
                    # the policy's saves would cost more than the value itself (a GEMM's
                    # output autograd did not keep, for a smaller value made from it)
                    plan = None
            elif _materialized(p):
                # backward writes it to memory whole anyway (a GEMM reads it): recomputed,
                # it is one more buffer written in backward where forward's is free
                continue
            else:
                plan = _Search(have, touched).plan(s, DEPTH)
            if plan is None or not plan.compute:
                continue
            order = _order(bg)
            first = min(p.users, key=lambda u: order[u])
            for n in plan.save:
                if n not in held:
                    held[n] = _placeholder(bg, tangents, n)
            for n in dict.fromkeys(plan.compute):
                if n in held and n is not s:  # s itself is held by the placeholder it replaces
                    continue
                with bg.inserting_before(first):
                    copy = bg.node_copy(n, lambda a: held[a])
                copy.meta[PART] = "backward"
                held[n] = copy
            p.replace_all_uses_with(held[s])
            changed = True
    # what is still a placeholder is what forward saves; the rest is gone from both
    keep_saved = [s for s, p in held.items() if p.op == "placeholder"]
    for p in [n for n in bg.nodes if n.op == "placeholder" and n not in tangents]:
        if p not in {held[s] for s in keep_saved}:
            bg.erase_node(p)
    _order_placeholders(bg, [held[s] for s in keep_saved], tangents)
    _repair_order(bg)
    f_out.args = (tuple(head) + tuple(keep_saved) + tuple(tail),)
    bg.lint()
    copies = [(s, p) for s, p in held.items() if p.op != "placeholder" and s not in regathered]
    by_policy = sum(1 for s, _ in copies if keep is not None and s.meta.get(BLOCK) is not None
                    and _recomputable(s, keep))
    jp.forward.meta[REMAT] = Remat(before, _stored(keep_saved), len(copies),
                                   by_policy)
    jp.forward.recompile()
    jp.backward.recompile()
    return jp


def _order(g: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(g.nodes)}


def _placeholder(bg: fx.Graph, tangents: list[fx.Node], n: fx.Node) -> fx.Node:
    anchor = tangents[0] if tangents else next(m for m in bg.nodes if m.op != "placeholder")
    with bg.inserting_before(anchor):
        p = bg.placeholder(f"saved_{n.name}")
    p.meta.update(n.meta)
    return p


def _order_placeholders(bg: fx.Graph, saved: list[fx.Node], tangents: list[fx.Node]) -> None:
    """Backward's placeholders in forward's output order: the saved, then the tangents."""
    anchor = next(n for n in bg.nodes if n.op != "placeholder")
    for p in [*saved, *tangents]:
        anchor.prepend(p)


def _repair_order(bg: fx.Graph) -> None:
    """Move each recomputed node (and what it reads) before its first reader, where a
    later recompute put a reader earlier than the node."""
    order = _order(bg)
    for n in list(bg.nodes):
        for a in n.all_input_nodes:
            if order[a] > order[n]:
                _move_before(a, n, order)
                order = _order(bg)


def _move_before(a: fx.Node, n: fx.Node, order: dict[fx.Node, int]) -> None:
    for b in a.all_input_nodes:
        if order[b] > order[n]:
            _move_before(b, n, order)
    n.prepend(a)

