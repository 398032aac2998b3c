"""Model FLOPs (shardc.planning.throughput): a hand count on the tests' GPT, and torch's own
FlopCounterMode on a real forward and backward."""
from __future__ import annotations

import pytest
import torch
from models import GPT, gpt2
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from shardc.planning.throughput import gpu_peak_flops, model_flops, throughput
from shardc.tools.models import lm_batch

pytestmark: list = []  # one process, fast: the fast tier


def test_gpt_flops_equal_a_hand_count() -> None:
    torch.manual_seed(0)
    model = GPT(vocab=64, dim=32, layers=2, heads=8, seq=16)  # fused qkv, tied head
    batch = lm_batch(8, 16, 64)
    f = model_flops(model, batch)
    d, v, L, S, T = 32, 64, 2, 16, 8 * 16
    # per block: qkv d x 3d, proj d x d, fc1 d x 4d, fc2 4d x d; the head is the tied
    # embedding d x v, a GEMM (the lookup multiplies nothing)
    n = L * (d * 3 * d + d * d + d * 4 * d + 4 * d * d) + d * v
    assert f.matmul_params == n == 26624
    assert (f.layers, f.seq, f.hidden, f.tokens) == (L, S, d, T)
    assert f.gemm_flops == 6 * n * T
    assert f.attention_flops == 12 * L * S * d * T
    assert f.per_token == 6 * n + 12 * L * S * d


@pytest.mark.parametrize("make", [GPT, GPT.peer, gpt2], ids=["gpt", "gpt_peer", "hf_gpt2"])
def test_flops_equal_flop_counter_on_forward_and_backward(make) -> None:
    """FlopCounterMode counts the matmul-class ops a real step runs (mm, addmm, bmm, the
    attention kernels it knows), never softmax, norms or the loss, nor does our formula:
    so the two agree exactly, GEMMs and attention separately. Attention runs in the math
    backend (two bmm, each counted): the fused CPU kernel is not in FlopCounterMode's
    table here, which would leave exactly the attention term uncounted."""
    torch.manual_seed(0)
    model = make()
    vocab = model.tok.num_embeddings if isinstance(model, GPT) else 64
    seq = model.pos.num_embeddings if isinstance(model, GPT) else 16
    batch = lm_batch(8, seq, vocab)
    f = model_flops(model, batch)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(*batch).backward()
    by_op = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert counter.get_total_flops() == f.per_step
    assert by_op.get("aten.mm", 0) + by_op.get("aten.addmm", 0) == f.gemm_flops
    assert by_op.get("aten.bmm", 0) == f.attention_flops


def test_peak_table_picks_the_specific_name_first() -> None:
    bf16 = torch.bfloat16
    # "H100" alone would also match the PCIe and NVL cards (lower clocks, fewer SMs)
    assert gpu_peak_flops("NVIDIA H100 PCIe", bf16) < gpu_peak_flops("NVIDIA H100 80GB HBM3", bf16)
    assert gpu_peak_flops("NVIDIA H100 NVL", bf16) < gpu_peak_flops("NVIDIA H100 80GB HBM3", bf16)
    # fp32 GEMMs run on tensor cores only as tf32
    a100 = "NVIDIA A100-SXM4-80GB"
    assert gpu_peak_flops(a100, torch.float32) < gpu_peak_flops(a100, torch.float32, tf32=True) \
        < gpu_peak_flops(a100, bf16)
    assert gpu_peak_flops("Some Future GPU", bf16) is None


def test_throughput_divides_the_step() -> None:
    torch.manual_seed(0)
    f = model_flops(GPT(), lm_batch(8, 16, 64))
    tp = throughput(f, step_s=0.5, world_size=4, peak_flops=1e9)
    assert tp.tokens_per_s_per_rank == 128 / 0.5 / 4
    assert tp.mfu == f.per_step / 0.5 / 1e9
