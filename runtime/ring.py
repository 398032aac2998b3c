"""Ring attention: scaled dot-product attention on a sequence cut over the ``context`` axis.

Each of the G ranks of a context group holds the queries, keys and values of its own
positions of the sequence (``positions``: one contiguous block, or "balanced": a head
chunk and its mirror in the tail, ``balanced_interleave``).
The keys and values travel round the ring: at step t a rank attends its queries to the
block of keys and values that started on rank r - t, while it passes the block it holds
to rank r + 1 (``batch_isend_irecv``, overlapped with the step's arithmetic). Each step gives
a partial attention and its log-sum-exp per query row; the partials are merged by the
log-sum-exp rule, so after G steps every rank holds exactly the rows one device computes
for its queries, having never held more than two blocks of keys and values.

Backward is the ring's own: the key/value blocks travel round again, and the gradient of
each block travels with it, each rank adding its share (from the final output and
log-sum-exp, the flash-attention backward), so that after G - 1 hops each block's gradient
arrives summed at its owner: one all-gather's bytes of keys and values and one
reduce-scatter's of their gradients, never a gather of the whole sequence.

Causal masks are applied from positions, so any cut of the sequence is exact, and the
work skips what the mask removes: runs of consecutive positions that see none of a block
are not computed, keys seen whole are taken in one product, and only the diagonal is
masked. With torch's fused CPU kernel (no explicit mask) a block is one product where it
can be (``_fused_pairs``); otherwise the rows are cut into tiles of at most TILE, which
bound the math form's score matrices. On the contiguous cut the last rank does G blocks
and the first one; the balanced (head-tail) cut gives every rank the same share.

The op is a ``torch.library`` custom op, as the expert region is: the traced step program
and plain autograd call the same code, and inductor keeps it as one opaque kernel. Its
bytes are counted with the runtime's other collectives, as the all-gather and the
reduce-scatter whose bytes they are (``Runtime.count``; the report's rows are written in
``shardc/program/report.py``).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from shardc.core.placement import MIRRORED, stripe_chunks
from shardc.runtime.collectives import get_runtime, guarded

# query/key rows a tile of the math form (an explicit mask, or no fused kernel): its
# score matrices are TILE x SPAN, and the causal structure is decided per tile pair
TILE = 256
# most key rows one product of the math form takes when a query tile sees neighbouring
# key tiles whole
SPAN = 4 * TILE
# most bytes, in key/value blocks (a block's k and v as the ring holds them), that one
# fused backward product may hold beside the ring's buffers: the kernel returns dq, dk and
# dv for every query and key row it takes, and copies its query-sized input once more.
# One and a half, the size of the gradients torch's ring returns a step (a block's dk and
# dv and the rank's dq): at 16,384 positions on 4 ranks a block is then one product (the
# own block three), where products of at most 1,024 rows a side made 5.7x as many kernel
# calls, whose zeroed outputs and their sums into the rank's gradients took 3% more CPU a
# rank and the step to 1.03x torch's, for 3.5 MiB less peak of 101
PRODUCT_ROOM = 1.5
# key/value blocks more that the rank's own block's backward product may hold, when that
# makes it one product: nothing else arrives while it is computed (ring_attention_backward)
OWN_ROOM = 1.0


def balanced_interleave(seq: int, size: int) -> int:
    """The balanced cut of a causal sequence over ``size`` ranks, as a layout's interleave:
    ``MIRRORED`` (the sequence read as 2G chunks, rank c holding chunks c and 2G-1-c: a
    head chunk and its mirror in the tail, core/placement.py) where the sequence divides
    into 2G chunks, else 1 (no balanced cut exists). Every rank then does the same causal
    work: chunk c's queries see c + 1/2 chunks of keys and chunk 2G-1-c's 2G-1-c + 1/2,
    2G chunks together whatever c. And each block of keys a rank receives is one product:
    a rank's tail sees an earlier rank's block whole, its head none of a later rank's, so
    from rank c' < c the rank's queries take the head chunk, and from c' > c the tail's
    queries the whole block. (Equal-chunk stripes, as torch's round-robin cut, balance
    only as their count grows, and each stripe is a product of its own: at 16,384 tokens
    on 4 ranks, 16 stripes left the last rank 5% more work than the first, and the ranks'
    arithmetic took 1.17x that of the mirrored cut, measured alone, one core a rank.)"""
    if size > 1 and seq % (2 * size) == 0:
        return MIRRORED
    return 1


def positions(seq: int, interleave: int, coord: int, size: int, device: Any = "cpu") -> torch.Tensor:
    """The global sequence positions a rank at ``coord`` of ``size`` holds, in its local
    order, for a sequence dim of ``seq`` cut over the axis with ``interleave`` (the dim read
    as (|interleave|, seq/|interleave|), the second factor cut, mirrored in odd stripes
    when negative: see core/placement.py). They rise along the rows in every such cut."""
    return torch.cat([torch.arange(a, a + n, device=device)
                      for a, n, _ in stripe_chunks(seq, interleave, coord, size)])


def _tiles(pos: torch.Tensor, cap: int) -> list[tuple[int, int, int, int]]:
    """(start, end, first position, last position) of each tile of rows: a run of
    consecutive positions, cut into pieces of at most ``cap`` rows. Positions rise along a
    rank's rows in every cut shardc makes, so a tile's ends bound it."""
    p = pos.tolist()
    out = []
    a = 0
    for i in range(1, len(p) + 1):
        if i == len(p) or p[i] != p[i - 1] + 1 or i - a == cap:
            out.append((a, i, p[a], p[i - 1]))
            a = i
    return out


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None,
            qpos: torch.Tensor | None, kpos: torch.Tensor | None) -> torch.Tensor:
    """q k^T * scale with the explicit mask and the causal mask (when positions are given)
    applied; in at least float32."""
    work = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(work), k.to(work).transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(work)
    if qpos is not None and kpos is not None:
        s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    return s


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values with fewer heads than the queries (grouped-query attention)."""
    rep = heads // t.shape[1]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _fold(g: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of ``_expand``: each key/value head's copies summed."""
    rep = g.shape[1] // heads
    return g if rep == 1 else g.unflatten(1, (heads, rep)).sum(2)


