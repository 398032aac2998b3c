"""Routing regions (passes/rules/routing.py): a mixture of experts that sorts its
token-expert pairs by expert, runs one GEMM per expert over the sorted rows and puts the
rows back in their order keeps each rank's tokens on that rank, instead of gathering the
batch for the sort. The analysis is checked one variant at a time on the traced graph
(which regions it takes and which it refuses), the lowering under the fake process group
(what the program moves); the numbers on gloo ranks against float64 are cases of
tests/test_more_models_gloo.py (Mixtral and GPT-OSS with transformers' default kernel, and
``Routed`` below)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardc
from shardc.passes.rules.routing import find_regions
from shardc.passes.trace import trace

pytestmark: list = []  # one process, fast: the fast tier


def _fallback_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    import transformers.integrations.moe  # noqa: F401 (registers the op)

    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


def _aten_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=offs)


class Routed(nn.Module):
    """Top-2 of 4 experts, dispatched as transformers' grouped_mm kernel does, in torch
    alone. ``norm`` puts a layer norm between the two GEMMs (row-wise: still a region).
    Any other ``variant`` reads the sorted order somewhere, which must keep the sort whole:
    ``descending`` (offsets of an ascending histogram no longer match the rows),
    ``aux`` (the rank's own counts in a load-balancing term), ``cumsum`` (a running sum
    over the sorted rows), ``unbounded`` (keys of unknown range: the histogram may drop
    some)."""

    def __init__(self, variant: str = "", grouped=_fallback_grouped_mm, dim: int = 8,
                 hidden: int = 16, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.variant, self.grouped, self.k, self.experts = variant, grouped, k, experts
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, dim, hidden, generator=g) * 0.3)
        self.down = nn.Parameter(torch.randn(experts, hidden, dim, generator=g) * 0.3)
        self.bias = nn.Parameter(torch.randn(experts, hidden, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = x.reshape(-1, d)
        probs = self.router(h).softmax(-1)
        w, idx = torch.topk(probs, self.k, dim=-1)
        flat = idx.reshape(-1)
        if self.variant == "unbounded":
            flat = (h.detach().abs().sum(-1) * 3).long().repeat_interleave(self.k)
        keys, perm = torch.sort(flat, descending=self.variant == "descending")
        rows = h[perm // self.k]
        weights = w.reshape(-1)[perm]
        counts = torch.histc(keys.float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        y = F.silu(self.grouped(rows, self.up, offs) + self.bias[keys])
        if self.variant == "norm":  # row-wise, and a node of several outputs
            y = F.layer_norm(y, (y.shape[-1],))
        y = self.grouped(y, self.down, offs) * weights.unsqueeze(-1)
        if self.variant == "cumsum":
            y = y.cumsum(0)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        out = y[inv].view(-1, self.k, d).sum(1).view(b, s, d)
        loss = (x + out).pow(2).mean()
        if self.variant == "aux":
            loss = loss + (counts * probs.mean(0)).sum() * 1e-2
        return loss


def _batch() -> tuple[torch.Tensor]:
    return (torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(1)),)


def _regions(model: nn.Module, dtype: torch.dtype = torch.float32) -> list:
    ep = trace(model.to(dtype), tuple(t.to(dtype) for t in _batch()), dtype)
    return find_regions(ep.graph if hasattr(ep, "graph") else ep.graph_module.graph)


@pytest.mark.parametrize("variant", ["", "norm"])
def test_a_sort_undone_before_its_order_is_read_is_a_region(variant: str) -> None:
    (region,) = _regions(Routed(variant))
    assert region.n == 8 * 4 * 2
    assert len(region.exits) == 1  # y[inv]
    kinds = {k for k, _ in region.kinds.values()}
    assert kinds == {"rows", "idx", "empty", "counts", "offs", "inv"}


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch < 2.8 has no _grouped_mm")
def test_torch_grouped_mm_is_a_grouped_gemm_of_the_region() -> None:
    """The kernel a CUDA bf16 run traces (transformers calls it when torch has it; its
    shape function takes bf16 only)."""
    assert len(_regions(Routed(grouped=_aten_grouped_mm), torch.bfloat16)) == 1


@pytest.mark.parametrize("variant", ["descending", "aux", "cumsum", "unbounded"])
def test_a_sort_whose_order_is_read_is_no_region(variant: str) -> None:
    assert _regions(Routed(variant)) == []


def _sort_collectives(sm: shardc.ShardedModule) -> list:
    """Collectives of the routing's activations (a parameter's gather over z, the
    experts' bias looked up by key, is FSDP's and stays)."""
    return [r for r in shardc.comm_report(sm).rows if r.param is None
            and r.op in ("aten.sort.default", "aten.index.Tensor", "aten.histc.default")]


@pytest.mark.parametrize("spec", ["x1y1z1d4", "x2y1z1d2", "x1y1z2d2"])
def test_routing_keeps_the_tokens_on_their_rank(fake_world, spec: str) -> None:
    """Nothing of the routing travels (once: the sorted keys and the tokens gathered over
    the batch axes in forward, 4x the experts' work a rank on d4); explain says why."""
    fake_world(4)
    sm = shardc.compile(Routed(), shardc.Mesh.parse(spec), _batch())
    assert _sort_collectives(sm) == []
    assert any("sorts its own rows" in d for d in sm.decisions)
    assert "sorts its own rows" in shardc.explain(sm)


def test_a_refused_region_still_sorts_the_whole_batch(fake_world) -> None:
    """The counts read by a load-balancing term are the global batch's: the sort runs on
    the gathered keys, as before regions existed."""
    fake_world(4)
    sm = shardc.compile(Routed("aux"), shardc.Mesh.parse("x1y1z1d4"), _batch())
    assert any(r.op == "aten.sort.default" and r.collective == "all_gather"
               for r in _sort_collectives(sm))
    assert not any("sorts its own rows" in d for d in sm.decisions)


def test_mixtral_default_kernel_keeps_the_tokens_on_their_rank(fake_world) -> None:
    """transformers' Mixtral as configured by default: its experts' grouped_mm kernel."""
    import test_more_models_gloo as M
    import test_train_gloo as T

    fake_world(4)
    make, batches = T._lm(M.MODELS["mixtral"][0])
    sm = shardc.compile(make(), shardc.Mesh.parse("x1y1z1d4"), batches[0])
    assert _sort_collectives(sm) == []
    # one region a layer
    assert sum("sorts its own rows" in d for d in sm.decisions) == 2
