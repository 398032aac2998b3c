"""Context parallelism (``Mesh(context=c, ...)``) on real gloo processes: the sequence dim
of every input cut over ``context``, every activation made from it kept cut, attention by
a ring (runtime/ring.py).

Each case trains three AdamW steps beside one device exactly as ``test_train_gloo`` judges
every mesh (``harness.train_side_by_side``, same tolerances, explained there): every
parameter's gradient against float64 at each step, the losses, the weights after the
steps, and the bytes this rank handed to torch.distributed equal to the comm report's,
byte for byte (the ring's hops included). The cases cut the sequence 2 and 4 ways, alone
and with data, z and x, on the GPT, transformers' Llama (causal, RoPE, grouped-query) and
GPT-2 (512 tokens cut 8 ways, and 2,048 tokens and Llama's 8,192 4 ways, among them), in both sequence layouts, and with the options (block recompute, shard_optimizer,
autograd's backward, inductor, resharding after forward); one case runs a longer sequence
with small tiles, so that the ring skips and masks tiles inside its blocks.
"""
from __future__ import annotations

import copy
import traceback
from typing import Any, Callable

import pytest
import torch
from harness import built_once, lm_batches, train_side_by_side
from models import GPT, gpt2, llama
from test_train_gloo import EPS, LR, _run_failures

import shardc
from shardc.core.errors import ShardcError
from shardc.runtime import ring

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


_lm_batches = lm_batches


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt": lambda: GPT(layers=2), "llama": lambda: llama(layers=2), "gpt2": lambda: gpt2(layers=2),
    "gpt_long": lambda: GPT(layers=1, seq=128), "gpt_h2": lambda: GPT(layers=1, heads=2),
    # longer sequences, one layer, a small batch: 512 tokens on 8 ranks, 2,048 and 8,192 on 4
    "gpt_512": lambda: GPT(layers=1, seq=512, heads=4), "llama_512": lambda: llama(layers=1, seq=512),
    "gpt_2k": lambda: GPT(layers=1, seq=2048, heads=4),
    "llama_8k": lambda: llama(layers=1, seq=8192, heads=4, kv_heads=2)}
# (sequence, batch) of a model's batches, where not (16, 8)
SHAPES = {"gpt_long": (128, 8), "gpt_512": (512, 2), "llama_512": (512, 2), "gpt_2k": (2048, 1),
          "llama_8k": (8192, 1)}
_model = built_once(MODELS)


def _train_failures(name: str, spec: str, layout: str, opts: dict | None = None,
                    expect: str = "ring") -> list[str]:
    """``expect``: how the attentions run, "ring", "ulysses" (all-to-alls) or "gather"."""
    mesh = shardc.Mesh.parse(spec)
    opts = opts or {}
    where = f"{name}@{spec} {layout}" + "".join(f" {k}={v}" for k, v in opts.items())
    seq, batch = SHAPES.get(name, (16, 8))
    batches = _lm_batches(seq=seq, batch=batch)
    old = ring.TILE, ring.SPAN, ring.PRODUCT_ROOM
    if name == "gpt_long":  # small tiles inside the ring's blocks: the backward's cuts too
        ring.TILE, ring.SPAN, ring.PRODUCT_ROOM = 8, 16, 1 / 8
    try:
        run = train_side_by_side(_model(name), batches, mesh, lr=LR, eps=EPS, context_layout=layout, **opts)
        out = _run_failures(where, run, mesh, batches)
    except Exception:  # noqa: BLE001 - a compile or runtime error is this case's failure
        return [f"{where}: raised\n{traceback.format_exc()}"]
    finally:
        ring.TILE, ring.SPAN, ring.PRODUCT_ROOM = old
    return out + _how_attention_ran(where, run.sm, expect)


