"""The pipeline's pieces that need no process group: the stage cut (``passes/stages.py``),
the schedules' action lists (``runtime/pipeline.py``), how micro-batch losses add up, and
the options. The gloo runs are ``test_pipeline_gloo.py``."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import GPT, llama

import shardc
from shardc.passes.stages import balance, cut_stages, unlifted_graph
from shardc.program.loss_terms import loss_terms
from shardc.program.pipeline import _loss_rule
from shardc.runtime.pipeline import P2P, actions, bubble_fraction, chunk_actions, simulate

pytestmark: list = []


def _batch(b: int = 4, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (b, t), generator=g), torch.randint(0, 64, (b, t), generator=g)


def _run_chain(stages: list, inputs: tuple) -> torch.Tensor:
    outs: list[tuple] = []
    for st in stages:
        args = [inputs[j] if src < 0 else outs[src][j] for src, j in st.inputs]
        outs.append(st.module(*args))
    return outs[-1][0]


def test_gpt_cut_in_two_runs_as_the_model() -> None:
    torch.manual_seed(0)
    model = GPT(layers=4)
    batch = _batch()
    stages = cut_stages(model, unlifted_graph(model, batch), 2)
    assert [st.blocks for st in stages] == [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]
    # stage 0 reads the tokens; stage 1 its hidden state and the targets, and makes the loss
    assert stages[0].inputs == [(-1, 0)] and stages[1].inputs == [(0, 0), (-1, 1)]
    assert stages[0].consumers == [[1]] and stages[1].consumers == [[-1]]
    assert stages[1].input_vals[0].requires_grad and not stages[1].input_vals[1].requires_grad
    # the tied embedding and head: both stages hold it, by the model's first name
    assert "tok.weight" in stages[0].params and "tok.weight" in stages[1].params
    assert "head.weight" not in stages[0].params + stages[1].params
    torch.testing.assert_close(_run_chain(stages, batch), model(*batch), rtol=0, atol=0)


def test_llama_cut_sends_rotary_tables_to_every_later_stage() -> None:
    torch.manual_seed(0)
    model = llama(layers=4)
    batch = _batch()
    stages = cut_stages(model, unlifted_graph(model, batch), 3)
    assert sum(len(st.blocks) for st in stages) == 4 and all(st.blocks for st in stages)
    # the last stage reads values the first made without passing through the middle one
    assert any(src == 0 for src, _ in stages[2].inputs)
    # only the hidden state carries a gradient back; the rotary tables are made under
    # no_grad and the mask is boolean
    carried = [v.requires_grad for v in stages[2].input_vals if v is not None]
    assert carried.count(True) == 1, carried
    torch.testing.assert_close(_run_chain(stages, batch), model(*batch), rtol=0, atol=0)


def test_too_many_stages_and_a_model_without_a_loss_are_refused() -> None:
    model = GPT(layers=2)
    batch = _batch()
    with pytest.raises(shardc.ShardcError, match="it has 2 .*at most 2 stages"):
        cut_stages(model, unlifted_graph(model, batch), 3)

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    x = torch.randn(4, 8)
    with pytest.raises(shardc.ShardcError, match="returns its loss, one floating-point scalar"):
        cut_stages(Logits(), unlifted_graph(Logits(), (x,)), 2)


class _Unrepeated(nn.Module):
    """No two layers of one class in a row: nothing for the default cut to cut between.
    The head's input is also read by the loss's residual term, across a split."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.mix = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.mix(self.norm(h))
        return F.cross_entropy(self.head(h), y) + h.pow(2).mean() * 1e-2


