"""Models the tests train: written for one device, never for shardc."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLPChain(nn.Module):
    """Bias-free linears with GELU between them, mean-squared-error loss."""

    def __init__(self, dim: int = 16, layers: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim, bias=False) for _ in range(layers)])

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return F.mse_loss(x, target)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)  # fused, with bias
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    """A plain-torch GPT: learned positions, pre-LN blocks, tied LM head, CE loss."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 8,
                 seq: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.drop = nn.Dropout(dropout)
        for n, p in self.named_parameters():
            if n.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02 if "fc2" not in n and "proj" not in n
                                else 0.02 / math.sqrt(2 * layers))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class HFCausalLM(nn.Module):
    """A transformers causal LM returning its own loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def gpt2(vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 8, seq: int = 16,
         dropout: float = 0.0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=dim, n_layer=layers, n_head=heads,
                     use_cache=False, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return HFCausalLM(GPT2LMHeadModel(cfg))