def _how_attention_ran(where: str, sm: Any, expect: str) -> list[str]:
    said = {"ring": any("attention by a ring over context" in d for d in sm.decisions),
            "ulysses": any("attention by all-to-all over context" in d for d in sm.decisions)}
    got = [k for k, v in said.items() if v] or ["gather"]
    out = [] if got == [expect] else [f"{where}: attention ran by {got}, expected {expect}: {sm.decisions}"]
    sent = sm.measured_comm()
    if expect == "ring" and ("reduce_scatter", "context", "backward") not in sent:
        out.append(f"{where}: no key/value gradient travelled the ring")
    if expect == "ulysses" and ("all_to_all", "context", "backward") not in sent:
        out.append(f"{where}: no all-to-all over context in backward")
    return out


CASES = {
    2: [("gpt", "x1y1c2z1d1", "balanced"), ("llama", "x1y1c2z1d1", "balanced"), ("gpt2", "x1y1c2z1d1", "contiguous"),
        ("gpt_long", "x1y1c2z1d1", "balanced")],
    4: [("gpt", "x1y1c4z1d1", "balanced"), ("llama", "x1y1c4z1d1", "contiguous"),
        ("gpt_long", "x1y1c4z1d1", "contiguous"), ("llama", "x1y1c2z1d2", "balanced"),
        ("gpt", "x1y1c2z2d1", "balanced"), ("llama", "x2y1c2z1d1", "balanced"),
        # GPT-2's Conv1D flattens [B, S] for its GEMMs; with the batch cut over data and
        # the sequence over context the flat rows are no layout shardc can state, so the
        # sequence is gathered there and attention runs whole (exact, not context
        # parallel: README, "Long sequences")
        ("gpt2", "x1y1c2z1d2", "balanced", {}, "gather"),
        # the options, each with the ring (bf16: tests/test_precision_gloo.py)
        ("llama", "x1y1c2z1d2", "balanced", {"activation_checkpoint": "blocks"}),
        ("gpt", "x1y1c2z2d1", "balanced", {"shard_optimizer": True}),
        ("llama", "x1y1c2z1d2", "contiguous", {"step_graph": False}),
        ("gpt", "x2y1c2z1d1", "balanced", {"backend": "inductor"}),
        ("llama", "x1y1c2z2d1", "balanced", {"reshard_after_forward": True}),
        # Ulysses: all-to-alls from the sequence to the heads and back (contiguous by
        # "auto"); with x cutting the heads too; and two heads on four ranks, where that attention takes the ring
        ("gpt", "x1y1c4z1d1", "auto", {"context_attention": "ulysses"}, "ulysses"),
        ("llama", "x1y1c2z1d2", "auto", {"context_attention": "ulysses"}, "ulysses"),
        ("gpt", "x2y1c2z1d1", "auto", {"context_attention": "ulysses"}, "ulysses"),
        ("gpt_h2", "x1y1c4z1d1", "auto", {"context_attention": "ulysses"}, "ring"),
        ("gpt_2k", "x1y1c4z1d1", "balanced"), ("llama_8k", "x1y1c4z1d1", "balanced")],
    8: [("gpt_512", "x1y1c8z1d1", "balanced"), ("llama_512", "x1y1c4z1d2", "contiguous")],
}


def _run_cases(rank: int, world: int, cases: list[tuple]) -> None:
    failures = [line for case in cases for line in _train_failures(*case)]
    if failures:
        raise AssertionError("\n".join(failures))


@pytest.mark.parametrize("case", [c for w in sorted(CASES) for c in CASES[w]], ids=lambda c: "-".join([*c[:3], *(f"{k}.{v}" for k, v in (c[3] if len(c) > 3 else {}).items())]))
def test_trains_like_one_device(ranks: Any, case: tuple) -> None:
    ranks.run(_run_cases, shardc.Mesh.parse(case[1]).world_size, [case])