def _pairs(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, tile: int = 0, span: int = 0):
    """(query rows, key rows, mask kind) of the work one block of keys gives: kind None
    (every query sees every key) or "causal" (the mask by positions); tiles (runs of
    consecutive positions, at most ``tile`` rows) the mask removes whole are left out, and
    neighbouring keys a query tile sees whole are taken in one product of up to ``span``
    rows (0: the module's TILE and SPAN)."""
    tile, span = tile or TILE, span or SPAN
    kt = _tiles(kpos, tile)
    for qa, qb, qlo, qhi in _tiles(qpos, tile):
        full: tuple[int, int] | None = None
        for ka, kb, klo, khi in kt:
            if causal and klo > qhi:
                continue  # every key of the tile comes after every query of the tile
            if not causal or khi <= qlo:
                if full is not None and full[1] == ka and kb - full[0] <= span:
                    full = (full[0], kb)
                else:
                    if full is not None:
                        yield (qa, qb), full, None
                    full = (ka, kb)
                continue
            yield (qa, qb), (ka, kb), "causal"
        if full is not None:
            yield (qa, qb), full, None


def _cut(qlen: int, klen: int, room: tuple[int, int, int]) -> tuple[int, int]:
    """Rows a piece (query, key) of a product of ``qlen`` x ``klen`` rows whose gradient
    buffers, ``room`` = (bytes a query row, bytes a key row, bytes in all), must fit: the
    side whose buffers are larger is cut first, into near-equal pieces."""
    qrow, krow, most = room
    nq = nk = 1
    while True:
        qn, kn = -(-qlen // nq), -(-klen // nk)
        if qn * qrow + kn * krow <= most or qn == kn == 1:
            return qn, kn
        if kn == 1 or (qn > 1 and qn * qrow >= kn * krow):
            nq += 1
        else:
            nk += 1


def _fused_pairs(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool,
                 room: tuple[int, int, int] | None = None):
    """``_pairs`` for the fused kernel, as few products as the block allows, since each
    call costs: forward (``room`` None), the rank's own block with a causal mask is one
    product (positions rise along the rows, so the kernel's top-left triangle is the mask
    by positions), and other blocks, runs of positions seen whole or not at all, one
    product a run of queries, neighbouring runs that see the same keys together.
    Backward, whose kernel returns the gradients of every query and key row it takes,
    cuts the products until those buffers fit ``room`` (bytes a query row, bytes a key
    row, bytes in all; ``PRODUCT_ROOM``), the own block into square tiles whose diagonal
    ones take the causal triangle. Blocks with a run seen in part: ``_pairs``."""
    same = causal and qpos.numel() == kpos.numel() and bool(torch.equal(qpos, kpos))
    if same and room is None:
        yield (0, len(qpos)), (0, len(kpos)), "causal"
        return
    if same and room is not None:
        side = max(1, room[2] // (room[0] + room[1]))
        if side >= len(qpos):  # the whole block fits: one product, as forward's
            yield (0, len(qpos)), (0, len(kpos)), "causal"
            return
        yield from _pairs(qpos, kpos, causal, side, side)
        return
    plan: list[tuple[tuple[int, int], list[tuple[int, int]]]] = []
    for qa, qb, qlo, qhi in _tiles(qpos, len(qpos)):
        seen: list[tuple[int, int]] = []
        for ka, kb, klo, khi in _tiles(kpos, len(kpos)):
            if causal and klo > qhi:
                continue
            if causal and khi > qlo:  # seen in part
                yield from _pairs(qpos, kpos, causal)
                return
            if seen and seen[-1][1] == ka:
                seen[-1] = (seen[-1][0], kb)
            else:
                seen.append((ka, kb))
        if plan and plan[-1][0][1] == qa and plan[-1][1] == seen:
            plan[-1] = ((plan[-1][0][0], qb), seen)
        else:
            plan.append(((qa, qb), seen))
    for (qa, qb), seen in plan:
        for ka, kb in seen:
            qcap, kcap = (qb - qa, kb - ka) if room is None else _cut(qb - qa, kb - ka, room)
            for q0 in range(qa, qb, qcap):
                for k0 in range(ka, kb, kcap):
                    yield (q0, min(qb, q0 + qcap)), (k0, min(kb, k0 + kcap)), None


# torch's fused CPU attention, which also returns the log-sum-exp a ring merges by
_FLASH_CPU: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _can_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> bool:
    """Does torch's fused kernel run this block: on the CPU, with no explicit mask, and
    one head size for queries, keys and values (latent attention's values are narrower
    than its queries and keys, which the kernel refuses)?"""
    return (_FLASH_CPU is not None and q.device.type == "cpu" and mask is None
            and q.shape[-1] == k.shape[-1] == v.shape[-1])


Product = tuple[int, int, int, int, "str | None", bool]  # query rows, key rows, mask kind, fused


def _products(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, fused: bool,
              room: tuple[int, int, int] | None = None) -> list[Product]:
    """The products of one block (``_fused_pairs`` where the fused kernel runs, else
    ``_pairs``; ``room`` for the backward's, see ``_fused_pairs``), each marked whether
    the fused kernel takes it: any product seen whole, and a causal one exactly on the
    diagonal (the kernel's causal mask is the top-left triangle); the math form takes the
    rest."""
    pairs = _fused_pairs(qpos, kpos, causal, room) if fused else _pairs(qpos, kpos, causal)
    return [(qa, qb, ka, kb, kind, fused and (kind is None or (
                qb - qa == kb - ka and bool(torch.equal(qpos[qa:qb], kpos[ka:kb])))))
            for (qa, qb), (ka, kb), kind in pairs]


def _room(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, more: float = 0.0
          ) -> tuple[int, int, int]:
    """(bytes a query row, bytes a key row, bytes in all) that a fused backward product of
    ``q`` against ``k``, ``v`` (as the kernel takes them: grouped-query heads expanded)
    holds, in a room of ``PRODUCT_ROOM`` (+ ``more``) key/value blocks of ``block`` bytes.
    (The kernel's scratch, a few hundred KiB a thread whatever the sizes, is not counted.)"""
    rows = q.shape[-2], k.shape[-2]
    return (2 * q.numel() // max(1, rows[0]) * q.element_size(),  # dq and the kernel's copy
            (k.numel() + v.numel()) // max(1, rows[1]) * k.element_size(),
            int((PRODUCT_ROOM + more) * block))


@functools.lru_cache(maxsize=1024)
def _ring_products(seq: int, interleave: int, size: int, qcoord: int, kcoord: int, causal: bool,
                   fused: bool, room: tuple[int, int, int] | None, tile: int, span: int) -> list[Product]:
    """``_products`` of the block of ``kcoord`` for the queries of ``qcoord``, kept: a plan
    reads every position in Python, the same each step (``tile`` and ``span``: the
    module's TILE and SPAN, part of the key)."""
    return _products(positions(seq, interleave, qcoord, size), positions(seq, interleave, kcoord, size),
                     causal, fused, room)


def _block_forward(q, k, v, scale, mask, qpos, kpos, causal, out, lse, products=None) -> None:
    """Merge the attention of ``q`` to one block of keys/values into (out, lse), in place
    (``products``: the block's ``_products``, when the caller has them)."""
    if products is None:
        products = _products(qpos, kpos, causal, _can_fuse(q, k, v, mask))
    for qa, qb, ka, kb, kind, fused in products:
        if fused:
            o, blk = _FLASH_CPU(q[..., qa:qb, :], k[..., ka:kb, :], v[..., ka:kb, :], 0.0,
                                kind is not None, scale=scale)
            o, blk = o.to(out.dtype), blk.to(lse.dtype)
        else:
            m = None if mask is None else mask[..., qa:qb, ka:kb]
            qp, kp = (qpos[qa:qb], kpos[ka:kb]) if kind else (None, None)
            s = _scores(q[..., qa:qb, :], k[..., ka:kb, :], scale, m, qp, kp)
            blk = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - _finite(blk)[..., None])
            o = torch.matmul(p, v[..., ka:kb, :].to(p.dtype))
        old = lse[..., qa:qb]
        new = torch.logaddexp(old, blk)
        safe = _finite(new)
        # in place: a product may take a rank's every query row, whose copies the
        # forward of a long sequence's last layer would hold beside its activations
        out[..., qa:qb, :].mul_(torch.exp(old - safe)[..., None]).addcmul_(o, torch.exp(blk - safe)[..., None])
        lse[..., qa:qb] = new


def _mask_columns(mask: torch.Tensor | None, kpos: torch.Tensor, seq: int) -> torch.Tensor | None:
    """The explicit mask's columns of one block of keys (a mask broadcast over the keys
    applies as it is)."""
    if mask is None or mask.shape[-1] != seq:
        return mask
    return mask.index_select(-1, kpos)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a row that sees no key yet) as 0, so that exp(s - x) is 0, not nan."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _block_backward(q, k, v, scale, mask, qpos, kpos, causal, dout, out, lse, delta, dq, dk, dv,
                    products=None) -> None:
    """Add one block's share of the gradients into dq (this rank's) and dk, dv (the
    block's), from the final output ``out``, log-sum-exp ``lse`` and ``delta`` =
    rowsum(dout * out): each share is the flash-attention backward of the product."""
    if products is None:
        products = _products(qpos, kpos, causal, _can_fuse(q, k, v, mask), _room(q, k, v, k.nbytes + v.nbytes))
    for qa, qb, ka, kb, kind, fused in products:
        if fused:
            gq, gk, gv = _FLASH_CPU_BACKWARD(dout[..., qa:qb, :], q[..., qa:qb, :], k[..., ka:kb, :],
                                             v[..., ka:kb, :], out[..., qa:qb, :], lse[..., qa:qb], 0.0,
                                             kind is not None, scale=scale)
            dq[..., qa:qb, :] += gq
            dk[..., ka:kb, :] += gk
            dv[..., ka:kb, :] += gv
            continue
        m = None if mask is None else mask[..., qa:qb, ka:kb]
        qp, kp = (qpos[qa:qb], kpos[ka:kb]) if kind else (None, None)
        s = _scores(q[..., qa:qb, :], k[..., ka:kb, :], scale, m, qp, kp)
        p = torch.exp(s - _finite(lse[..., qa:qb])[..., None])
        g = dout[..., qa:qb, :].to(p.dtype)
        dv[..., ka:kb, :] += torch.matmul(p.transpose(-2, -1), g)
        dp = torch.matmul(g, v[..., ka:kb, :].to(p.dtype).transpose(-2, -1))
        ds = p * (dp - delta[..., qa:qb, None]) * scale
        dq[..., qa:qb, :] += torch.matmul(ds, k[..., ka:kb, :].to(p.dtype))
        dk[..., ka:kb, :] += torch.matmul(ds.transpose(-2, -1), q[..., qa:qb, :].to(p.dtype))


