"""Ready-made SPECs for the command line: each returns (model, example_inputs)."""
from __future__ import annotations

import torch

from shardc.tools.models import GPT, MLPChain, lm_batch


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


def paper_gpt(name: str, batch: int = 512, seq: int = 2048) -> tuple[torch.nn.Module, tuple]:
    """A GPT of the AxoNN paper's Table II in bf16 on the meta device (no weights are
    allocated), with a global batch of ``batch`` sequences of ``seq`` tokens."""
    with torch.device("meta"):
        model = GPT.paper(name, seq=seq).to(torch.bfloat16)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (tokens, tokens)


def gpt_paper_20b() -> tuple[torch.nn.Module, tuple]:
    """GPT-20B's shape (32 layers, hidden 7168, 56 heads), bf16, 512 x 2048 tokens."""
    return paper_gpt("gpt-20b")


def gpt_paper_40b() -> tuple[torch.nn.Module, tuple]:
    """GPT-40B's shape (38 layers, hidden 9216, 72 heads), bf16, 512 x 2048 tokens."""
    return paper_gpt("gpt-40b")


def gpt_paper_320b() -> tuple[torch.nn.Module, tuple]:
    """GPT-320B's shape (96 layers, hidden 16384, 128 heads), bf16, 16384 x 2048 tokens."""
    return paper_gpt("gpt-320b", batch=16384)


# Planning needs a batch that fits in memory; the paper does not state its global batch
# for Fig. 2, so these use 32 (20B, 32 GPUs), 64 (40B, 64 GPUs) and 16,384 (320B, 32,768
# GCDs) sequences of 2,048 tokens.
def plan_gpt_20b() -> tuple[torch.nn.Module, tuple]:
    return paper_gpt("gpt-20b", batch=32)


def plan_gpt_40b() -> tuple[torch.nn.Module, tuple]:
    return paper_gpt("gpt-40b", batch=64)


def plan_gpt_320b() -> tuple[torch.nn.Module, tuple]:
    return paper_gpt("gpt-320b", batch=16384)
