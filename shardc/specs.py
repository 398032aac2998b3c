"""Ready-made SPECs for the command line: each returns (model, example_inputs)."""
from __future__ import annotations

import torch

from shardc.models import GPT, MLPChain, lm_batch


def mlp_chain() -> tuple[torch.nn.Module, tuple]:
    """The bias-free 6-linear MLP chain of the tests (hidden 64, batch 32)."""
    torch.manual_seed(0)
    return MLPChain(dim=64, layers=6), (torch.randn(32, 64), torch.randn(32, 64))


def gpt_small() -> tuple[torch.nn.Module, tuple]:
    """The tests' plain-torch GPT (fused QKV with bias, tied head), batch 8 x 16."""
    torch.manual_seed(0)
    return GPT(), lm_batch(8, 16, 64)


def gpt_peer() -> tuple[torch.nn.Module, tuple]:
    """The peers' GPT: 4 blocks, hidden 256, 4 heads, seq 64, vocab 512, batch 16."""
    torch.manual_seed(0)
    return GPT.peer(), lm_batch(16, 64, 512)


def _paper(name: str, batch: int) -> tuple[torch.nn.Module, tuple]:
    with torch.device("meta"):
        model = GPT.paper(name)
    tokens = torch.zeros(batch, 2048, dtype=torch.long, device="meta")
    return model, (tokens, tokens)


def gpt_paper_20b() -> tuple[torch.nn.Module, tuple]:
    """GPT-20B's shape (32 layers, hidden 7168, 56 heads), meta tensors, batch 4096 x 2048."""
    return _paper("gpt-20b", 4096)


def gpt_paper_40b() -> tuple[torch.nn.Module, tuple]:
    return _paper("gpt-40b", 4096)


def gpt_paper_320b() -> tuple[torch.nn.Module, tuple]:
    return _paper("gpt-320b", 32768)