def _unrepeated_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def test_split_points_cut_a_model_without_repeated_blocks() -> None:
    """``split_points``: stage i begins at the first op of the i-th named module; what runs
    between two named modules (the residual add outside any of them) is the earlier
    stage's, and a value read across two stages is sent to each reader."""
    torch.manual_seed(0)
    model, batch = _Unrepeated(), _unrepeated_batch()
    gm = unlifted_graph(model, batch)
    with pytest.raises(shardc.ShardcError, match="it has 0.*split_points"):
        cut_stages(model, gm, 2)
    stages = cut_stages(model, gm, 3, split_points=("mix", "head"))
    assert [st.begins for st in stages] == [None, "mix", "head"]
    assert stages[0].params == ["embed.bias", "embed.weight", "norm.bias", "norm.weight"]
    assert stages[1].params == ["mix.0.bias", "mix.0.weight", "mix.2.bias", "mix.2.weight"]
    assert stages[2].params == ["head.bias", "head.weight"]
    # the residual h comes to stage 2 from stage 1, which made it (the add runs there)
    assert any(src == 1 for src, _ in stages[2].inputs)
    torch.testing.assert_close(_run_chain(stages, batch), model(*batch), rtol=0, atol=0)
    # a point inside a repeated block: that block is no stage's to recompute
    gpt = GPT(layers=4)
    cut = cut_stages(gpt, unlifted_graph(gpt, _batch()), 2, split_points=("blocks.1.ln2",))
    assert cut[0].blocks == ["blocks.0"] and cut[1].blocks == ["blocks.2", "blocks.3"]
    torch.testing.assert_close(_run_chain(cut, _batch()), gpt(*_batch()), rtol=0, atol=0)


@pytest.mark.parametrize("points,text", [
    (("mix",), "names 1 module.*begin 2 stages.*needs 3"),
    (("mixer", "head"), "'mixer' is not a module of _Unrepeated.*did you mean 'mix'"),
    (("head", "mix"), "follow the order forward runs them.*'mix' starts before 'head'"),
    (("embed", "head"), "nothing runs before 'embed'"),
    (("mix", "mix.0"), "'mix.0' starts with 'mix'"),
])
def test_bad_split_points_are_refused_by_name(points: tuple, text: str) -> None:
    model, batch = _Unrepeated(), _unrepeated_batch()
    with pytest.raises(shardc.ShardcError, match=text):
        cut_stages(model, unlifted_graph(model, batch), 3, split_points=points)


@pytest.mark.parametrize("value,error,text", [
    ("mix", shardc.OptionTypeError, "tuple of module names"),
    ((), shardc.OptionError, "at least one module"),
    (("mix", "mix"), shardc.OptionError, "each once"),
    (("mix", 3), shardc.OptionTypeError, "tuple of module names"),
])
def test_split_points_option_is_checked(value, error, text) -> None:
    with pytest.raises(error, match=text):
        shardc.Options(split_points=value)


def test_balance_minimises_the_most_expensive_stage() -> None:
    assert balance([1, 1, 1, 1], [0] * 4, 2) == [0, 2]
    assert balance([4, 1, 1, 1, 1], [0] * 5, 2) == [0, 1]
    assert balance([1, 1, 1, 1, 1, 1], [0] * 6, 3) == [0, 2, 4]
    # equal FLOPs: the bytes decide
    assert balance([1, 1, 1], [10, 1, 1], 2) == [0, 1]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 2), (4, 16)])
def test_schedules_run_each_micro_batch_once_in_order(schedule: str, p: int, m: int) -> None:
    split = schedule == "zero_bubble"
    for s in range(p):
        acts = actions(schedule, p, s, m)
        kinds = ("F", "B", "W") if split else ("F", "B")
        assert sorted(acts) == sorted((kind, k) for kind in kinds for k in range(m))
        for k in range(m):
            assert acts.index(("F", k)) < acts.index(("B", k))
            if split:
                assert acts.index(("B", k)) < acts.index(("W", k))
        # activations held (F done, backward not finished): 1F1B at most p - s, GPipe
        # all, zero bubble at most p (1F1B's first stage's, ZB-H1's memory)
        live = peak = ahead = most_ahead = 0
        for kind, _ in acts:
            live += 1 if kind == "F" else -1 if kind == ("W" if split else "B") else 0
            ahead += 1 if kind == "F" else -1 if kind == "B" else 0
            peak, most_ahead = max(peak, live), max(most_ahead, ahead)
        want = {"1f1b": min(p - s, m), "gpipe": m, "zero_bubble": min(p, m)}[schedule]
        assert peak <= want and (split or peak == want)
        if split:
            assert most_ahead <= p - s


