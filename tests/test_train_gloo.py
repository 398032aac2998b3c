"""Real multi-process training on gloo: every mesh of 8 ranks (and of 1, 2, 4) trains the
bias-free MLP chain, the plain-torch GPT, transformers' GPT2LMHeadModel, LlamaForCausalLM,
OPTForCausalLM, GPTNeoXForCausalLM, GPTBigCodeForCausalLM and Phi3ForCausalLM, and LitGPT's
GPT (multi-head and grouped-query) like the single-device model on the same global batch:
each of three AdamW steps' gradients as accurately as one fp32 device at the same weights
(both measured against a float64 copy), the losses, the weights after the steps (one
device's AdamW stepped on the compiled gradients: harness.train_side_by_side), and the
bytes the runtime hands to torch.distributed equal to the comm report's, byte for byte.

Each (model, mesh) is its own test, ``test_meshes_of_1_2_4_ranks[gpt-x2y1z1d2]``, run on a
pool of ranks per world size started once for the module (the ``ranks`` fixture,
``harness.RankPool``), so ``-k``, ``--lf`` and ``-x`` pick cases; a failing case lists
its failures (model, mesh, step or tensor, errors). ``python tests/test_train_gloo.py
MODEL@MESH ...`` re-runs chosen cases outside pytest (``--list`` names them all). The
4- and 8-rank sweeps run every mesh with the MLP and three or two language models in
turn (``sweep_cases``); SHARDC_FULL_SWEEP=1 runs every model on every mesh.
"""
from __future__ import annotations

import copy
import math
import os
import sys
import traceback
from typing import Any

import pytest
import torch
from harness import run_on_ranks, train_side_by_side
from models import (
    GPT,
    MLPChain,
    gpt2,
    gpt_bigcode,
    gpt_neox,
    litgpt_llama,
    llama,
    opt,
    phi3,
)

import shardc

pytestmark: list = []  # the tests that start ranks are marked slow and distributed one by one

# Tolerances. The compiled program sums the same products in another order (shards,
# then a ring), so in fp32 the loss and gradients agree to ~1e-7 relative, and each
# step's gradients are judged against float64 below. The weights after three AdamW steps
# are not judged against a one-device run that trains on its own gradients: AdamW divides
# each gradient element by its own magnitude, so an element near eps (an embedding row
# whose token occurs once: 1.8e-6 in one of Qwen3's) turns the rounding of the sums
# behind it into a weight difference of ~1e-5 between any two summation orders. The
# one-device optimizer is driven by the compiled model's gradients instead
# (harness.train_side_by_side): both apply AdamW's elementwise update to the same
# numbers, so the weights agree to a few fp32 roundings at most (measured: bitwise equal
# for the GPT, Llama and Qwen3, with and without shard_optimizer), and RTOL/ATOL = 1e-5
# is far above that and far below one step's lr = 1e-3 (a shard stepped twice or not at
# all, a stale weight). eps=1e-6 and lr=1e-3 are ordinary AdamW settings that keep three steps
# well inside fp32's resolution of the weights.
LR, EPS = 1e-3, 1e-6
RTOL = ATOL = 1e-5

# Gradients against float64. Both the compiled program and one fp32 device compute each
# step's gradient, at the same weights, with fp32 rounding, in different summation orders; a float64 copy
# of the same model on the same batch is exact to ~1e-16 relative, so each fp32 run's
# max-abs distance to it *is* that run's rounding error. Reordering a sum of n terms
# changes its error bound by nothing, but the realised error of one order against another
# varies with the order by a small factor (the shards' partial sums are shorter, the
# ring's additions are extra); GRAD_FACTOR = 4 allows that and nothing more: a wrong
# layout, a missing or doubled reduction, a wrong column order is off by the gradient's
# own magnitude, ~1e5 times one device's error.
GRAD_FACTOR = 4.0
# ... plus an absolute floor, for tensors whose gradient is exactly zero in exact
# arithmetic (an attention key bias: softmax is invariant to adding the same number to a
# row of scores; a cancelling sum): there one device may by chance round to exactly 0
# (or to ~1e-12) while another summation order leaves ~1e-11 of noise, so "4x of one
# device's error" would demand exact zeros. The noise is a few fp32 roundings (unit
# roundoff 2**-24 = 6e-8) of the terms that cancel, which are no larger than the model's
# largest gradient entry G; the floor is 2**-24 * G (per model and batch, taken from the
# float64 gradients), below one fp32 ulp of any entry of size G, so it cannot hide an
# error in any gradient that is not ~0.
FP32_UNIT_ROUNDOFF = 2.0 ** -24