class _Ring:
    """This rank's neighbours on its context ring and the exchange of one step."""

    def __init__(self, rt: str, axis: str, phase: str) -> None:
        r = get_runtime(rt)
        self.rt, self.axis, self.phase = rt, axis, phase
        self.size = r.mesh.size(axis)
        self.coord = r.coord(axis)
        ranks = r.mesh.group_of(r.rank, axis)
        self.next, self.prev = ranks[(self.coord + 1) % self.size], ranks[(self.coord - 1) % self.size]
        self.group = r.group(axis)

    def owner(self, step: int) -> int:
        """The context coordinate whose block this rank holds at ``step``."""
        return (self.coord - step) % self.size

    def start(self, buf: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """Send ``buf`` on to the next rank; receive the previous rank's into a new buffer.
        One message a hop: the ring's pairs of blocks (keys and values, their gradients)
        travel packed (``_pack``), since each message costs the sender and the receiver a
        call and a wake of the transport's thread (two messages a hop took 36 sends and as
        many receives a step of the 2-layer GPT on 4 ranks, 29 ms of the calls' time at
        8,192 positions, against torch's 8 collectives of one packed buffer, 8 ms). The
        handle ``finish`` takes holds the sent buffer until then, so a caller may drop its
        own references."""
        got = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, self.next, self.group),
               dist.P2POp(dist.irecv, got, self.prev, self.group)]
        with guarded(self.rt, "ring attention", self.axis, self.phase):
            works = dist.batch_isend_irecv(ops)
        return got, (works, buf)

    def finish(self, handle: tuple) -> None:
        works, _sent = handle
        with guarded(self.rt, "ring attention", self.axis, self.phase):
            for w in works:
                w.wait()