def _layouts_agree(rank: int, world: int) -> None:
    """Both sequence layouts give one device's loss and the same gradients (to fp32
    reduction order: both are within the float64 judge's bound in the cases above; here
    they are compared with each other, as a user switching layouts would)."""
    mesh = shardc.Mesh.parse("x1y1c4z1d1")
    batch = _lm_batches(seq=32, n=1)[0]
    local = [shardc.shard_batch(t, mesh) for t in batch]
    got = {}
    for layout in ("balanced", "contiguous"):
        sm = shardc.compile(_model("llama")(), mesh, example_inputs=batch, context_layout=layout)
        loss = sm(*local)
        loss.backward()
        got[layout] = (loss.item(), sm.full_grads())
    (la, ga), (lb, gb) = got["balanced"], got["contiguous"]
    ref = _model("llama")()(*batch).item()
    # fp32 sums of the same terms in two orders: ~1e-7 relative; 1e-5 is far below a
    # wrong block or mask
    assert abs(la - lb) <= 1e-5 * abs(ref) and abs(la - ref) <= 1e-5 * abs(ref), (la, lb, ref)
    for k in ga:
        assert torch.allclose(ga[k], gb[k], rtol=1e-4, atol=1e-6), k


def test_balanced_and_contiguous_layouts_agree(ranks: Any) -> None:
    ranks.run(_layouts_agree, 4)


def _ring_memory(rank: int, world: int) -> None:
    """The ring's backward holds few key/value-sized blocks at once (its buffers, not its
    arithmetic, set a long sequence's peak), and its result equals one device's."""
    # first with products of a tenth of a block: what is measured is then mostly the
    # ring's own buffers; then with the default room, PRODUCT_ROOM blocks more at most,
    # and the fused kernel's scratch, measured here on one whole block
    saved = ring.PRODUCT_ROOM
    try:
        for room, scratch in ((1 / 10, False), (saved, True)):
            ring.PRODUCT_ROOM = room
            _ring_memory_case(rank, world, scratch)
    finally:  # restored: the ranks run later cases
        ring.PRODUCT_ROOM = saved