def _mlp() -> tuple:
    g = torch.Generator().manual_seed(1)
    return MLPChain, [(torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g))
                      for _ in range(3)]


def _lm(make) -> tuple:
    g = torch.Generator().manual_seed(1)
    return make, [(torch.randint(0, 64, (8, 16), generator=g),
                   torch.randint(0, 64, (8, 16), generator=g)) for _ in range(3)]


MODELS = {"mlp": _mlp, "gpt": lambda: _lm(GPT), "gpt2": lambda: _lm(gpt2),
          "llama": lambda: _lm(llama), "opt": lambda: _lm(opt),
          "litgpt": lambda: _lm(litgpt_llama),
          "litgpt_gqa": lambda: _lm(lambda: litgpt_llama(query_groups=2)),
          "neox": lambda: _lm(gpt_neox), "bigcode": lambda: _lm(gpt_bigcode),
          "phi3": lambda: _lm(phi3)}


def _grad_failures(where: str, grads: dict, ref_grads: dict, f64_grads: dict, step: int = 0
                   ) -> list[str]:
    """Each parameter's gradient at one step, compiled, within GRAD_FACTOR of one fp32
    device's max-abs error against float64 at the same weights (plus the floor)."""
    out = []
    if sorted(grads) != sorted(f64_grads):
        return [f"{where}: full_grads names {sorted(grads)} != {sorted(f64_grads)}"]
    big = max((g.abs().max().item() for g in f64_grads.values() if g is not None), default=0.0)
    floor = FP32_UNIT_ROUNDOFF * big
    for k, g64 in f64_grads.items():
        if g64 is None or grads[k] is None:
            if (g64 is None) != (grads[k] is None):
                out.append(f"{where}: step {step} grad {k}: compiled {grads[k] is None and 'None'} "
                           f"vs float64 {g64 is None and 'None'}")
            continue
        if grads[k].shape != g64.shape:
            out.append(f"{where}: step {step} grad {k}: shape {tuple(grads[k].shape)} vs {tuple(g64.shape)}")
            continue
        err = (grads[k].double() - g64).abs().max().item()
        err1 = (ref_grads[k].double() - g64).abs().max().item()
        limit = GRAD_FACTOR * err1 + floor
        if not err <= limit:
            out.append(f"{where}: step {step} grad {k}: max-abs err vs float64 compiled {err:.3e}, "
                       f"one fp32 device {err1:.3e} (limit {limit:.3e}, |g|max {g64.abs().max().item():.3e})")
    return out


def _steps_grad_failures(where: str, run: Any) -> list[str]:
    """``_grad_failures`` at every step of a ``train_side_by_side`` run."""
    return [line for step, g in enumerate(zip(run.grads, run.ref_grads, run.f64_grads))
            for line in _grad_failures(where, *g, step=step)]


_BUILT: dict[str, torch.nn.Module] = {}


def _same_model(name: str, make):
    """One model per name and process, built once with seed 0 (what train_side_by_side
    seeds): compile traces it once for all meshes (the trace is cached per model object;
    compile only reads it), and the single-device runs train copies of it."""
    def build() -> torch.nn.Module:
        if name not in _BUILT:
            _BUILT.clear()  # the sweep goes model by model
            _BUILT[name] = make()
        return _BUILT[name]
    return build


def _attention_masks(f) -> bool:
    """transformers build their attention masks with advanced indexing on whole integer
    tensors: replicated, and nothing to gather."""
    return f.op == "aten.index.Tensor" and not f.gathered


