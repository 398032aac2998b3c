"""StepGuard on real gloo processes: the project's GPT on x2y1z1d2 (every parameter
replicated over data, the norms' and biases' also over x), with NaN and Inf injected on
one rank only. Every rank must take the same decision, a skipped step must leave the
parameters and the optimizer state bitwise untouched, the global gradient norm must be
the single-device one (a copy held by several ranks counted once), and K consecutive
skips must raise on every rank naming the step and the first offending parameter."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from models import GPT

import shardc

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# The guard sums squares in float64 from fp32 gradients that differ from one device's
# by fp32 rounding of the same sums in another order (~1e-7 relative); 1e-5 leaves room
# for that and nothing else: counting a replicated block twice is off by a factor of
# up to sqrt(2) here.
NORM_RTOL = 1e-5


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
            for _ in range(n)]


def _guarded(rank: int, world: int, backend: str) -> None:
    torch.manual_seed(0)
    model = GPT()
    ref = copy.deepcopy(model)
    mesh = shardc.Mesh.parse("x2y1z1d2")
    sm = shardc.compile(model, mesh, example_inputs=_batches(1)[0], backend=backend)
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    guard = shardc.StepGuard(sm, opt, max_consecutive_skips=2)
    order = [n for n, _ in sm.named_parameters()]
    first, later = "blocks.0.fc1.weight", "blocks.1.proj.bias"
    assert order.index(first) < order.index(later)
    batches = iter(_batches(6))

    def backward(poison: dict[int, str] | None = None, loss_scale: dict[int, float] | None = None):
        b = next(batches)
        loss = sm(*[shardc.shard_batch(t, mesh) for t in b])
        loss.backward()
        for r, name in (poison or {}).items():
            if r == rank:
                g = sm.get_parameter(name).grad
                g.view(-1)[g.numel() // 2] = math.nan if "weight" in name else math.inf
        if loss_scale and rank in loss_scale:
            loss = loss * loss_scale[rank]
        return b, loss

    def snapshot() -> tuple[dict, dict]:
        return ({n: p.detach().clone() for n, p in sm.named_parameters()},
                {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()})

    def unchanged(snap: tuple[dict, dict]) -> None:
        params, state = snap
        for n, p in sm.named_parameters():
            assert torch.equal(p.detach(), params[n]), n
        for p, st in opt.state.items():
            for k, v in st.items():
                assert torch.equal(v, state[id(p)][k]), k

    # step 1: finite; the guard's norm is one device's clip_grad_norm_ total
    b, loss = backward()
    ref(*b).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf).item()
    assert guard.step(loss) is True
    assert math.isclose(guard.last_norm, ref_norm, rel_tol=NORM_RTOL), (guard.last_norm, ref_norm)
    opt.zero_grad()

    # step 2: a NaN on rank 3 in a data-replicated block (rank 3 is data=1: a copy that
    # the norm does not count), an Inf later in the order on rank 0
    snap = snapshot()
    _, loss = backward(poison={3: first, 0: later})
    assert guard.step(loss) is False
    assert (guard.last_offender, guard.skipped, guard.consecutive_skips) == (first, 1, 1)
    assert math.isnan(guard.last_norm)
    unchanged(snap)
    opt.zero_grad()

    # step 3: finite again: steps, the run of skips is over
    assert guard.step(backward()[1]) is True
    assert guard.consecutive_skips == 0
    opt.zero_grad()

    # step 4: the loss is Inf on rank 1 only
    snap = snapshot()
    _, loss = backward(loss_scale={1: math.inf})
    assert guard.step(loss) is False
    assert guard.last_offender == "loss"
    unchanged(snap)
    opt.zero_grad()

    # step 5: a second skip in a row: every rank raises, naming the steps and the parameter
    _, loss = backward(poison={2: later})
    with pytest.raises(shardc.NonFiniteError,
                       match=rf"2 consecutive steps skipped \(steps 4, 5\).*at step 5 the first "
                             rf"parameter with a non-finite gradient is '{later}'"):
        guard.step(loss)
    unchanged(snap)
    assert guard.skipped == 3


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_step_guard_skips_everywhere_and_stops(ranks, backend: str) -> None:
    ranks.run(_guarded, 4, backend)
