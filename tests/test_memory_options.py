"""One-process tests (fake process group) of the memory and precision options' guards:
what is not built is refused by name, autocast around compile is refused, and a model's
own torch.utils.checkpoint calls are honoured (or, where they cannot be, named) instead of
silently dropped."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from models import GPT, MLPChain
from torch.utils.checkpoint import checkpoint

import shardc
from shardc.core.compat import RECOMPUTE_COMPILED_FROM, torch_version

pytestmark: list = []  # one process, fast: the fast tier


def _mlp() -> tuple[nn.Module, tuple]:
    return MLPChain(dim=16, layers=2), (torch.randn(8, 16), torch.randn(8, 16))


@pytest.mark.parametrize("kw, err, match", [
    ({"activation_checkpoint": {"save": ["aten.mm"]}}, ValueError,
     "or a shardc.Selective"),
    ({"activation_checkpoint": "everything"}, ValueError, "not one of"),
    ({"activation_checkpoint": shardc.Selective(save=["aten.mm"]), "backend": "inductor",
      "step_graph": False}, ValueError, "selective recompute .* inside the step program"),
    ({"precision": "fp16"}, ValueError, "precision='fp16' is not one of"),
    ({"shard_optimizer": "yes"}, TypeError, r"option shard_optimizer=.yes. must be a bool \(True or False\)"),
])
def test_options_not_built_are_refused(fake_world, kw: dict, err: type, match: str) -> None:
    fake_world(4)
    model, inputs = _mlp()
    with pytest.raises(err, match=match):
        shardc.compile(model, shardc.Mesh(x=2, data=2), inputs, **kw)


def test_selective_policy_names_real_ops() -> None:
    assert "aten.mm" in shardc.Selective().save
    assert shardc.Selective(save=["aten.mm"]).save == ("aten.mm",)
    with pytest.raises(ValueError, match="'aten.matmull' name no op"):
        shardc.Selective(save=["aten.mm", "aten.matmull"])
    with pytest.raises(ValueError, match="'mm' name no op"):
        shardc.Selective(save=["mm"])
    with pytest.raises(TypeError, match="save=\\['aten.mm'\\]"):
        shardc.Selective(save="aten.mm")


def test_defaults_compile(fake_world) -> None:
    fake_world(4)
    model, inputs = _mlp()
    sm = shardc.compile(model, shardc.Mesh(x=2, data=2), inputs, activation_checkpoint="none",
                        precision="fp32", shard_optimizer=False)
    assert sm.ctx.options.precision == shardc.Precision(torch.float32, torch.float32)


def test_autocast_around_compile_is_refused(fake_world) -> None:
    fake_world(4)
    model, inputs = _mlp()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(shardc.ShardcError, match=r"torch.autocast is active \(cpu, torch.bfloat16\)"):
            shardc.compile(model, shardc.Mesh(z=4), inputs)


class Checkpointed(nn.Module):
    """Blocks wrapped in torch.utils.checkpoint, both forms, as users write them."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = GPT(layers=3)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        m = self.inner
        x = m.tok(idx) + m.pos(torch.arange(idx.shape[1]))
        x = checkpoint(m.blocks[0], x, use_reentrant=False)
        x = checkpoint(m.blocks[1].forward, x, use_reentrant=True)
        x = m.blocks[2](x)
        logits = m.head(m.ln_f(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class CheckpointedFunction(Checkpointed):
    """A checkpointed function (not a submodule): the program cannot cut it out."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        m = self.inner
        x = m.tok(idx) + m.pos(torch.arange(idx.shape[1]))
        x = checkpoint(lambda h: m.blocks[1](m.blocks[0](h)), x, use_reentrant=False)
        x = m.blocks[2](x)
        logits = m.head(m.ln_f(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class CheckpointedModules(Checkpointed):
    """Non-reentrant checkpoint on two submodules."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        m = self.inner
        x = m.tok(idx) + m.pos(torch.arange(idx.shape[1]))
        x = checkpoint(m.blocks[0], x, use_reentrant=False)
        x = checkpoint(m.blocks[1], x, use_reentrant=False)
        x = m.blocks[2](x)
        logits = m.head(m.ln_f(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_model_recompute_calls_are_honoured(fake_world, backend: str) -> None:
    """Checkpoint on submodules: those blocks are recomputed (and said so); nothing is
    lost, so nothing warns. Under inductor the segments run compiled (on a torch older than
    the one that was verified, the calls are named as not honoured)."""
    fake_world(4)
    tokens = torch.randint(0, 64, (8, 16))
    if backend == "inductor" and torch_version() < RECOMPUTE_COMPILED_FROM:
        with pytest.warns(shardc.ShardcWarning, match=r"inner.blocks.0, inner.blocks.1, which .* "
                          r"backend='inductor' on torch older than"):
            sm = shardc.compile(CheckpointedModules(), shardc.Mesh(x=2, z=2), (tokens, tokens),
                                backend=backend)
        assert sm._recompute is None
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardc.ShardcWarning)
        sm = shardc.compile(CheckpointedModules(), shardc.Mesh(x=2, z=2), (tokens, tokens), backend=backend)
    assert sm._recompute is not None
    assert len(sm._recompute_programs) == (len(list(sm._recompute.children())) if backend == "inductor" else 0)
    assert any("inner.blocks.0, inner.blocks.1" in d for d in sm.decisions), sm.decisions
    marked = {n.meta.get("shardc_recompute") for n in sm.graph_module.graph.nodes} - {None}
    assert marked == {"inner.blocks.0", "inner.blocks.1"}


def test_both_checkpoint_forms_are_recomputed(fake_world) -> None:
    """The reentrant form (an autograd.Function that runs its function under no_grad) on
    module.forward is traced as a call of the module, so its block is cut out and
    recomputed like the non-reentrant one's, and no no_grad region cuts its gradient."""
    fake_world(4)
    tokens = torch.randint(0, 64, (8, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardc.ShardcWarning)
        sm = shardc.compile(Checkpointed(), shardc.Mesh(x=2, z=2), (tokens, tokens))
    marked = {n.meta.get("shardc_recompute") for n in sm.graph_module.graph.nodes} - {None}
    assert marked == {"inner.blocks.0", "inner.blocks.1"}
    assert not any(n.target is torch.ops.aten.detach.default for n in sm.graph_module.graph.nodes)


def test_model_recompute_calls_that_cannot_be_honoured_are_named(fake_world) -> None:
    fake_world(4)
    tokens = torch.randint(0, 64, (8, 16))
    with pytest.warns(shardc.ShardcWarning, match=r"torch.utils.checkpoint on .*<lambda>.* "
                      r"cannot recompute"):
        sm = shardc.compile(CheckpointedFunction(), shardc.Mesh(x=2, z=2), (tokens, tokens))
    assert sm._recompute is None
    # with an option that runs the step program, the submodules' calls are named too
    with pytest.warns(shardc.ShardcWarning, match=r"inner.blocks.0, inner.blocks.1, which the "
                      r"compiled program cannot recompute"):
        sm = shardc.compile(Checkpointed(), shardc.Mesh(x=2, z=2), (tokens, tokens),
                            reshard_after_forward=True)
    assert sm._recompute is None
    # and the hook is gone after the trace: a plain model warns nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error", shardc.ShardcWarning)
        shardc.compile(GPT(), shardc.Mesh(x=2, z=2), (tokens, tokens))
    assert torch.utils.checkpoint._checkpoint_without_reentrant_generator.__module__ == "torch.utils.checkpoint"
