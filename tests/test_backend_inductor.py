"""compile(..., backend="inductor"): the compute between collectives through inductor,
collectives, random draws and in-place writes eager (shardc/program/backend.py), in the forward
program and in both parts of the step program."""
from __future__ import annotations

import copy
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from models import GPT, MLPChain

import shardc
from shardc.program.backend import InductorProgram, is_collective, is_random, runs_eagerly
from shardc.tools.models import lm_batch

pytestmark: list = []  # the test on ranks is slow and distributed

# Against float64, as tests/test_train_gloo.py measures the eager program: inductor fuses
# and reorders the same fp32 operations, so its rounding error differs from the eager
# program's by the order of the operations, not by their number; GRAD_FACTOR = 4 allows a
# different realised error of the same bound and nothing more (a wrong piece, a lost
# collective or a different dropout mask is off by the gradient's own size, ~1e5 times
# more). The floor (fp32 unit roundoff x the largest gradient) covers entries that are 0
# in exact arithmetic, where either order may leave a few roundings of noise.
GRAD_FACTOR = 4.0
FP32_UNIT_ROUNDOFF = 2.0 ** -24


def test_backend_option_is_validated(fake_world) -> None:
    fake_world(2)
    with pytest.raises(ValueError, match="backend='tvm' is not one of"):
        shardc.compile(MLPChain(), shardc.Mesh(x=2), example_inputs=(torch.randn(8, 16),) * 2,
                       backend="tvm")


def test_pieces_hold_no_collective_and_no_random_op(fake_world) -> None:
    """Every collective and random node of the program runs eagerly, alone, in the
    program's order; every other node is in a compiled piece."""
    fake_world(8)
    torch.manual_seed(0)
    sm = shardc.compile(GPT(dropout=0.1), shardc.Mesh.parse("x2y2z2d1"),
                        example_inputs=lm_batch(8, 16, 64))
    program = InductorProgram(sm.graph_module)  # torch.compile is lazy: nothing compiles yet
    eager_in_program = [n.target for n in sm.graph_module.graph.nodes if runs_eagerly(n)]
    assert any(is_random(n) for n in sm.graph_module.graph.nodes)
    eager_in_split = []
    compiled_nodes = 0
    for node in program.split.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(program.split, node.target)
        if hasattr(sub, "eager") and hasattr(sub, "compiled"):  # a compiled piece
            inner = [n for n in sub.eager.graph.nodes if n.op == "call_function"]
            assert not any(is_collective(n) or is_random(n) for n in inner), node.target
            compiled_nodes += len(inner)
        else:
            inner = [n for n in sub.graph.nodes if n.op == "call_function"]
            assert len(inner) == 1 and runs_eagerly(inner[0]), node.target
            eager_in_split.append(inner[0].target)
    assert eager_in_split == eager_in_program
    total = sum(1 for n in sm.graph_module.graph.nodes if n.op == "call_function")
    assert compiled_nodes + len(eager_in_split) == total
    assert program.pieces > 1


def _inductor_vs_eager(rank: int, world_size: int, spec: str) -> None:
    mesh = shardc.Mesh.parse(spec)
    torch.manual_seed(0)
    # one block (every collective and cut kind of a GPT, half the pieces to compile); dropout:
    # the random cut must keep the masks one device draws
    model = GPT(layers=1, dropout=0.1)
    batch = lm_batch(8, 16, 64)
    ref64 = copy.deepcopy(model).double()
    rng = torch.get_rng_state()
    ref64(*batch).backward()
    g64 = {n: p.grad for n, p in ref64.named_parameters()}
    local = [shardc.shard_batch(t, mesh) for t in batch]
    results = {}
    for backend in ("eager", "inductor"):
        sm = shardc.compile(model, mesh, example_inputs=batch, backend=backend)
        torch.set_rng_state(rng)
        loss = sm(*local)
        loss.backward()
        results[backend] = (shardc.global_mean(loss, mesh).item(), sm.full_grads(), sm)
    # training runs the step program (forward and backward in one graph, with the
    # step passes), each part cut at its collectives and compiled piece by piece
    (jp,) = results["inductor"][2]._joint.values()
    for part in jp.runners():
        assert isinstance(part, InductorProgram) and part.pieces >= 1
        assert part.fallbacks == []  # every piece really went through inductor
        assert all(p.tried for p in part._pieces.values())
    assert jp.runners()[0].pieces > 1
    torch.set_rng_state(rng)
    loss64 = ref64(*batch).item()
    (loss_e, grads_e, _), (loss_i, grads_i, _) = results["eager"], results["inductor"]
    # the loss is one number summed over 2048 terms: fp32 rounding ~1e-6 relative
    assert abs(loss_i - loss64) <= GRAD_FACTOR * abs(loss_e - loss64) + 4e-7 * abs(loss64)
    floor = FP32_UNIT_ROUNDOFF * max(g.abs().max().item() for g in g64.values())
    for name, g in g64.items():
        err_e = (grads_e[name].double() - g).abs().max().item()
        err_i = (grads_i[name].double() - g).abs().max().item()
        assert err_i <= GRAD_FACTOR * err_e + floor, (name, err_i, err_e, floor)


@pytest.mark.slow
@pytest.mark.distributed
def test_inductor_matches_eager_against_float64_on_gloo(ranks) -> None:
    """Two gloo ranks, a one-block GPT with dropout on x2 (Megatron: all-reduces inside every
    block, between compiled pieces): the loss and every gradient of the inductor program
    are as close to a float64 one-device run as the eager program's."""
    ranks.run(_inductor_vs_eager, 2, "x2y1z1d1")


def test_inductor_failure_falls_back_to_eager_with_a_warning(monkeypatch) -> None:
    import torch._inductor.compile_fx as compile_fx

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler on this machine")

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            model = MLPChain()
            x, t = torch.randn(8, 16), torch.randn(8, 16)
            eager = shardc.compile(model, shardc.Mesh(), example_inputs=(x, t))
            monkeypatch.setattr(compile_fx, "compile_fx", broken)
            torch._dynamo.reset()
            sm = shardc.compile(model, shardc.Mesh(), example_inputs=(x, t), backend="inductor")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = sm(x, t)
            assert any("runs eagerly" in str(w.message) and "no C++ compiler" in str(w.message)
                       for w in caught), [str(w.message) for w in caught]
            (jp,) = sm._joint.values()
            forward = jp.runners()[0]
            assert forward.fallbacks and forward.pieces == len(forward.fallbacks)
            loss.backward()
            ref = eager(x, t)
            ref.backward()
            assert torch.equal(loss, ref)  # the same eager ops in the same order
            for (n, p), q in zip(sm.named_parameters(), eager.parameters()):
                assert torch.equal(p.grad, q.grad), n
        finally:
            torch._dynamo.reset()
            dist.destroy_process_group()
