"""Real multi-process training on gloo: every mesh of 8 ranks (and of 1, 2, 4) trains the
bias-free MLP chain, the plain-torch GPT and transformers' GPT2LMHeadModel, LlamaForCausalLM
and OPTForCausalLM like the single-device model on the same global batch, and the bytes the
runtime hands to torch.distributed equal the comm report's, byte for byte.

Ranks are spawned once per world size; all meshes and models run inside.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import shardc
from harness import run_on_ranks, train_side_by_side
from models import GPT, MLPChain, gpt2, llama, opt

pytestmark = pytest.mark.distributed

# Tolerances. The compiled program sums the same products in another order (shards,
# then a ring), so in fp32 the loss and gradients agree to ~1e-7 relative. AdamW then
# divides each gradient element by its own magnitude: elements that are zero in exact
# arithmetic (the attention key bias under softmax's shift invariance, sums that cancel)
# are ~1e-11 of rounding noise whose sign depends on the summation order, and AdamW
# would turn that noise into a full lr-sized step. eps=1e-6 (instead of 1e-8) keeps
# those steps below lr * 1e-5 while every real gradient here (>= 1e-5) is still
# normalised; lr=1e-3 keeps three steps within fp32's resolution of the weights. With
# that, every tensor must match to 1e-5 relative (and 1e-5 absolute for entries near 0).
LR, EPS = 1e-3, 1e-6
RTOL = ATOL = 1e-5


def _mlp() -> tuple:
    g = torch.Generator().manual_seed(1)
    return MLPChain, [(torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g))
                      for _ in range(3)]


def _lm(make) -> tuple:
    g = torch.Generator().manual_seed(1)
    return make, [(torch.randint(0, 64, (8, 16), generator=g),
                   torch.randint(0, 64, (8, 16), generator=g)) for _ in range(3)]


MODELS = {"mlp": _mlp, "gpt": lambda: _lm(GPT), "gpt2": lambda: _lm(gpt2),
          "llama": lambda: _lm(llama), "opt": lambda: _lm(opt)}


def _check(name: str, mesh: shardc.Mesh) -> None:
    make, batches = MODELS[name]()
    ref_losses, losses, ref_state, state, sm = train_side_by_side(make, batches, mesh, lr=LR, eps=EPS)
    where = f"{name} on {mesh}"
    for step, (a, b) in enumerate(zip(ref_losses, losses)):
        assert math.isclose(a, b, rel_tol=RTOL), f"{where}: step {step} loss {b} vs {a}"
    assert list(state) == list(ref_state), where
    for k, ref in ref_state.items():
        assert state[k].shape == ref.shape, (where, k)
        torch.testing.assert_close(state[k], ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where}: {k}: {m}")
        # and as a whole tensor (tensors that are ~0 in both, like a key bias, by atol)
        err = (state[k] - ref).norm().item()
        assert err <= RTOL * ref.norm().item() + ATOL, f"{where}: {k} off by {err:.2e} (norm)"
    # what the runtime hands to torch.distributed in one step == the compile-time report
    sm.reset_measured_comm()
    sm(*[shardc.shard_batch(t, mesh) for t in batches[0]]).backward()
    measured, reported = sm.measured_comm(), shardc.comm_report(sm).by_key()
    assert measured == reported, f"{where}: measured {measured} != reported {reported}"
    # transformers build their attention masks with advanced indexing on whole integer
    # tensors: replicated, and nothing to gather
    assert all(f.op == "aten.index.Tensor" and not f.gathered for f in sm.fallbacks), (
        f"{where}: unexpected fallbacks {sm.fallbacks}")


def _sweep(rank: int, world_size: int, meshes: list[str]) -> None:
    for name in MODELS:
        for spec in meshes:
            _check(name, shardc.Mesh.parse(spec))


def _bad_input(rank: int, world_size: int) -> None:
    """Every rank gets the same clear error, and nobody hangs waiting for another."""
    make, batches = _mlp()
    model = make()
    try:
        shardc.compile(model, shardc.Mesh(x=2), batches[0])
    except ValueError as e:
        assert "has 2 ranks" in str(e) and f"world size is {world_size}" in str(e)
    else:
        raise AssertionError("a mesh of the wrong size compiled")
    try:
        shardc.compile(model, shardc.Mesh(data=world_size), (torch.randn(3, 16), torch.randn(3, 16)))
    except ValueError as e:
        assert "does not divide" in str(e)
    else:
        raise AssertionError("an indivisible batch compiled")
    # the process group still works: a real collective after the errors
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    assert t.item() == world_size


def _grads_and_state(rank: int, world_size: int) -> None:
    """full_grads is the single-device gradient; load_full_state_dict is the inverse of
    full_state_dict, tied weights and all."""
    make, batches = _lm(GPT)
    for spec in ("x2y1z1d2", "x1y2z2d1"):
        mesh = shardc.Mesh.parse(spec)
        torch.manual_seed(0)
        ref = make()
        sm = shardc.compile(copy.deepcopy(ref), mesh, example_inputs=batches[0])
        ref(*batches[0]).backward()
        sm(*[shardc.shard_batch(t, mesh) for t in batches[0]]).backward()
        grads = sm.full_grads()
        assert sorted(grads) == sorted(n for n, _ in ref.named_parameters())
        for name, p in ref.named_parameters():
            # same products summed in another order: fp32 rounding, ~1e-7 relative
            torch.testing.assert_close(grads[name], p.grad, rtol=RTOL, atol=1e-7)
        sd = {k: v + 1.0 for k, v in ref.state_dict().items()}
        sm.load_full_state_dict(sd)
        back = sm.full_state_dict()
        assert list(back) == list(sd)
        for k in sd:
            assert torch.equal(back[k], sd[k]), k


def _dropout(rank: int, world_size: int) -> None:
    """Training with dropout (p=0.1 on embeddings and residuals) matches one device: each
    rank draws the global mask from the same generator and keeps its piece."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
               for _ in range(3)]
    for make in (lambda: GPT(dropout=0.1), lambda: gpt2(dropout=0.1)):
        for spec in ("x2y1z1d2", "x1y2z2d1"):
            mesh = shardc.Mesh.parse(spec)
            ref_losses, losses, ref_state, state, _ = train_side_by_side(make, batches, mesh, lr=LR, eps=EPS)
            for a, b in zip(ref_losses, losses):
                assert math.isclose(a, b, rel_tol=RTOL), (spec, ref_losses, losses)
            for k, ref in ref_state.items():
                torch.testing.assert_close(state[k], ref, rtol=RTOL, atol=ATOL)


def _grads_state_dropout(rank: int, world_size: int) -> None:
    _grads_and_state(rank, world_size)
    _dropout(rank, world_size)


def test_full_grads_state_dict_roundtrip_and_dropout() -> None:
    run_on_ranks(_grads_state_dropout, 4)


def test_all_20_meshes_of_8_ranks() -> None:
    run_on_ranks(_sweep, 8, [m.spec() for m in shardc.Mesh.all(8)])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_meshes_of_1_2_4_ranks(world_size: int) -> None:
    run_on_ranks(_sweep, world_size, [m.spec() for m in shardc.Mesh.all(world_size)])


def test_bad_input_fails_on_every_rank_without_hanging() -> None:
    run_on_ranks(_bad_input, 4)