def model_and_batches(name: str, device: str = "cpu") -> tuple[Any, list[tuple]]:
    """(the builder of ``name``'s one model on ``device``, its three batches there)."""
    make, batches = MODELS[name]()
    if device == "cpu":
        return _same_model(name, make), batches
    return (_same_model(f"{name}@{device}", lambda: make().to(device)),
            [tuple(t.to(device) for t in b) for b in batches])


def _case_failures(name: str, mesh: shardc.Mesh, allowed=_attention_masks, device: str = "cpu",
                   **compile_kw: Any) -> list[str]:
    """Every check of one (model, mesh); the failures as lines (empty when it passes).
    ``allowed``: which ops may run replicated (``sm.fallbacks``) without failing the case;
    ``device``: where the model and batches live (``test_gpu`` runs "cuda");
    ``compile_kw``: options for shardc.compile (named in the failure lines)."""
    make, batches = model_and_batches(name, device)
    where = f"{name}@{mesh.spec()}" + (f" on {device}" if device != "cpu" else "") + \
        "".join(f" {k}={v}" for k, v in compile_kw.items())
    try:
        run = train_side_by_side(make, batches, mesh, lr=LR, eps=EPS, **compile_kw)
    except Exception:  # noqa: BLE001 (a compile or runtime error is this case's failure)
        return [f"{where}: raised\n{traceback.format_exc()}"]
    out = _run_failures(where, run, mesh, batches)
    if not all(allowed(f) for f in run.sm.fallbacks):
        out.append(f"{where}: unexpected fallbacks {run.sm.fallbacks}")
    return out


def _run_failures(where: str, run: Any, mesh: shardc.Mesh, batches: list) -> list[str]:
    """A side-by-side run's checks: each step's gradients, the losses, the state after the
    steps against one device, and one more step's measured bytes == the comm report's."""
    out = _steps_grad_failures(where, run)
    for step, (a, b) in enumerate(zip(run.ref_losses, run.losses)):
        if not math.isclose(a, b, rel_tol=RTOL):
            out.append(f"{where}: step {step} loss {b!r} vs one device {a!r} "
                       f"(rel {abs(a - b) / abs(a):.2e})")
    if list(run.state) != list(run.ref_state):
        out.append(f"{where}: state names {list(run.state)} != {list(run.ref_state)}")
    for k, ref in run.ref_state.items():
        got = run.state.get(k)
        if got is None or got.shape != ref.shape:
            out.append(f"{where}: after 3 steps {k}: {None if got is None else tuple(got.shape)} "
                       f"vs {tuple(ref.shape)}")
            continue
        if not ref.is_floating_point():  # a counter (BatchNorm's num_batches_tracked)
            if not torch.equal(got, ref):
                out.append(f"{where}: after 3 steps {k}: {got.tolist()} vs {ref.tolist()}")
            continue
        # elementwise, and as a whole tensor (tensors that are ~0 in both, like a key
        # bias, by atol)
        worst = ((got - ref).abs() - RTOL * ref.abs()).max().item()
        err = (got - ref).norm().item()
        if worst > ATOL or err > RTOL * ref.norm().item() + ATOL:
            out.append(f"{where}: after 3 steps {k}: max-abs diff {(got - ref).abs().max().item():.3e}, "
                       f"norm diff {err:.3e} of norm {ref.norm().item():.3e}")
    # what the runtime hands to torch.distributed in one step == the compile-time report
    sm = run.sm
    sm.reset_measured_comm()
    sm(*[shardc.shard_batch(t, mesh) for t in batches[0]]).backward()
    measured, reported = sm.measured_comm(), shardc.comm_report(sm).by_key()
    if measured != reported:
        out.append(f"{where}: measured comm {measured} != reported {reported}")
    return out


def _cases(rank: int, world_size: int, cases: list[tuple[str, str]]) -> None:
    """Run every (model, mesh spec); fail at the end with every failing case's lines."""
    failures: list[str] = []
    for name, spec in cases:
        failures += _case_failures(name, shardc.Mesh.parse(spec))
    if failures:
        failing = sorted({line.split(":", 1)[0] for line in failures})
        raise AssertionError(f"{len(failing)} of {len(cases)} cases fail: {' '.join(failing)}\n"
                             + "\n".join(failures))


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