def test_zero_bubble_has_less_bubble_than_1f1b() -> None:
    for p, m in [(2, 4), (4, 4), (4, 8), (4, 16)]:
        zb, ofob = bubble_fraction("zero_bubble", p, m), bubble_fraction("1f1b", p, m)
        # ZB-H1: about a third of 1F1B's bubble when F = B = W (the simulated order)
        assert zb < 0.75 * ofob, (p, m, zb, ofob)


def test_bubble_formula() -> None:
    assert bubble_fraction("1f1b", 4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction("gpipe", 2, 8) == pytest.approx(1 / 9)


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (2, 3, 2), (3, 2, 6), (4, 2, 4), (4, 2, 8),
                                   (4, 3, 12), (8, 2, 16), (2, 1, 4)])
def test_interleaved_order(p: int, v: int, m: int) -> None:
    """Each rank runs every (micro-batch, chunk) forward once and its backward once after
    it; the orders of all ranks together never deadlock (sends do not block); the bubble
    with equal chunks (F 1, B 2) is Megatron's (p-1)/(v*m + p-1), v times less than
    1F1B's pipe of p stages; and a rank holds at most 2(p-r-1) + (v-1)p + 1 chunks'
    activations (its warm-up forwards, then one in flight)."""
    orders = [chunk_actions("interleaved", p, r, m, v) for r in range(p)]
    for r, acts in enumerate(orders):
        assert sorted(acts) == sorted((kind, k, c) for kind in "FB" for k in range(m) for c in range(v))
        for k in range(m):
            for c in range(v):
                assert acts.index(("F", k, c)) < acts.index(("B", k, c))
        live = peak = 0
        for kind, _, _ in acts:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak <= min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)
    simulate(orders, p, v, {"F": 1, "B": 2})  # raises on a deadlock
    assert bubble_fraction("interleaved", p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))
    assert bubble_fraction("interleaved", p, m, v) <= bubble_fraction("1f1b", p, m)


