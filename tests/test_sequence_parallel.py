"""Sequence parallelism (``sequence_parallel``, passes/rules/sequence.py) in one process:
where the compiler applies it, what it leaves alone, and its bytes against Algorithm 1's
all-reduces, exactly, from the comm report. Training with it on real gloo ranks is
tests/test_sequence_parallel_gloo.py."""
from __future__ import annotations

import math

import pytest
import torch
from models import GPT, MLPChain, gpt2, llama
from torch import nn

import shardc
from shardc.core.context import PLACEMENT
from shardc.core.errors import OptionTypeError
from shardc.tools.cli import compile_offline

pytestmark: list = []  # one process, fast: the fast tier

TOKENS = (torch.randint(0, 64, (8, 16)),) * 2


def _pair(model_fn, mesh: str, inputs: tuple = TOKENS, **kw):
    return (compile_offline(model_fn(), inputs, mesh, sequence_parallel=False, **kw),
            compile_offline(model_fn(), inputs, mesh, **kw))


def _bytes(sm, **where) -> int:
    return shardc.comm_report(sm).total_bytes(**where)


def _norm_inputs(sm) -> list:
    return [n.args[0].meta[PLACEMENT] for n in sm.graph_module.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten.layer_norm.default]


# every mesh of 8 with a tensor axis, and one with context
MESHES = [m for m in shardc.Mesh.all(8) if m.x > 1 or m.y > 1] + [shardc.Mesh.parse("x2y1c2z1d2")]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_gpt_moves_algorithm_1s_bytes_plus_the_norm_and_bias_gradient_sums(mesh: shardc.Mesh) -> None:
    """A reduce-scatter and the next GEMM's all-gather move what the all-reduce moved; a
    layer norm whose features y cuts also sums fewer tokens' statistics. What sequence
    parallelism adds is the sum over x (or y) of the gradients of the weights applied to
    cut tokens (norm scale and shift, the row-parallel GEMM's bias): each is exactly
    2 (G-1)/G of the parameter's bytes on that axis, after backward."""
    base, sp = _pair(GPT, mesh)
    base_rep, sp_rep = shardc.comm_report(base), shardc.comm_report(sp)
    for phase in ("forward", "backward"):
        assert sp_rep.total_bytes(phase=phase) <= base_rep.total_bytes(phase=phase), phase
    old = {(r.param, r.axis) for r in base_rep.rows if r.phase == "step"}
    added = [r for r in sp_rep.rows if r.phase == "step" and (r.param, r.axis) not in old]
    params = dict(GPT().named_parameters())
    for r in added:
        assert r.collective == "all_reduce" and r.axis in ("x", "y"), r
        assert r.param.split(".")[-2] in ("ln1", "ln2", "ln_f", "proj", "fc2"), r
        g = mesh.size(r.axis)
        p = params[r.param]
        # the rank's stored piece (z cuts storage: that sum runs on the piece)
        stored = math.prod(sp.param_layouts[r.param].local_shape(list(p.shape), mesh))
        assert r.bytes == 2 * (g - 1) * stored * p.element_size() // g, r
    same = [r for r in sp_rep.rows if r.phase == "step" and (r.param, r.axis) in old]
    assert sum(r.bytes for r in same) == base_rep.total_bytes(phase="step")
    if mesh.x > 1:
        assert added and any("sequence parallel" in d for d in sp.decisions)


def test_gpt_on_x8_norms_run_on_an_eighth_of_the_tokens() -> None:
    base, sp = _pair(GPT, "x8y1z1d1")
    # the first block's first norm reads the embeddings, which the vocabulary-parallel
    # lookup leaves partial: reduce-scattered too, so every norm reads cut tokens
    assert all(lay.shard_dim("x") == 0 for lay in _norm_inputs(sp)), _norm_inputs(sp)
    assert all(lay.is_replicated("x") for lay in _norm_inputs(base))
    rep = shardc.comm_report(sp)
    fwd = {(r.module, r.collective) for r in rep.rows if r.phase == "forward" and r.axis == "x"}
    for blk in (0, 1):
        assert (f"blocks.{blk}.proj", "reduce_scatter") in fwd and (f"blocks.{blk}.fc2", "reduce_scatter") in fwd
        assert (f"blocks.{blk}.qkv", "all_gather") in fwd and (f"blocks.{blk}.fc1", "all_gather") in fwd
    assert ("head", "all_gather") in fwd
    # no activation all-reduce over x is left in forward: only the vocabulary-parallel
    # loss's row maxima and sums
    ar = [r for r in rep.rows if r.phase == "forward" and r.axis == "x" and r.collective == "all_reduce"]
    assert ar and all("cross_entropy" in r.op for r in ar), ar
    text = shardc.explain(sp)
    assert "sequence parallel" in text and "reduce-scattered onto dim 0" in text