def _grads_and_state(rank: int, world_size: int, spec: str) -> None:
    """full_grads is the single-device gradient; load_full_state_dict is the inverse of
    full_state_dict, tied weights and all."""
    make, batches = _lm(GPT)
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
    _sliced_batch(ref, mesh)
    sd = {k: v + 1.0 for k, v in ref.state_dict().items()}
    sm.load_full_state_dict(sd)
    back = sm.full_state_dict()
    assert list(back) == list(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    # the gathers go out in buckets of at most GATHER_BUCKET_BYTES of this rank's pieces: in
    # buckets of one tensor or a few, every tensor comes back the same
    for cap in (1, 4096):
        sm.GATHER_BUCKET_BYTES = cap
        again, grads_again = sm.full_state_dict(), sm.full_grads()
        assert all(torch.equal(again[k], back[k]) for k in sd)
        assert all(torch.equal(grads_again[k], grads[k]) for k in grads)


def _sliced_batch(model: torch.nn.Module, mesh: shardc.Mesh) -> None:
    """Inputs and targets sliced from one (B, T+1) batch, as language-model loaders make
    them: non-contiguous, for the example inputs and every call. The compiled model
    matches one device on contiguous copies of the same values."""
    data = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(2))
    x, y = data[:, :-1], data[:, 1:]
    ref = copy.deepcopy(model)
    ref.zero_grad()
    sm = shardc.compile(copy.deepcopy(model), mesh, example_inputs=(x, y))
    loss_ref = ref(x.contiguous(), y.contiguous())  # this GPT's `.view` needs contiguous
    loss_ref.backward()
    loss = sm(shardc.shard_batch(x, mesh), shardc.shard_batch(y, mesh))
    loss.backward()
    assert math.isclose(loss.item(), loss_ref.item(), rel_tol=RTOL), (loss.item(), loss_ref.item())
    grads = sm.full_grads()
    for name, p in ref.named_parameters():
        # as in _grads_and_state: the same products summed in another order
        torch.testing.assert_close(grads[name], p.grad, rtol=RTOL, atol=1e-7)


DROPOUT_MODELS = {"gpt": lambda: GPT(dropout=0.1), "gpt2": lambda: gpt2(dropout=0.1)}
TWO_MESHES = ("x2y1z1d2", "x1y2z2d1")


