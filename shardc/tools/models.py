"""Reference models, written for one device and never for shardc: what the tests, the
demo, the benchmarks and ``shardc plan``'s presets compile. Nothing in the compiler
knows them."""
from __future__ import annotations

import math
from typing import Any

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
    def __init__(self, dim: int, heads: int, dropout: float, fused_qkv: bool = True,
                 bias: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.fused_qkv = fused_qkv
        self.ln1 = nn.LayerNorm(dim)
        if fused_qkv:
            self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        else:
            self.wq = nn.Linear(dim, dim, bias=bias)
            self.wk = nn.Linear(dim, dim, bias=bias)
            self.wv = nn.Linear(dim, dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim, bias=bias)
        self.fc2 = nn.Linear(4 * dim, dim, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.ln1(x)
        if self.fused_qkv:
            q, k, v = self.qkv(h).split(C, dim=2)
        else:
            q, k, v = self.wq(h), self.wk(h), self.wv(h)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    """A plain-torch GPT: learned positions, pre-LN blocks (fused QKV with bias by
    default), LM head tied to the token embedding, cross-entropy loss.

    ``GPT.peer()`` is the shape of ../shared/peers (separate bias-free q/k/v/o, untied).
    """

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 8,
                 seq: int = 16, dropout: float = 0.0, fused_qkv: bool = True, bias: bool = True,
                 tie: bool = True) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, dropout, fused_qkv, bias)
                                     for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.tok.weight
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

    @classmethod
    def peer(cls) -> "GPT":
        """4 blocks, hidden 256, 4 heads, seq 64, vocab 512: the peers' small GPT."""
        return cls(vocab=512, dim=256, layers=4, heads=4, seq=64, fused_qkv=False, bias=False,
                   tie=False)

    @classmethod
    def paper(cls, name: str, vocab: int = 51200, seq: int = 2048) -> "GPT":
        """The shapes of the AxoNN paper's Table II (build it under torch.device("meta"))."""
        layers, dim, heads = PAPER_SHAPES[name]
        return cls(vocab=vocab, dim=dim, layers=layers, heads=heads, seq=seq)


# the AxoNN paper's Table II: name -> (layers, hidden, heads)
PAPER_SHAPES = {
    "gpt-5b": (24, 4096, 32), "gpt-10b": (32, 5120, 40), "gpt-20b": (32, 7168, 56),
    "gpt-40b": (38, 9216, 72), "gpt-60b": (56, 9216, 72), "gpt-80b": (42, 12288, 96),
    "gpt-160b": (84, 12288, 96), "gpt-320b": (96, 16384, 128), "gpt-640b": (192, 16384, 128),
}


