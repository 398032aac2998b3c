"""Ring attention's arithmetic in one process (runtime/ring.py), and the context axis in
an offline compile: the program attends by a ring, and the report's rows are its hops.

The ring's steps are played here by calling its block functions for every (rank, block)
pair a ring of G ranks visits, so the merge by log-sum-exp, the tile skipping and the
backward's per-block shares are checked against one device's attention in float64 without
any process group; the real ring, with its sends, runs in tests/test_context_gloo.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import GPT

import shardc
from shardc.runtime import ring as R
from shardc.tools.cli import compile_offline

pytestmark: list = []  # one process, fast: the fast tier

# float64 throughout: the ring sums the same products as one device in another order, so
# they agree to a few float64 roundings of values of size ~1 (1e-15); 1e-12 is far above
# that and far below any error of the arithmetic (a missed block, a wrong mask: ~1e-1)
TOL = 1e-12


def _played(q, k, v, causal: bool, G: int, interleave: int, mask=None, dout=None):
    """Output and (dq, dk, dv) of attention by a ring of G ranks, every step played here."""
    B, H, S, D = q.shape
    scale = D ** -0.5
    pos = [R.positions(S, interleave, c, G) for c in range(G)]
    out = q.new_zeros((B, H, S, v.shape[-1]))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r in range(G):
        qr = q[:, :, pos[r]]
        mr = None if mask is None else mask[..., pos[r], :]
        o = q.new_zeros((B, H, len(pos[r]), v.shape[-1]))
        lse = torch.full(qr.shape[:-1], float("-inf"), dtype=q.dtype)
        for step in range(G):
            j = (r - step) % G
            m = None if mr is None else mr[..., pos[j]]
            R._block_forward(qr, R._expand(k[:, :, pos[j]], H), R._expand(v[:, :, pos[j]], H), scale, m,
                             pos[r], pos[j], causal, o, lse)
        out[:, :, pos[r]] = o
        if dout is None:
            continue
        d = dout[:, :, pos[r]]
        delta = (d * o).sum(-1)
        g = torch.zeros_like(qr)
        for j in range(G):
            m = None if mr is None else mr[..., pos[j]]
            ke, ve = R._expand(k[:, :, pos[j]], H), R._expand(v[:, :, pos[j]], H)
            gk, gv = torch.zeros_like(ke), torch.zeros_like(ve)
            R._block_backward(qr, ke, ve, scale, m, pos[r], pos[j], causal, d, o, lse, delta, g, gk, gv)
            dk[:, :, pos[j]] += R._fold(gk, k.shape[1])
            dv[:, :, pos[j]] += R._fold(gv, v.shape[1])
        dq[:, :, pos[r]] = g
    return out, (dq, dk, dv)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("G,interleave", [(2, 1), (2, 12), (4, 1), (4, 2), (3, 4), (2, 3), (4, -2), (3, -2),
                                          (2, -6)])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("kernel", ["fused", "math"])
def test_ring_equals_one_device(monkeypatch, causal: bool, G: int, interleave: int, kv_heads: int,
                                kernel: str) -> None:
    """Both tile kernels: torch's fused CPU attention (what runs on the CPU without an
    explicit mask) and the math form (explicit masks, other devices)."""
    monkeypatch.setattr(R, "TILE", 3)  # several tiles a block: the skipping is exercised
    monkeypatch.setattr(R, "SPAN", 6)  # and keys seen whole cut into products of two tiles
    if kernel == "math":
        monkeypatch.setattr(R, "_FLASH_CPU", None)
    g = torch.Generator().manual_seed(0)
    B, H, S, D = 2, 4, 24, 5
    q = torch.randn(B, H, S, D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(B, kv_heads, S, D, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(B, kv_heads, S, D, dtype=torch.float64, generator=g, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(H // kv_heads, 1),
                                         v.repeat_interleave(H // kv_heads, 1), is_causal=causal)
    dout = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    ref.backward(dout)
    out, grads = _played(q.detach(), k.detach(), v.detach(), causal, G, interleave, dout=dout)
    assert (out - ref).abs().max() < TOL
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("G,interleave", [(2, 1), (4, -2)])
@pytest.mark.parametrize("kernel", ["fused", "math"])
def test_values_narrower_than_queries_and_keys(monkeypatch, causal: bool, G: int, interleave: int,
                                               kernel: str) -> None:
    """Latent attention (DeepSeek-V3): values of another head size than queries and keys,
    which torch's fused CPU kernel refuses; the ring takes the math form for them, and its
    output has the values' head size."""
    monkeypatch.setattr(R, "TILE", 3)
    if kernel == "math":
        monkeypatch.setattr(R, "_FLASH_CPU", None)
    g = torch.Generator().manual_seed(2)
    B, H, S = 2, 2, 16
    q, k = (torch.randn(B, H, S, 6, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(B, H, S, 4, dtype=torch.float64, generator=g, requires_grad=True)
    assert not R._can_fuse(q, k, v, None)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    dout = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    ref.backward(dout)
    out, grads = _played(q.detach(), k.detach(), v.detach(), causal, G, interleave, dout=dout)
    assert out.shape == ref.shape and (out - ref).abs().max() < TOL
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_ring_applies_an_explicit_mask(monkeypatch, kind: str) -> None:
    """A padding mask (transformers' masks): rows that see nothing come out 0, not nan."""
    monkeypatch.setattr(R, "TILE", 4)
    g = torch.Generator().manual_seed(1)
    B, H, S, D, G = 2, 2, 16, 4, 4
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    keep = torch.ones(B, 1, S, S, dtype=torch.bool).tril()
    keep[0, :, :, :5] = False  # sample 0: its first five keys are padding
    mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # one device gives nan for a query that sees no key; the ring gives 0 there (its rows
    # are the model's padding, which the loss ignores): compare where one device is finite
    seen = keep.any(-1, keepdim=True).expand(B, H, S, D)
    dout = torch.randn(ref.shape, dtype=torch.float64, generator=g) * seen
    ref.masked_fill(~seen, 0).backward(dout)
    out, grads = _played(q.detach(), k.detach(), v.detach(), False, G, S // G, mask=mask, dout=dout)
    assert (out[seen] - ref[seen]).abs().max() < TOL and (out[~seen] == 0).all()
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert (got - want).abs().max() < TOL


def _work(S: int, G: int, interleave: int) -> list[int]:
    """Query-key pairs each rank's causal ring computes with the fused kernel: a product's
    all, or, for a causal one, those the kernel does not mask (it skips the rest)."""
    pos = [R.positions(S, interleave, c, G) for c in range(G)]
    out = []
    for r in range(G):
        n = 0
        for j in range(G):
            for (qa, qb), (ka, kb), kind in R._fused_pairs(pos[r], pos[j], True):
                n += int((pos[j][ka:kb][None, :] <= pos[r][qa:qb][:, None]).sum()) if kind else (qb - qa) * (kb - ka)
        out.append(n)
    return out


def test_balanced_cut_gives_every_rank_the_same_causal_work() -> None:
    """The contiguous cut leaves the first rank half a block and the last G - 1/2; the
    balanced (head-tail) cut gives every rank exactly the same share, computing no pair
    the mask removes: one device's causal pairs, dealt out evenly."""
    S, G = 4096, 4
    k = R.balanced_interleave(S, G)
    assert k == R.MIRRORED
    plain, balanced = _work(S, G, 1), _work(S, G, k)
    block = (S // G) ** 2
    assert plain[-1] > 3 * block and plain[0] < block, plain
    assert len(set(balanced)) == 1 and sum(balanced) == sum(plain) == S * (S + 1) // 2, (balanced, plain)


def test_balanced_ring_takes_each_block_in_one_product() -> None:
    """Forward, a block is one fused product (the own block one causal product); backward
    cuts a block's products only until what each holds fits the room (PRODUCT_ROOM
    key/value blocks), which the default lets a block be one product too, and a smaller
    room cuts them finer, each within it."""
    S, G, H, D = 4096, 4, 4, 32
    L = S // G
    q, k, v = (torch.empty(1, H, L, D, device="meta") for _ in range(3))
    block = k.nbytes + v.nbytes
    pos = [R.positions(S, R.MIRRORED, c, G) for c in range(G)]
    for share in (1.0, 1 / 16):
        room = R._room(q, k, v, int(share * block))
        for r in range(G):
            for j in range(G):
                assert len(list(R._fused_pairs(pos[r], pos[j], True))) == 1
                back = list(R._fused_pairs(pos[r], pos[j], True, room))
                assert all((qb - qa) * room[0] + (kb - ka) * room[1] <= room[2]
                           for (qa, qb), (ka, kb), _ in back)
                # the own block: two chunks' triangles and the one below them; an
                # earlier rank's head chunk under every query, a later rank's block under
                # the tail's queries: one each
                want = 3 if j == r else 1
                assert len(back) == want if share == 1.0 else len(back) > want


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_a_block_seen_in_part_falls_back_to_tiles(monkeypatch, backward: bool) -> None:
    """No cut shardc makes gives a run of keys that a run of queries sees in part, but
    the fused plan must stay exact if one did: such a block takes the tile plan, whose
    off-diagonal causal tiles run in the math form."""
    monkeypatch.setattr(R, "TILE", 4)
    monkeypatch.setattr(R, "SPAN", 8)
    qpos, kpos = torch.arange(0, 12), torch.arange(5, 17)
    products = R._products(qpos, kpos, True, True, backward)
    covered = torch.zeros(12, 12, dtype=torch.bool)
    for qa, qb, ka, kb, kind, fused in products:
        assert not covered[qa:qb, ka:kb].any()
        covered[qa:qb, ka:kb] = True
        if kind is not None and not torch.equal(qpos[qa:qb], kpos[ka:kb]):
            assert not fused  # the kernel's triangle is not this tile's mask
    seen = kpos[None, :] <= qpos[:, None]
    assert covered[seen].all()  # every pair the mask keeps is in some product
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 12, 4, dtype=torch.float64, generator=g) for _ in range(3))
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    R._block_forward(q, k, v, 0.5, None, qpos, kpos, True, out, lse)
    rows = seen.any(-1)
    ref = F.scaled_dot_product_attention(q[:, :, rows], k, v, attn_mask=seen[rows], scale=0.5)
    assert (out[:, :, rows] - ref).abs().max() < TOL and (out[:, :, ~rows] == 0).all()


def test_the_balanced_cut_needs_two_chunks_a_rank() -> None:
    assert R.balanced_interleave(16, 2) == R.MIRRORED and R.balanced_interleave(8, 4) == R.MIRRORED
    assert R.balanced_interleave(12, 4) == 1 and R.balanced_interleave(6, 4) == 1
    assert R.balanced_interleave(64, 1) == 1


def test_positions_follow_the_layouts_cut() -> None:
    assert R.positions(8, 1, 1, 2).tolist() == [4, 5, 6, 7]
    assert R.positions(8, 4, 1, 2).tolist() == [1, 3, 5, 7]
    assert R.positions(16, 2, 1, 2).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert R.positions(16, R.MIRRORED, 1, 4).tolist() == [2, 3, 12, 13]
    assert R.positions(24, -4, 0, 2).tolist() == [0, 1, 2, 9, 10, 11, 12, 13, 14, 21, 22, 23]


@pytest.mark.parametrize("layout", ["balanced", "contiguous"])
def test_offline_context_program_attends_by_a_ring(layout: str) -> None:
    """Compiled for x1y1c4z1d1 without any process group: each attention is one ring op,
    no key or value is gathered, and the report's ring rows are an all-gather's bytes of
    the keys and values forward and backward and a reduce-scatter's of their gradients."""
    torch.manual_seed(0)
    model = GPT(layers=2)
    tokens = torch.randint(0, 64, (8, 16))
    sm = compile_offline(model, (tokens, tokens), "x1y1c4z1d1", context_layout=layout)
    rings = [d for d in sm.decisions if "attention by a ring over context" in d]
    assert len(rings) == 2 and all(layout in d for d in rings), sm.decisions
    rep = shardc.comm_report(sm)
    rows = [r for r in rep.rows if "ring" in r.op]
    # per layer: k and v, [8, 8 heads, 16, 4] fp32 each, a quarter on a rank: 2 KiB;
    # three hops forward and back, and the gradients three hops back
    kv = 2 * 8 * 8 * 16 * 4 * 4 // 4
    by = {(r.collective, r.phase): r.bytes for r in rows if r.node == rows[0].node}
    assert by == {("all_gather", "forward"): 3 * kv, ("all_gather", "backward"): 3 * kv,
                  ("reduce_scatter", "backward"): 3 * kv}, by
    assert len(rows) == 6 and all(r.axis == "context" for r in rows)
    assert not [r for r in rep.rows if r.collective == "all_gather" and "ring" not in r.op]
    # the balanced layout's re-cut of the two inputs (int64 tokens, [8, 4] a rank): an
    # exchange of the rank's chunks, an all-to-all's (G-1)/G of its piece each
    recut = [r.bytes for r in rep.rows if r.op == "input"]
    assert recut == ([3 * 8 * 4 * 8 // 4] * 2 if layout == "balanced" else []), recut
    assert "attention by a ring" in shardc.explain(sm)


def test_offline_ulysses_program_re_cuts_to_heads_by_all_to_all() -> None:
    """context_attention="ulysses": per attention, q, k and v go from the sequence cut to
    the heads cut and the output back, one all-to-all each (bytes (G-1)/G of the piece),
    on the contiguous layout "auto" gives it; no ring, no gather."""
    torch.manual_seed(0)
    model = GPT(layers=2)
    tokens = torch.randint(0, 64, (8, 16))
    sm = compile_offline(model, (tokens, tokens), "x1y1c4z1d1", context_attention="ulysses")
    rep = shardc.comm_report(sm)
    assert not [r for r in rep.rows if "ring" in r.op or r.collective == "all_gather"], rep.rows
    fwd = [r for r in rep.rows if r.collective == "all_to_all" and r.phase == "forward"]
    # q, k, v and the output, [8, 8 heads, 16, 4] fp32 each, a quarter a rank: 1 KiB,
    # three quarters of it sent
    assert len(fwd) == 8 and {r.bytes for r in fwd} == {3 * 8 * 8 * 16 * 4 * 4 // 16}, fwd
    assert sum(1 for d in sm.decisions if "attention by all-to-all over context" in d) == 2