def _dropout(rank: int, world_size: int, model: str, spec: str) -> None:
    """Training with dropout (p=0.1 on embeddings and residuals) matches one device: each
    rank draws the global mask from the same generator and keeps its piece."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
               for _ in range(3)]
    make = DROPOUT_MODELS[model]
    mesh = shardc.Mesh.parse(spec)
    run = train_side_by_side(make, batches, mesh, lr=LR, eps=EPS)
    # a mask drawn differently changes the gradient by its own size, far past
    # the rounding bound
    fails = _steps_grad_failures(f"dropout@{spec}", run)
    assert not fails, fails
    for a, b in zip(run.ref_losses, run.losses):
        assert math.isclose(a, b, rel_tol=RTOL), (spec, run.ref_losses, run.losses)
    for k, ref in run.ref_state.items():
        torch.testing.assert_close(run.state[k], ref, rtol=RTOL, atol=ATOL)


def sweep_cases(world: int, full: bool = False) -> list[tuple[str, str]]:
    """The (model, mesh) cases of the sweep on ``world`` ranks. On 1 and 2 ranks every
    model trains on every mesh. On 4 and 8 every mesh trains the MLP chain and three (4
    ranks) or one (8 ranks) of the nine language models: on 4, a different triple on each
    mesh (neighbours in MODELS' order, then one of models two apart), so that each model
    trains on three or four meshes of 4; on 8, the models in turn along the meshes, so
    that each trains on two or three meshes of 8 that split different sets of axes. The
    rotation keeps the suite inside CI's 30 minutes: every model on every mesh of 4 took
    7 minutes, of 8 about 15 (two models a mesh of 8: 12 minutes; one: 7). ``full``:
    every model on every mesh (SHARDC_FULL_SWEEP=1)."""
    meshes = [m.spec() for m in shardc.Mesh.all(world)]
    lms = [n for n in MODELS if n != "mlp"]
    if full or world < 4:
        return [(n, s) for n in MODELS for s in meshes]
    n = len(lms)
    if world == 4:
        groups = [(i, (i + d) % n, (i + 2 * d) % n) for d in (1, 2) for i in range(n)]
    else:
        groups = [(i % n,) for i in range(len(meshes))]
    picked = [("mlp", s) for s in meshes]
    for s, group in zip(meshes, groups):
        picked += [(lms[i], s) for i in group]
    # model by model: compile reuses a model's torch.export trace for all its meshes
    order = list(MODELS)
    return sorted(picked, key=lambda c: (order.index(c[0]), meshes.index(c[1])))


def _full() -> bool:
    return os.environ.get("SHARDC_FULL_SWEEP") == "1"


def _sweep(worlds: tuple[int, ...]) -> list[Any]:
    """One test param a (model, mesh) of the sweep on each of ``worlds`` ranks, world by
    world (each pool of ranks starts once), id ``model@mesh``."""
    return [pytest.param(w, name, spec, id=f"{name}-{spec}")
            for w in worlds for name, spec in sweep_cases(w, _full())]


# the world sizes' tests in the order their pools start: 1, 2, 4 (the sweep, then the
# tests of 4 ranks below), then 8
@pytest.mark.parametrize("world_size, name, spec", _sweep((1, 2, 4)))
@pytest.mark.sweep
@pytest.mark.slow
@pytest.mark.distributed
def test_meshes_of_1_2_4_ranks(ranks, world_size: int, name: str, spec: str) -> None:
    ranks.run(_cases, world_size, [(name, spec)])


@pytest.mark.parametrize("spec", TWO_MESHES)
@pytest.mark.slow
@pytest.mark.distributed
def test_full_grads_and_state_dict_roundtrip(ranks, spec: str) -> None:
    ranks.run(_grads_and_state, 4, spec)


@pytest.mark.parametrize("model, spec", [(m, s) for m in DROPOUT_MODELS for s in TWO_MESHES],
                         ids=[f"{m}-{s}" for m in DROPOUT_MODELS for s in TWO_MESHES])
@pytest.mark.slow
@pytest.mark.distributed
def test_dropout_trains_like_one_device(ranks, model: str, spec: str) -> None:
    ranks.run(_dropout, 4, model, spec)


@pytest.mark.parametrize("world_size", [4, 8])
def test_the_rotation_covers_every_mesh_and_model(world_size: int) -> None:
    """The rotation leaves no mesh and no model out, and mixes the families."""
    cases = sweep_cases(world_size)
    meshes = {m.spec() for m in shardc.Mesh.all(world_size)}
    per_mesh = 3 if world_size == 4 else 1
    assert {s for _, s in cases} == meshes
    per_model = {n: {s for m, s in cases if m == n} for n in MODELS}
    assert per_model["mlp"] == meshes
    assert all(len(v) >= (3 if world_size == 4 else 2) for v in per_model.values()), per_model
    # the same number of language models on every mesh; on 4 ranks no two meshes the same
    # set, on 8 (one model a mesh) every model on meshes that split different sets of axes
    sets = [frozenset(m for m, s2 in cases if s2 == s and m != "mlp") for s in sorted(meshes)]
    assert all(len(p) == per_mesh for p in sets), sets
    if world_size == 4:
        assert len(set(sets)) == len(meshes), sets
    else:
        for n, specs in per_model.items():
            if n != "mlp":
                split = [frozenset(a for a, g in shardc.Mesh.parse(s).sizes.items() if g > 1)
                         for s in specs]
                assert len(set(split)) == len(split), (n, specs)
    assert len(sweep_cases(world_size, full=True)) == len(MODELS) * len(meshes)


# The memory options, each as compile takes it. Every pair of them (two settings of one
# option excepted) trains on every mesh of 4 ranks with two axes > 1, where one option's
# collectives meet the other's on another axis: shard_optimizer with "blocks" once summed
# a norm's gradient over data but not over x (x >= 2 and data >= 2 only; every mesh with
# one axis > 1, and each option alone, was exact).
MEMORY_OPTIONS: dict[str, dict[str, Any]] = {
    "zero": {"shard_optimizer": True},
    "blocks": {"activation_checkpoint": "blocks"},
    "selective": {"activation_checkpoint": "selective"},
    "reshard": {"reshard_after_forward": True},
    "autograd": {"step_graph": False},
}


def _accepted(kw: dict[str, Any]) -> bool:
    """Does compile take these options together? (A pair it refuses, such as
    reshard_after_forward without the step program, is refused by name: test_memory_options.)"""
    from shardc.core.options import Options

    try:
        Options(**kw)
    except ValueError:
        return False
    return True


def option_pairs() -> list[tuple[str, str]]:
    names = list(MEMORY_OPTIONS)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if MEMORY_OPTIONS[a].keys() != MEMORY_OPTIONS[b].keys()
            and _accepted({**MEMORY_OPTIONS[a], **MEMORY_OPTIONS[b]})]


def two_axis_meshes(world: int = 4) -> list[str]:
    return [m.spec() for m in shardc.Mesh.all(world) if sum(g > 1 for g in m.sizes.values()) == 2]


def _option_pair(rank: int, world_size: int, model: str, spec: str, a: str, b: str) -> None:
    failures = _case_failures(model, shardc.Mesh.parse(spec),
                              **MEMORY_OPTIONS[a], **MEMORY_OPTIONS[b])
    assert not failures, "\n".join(failures)


def test_the_option_pairs_meet_on_every_mesh_of_two_axes() -> None:
    assert len(two_axis_meshes()) == 6 and len(option_pairs()) >= 6


@pytest.mark.parametrize("spec, a, b", [pytest.param(s, a, b, id=f"llama-{s}-{a}+{b}")
                                        for s in two_axis_meshes() for a, b in option_pairs()])
@pytest.mark.sweep
@pytest.mark.slow
@pytest.mark.distributed
def test_every_pair_of_memory_options_on_meshes_of_two_axes(ranks, spec: str, a: str, b: str) -> None:
    """Llama (RMSNorm weights replicated over x and y, grouped-query attention, an untied
    head): each pair of memory options on each mesh of 4 ranks with two axes > 1, three
    AdamW steps against float64, and the bytes moved equal to the report's."""
    ranks.run(_option_pair, 4, "llama", spec, a, b)


@pytest.mark.slow
@pytest.mark.distributed
def test_bad_input_fails_on_every_rank_without_hanging(ranks) -> None:
    ranks.run(_bad_input, 4)


@pytest.mark.parametrize("world_size, name, spec", _sweep((8,)))
@pytest.mark.sweep
@pytest.mark.slow
@pytest.mark.distributed
def test_all_20_meshes_of_8_ranks(ranks, world_size: int, name: str, spec: str) -> None:
    ranks.run(_cases, world_size, [(name, spec)])


if __name__ == "__main__":
    # python tests/test_train_gloo.py gpt@x2y1z1d4 litgpt_gqa@x2y2z2d1 ...: re-run cases
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # the ranks' torch deprecation noise
    if sys.argv[1:] in ([], ["--list"]):
        print(" ".join(f"{n}@{m.spec()}" for w in (1, 2, 4, 8) for n in MODELS for m in shardc.Mesh.all(w)))
        sys.exit(0)
    by_world: dict[int, list[tuple[str, str]]] = {}
    for arg in sys.argv[1:]:
        name, spec = arg.split("@")
        by_world.setdefault(shardc.Mesh.parse(spec).world_size, []).append((name, spec))
    for w, cases in sorted(by_world.items()):
        run_on_ranks(_cases, w, cases)
        print(f"{len(cases)} case(s) on {w} rank(s) pass")