def _pack(ts: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One flat buffer holding ``ts`` one after another (zeros when ``dtype`` is given:
    a pair of gradient blocks to add into). Its views (``_unpack``) are what the ring
    computes on, so packing costs the one copy that making k and v contiguous did."""
    if dtype is not None:
        return torch.zeros(sum(t.numel() for t in ts), dtype=dtype, device=ts[0].device)
    buf = torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=ts[0].device)
    for view, t in zip(_unpack(buf, ts), ts):
        view.copy_(t)
    return buf


def _unpack(buf: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``buf`` shaped as ``like``, one after another (contiguous each)."""
    out, at = [], 0
    for t in like:
        out.append(buf[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def _bytes_like(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A storage-less tensor of the bytes of one key/value block, for ``Runtime.count``."""
    return torch.empty(k.numel() * k.element_size() + v.numel() * v.element_size(),
                       dtype=torch.uint8, device="meta")


def _phase(rt: str, backward: bool) -> str:
    return "backward" if backward or get_runtime(rt).recomputing else "forward"


# the schemas spelled out, as runtime/experts.py does: torch 2.6's inference is narrower
@torch.library.custom_op("shardc::ring_attention", mutates_args=(), schema=(
    "(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale, int seq, "
    "int interleave, str rt, str axis) -> (Tensor, Tensor)"))
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   causal: bool, scale: float, seq: int, interleave: int, rt: str,
                   axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of attention of this rank's queries to the whole sequence:
    q, k, v are [B, H, L/G, D] (k and v may have fewer heads), cut over ``axis`` with
    ``interleave``; ``mask`` this rank's query rows against every key (or None)."""
    ring = _Ring(rt, axis, _phase(rt, False))
    r = get_runtime(rt)
    qpos = positions(seq, interleave, ring.coord, ring.size, q.device)
    work = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=work, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=work, device=q.device)
    buf = _pack([k, v])
    kb, vb = _unpack(buf, [k, v])
    r.count("all_gather", axis, ring.phase, _bytes_like(kb, vb))
    heads = q.shape[1]
    for step in range(ring.size):
        pending = ring.start(buf) if step < ring.size - 1 else None
        j = ring.owner(step)
        kpos = positions(seq, interleave, j, ring.size, q.device)
        m = _mask_columns(mask, kpos, seq)
        products = _ring_products(seq, interleave, ring.size, ring.coord, j, causal, _can_fuse(q, k, v, m), None,
                                  TILE, SPAN)
        _block_forward(q, _expand(kb, heads), _expand(vb, heads), scale, m, qpos, kpos, causal, out, lse,
                       products)
        if pending is not None:
            ring.finish(pending[1])
            buf = pending[0]
            kb, vb = _unpack(buf, [k, v])
            del pending
    return out.to(q.dtype), lse


@ring_attention.register_fake
def _(q, k, v, mask, causal, scale, seq, interleave, rt, axis):
    work = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=work)


@torch.library.custom_op("shardc::ring_attention_backward", mutates_args=(), schema=(
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor out, Tensor lse, "
    "bool causal, float scale, int seq, int interleave, str rt, str axis) -> (Tensor, Tensor, Tensor)"))
def ring_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                            causal: bool, scale: float, seq: int, interleave: int, rt: str,
                            axis: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``ring_attention``: this rank's own blocks' gradients.

    Order: the blocks of ranks r-1, r-2, ... as they arrive, each block's gradient handed
    on with it, and this rank's own block last: the gradient of block r starts at rank
    r+1 and comes home after G-1 hops with every rank's share but r's, which r computes
    while that last hop is on its way and then adds.

    Memory, not overlap, decides the shape, since a long sequence's peak is the ring's
    buffers: a rank works on one key/value block while the next arrives, and holds one
    gradient block, into which the block's gradient from the previous rank was received
    and its own share is added in place. The next block is waited for before the share
    goes out, and the share's hop before the next block is asked for, so no rank holds
    two of either: 3.5 blocks at most (``dq``, half of one, among them), where
    packing k and v into one message, keeping the own block's gradient through the ring
    or adding shares out of place would each hold one more. The cost is one exposed hop a
    step but the last (a block of key and value gradients: microseconds on NVLink) and
    the first hop of keys and values, which only the own block's work could have
    overlapped, and that block comes last so that no gradient buffer of its own lives
    through the ring; its share's buffer then takes the place of the key/value block no
    longer held, so the last hop overlaps it within the same 3.5 blocks (with G = 2, or
    on a rank of the contiguous cut that has no other block's work, this is the step
    that holds them). Beside them, what one product of the fused kernel holds:
    ``PRODUCT_ROOM`` blocks at most, and the kernel's scratch."""
    ring = _Ring(rt, axis, _phase(rt, True))
    r = get_runtime(rt)
    G = ring.size
    heads = q.shape[1]
    work = torch.promote_types(q.dtype, torch.float32)
    qpos = positions(seq, interleave, ring.coord, G, q.device)
    delta = (dout.to(work) * out.to(work)).sum(-1)
    dq = torch.zeros(q.shape, dtype=work, device=q.device)
    block = k.nbytes + v.nbytes
    r.count("all_gather", axis, ring.phase, _bytes_like(k, v))

    def add_grads(into: list[torch.Tensor], kb: torch.Tensor, vb: torch.Tensor, owner: int,
                  more: float = 0.0) -> None:
        """Add this rank's share of the gradient of block ``owner`` into ``into``: [dk, dv];
        with ``more``, the block is one product if that holds at most ``more`` blocks
        beyond ``PRODUCT_ROOM``."""
        dk, dv = into
        kpos = positions(seq, interleave, owner, G, q.device)
        m = _mask_columns(mask, kpos, seq)
        ke, ve = _expand(kb, heads), _expand(vb, heads)
        # grouped-query: the expanded heads' gradients first, then folded onto the few
        gk = dk if ke is kb else torch.zeros(ke.shape, dtype=work, device=q.device)
        gv = dv if ve is vb else torch.zeros(ve.shape, dtype=work, device=q.device)
        room = _room(q, ke, ve, block)
        if more:
            wider = _room(q, ke, ve, block, more)
            if q.shape[-2] * wider[0] + ke.shape[-2] * wider[1] <= wider[2]:
                room = wider  # the block is one product in the wider room (else cut as the others)
        products = _ring_products(seq, interleave, G, ring.coord, owner, causal, _can_fuse(q, k, v, m),
                                  room, TILE, SPAN)
        _block_backward(q, ke, ve, scale, m, qpos, kpos, causal, dout, out, lse, delta, dq, gk, gv, products)
        if gk is not dk:
            dk += _fold(gk, k.shape[1])
        if gv is not dv:
            dv += _fold(gv, v.shape[1])

    def zeros() -> list[torch.Tensor]:
        return [torch.zeros(k.shape, dtype=work, device=q.device),
                torch.zeros(v.shape, dtype=work, device=q.device)]

    if G > 1:
        # (the packed copy of k and v lives only until the first hop is done; the own
        # block's work at the end reads k and v. Handles are finished through the tuples
        # that hold them: a name bound to one would keep its sent buffer alive through
        # the next step)
        first = ring.start(_pack([k, v]))
        ring.finish(first[1])
        buf = first[0]
        del first
        acc: tuple[torch.Tensor, tuple] | None = None
        for step in range(1, G):
            if acc is None:
                share = _pack([k, v], work)
            else:  # this block's gradient from the ranks it has been to: add to it in place
                ring.finish(acc[1])
                share = acc[0]
                acc = None
            nxt = ring.start(buf) if step < G - 1 else None
            kb, vb = _unpack(buf, [k, v])
            add_grads(_unpack(share, [k, v]), kb, vb, ring.owner(step))
            del kb, vb
            del buf
            if nxt is not None:
                ring.finish(nxt[1])
                buf = nxt[0]
                del nxt
            acc = ring.start(share)
            del share
        assert acc is not None
        # the own block's share, while the last hop brings the others' home: its buffer
        # takes the place of the key/value block no longer held, and no next block is
        # arriving: 2.5 blocks of buffers at most here against 3.5 at every other step, so
        # it may be one product of up to one block more than the others' room, as torch's
        # ring computes it (a causal own block holds two: its dq, the kernel's copy of q, dk
        # and dv), where three made 160 kernel calls a step of the 2-layer GPT on 8 ranks
        # against torch's 128. (Cut smaller, its tiles would be no cheaper for the room:
        # the head-tail cut's own tiles, seen in part, take the math form.)
        own = zeros()
        add_grads(own, k, v, ring.coord, more=OWN_ROOM)
        ring.finish(acc[1])
        for mine, theirs in zip(own, _unpack(acc[0], [k, v])):
            mine += theirs
        del acc
        # the gradients' hops: G-1 sends of this rank's block's size, a reduce-scatter's bytes
        r.count("reduce_scatter", axis, ring.phase,
                torch.empty(G * sum(t.numel() for t in own), dtype=work, device="meta"))
    else:
        own = zeros()
        add_grads(own, k, v, ring.coord)
    dk, dv = own
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@ring_attention_backward.register_fake
def _(dout, q, k, v, mask, out, lse, causal, scale, seq, interleave, rt, axis):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    q, k, v, mask, causal, scale, seq, interleave, rt, axis = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, out, lse)
    ctx.info = (causal, scale, seq, interleave, rt, axis)


def _backward(ctx: Any, dout: torch.Tensor, _dlse: Any) -> tuple:
    q, k, v, mask, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_attention_backward(dout.contiguous(), q, k, v, mask, out, lse, *ctx.info)
    return dq, dk, dv, None, None, None, None, None, None, None


ring_attention.register_autograd(_backward, setup_context=_setup)

RING_ATTENTION = torch.ops.shardc.ring_attention.default