def lm_batch(batch: int, seq: int, vocab: int, step: int = 0, device: str | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic batch (the peers' arithmetic sequences): inputs, targets."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.tensor([1, 2, 3, 5, 7])[torch.randint(0, 5, (batch, 1), generator=g)]
    toks = (start + stride * torch.arange(seq + 1)) % vocab
    x, y = toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


class HFCausalLM(nn.Module):
    """A transformers causal LM returning its own loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def gpt2(vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 8, seq: int = 16,
         dropout: float = 0.0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415 - optional (the [test] extra installs transformers)

    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=dim, n_layer=layers, n_head=heads,
                     use_cache=False, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return HFCausalLM(GPT2LMHeadModel(cfg))


def llama(vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 8, kv_heads: int = 4,
          seq: int = 16) -> nn.Module:
    """transformers' LlamaForCausalLM: RMSNorm, rotary positions, grouped-query
    attention, SiLU-gated MLP, no biases, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415 - optional (the [test] extra installs transformers)

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=seq, use_cache=False,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return HFCausalLM(LlamaForCausalLM(cfg))


def opt(vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 8, seq: int = 16) -> nn.Module:
    """transformers' OPTForCausalLM: learned positions with an offset, biases, ReLU MLP, an
    embedding with a padding row, LM head tied to it."""
    from transformers import OPTConfig, OPTForCausalLM  # noqa: PLC0415 - optional (the [test] extra installs transformers)

    cfg = OPTConfig(vocab_size=vocab, hidden_size=dim, ffn_dim=2 * dim, num_hidden_layers=layers,
                    num_attention_heads=heads, max_position_embeddings=seq, word_embed_proj_dim=dim,
                    use_cache=False, dropout=0.0, attention_dropout=0.0, pad_token_id=1,
                    bos_token_id=2, eos_token_id=2)
    return HFCausalLM(OPTForCausalLM(cfg))


class LitGPTLM(nn.Module):
    """LitGPT's ``GPT`` (which returns logits) with the cross-entropy loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def litgpt_llama(vocab: int = 64, dim: int = 64, layers: int = 2, heads: int = 8,
                 query_groups: int = 8, seq: int = 16) -> nn.Module:
    """LitGPT's ``GPT`` in its Llama configuration: one fused QKV linear whose columns are
    laid out per query group (the group's q heads, then its k, then its v), RMSNorm,
    rotary positions, SiLU-gated MLP, no biases, untied head. ``query_groups == heads``
    is plain multi-head attention, fewer is grouped-query attention."""
    # optional, as transformers is: the tests install LitGPT, a user of the other models
    # and of the benchmarks need not
    from litgpt import Config  # noqa: PLC0415 - see above
    from litgpt.model import GPT as LitGPT  # noqa: PLC0415 - see above

    cfg = Config(name="shardc-tiny-llama", block_size=seq, vocab_size=vocab,
                 padded_vocab_size=vocab, n_layer=layers, n_embd=dim, n_head=heads,
                 n_query_groups=query_groups, rotary_percentage=1.0, parallel_residual=False,
                 bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                 intermediate_size=2 * dim)
    return LitGPTLM(LitGPT(cfg))


def gpt_neox(vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 8,
             seq: int = 16) -> nn.Module:
    """transformers' GPTNeoXForCausalLM: one fused ``query_key_value`` whose columns are
    interleaved per head (head h's q, k, v side by side, viewed as (heads, 3 * hd)),
    partial rotary, parallel residual, biases, untied head."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM  # noqa: PLC0415 - optional (the [test] extra installs transformers)

    # partial rotary under its legacy name: transformers 4.x takes it, 5.x maps it into
    # rope_parameters["partial_rotary_factor"] (so it is not in 5.x's typed signature)
    legacy: dict[str, Any] = {"rotary_pct": 0.5}
    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=2 * dim,
                        max_position_embeddings=seq, use_cache=False,
                        hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
                        bos_token_id=0, eos_token_id=0, **legacy)
    return HFCausalLM(GPTNeoXForCausalLM(cfg))


def gpt_bigcode(vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 8,
                seq: int = 16) -> nn.Module:
    """transformers' GPTBigCodeForCausalLM (StarCoder): multi-query attention through one
    fused ``c_attn`` of width dim + 2 * head_dim (all q heads, then the single k and v),
    learned positions, biases, tied head."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM  # noqa: PLC0415 - optional (the [test] extra installs transformers)

    cfg = GPTBigCodeConfig(vocab_size=vocab, n_positions=seq, n_embd=dim, n_layer=layers,
                           n_head=heads, n_inner=2 * dim, multi_query=True, use_cache=False,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           bos_token_id=0, eos_token_id=0)
    return HFCausalLM(GPTBigCodeForCausalLM(cfg))


def phi3(vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 8, kv_heads: int = 4,
         seq: int = 16) -> nn.Module:
    """transformers' Phi3ForCausalLM: fused ``qkv_proj`` (all q heads, then k, then v, GQA)
    and fused ``gate_up_proj`` (gate then up, split in halves), RMSNorm, rotary, no biases."""
    from transformers import Phi3Config, Phi3ForCausalLM  # noqa: PLC0415 - optional (the [test] extra installs transformers)

    cfg = Phi3Config(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim,
                     num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv_heads, max_position_embeddings=seq,
                     original_max_position_embeddings=seq, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                     tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return HFCausalLM(Phi3ForCausalLM(cfg))


def falcon(vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 8, kv_heads: int = 2,
           seq: int = 16) -> nn.Module:
    """transformers' FalconForCausalLM, new decoder architecture: fused ``query_key_value``
    laid out per kv group (the group's q heads, then its k, then its v), two layer norms
    feeding a parallel attention/MLP, rotary, no biases, tied head."""
    from transformers import FalconConfig, FalconForCausalLM  # noqa: PLC0415 - optional (the [test] extra installs transformers)

    cfg = FalconConfig(vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers,
                       num_attention_heads=heads, num_kv_heads=kv_heads,
                       new_decoder_architecture=True, parallel_attn=True, bias=False,
                       max_position_embeddings=seq, use_cache=False, hidden_dropout=0.0,
                       attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    return HFCausalLM(FalconForCausalLM(cfg))