@pytest.mark.parametrize("model_fn, mesh", [(llama, "x2y1z1d2"), (llama, "x4y1z1d1"), (gpt2, "x2y1z1d2"),
                                            (gpt2, "x4y1z1d1"), (llama, "x2y1c2z1d1")],
                         ids=["llama-x2d2", "llama-x4", "gpt2-x2d2", "gpt2-x4", "llama-x2c2"])
def test_transformers_models_cut_their_norms_at_no_more_activation_bytes(model_fn, mesh: str) -> None:
    """Llama (RMS norms made of pow and mean, no biases) and GPT-2 (Conv1D: its GEMMs
    flatten [B, S] into rows and view them back)."""
    base, sp = _pair(model_fn, mesh)
    for phase in ("forward", "backward"):
        assert _bytes(sp, phase=phase) <= _bytes(base, phase=phase), phase
    assert any("sequence parallel" in d for d in sp.decisions), sp.decisions
    rs = [r for r in shardc.comm_report(sp).rows if r.collective == "reduce_scatter" and r.axis == "x"
          and r.phase == "forward"]
    assert rs


def test_a_chain_of_gemms_without_norms_keeps_algorithm_1() -> None:
    """GEMM, activation, GEMM: the next GEMM keeps its gathered input for backward anyway,
    so cutting the activation saves little and adds a collective's latency; the paper's
    all-reduce stays (test_comm_report checks its equations on every mesh)."""
    inputs = (torch.randn(32, 16), torch.randn(32, 16))
    base, sp = _pair(MLPChain, "x2y2z2d1", inputs)
    assert shardc.comm_report(sp).rows == shardc.comm_report(base).rows
    assert not any("sequence parallel" in d for d in sp.decisions)


class Encoder(nn.Module):
    """Returns its hidden states: the residual stream reaches the output, which expects
    every token on every rank. Gathering them there would not be free as a GEMM's gather
    is: the output's gradient is whole on every rank, so in backward the all-reduce costs
    nothing, while the reduce-scatter's backward is an all-gather (1.5x the bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.ln = nn.Linear(32, 64), nn.Linear(64, 32), nn.LayerNorm(32)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln(h + self.down(torch.relu(self.up(h))))


class Pooled(nn.Module):
    """Mean over the sequence after the block: a reduction across tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.ln, self.head = nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.ln(h + self.down(torch.relu(self.up(h))))
        return self.head(h.mean(1)).square().mean()


@pytest.mark.parametrize("model_fn", [Encoder, Pooled])
def test_a_stream_that_leaves_the_gemms_keeps_the_all_reduce(model_fn) -> None:
    inputs = (torch.randn(4, 16, 32),)
    base, sp = _pair(model_fn, "x2y1z1d2", inputs)
    assert shardc.comm_report(sp).rows == shardc.comm_report(base).rows
    assert not any("sequence parallel" in d for d in sp.decisions)


def test_a_sequence_no_token_dim_divides_keeps_the_all_reduce() -> None:
    """Batch 1 of 3 tokens on x4: no token dim divides by 4."""
    def fn() -> nn.Module:
        return GPT(seq=3)
    inputs = (torch.randint(0, 64, (1, 3)),) * 2
    base, sp = _pair(fn, "x4y1z1d1", inputs)
    assert shardc.comm_report(sp).rows == shardc.comm_report(base).rows


def test_the_option_is_a_bool() -> None:
    with pytest.raises(OptionTypeError, match="sequence_parallel"):
        compile_offline(GPT(), TOKENS, "x2y1z1d1", sequence_parallel="yes")