def test_simulate_finds_a_deadlock() -> None:
    # stage 1 asks for micro-batch 1 before 0, stage 0 sends 0 first but then waits for
    # backward 0, which stage 1 runs only after forward 1
    orders = [[("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)],
              [("F", 1, 0), ("B", 1, 0), ("F", 0, 0), ("B", 0, 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(orders, 2, 1, {"F": 1, "B": 1})


def test_messages_are_taken_in_the_senders_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that asks for the second message of a link first receives the first into
    keeping (the link delivers in the sender's order), hands it out when asked, and takes
    a message to another chunk of its own rank from memory, counting no bytes."""
    wire = [torch.full((2,), 1.0), torch.full((3,), 2.0)]  # what the peer sent, in its order
    p2p = P2P(shardc.Mesh.parse("p2x1y1z1d1"), 0)

    def recv(shape: tuple, dtype: torch.dtype, device: torch.device, stage: int, phase: str) -> torch.Tensor:
        got = wire.pop(0)
        assert tuple(got.shape) == tuple(shape) and stage == 1
        return got

    monkeypatch.setattr(p2p, "recv", recv)
    p2p.expect({1: [("a", (2,), torch.float32), ("b", (3,), torch.float32)]})
    assert p2p.take("b", 1, torch.device("cpu"), "backward").tolist() == [2.0] * 3
    assert p2p.take("a", 1, torch.device("cpu"), "forward").tolist() == [1.0] * 2
    mine = torch.ones(4)
    p2p.send(mine, 0, "forward", key="c")
    mine.add_(1)  # the writer's tensor moves on; the reader has the value sent
    assert p2p.take("c", 0, torch.device("cpu"), "forward").tolist() == [1.0] * 4
    assert not p2p.sent
    with pytest.raises(RuntimeError, match="sends no message"):
        p2p.take("d", 1, torch.device("cpu"), "forward")


class _Summed(GPT):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.tok(idx))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


class _Squares(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return ((x - y) ** 2).mean()


class _SummedSquares(_Squares):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return 0.5 * ((x - y) ** 2).sum() + 3.0


class _MaskedMean(_Squares):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        keep = (y > 0).to(x.dtype)
        return (((x - y) ** 2) * keep).sum() / keep.sum()


class _BatchNormed(_Squares):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.norm(x), y)


def _rule(model: nn.Module, batch: tuple) -> tuple:
    gm = unlifted_graph(model, batch)
    terms, why = loss_terms(gm)
    return _loss_rule(gm, terms) + (why,)


def test_loss_rule_is_read_from_the_traced_loss() -> None:
    batch = _batch()
    kind, counter, why = _rule(GPT(layers=2), batch)
    assert kind == "count" and counter is not None and why is None
    targets = batch[1].clone()
    targets[0, :5] = -100
    assert int(counter(batch[0], targets)) == targets.numel() - 5
    assert _rule(_Summed(layers=2), batch)[0] == "sum"
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    assert _rule(_Squares(), (x, y)) == ("mean", None, None)
    # a sum over rows written by hand (scaled, plus a constant) adds micro-batches' losses
    assert _rule(_SummedSquares(), (x, y)) == ("sum", None, None)
    # no combination of micro-batches' losses gives these: averaged, and said why
    kind, _, why = _rule(_MaskedMean(), (x, y))
    assert kind == "mean" and why is not None and "reduces over the batch's rows" in why
    kind, _, why = _rule(_BatchNormed(), (x, y))
    assert kind == "mean" and why is not None and "batch_norm" in why


def test_pipeline_options_are_checked() -> None:
    with pytest.raises(shardc.OptionError, match="microbatches must be >= 1"):
        shardc.Options(microbatches=0)
    with pytest.raises(TypeError, match="microbatches=2.0 must be an int"):
        shardc.Options(microbatches=2.0)
    with pytest.raises(shardc.OptionError, match="schedule='pipedream' is not one of"):
        shardc.Options(schedule="pipedream")
    assert shardc.Options(schedule="gpipe", microbatches=4).microbatches == 4
    # the interleaved schedule's chunks a rank: 2 unless virtual_stages says, and only there
    assert shardc.Options(schedule="interleaved").chunks == 2
    assert shardc.Options(schedule="interleaved", virtual_stages=3).chunks == 3
    assert shardc.Options(schedule="1f1b", virtual_stages=1).chunks == 1
    with pytest.raises(shardc.OptionError, match="virtual_stages=2 with schedule='gpipe'"):
        shardc.Options(schedule="gpipe", virtual_stages=2)
    with pytest.raises(shardc.OptionError, match="virtual_stages must be >= 1"):
        shardc.Options(schedule="interleaved", virtual_stages=0)
    with pytest.raises(TypeError, match="virtual_stages='2' must be an int"):
        shardc.Options(schedule="interleaved", virtual_stages="2")


def test_split_points_without_stages_are_refused(fake_world) -> None:
    """A mesh without a pipe axis has no stages to begin; mesh="auto" picks its own stage
    count, which named points would contradict."""
    fake_world(2)
    model, batch = _Unrepeated(), _unrepeated_batch()
    with pytest.raises(shardc.OptionError, match="has none \\(pipe=1\\)"):
        shardc.compile(model, "x1y1z1d2", batch, split_points=("mix",))
    with pytest.raises(shardc.OptionError, match="fixes 2 pipeline stages"):
        shardc.compile(model, "auto", batch, machine=shardc.Machine.preset("local"), split_points=("mix",))