def _kernel_scratch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Bytes the fused backward kernel holds on a product of every row of ``q`` against
    every row of ``k``, ``v``, beyond what the ring's room counts for it (its gradients and
    one query-sized copy): its per-thread buffers."""
    from shardc.planning.memory import measured_peak

    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = kernel(q, k, v, 0.0, False)[:2]
    grads: list = []
    peak = measured_peak(lambda: grads.extend(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        torch.ones_like(out), q, k, v, out, lse, 0.0, False)))
    return peak - sum(t.nbytes for t in grads) - q.nbytes


def _ring_memory_case(rank: int, world: int, scratch: bool) -> None:
    from shardc.planning.memory import measured_peak
    from shardc.runtime.collectives import Runtime

    mesh = shardc.Mesh(context=world)
    rt = Runtime(mesh, rank).key
    B, H, L, D = 1, 4, 512, 32  # L positions a rank: 2,048 in all
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(B, H, L * world, D, generator=g) for _ in range(4)]  # q, k, v, dout
    interleave = ring.balanced_interleave(L * world, world)
    pos = ring.positions(L * world, interleave, rank, world)
    q, k, v, dout = (t[:, :, pos].contiguous() for t in full)
    scale = D ** -0.5
    out, lse = ring.ring_attention(q, k, v, None, True, scale, L * world, interleave, rt, "context")
    got: list = []
    peak = measured_peak(lambda: got.extend(ring.ring_attention_backward(
        dout, q, k, v, None, out, lse, True, scale, L * world, interleave, rt, "context")))
    block = k.nbytes + v.nbytes
    # at the busiest step (runtime/ring.py): dq (half a block), the key/value block worked
    # on, the one arriving, and the gradient block (one received, one sent, never both):
    # 3.5 blocks, plus what one product holds (PRODUCT_ROOM blocks at most; with a tenth,
    # the kernel's scratch on products that small is a few KiB), and half a block left
    # for the rest of the arithmetic's temporaries. Packing k and v into one message,
    # keeping the own block's gradient through the ring, adding shares out of place or
    # overlapping the two hops would each hold one more.
    bound = (4 + ring.PRODUCT_ROOM) * block + (_kernel_scratch(q, k, v) if scratch else 0)
    assert peak <= bound, (peak / block, bound / block)
    ref = [t.clone().requires_grad_(True) for t in full[:3]]
    torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True).backward(full[3])
    for mine, want in zip(got, ref):
        # fp32, the same sums in another order: ~1e-6 of values of size ~1
        assert (mine - want.grad[:, :, pos]).abs().max() < 1e-4


def test_ring_backward_holds_few_blocks(ranks: Any) -> None:
    ranks.run(_ring_memory, 4)


class _Logits(torch.nn.Module):
    """The GPT returning its logits, [B, S, V]: a per-token output."""

    def __init__(self) -> None:
        super().__init__()
        self.g = GPT(layers=1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        g = self.g
        x = g.drop(g.tok(idx) + g.pos(torch.arange(idx.shape[1])))
        for b in g.blocks:
            x = b(x)
        return g.head(g.ln_f(x))


def _outputs(rank: int, world: int) -> None:
    """A per-token output comes back cut as shard_batch cuts the inputs (batch over data,
    contiguous sequence blocks over context), whichever layout the program holds."""
    torch.manual_seed(0)
    model = _Logits()
    idx = _lm_batches(n=1, batch=4)[0][0]
    for spec, layout in (("x1y1c2z1d2", "balanced"), ("x1y1c2z1d2", "contiguous"), ("x1y1c4z1d1", "balanced")):
        mesh = shardc.Mesh.parse(spec)
        want = shardc.shard_batch(model(idx), mesh)
        sm = shardc.compile(model, mesh, example_inputs=(idx,), context_layout=layout)
        got = sm(shardc.shard_batch(idx, mesh))
        # fp32, the same sums in another order: ~1e-7 of values of size ~1
        assert got.shape == want.shape and (got - want).abs().max() < 1e-5, (spec, layout, got.shape)


def test_per_token_outputs_come_back_cut_as_the_inputs(ranks: Any) -> None:
    ranks.run(_outputs, 4)


def _recuts(rank: int, world: int) -> None:
    """The re-cuts of the balanced layout (the token ids in, the per-token logits back to
    contiguous blocks, and the logits' gradient the other way) are exchanges of the
    rank's chunks, point to point on gloo, not all-gathers: the report has no all-gather
    of an input or output, and an all-to-all's figure for each re-cut; a training step
    moves what it says, byte for byte, never calls torch's all-to-all, and gives one
    device's logits and float64's gradients."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = _Logits()
    idx = _lm_batches(n=1, batch=4)[0][0]
    mesh = shardc.Mesh.parse("x1y1c4z1d1")
    sm = shardc.compile(model, mesh, example_inputs=(idx,))
    rows = shardc.comm_report(sm).rows
    recut = [r for r in rows if r.op in ("input", "output")]
    assert recut and {r.collective for r in recut} == {"all_to_all"}, recut
    piece = idx.numel() // world * idx.element_size()
    assert [r.bytes for r in recut if r.op == "input"] == [piece * (world - 1) / world], recut
    seed = torch.Generator().manual_seed(1)
    dy = torch.randn(model(idx).shape, generator=seed)
    ref_model = copy.deepcopy(model).double()
    (ref_model(idx) * dy.double()).sum().backward()
    real, calls = dist.all_to_all_single, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 2 and args[2] is not None:  # split sizes: a re-cut's (small
            calls.append(1)                        # all-reduces exchange without them)
        return real(*args, **kwargs)

    try:
        dist.all_to_all_single = counted
        for _ in range(2):  # the first step builds the step program, the second runs it
            sm.zero_grad()
            sm.reset_measured_comm()
            got = sm(shardc.shard_batch(idx, mesh))
            (got * shardc.shard_batch(dy, mesh)).sum().backward()
            measured, reported = sm.measured_comm(), shardc.comm_report(sm).by_key()
            assert measured == reported, (measured, reported)
    finally:
        dist.all_to_all_single = real
    assert not calls, f"torch's all-to-all with split sizes ran {len(calls)} times"
    want = shardc.shard_batch(model(idx), mesh)
    # fp32, the same sums in another order: ~1e-7 of values of size ~1
    assert (got - want).abs().max() < 1e-5
    for k, g in sm.full_grads().items():
        w = dict(ref_model.named_parameters())[k].grad
        # fp32 against float64 over sums of ~100 products of size ~1: ~1e-6 relative; a
        # chunk sent to the wrong rank is off by O(1)
        assert torch.allclose(g.double(), w, rtol=1e-4, atol=1e-5), (k, (g.double() - w).abs().max())


def test_recuts_are_exchanges_of_the_ranks_chunks(ranks: Any) -> None:
    ranks.run(_recuts, 4)


def _refusals(rank: int, world: int) -> None:
    mesh = shardc.Mesh.parse("x1y1c2z1d1" if world == 2 else "x1y1c2z1d2")
    odd = torch.randint(0, 64, (8, 15))
    try:
        shardc.shard_batch(odd, mesh)
    except ShardcError as e:
        assert "sequence of 15" in str(e) and "context = 2" in str(e), e
    else:
        raise AssertionError("shard_batch cut a sequence of 15 over 2 ranks")
    try:
        shardc.compile(GPT(layers=1), mesh, example_inputs=(odd, odd))
    except ShardcError as e:
        assert "sequence of 15" in str(e) and "multiple of 2" in str(e), e
    else:
        raise AssertionError("a sequence of 15 compiled over context = 2")
    for bad in ({"context_layout": "zigzag"}, {"context_attention": "allgather"},
                {"context_attention": "ulysses", "context_layout": "balanced"}):
        try:
            shardc.compile(GPT(layers=1), mesh, example_inputs=_lm_batches(n=1)[0], **bad)
        except ShardcError as e:
            assert "{}={!r}".format(*next(iter(bad.items()))) in str(e), e
        else:
            raise AssertionError(f"{bad} compiled")
    if world == 4:
        # with pipeline stages too: the first stage's inputs, and every rank hears of it
        try:
            shardc.compile(GPT(layers=2), shardc.Mesh.parse("p2x1y1c2z1d1"), example_inputs=(odd, odd))
        except ShardcError as e:
            assert "sequence of 15" in str(e), e
        else:
            raise AssertionError("a pipeline compiled a sequence of 15 over context = 2")


def test_clear_errors(ranks: Any) -> None:
    ranks.run(_refusals, 2)
    ranks.run(_refusals, 4)


# transformers models of test_more_models_gloo on a context mesh, through test_train_gloo's
# checks. By a ring: padding masks (an explicit mask the ring slices by key). Attention
# written out as products and a softmax (Gemma 2's soft-capped logits; BLOOM's ALiBi
# baddbmm, run by hand) is no sdpa: its keys are gathered, exactly.
# T5 adds its learned position bias as a floating mask with a gradient; the ring gives its
# mask none, so T5 keeps the gathering attention (and its bias's gradient). DeepSeek-V3's
# latent attention has values narrower than its queries and keys, which torch's fused CPU
# kernel refuses: its ring runs the math form, and its output has the values' head size
OTHER_CASES = [("llama-padded", "x1y1c2z1d2", "ring"), ("bert-padded", "x1y1c4z1d1", "ring"),
               ("gemma2", "x1y1c4z1d1", "gather"), ("t5", "x1y1c2z1d2", "gather"),
               ("deepseek-v3", "x1y1c2z1d2", "ring")]


def _other(rank: int, world: int, name: str, spec: str, expect: str) -> None:
    import test_more_models_gloo as M
    import test_train_gloo as T

    if name in M.MODELS:
        T.MODELS[name] = (lambda m: (lambda: T._lm(m)))(M.MODELS[name][0])
    else:
        T.MODELS[name] = M.OTHERS[name][0]
    old = shardc.compile
    compiled: list = []

    def keep(*args: Any, **kw: Any) -> Any:
        compiled.append(old(*args, **kw))
        return compiled[-1]

    shardc.compile = keep  # type: ignore[assignment]
    try:
        # transformers build their masks whole (replicated integer work, nothing gathered)
        failures = T._case_failures(name, shardc.Mesh.parse(spec), allowed=lambda f: True)
    finally:
        shardc.compile = old  # type: ignore[assignment]
    failures += _how_attention_ran(f"{name}@{spec}", compiled[0], expect)
    if failures:
        raise AssertionError("\n".join(failures))


@pytest.mark.parametrize("case", OTHER_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_transformers_models_with_masks(ranks: Any, case: tuple) -> None:
    ranks.run(_other, shardc.Mesh.parse(case[1]).world_size, *case)
