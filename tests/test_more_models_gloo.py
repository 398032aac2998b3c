"""More transformers architectures than the sweep's, each on one mesh of 4 gloo ranks (each
its own test, ``test_more_architectures_train_like_one_device[qwen2-x2y2z1d1]``, on the
module's pool of ranks), through the same checks as tests/test_train_gloo.py (each step's
gradients against float64, three AdamW steps against one device, measured == reported):
Qwen2, Mistral, Gemma,
BLOOM (alibi), GPT-J (parallel attention and MLP, interleaved rotary), StableLM,
OLMo and Qwen3 (q/k norms), tiny configurations of each; and beyond decoders: T5
(encoder-decoder, as configured by default: its labels shifted right by writes into a new
tensor, keys concatenated onto a DynamicCache's empty start), ViT (a convolutional patch
embedding) and a small CNN (convolutions, group norm, max and adaptive average pooling) on
a data-parallel mesh, which must keep every sample on its own rank; an LSTM (whose chunked
gates once put a gradient sum on a tuple) and torch's nn.TransformerEncoder; and GEMM dims
a mesh axis does not divide (a 3-class ViT head, 3 input features), kept whole on it;
batch norm in training (a small CNN, transformers' ResNet): the global batch's statistics,
the running ones and the batch counter written back as one device's; GPT-2 with its
default dropout, in attention too, drawing one device's masks; DeBERTa-v2 (relative
positions tiled over the batch), Swin (whose pooling's backward writes in place), ConvNeXt-V2
(vector norms; per-block gathers on z), Falcon (multi-query lookups), M2M100 (sinusoidal
positions by index_select), CLIP (contrastive, the end-of-text token picked per row) and
ViT-MAE's pretraining (random masking) with reshard_after_forward; XLM (an assert on its
lengths, whose operand nothing else reads); FNet (Fourier transforms, complex views);
Gemma 2 (soft-capped logits, sliding-window layers), DeepSeek-V3 (latent attention, routed
and shared experts), GPT-Neo (local attention), ALBERT (one layer's weights shared by every
layer), Mamba (selective scan, transformers' PyTorch path), XLNet (relative attention by
einsum) and Llama with transformers' gradient checkpointing switched on; Mixtral and GPT-OSS
with transformers' default experts kernel (grouped_mm) and tests/test_routing.py's
``Routed``, whose sort by expert runs on each rank's own token-expert pairs; Qwen3-Next
(linear attention, whose step program needed passes/strides.py); BERT's masked language
model with its loss written by hand over the labelled tokens (``logits.view(-1, V)[active]``,
traced as the loss over every token, passes/masked_losses.py), and ELECTRA's
discriminator, whose binary loss over the attended tokens is traced alike; Mixtral with
transformers' ``eager`` experts kernel, DBRX and Switch Transformers, whose experts loop
over the experts the batch hit (passes/hit_loops.py).
Each of the following once gathered the batch on a data axis: a segmentation head
(cross-entropy over (N, C, H, W) with class weights, label smoothing and probability
targets), within-sample ops (var_mean, cumprod, scatter_add, index_add, F.unfold), a
kernel-regression head (linalg solve, slogdet, Cholesky), torch's nn.Transformer with a
weight-normed head (weights computed in forward), Mixtral's batched_mm experts (weights
indexed by expert id) and PatchTST (Tensor.unfold patches).

Some run a few ops replicated (BLOOM's alibi ``repeat``, GPT-J's sin/cos table
``index``, ``repeat`` and ``gather``): allowed here as long as they gather nothing, that
is, they read only replicated values (position tables), which ``Fallback.gathered``
says; a fallback that gathers a sharded tensor still fails the case.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardc
from shardc.core.compat import LOOP_ENTRIES_AS_DATA_FROM, PICKED_LOSSES_FROM, torch_version
from shardc.tools.models import HFCausalLM

pytestmark: list = []  # the cases are slow and distributed, one by one

_NO_DROPOUT = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")


def _hf(config: str, model: str, experts: str | None = None, **kw):
    def make():
        import transformers

        cfg = getattr(transformers, config)(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                            use_cache=False, tie_word_embeddings=False, **kw)
        if experts is not None:  # which of transformers' MoE kernels the experts run
            cfg._experts_implementation = experts
        for k in _NO_DROPOUT:
            if hasattr(cfg, k):
                setattr(cfg, k, 0.0)
        return HFCausalLM(getattr(transformers, model)(cfg))
    return make


_LLAMA_LIKE = dict(intermediate_size=64, num_attention_heads=8, max_position_embeddings=16)
MODELS = {
    "qwen2": (_hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=4, **_LLAMA_LIKE), "x2y2z1d1"),
    "mistral": (_hf("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, **_LLAMA_LIKE), "x1y1z2d2"),
    "gemma": (_hf("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=4, head_dim=4, **_LLAMA_LIKE),
              "x2y1z1d2"),
    "bloom": (_hf("BloomConfig", "BloomForCausalLM", n_head=8), "x2y2z1d1"),
    "gptj": (_hf("GPTJConfig", "GPTJForCausalLM", n_head=8, rotary_dim=4, n_positions=16), "x1y2z2d1"),
    "stablelm": (_hf("StableLmConfig", "StableLmForCausalLM", num_key_value_heads=8, **_LLAMA_LIKE),
                 "x2y1z2d1"),
    "olmo": (_hf("OlmoConfig", "OlmoForCausalLM", num_key_value_heads=8, **_LLAMA_LIKE), "x1y1z1d4"),
    "qwen3": (_hf("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=4, head_dim=4, **_LLAMA_LIKE),
              "x2y2z1d1"),
    # batched_mm looks each token's experts' weights up by index (gate_up_proj[expert_ids]):
    # a parameter indexed by a batch-cut tensor, which once gathered the routing
    "mixtral-batched": (_hf("MixtralConfig", "MixtralForCausalLM", experts="batched_mm",
                            num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
                            **_LLAMA_LIKE), "x1y1z2d2"),
    # logits soft-capped by tanh, and a sliding window on every other layer's attention mask
    "gemma2": (_hf("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=4, head_dim=4,
                   sliding_window=8, **_LLAMA_LIKE), "x2y1z1d2"),
    # multi-head latent attention (low-rank q and kv projections, a split rotary head) and
    # routed experts with a shared one after a first dense layer
    # transformers' default experts kernel (grouped_mm): the token-expert pairs sorted by
    # expert, each rank's own rows (once the batch's keys and tokens were gathered for the
    # sort; passes/rules/routing.py)
    "mixtral": (_hf("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=4, num_local_experts=4,
                    num_experts_per_tok=2, **_LLAMA_LIKE), "x1y1z2d2"),
    # the same kernel with experts' biases looked up by the sorted keys, on a mesh that cuts
    # the hidden dim too (gathered into the region)
    "gpt-oss": (_hf("GptOssConfig", "GptOssForCausalLM", num_key_value_heads=4, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=32, num_attention_heads=8, head_dim=4,
                    max_position_embeddings=16, sliding_window=8), "x2y1z1d2"),
    # gated delta-net linear attention beside full attention, and routed experts: its
    # softplus_backward returns a transposed layout on CPU, which a traced view of the
    # step program once could not take (passes/strides.py). One layer of each kind (the
    # default puts full attention every 4th layer, so two layers were both linear, and
    # each linear layer's chunked delta rule costs about half a minute of CI)
    "qwen3-next": (_hf("Qwen3NextConfig", "Qwen3NextForCausalLM", num_key_value_heads=4, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                       head_dim=4, layer_types=["linear_attention", "full_attention"], **_LLAMA_LIKE),
                   "x1y1z1d4"),
    # transformers' ``eager`` experts kernel: a Python loop over the experts the batch hit
    # (once refused: export cannot trace its trip count), traced over every expert, each a
    # constant (the loop skips the one-hot's extra class by comparing with it), each
    # iteration's picks masked by whether its expert was hit (passes/hit_loops.py)
    "mixtral-eager": (_hf("MixtralConfig", "MixtralForCausalLM", experts="eager",
                          num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
                          **_LLAMA_LIKE), "x1y1z2d2"),
    "deepseek-v3": (_hf("DeepseekV3Config", "DeepseekV3ForCausalLM", experts="batched_mm",
                        num_key_value_heads=8, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16, first_k_dense_replace=1, kv_lora_rank=8,
                        q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                        n_group=1, topk_group=1, **_LLAMA_LIKE), "x2y1z1d2"),
}


class T5(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=4, d_ff=64, num_layers=2,
                                    num_heads=8, dropout_rate=0.0, decoder_start_token_id=0)
        self.m = transformers.T5ForConditionalGeneration(cfg)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, labels=labels).loss


class SwitchMoE(torch.nn.Module):
    """Switch Transformers: top-1 experts in a ``ModuleDict`` looked up by the expert's
    number (``self[f"expert_{idx}"]``) in a loop over the experts the batch hit, traced
    with each a constant (passes/hit_loops.py), and its router's z-loss and load-balancing
    loss in the training loss. transformers 5.24 reads the decoder's start token and the
    encoder's attention mask without defaults: given here."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.SwitchTransformersConfig(
            vocab_size=64, d_model=32, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
            num_heads=8, num_experts=4, expert_capacity=64, dropout_rate=0.0, use_cache=False,
            decoder_start_token_id=0, pad_token_id=0)
        self.m = transformers.SwitchTransformersForConditionalGeneration(cfg)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids),
                      decoder_attention_mask=torch.ones_like(labels)).loss


class DebertaV2(torch.nn.Module):
    """DeBERTa-v2's masked LM: disentangled attention over log-bucketed relative
    positions, whose code casts a 0-d scalar by a matrix (``type_as``: the lowering once
    broadcast the matrix into the scalar and failed)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.DebertaV2Config(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=32, relative_attention=True,
            position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"],
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.m = transformers.DebertaV2ForMaskedLM(cfg)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, labels=labels).loss


class HFLoss(torch.nn.Module):
    """A transformers model built from ``config(**kw)`` (dropouts zeroed), whose
    forward(*batch) passes the batch under ``keys`` and returns the model's loss."""

    def __init__(self, config: str, model: str, keys: tuple[str, ...], **kw) -> None:
        super().__init__()
        import transformers

        cfg = getattr(transformers, config)(**kw)
        for k, v in list(vars(cfg).items()):
            if "drop" in k and isinstance(v, float):
                setattr(cfg, k, 0.0)
        for sub in ("text_config", "vision_config"):
            if getattr(cfg, sub, None) is not None:
                for k, v in list(vars(getattr(cfg, sub)).items()):
                    if "drop" in k and isinstance(v, float):
                        setattr(getattr(cfg, sub), k, 0.0)
        self.m = getattr(transformers, model)(cfg)
        self.keys = keys
        self.extra = {"return_loss": True} if model == "CLIPModel" else {}

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        return self.m(**dict(zip(self.keys, batch)), **self.extra).loss


def _hf_loss(config: str, model: str, keys: tuple[str, ...], **kw):
    return lambda: HFLoss(config, model, keys, **kw)


_IMG = ("pixel_values", "labels")
_IDS = ("input_ids", "labels")
_S2S = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_position_embeddings=32, use_cache=False)
# Swin pools with adaptive_avg_pool1d, whose backward make_fx keeps as a write into a slice
# of fresh zeros; the schedule once moved that write after the reads of the zeros (every
# gradient but the head's came out zero)
_SWIN = _hf_loss("SwinConfig", "SwinForImageClassification", _IMG, image_size=32, patch_size=4,
                 embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=10)
# ConvNeXt-V2's global response norm (a vector norm over H and W) and its (1, 1, 1, C)
# scales, gathered with their block on z
_CONVNEXTV2 = _hf_loss("ConvNextV2Config", "ConvNextV2ForImageClassification", _IMG,
                       hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=10)
# multi-query attention picks its shared key and value with fused_qkv[..., [-2], :]
_FALCON = _hf_loss("FalconConfig", "FalconForCausalLM", _IDS, vocab_size=64, hidden_size=32,
                   num_hidden_layers=2, num_attention_heads=8, use_cache=False)
# sinusoidal positions looked up with index_select by batch-cut position ids
_M2M100 = _hf_loss("M2M100Config", "M2M100ForConditionalGeneration", _IDS, pad_token_id=1,
                   decoder_start_token_id=2, **_S2S)
# the text tower pools its end-of-text token: x[arange(B), ids.argmax(-1)]
_CLIP = _hf_loss("CLIPConfig", "CLIPModel", ("input_ids", "pixel_values"), projection_dim=16,
                 text_config=dict(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=16, eos_token_id=3),
                 vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, image_size=16, patch_size=4))


# The usual training batch: right padding, attention_mask 0 there, labels -100 there.
# transformers builds the 4-D attention mask by indexing the padding mask with aranges of
# the batch and of the keys (masking_utils); run whole, that gathered the batch-cut mask
_PAD_KEYS = ("input_ids", "attention_mask", "labels")
_LLAMA_PADDED = _hf_loss("LlamaConfig", "LlamaForCausalLM", _PAD_KEYS, vocab_size=64, hidden_size=32,
                         num_hidden_layers=2, intermediate_size=64, num_attention_heads=8,
                         max_position_embeddings=16, pad_token_id=0, use_cache=False)
_BERT_PADDED = _hf_loss("BertConfig", "BertForSequenceClassification", _PAD_KEYS, vocab_size=64,
                        hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=32, num_labels=3)


# A speech model's CTC head (HuBERT; Wav2Vec2, WavLM, SEW and Data2VecAudio write it alike):
# labels padded with -100, concatenated with masked_select, torch's CTC loss. torch.export
# could not trace aten._ctc_loss (no fake kernel); the trace now sees runtime/ctc.py's op
_HUBERT_CTC = _hf_loss("HubertConfig", "HubertForCTC", ("input_values", "labels"), vocab_size=16,
                       hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                       conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                       num_conv_pos_embedding_groups=4, ctc_loss_reduction="mean", pad_token_id=0,
                       mask_time_prob=0.0)


def _speech(make):
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        labels = torch.randint(1, 16, (8, 5), generator=g)
        labels[1::3, 3:] = -100  # shorter transcripts
        batches.append((torch.randn(8, 400, generator=g), labels))
    return make, batches


def _ctc_head():
    """The CTC loss without a branch on values before it: the step program (HuBERT's
    `labels.max()` check leaves it to autograd's backward) runs the loss's backward op."""
    from test_ctc import _CTCHead

    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        labels = torch.randint(1, 10, (8, 6), generator=g)
        labels[1::3, 4:] = -100
        batches.append((torch.randn(8, 20, 8, generator=g), labels))
    return _CTCHead, batches


def _padded(make, classes: int | None = None):
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(3, 64, (8, 16), generator=g)
        lengths = torch.randint(8, 17, (8,), generator=g)
        mask = torch.arange(16)[None] < lengths[:, None]
        ids = ids.masked_fill(~mask, 0)
        labels = (ids.masked_fill(~mask, -100) if classes is None
                  else torch.randint(0, classes, (8,), generator=g))
        batches.append((ids, mask.long(), labels))
    return make, batches


# ViT-MAE's pretraining: each step masks a random half of the patches (torch.rand inside
# forward) and gathers the kept ones by index. With reshard_after_forward the gather of
# those patches, computed from the batch alone, was taken for a weight's and copied into
# backward before its input existed; the step program failed and comm_report raised.
_VITMAE = _hf_loss("ViTMAEConfig", "ViTMAEForPreTraining", ("pixel_values",), hidden_size=32,
                   num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
                   patch_size=4, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                   decoder_num_attention_heads=4, decoder_intermediate_size=64, mask_ratio=0.5)


# checks its lengths with assert lengths.max().item() <= slen: the check is dropped, and
# the gather of the batch-cut lengths its max once needed was reported but never run
_XLM = _hf_loss("XLMConfig", "XLMWithLMHeadModel", _IDS, vocab_size=64, emb_dim=32, n_layers=2,
                n_heads=4, max_position_embeddings=40)


# mixes tokens with a 2-D FFT over sequence and hidden, per sample: the batch stays cut
_FNET = _hf_loss("FNetConfig", "FNetForMaskedLM", _IDS, vocab_size=64, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=40, use_tpu_fourier_optimizations=False)


# checks its attention mask with `if is_global_attn:` (a branch on tensor values: traced by
# draft_export, checked each step) and cuts its sliding windows with as_strided over a view
# whose storage is ordered (seq, batch*heads, head_dim): run on the gathered batch, the
# recorded strides read other elements (loss and gradients wrong) until the fallback laid
# the input out as the trace saw it
_LONGFORMER = _hf_loss("LongformerConfig", "LongformerForMaskedLM", _IDS, vocab_size=64,
                       hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
                       intermediate_size=64, max_position_embeddings=40, attention_window=[4, 4])


# local attention (a causal window of 4) on every other layer
_GPT_NEO = _hf_loss("GPTNeoConfig", "GPTNeoForCausalLM", _IDS, vocab_size=64, hidden_size=32,
                    num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                    window_size=4, max_position_embeddings=32, use_cache=False)
# one layer's weights run by every layer (each weight read twice in forward, its gradient
# summed over both uses), embeddings factorized through a smaller width
_ALBERT = _hf_loss("AlbertConfig", "AlbertForMaskedLM", _IDS, vocab_size=64, hidden_size=32,
                   embedding_size=16, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64, max_position_embeddings=32)
# a state-space model, transformers' PyTorch path (no mamba_ssm kernels): a depthwise causal
# convolution and the selective scan as a loop over time steps
_MAMBA = _hf_loss("MambaConfig", "MambaForCausalLM", _IDS, vocab_size=64, hidden_size=32,
                  num_hidden_layers=2, state_size=4, use_cache=False)
# relative attention by einsum over position encodings, and its relative shift
_XLNET = _hf_loss("XLNetConfig", "XLNetLMHeadModel", _IDS, vocab_size=64, d_model=32, n_layer=2,
                  n_head=4, d_inner=64, use_mems_train=False)


class LlamaCheckpointed(torch.nn.Module):
    """Llama with transformers' own activation checkpointing switched on
    (``gradient_checkpointing_enable``: torch.utils.checkpoint around each layer)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                       num_key_value_heads=4, use_cache=False,
                                       tie_word_embeddings=False, **_LLAMA_LIKE)
        self.m = transformers.LlamaForCausalLM(cfg)
        self.m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.m.train()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, labels=labels).loss


def _pixels():
    g = torch.Generator().manual_seed(1)
    return _VITMAE, [(torch.randn(8, 3, 16, 16, generator=g),) for _ in range(3)]


def _clip_batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        ids = torch.randint(4, 64, (8, 16), generator=g)
        ids[:, -1] = 3
        out.append((ids, torch.randn(8, 3, 16, 16, generator=g)))
    return _CLIP, out


class ViT(torch.nn.Module):
    def __init__(self, labels: int = 10) -> None:
        super().__init__()
        import transformers

        cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
                                     intermediate_size=64, image_size=16, patch_size=4, num_labels=labels,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.m = transformers.ViTForImageClassification(cfg)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(pixel_values=pixels, labels=labels).loss


class CNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, 16)
        self.c2 = torch.nn.Conv2d(16, 16, 3, padding=1, groups=2)
        self.fc = torch.nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.norm(self.c1(x))), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.c2(x)), 4)
        return F.cross_entropy(self.fc(x.flatten(1)), y)


class BNNet(torch.nn.Module):
    """Batch norm in training (2-d after convolutions, 1-d after a linear whose features
    x cuts): the statistics are the global batch's, the running ones too."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(8, momentum=0.3)
        self.fc = torch.nn.Linear(8 * 4 * 4, 16)
        self.bn3 = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.c1(x))), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.bn2(self.c2(x))), 4)
        return F.cross_entropy(self.head(F.relu(self.bn3(self.fc(x.flatten(1))))), y)


def _gpt2_dropout():
    """GPT-2 as configured by default (dropout 0.1 on embeddings, attention probabilities
    and residuals): the attention's dropout runs per head with one device's mask."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=8)
    assert cfg.attn_pdrop > 0 and cfg.resid_pdrop > 0
    return HFCausalLM(transformers.GPT2LMHeadModel(cfg))


class ResNet(torch.nn.Module):
    """transformers' ResNet: batch norm after every convolution, in training."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                        num_labels=10)
        self.m = transformers.ResNetForImageClassification(cfg)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(pixel_values=pixels, labels=labels).loss


class SegNet(torch.nn.Module):
    """Per-pixel classes, as segmentation trains: ``F.cross_entropy`` over the class dim 1
    of (N, C, H, W) logits with class weights, label smoothing and an ignored label, plus
    a mixup-style term against probability targets of the same shape. The head is a
    linear layer over each pixel's features (SegFormer's decoder), so x cuts the classes."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.head = torch.nn.Linear(16, 8)
        self.register_buffer("w", torch.linspace(0.5, 2.0, 8))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x)).permute(0, 2, 3, 1)  # (N, H, W, features)
        logits = self.head(h).permute(0, 3, 1, 2)
        return (F.cross_entropy(logits, mask, weight=self.w, label_smoothing=0.1, ignore_index=255)
                + 0.5 * F.cross_entropy(logits, soft))


def _segmentation():
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        mask = torch.randint(0, 8, (8, 6, 6), generator=g)
        mask[:, :2, :3] = 255  # unlabelled pixels
        soft = torch.softmax(torch.randn(8, 8, 6, 6, generator=g), 1)
        batches.append((torch.randn(8, 3, 6, 6, generator=g), mask, soft))
    return SegNet, batches


class PerSample(torch.nn.Module):
    """Ops that work within each sample as user code writes them: a hand-made norm's
    ``var_mean`` and ``std``, ``cumprod`` along the sequence, ``scatter_add`` and
    ``index_add`` of values into slots, and ``F.unfold``'s patches of a feature map."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, img: torch.Tensor, slots: torch.Tensor,
                y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        var, mean = torch.var_mean(h, -1, keepdim=True)
        h = (h - mean) / (var + 1e-5).sqrt() * h.std(-1, keepdim=True)
        gated = torch.cumprod(torch.sigmoid(h), 1)
        pooled = torch.zeros_like(h).scatter_add(-1, slots, gated)
        pooled = pooled.index_add(1, torch.tensor([0, 2, 2, 1, 5, 4]), gated)
        patches = F.unfold(self.conv(img), 2, stride=2)  # (N, 4 * 2 * 2, 16)
        return F.cross_entropy(self.head(pooled.mean(1) + patches.mean(1)), y)


def _per_sample():
    g = torch.Generator().manual_seed(1)
    return PerSample, [(torch.randn(8, 6, 16, generator=g), torch.randn(8, 3, 8, 8, generator=g),
                        torch.randint(0, 16, (8, 6, 16), generator=g),
                        torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]


class KernelHead(torch.nn.Module):
    """A kernel-regression head per sample: a Gram matrix of the sample's tokens, its
    Cholesky factor, a solve and a log-determinant (as in a Gaussian-process layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # (N, 6, 8)
        k = h @ h.transpose(1, 2) + torch.eye(6)
        alpha = torch.linalg.solve(k, y)
        fit = (y * alpha).sum((1, 2)) + torch.linalg.slogdet(k)[1]
        return fit.mean() + torch.linalg.cholesky(k).diagonal(dim1=1, dim2=2).log().mean()


def _kernel_head():
    g = torch.Generator().manual_seed(1)
    return KernelHead, [(torch.randn(8, 6, 16, generator=g), torch.randn(8, 6, 2, generator=g))
                        for _ in range(3)]


class RuleLess(torch.nn.Module):
    """Ops with no sharding rule, decomposed where they stand rather than by re-tracing the
    export (``passes/decompose.py``): a difference along the features, hardswish, a GLU, a
    cosine similarity and a pairwise distance, between linear layers. (An op of two
    outputs, ``aminmax``, is in tests/test_decompose.py: torch 2.8 has no derivative for
    it, so the single-device reference could not train here.)"""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 17)
        self.b = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        d = torch.diff(self.a(x), dim=-1)  # (N, 16)
        h = torch.nn.functional.hardswish(d)
        g = torch.nn.functional.glu(self.b(h), dim=-1)  # (N, 16)
        sim = torch.nn.functional.cosine_similarity(g, x, dim=-1)
        far = torch.nn.functional.pairwise_distance(g, x)
        return ((self.head(g) - y) ** 2).mean() + sim.mean() + 0.1 * far.mean()


def _rule_less():
    g = torch.Generator().manual_seed(1)
    return RuleLess, [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
                      for _ in range(3)]


class TorchSeq2Seq(torch.nn.Module):
    """torch's nn.Transformer (its decoder's cross-attention splits the packed in-projection
    into a query and a key-value weight in forward) and a weight-normed head
    (torch.nn.utils.parametrizations.weight_norm): linear layers whose weight is computed
    in forward. Each once gathered the batch."""

    def __init__(self) -> None:
        super().__init__()
        from torch.nn.utils.parametrizations import weight_norm

        self.emb = torch.nn.Embedding(64, 32)
        self.tr = torch.nn.Transformer(32, 4, 1, 1, 64, dropout=0.0, batch_first=True)
        self.head = weight_norm(torch.nn.Linear(32, 64))

    def forward(self, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        causal = torch.nn.Transformer.generate_square_subsequent_mask(t.shape[1])
        h = self.tr(self.emb(ids), self.emb(t), tgt_mask=causal)
        return F.cross_entropy(self.head(h).flatten(0, 1), t.flatten())


class PatchTST(torch.nn.Module):
    """transformers' PatchTST forecaster: the series is cut into patches by
    ``Tensor.unfold`` along time (which once gathered the batch)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.PatchTSTConfig(num_input_channels=3, context_length=32, patch_length=8,
                                          patch_stride=8, d_model=16, num_hidden_layers=2,
                                          num_attention_heads=4, ffn_dim=32, prediction_length=8,
                                          dropout=0.0, attention_dropout=0.0, ff_dropout=0.0,
                                          positional_dropout=0.0, path_dropout=0.0, head_dropout=0.0)
        self.m = transformers.PatchTSTForPrediction(cfg)

    def forward(self, past: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        return self.m(past_values=past, future_values=future).loss


def _series():
    g = torch.Generator().manual_seed(1)
    return PatchTST, [(torch.randn(8, 32, 3, generator=g), torch.randn(8, 8, 3, generator=g))
                      for _ in range(3)]


class LSTMNet(torch.nn.Module):
    """Two LSTM layers (export unrolls them: the gates of each step are one GEMM's output
    chunked in four) between an embedding and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.rnn = torch.nn.LSTM(32, 32, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.rnn(self.emb(ids))[0]).flatten(0, 1), t.flatten())


class Encoder(torch.nn.Module):
    """torch's own nn.TransformerEncoder (packed in-projection, post-norm) and nn.RMSNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = torch.nn.RMSNorm(32)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.enc(self.emb(ids)))
        return F.cross_entropy(self.head(h).flatten(0, 1), t.flatten())


class Writes(torch.nn.Module):
    """Writes into new tensors, as user code does: ``new_zeros`` then ``out[:, 1:] = h``,
    ``zeros_like(h).copy_(row)``, and topk / max over the last dim. ``new_zeros`` once
    gathered h (it reads only its dtype), and the comm report counted a backward for that
    gather and for sums on the constants that the step program never ran."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        out = h.new_zeros(h.shape)
        out[:, 1:] = h[:, :-1]
        out[:, 0] = 0.5
        g = torch.zeros_like(h).copy_(h.mean(0, keepdim=True))
        v, _ = torch.topk(out, 4, dim=-1)
        return F.mse_loss(self.b(out + g), t) + v.mean() + torch.max(h, dim=-1).values.mean()


class OddDims(torch.nn.Module):
    """GEMM dims a mesh axis does not divide: 3 input features (cut over y by the first,
    normal, GEMM) and a 5-class head (its classes cut over x). Each is kept whole on that
    axis, not refused."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 16)
        self.b = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.norm(self.b(F.gelu(self.a(x))))), y)


def _odd():
    g = torch.Generator().manual_seed(1)
    return OddDims, [(torch.randn(8, 3, generator=g), torch.randint(0, 5, (8,), generator=g))
                     for _ in range(3)]


def _dense():
    g = torch.Generator().manual_seed(1)
    return Writes, [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g))
                    for _ in range(3)]


def _images(make, size: int = 16, labels: int = 10):
    g = torch.Generator().manual_seed(1)
    return make, [(torch.randn(8, 3, size, size, generator=g),
                   torch.randint(0, labels, (8,), generator=g)) for _ in range(3)]


class LoopedExperts(torch.nn.Module):
    """Experts in a ``ModuleList``, looped over with the rows the router sent each one, as
    research code and transformers 4.x write mixtures of experts: ``torch.where`` of the
    expert mask, rows looked up with ``x[None, tok]`` and weights with ``w[tok, slot,
    None]``, summed back by ``index_add_`` (Mixtral, 4.36-4.47), or a boolean mask read and
    written, ``y[flat == i] = expert(x[flat == i])`` (DeepSeek's remote code). How many
    rows an expert gets is known only when the step runs: shardc computes each at its
    bound (``passes/data_sized.py``)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.emb = torch.nn.Embedding(64, 16)
        self.router = torch.nn.Linear(16, 4, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.SiLU(),
                                torch.nn.Linear(32, 16)) for _ in range(4))
        self.head = torch.nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        b, t, d = h.shape
        x = h.view(-1, d)
        w, e = self.router(x).softmax(-1).topk(2, dim=-1)
        if self.style == "where":
            out = torch.zeros_like(x)
            mask = F.one_hot(e, 4).permute(2, 1, 0)
            for i, expert in enumerate(self.experts):
                slot, tok = torch.where(mask[i])
                rows = x[None, tok].reshape(-1, d)
                out.index_add_(0, tok, expert(rows) * w[tok, slot, None])
        elif self.style == "switch":  # top-1, the unrouted rows kept: ``out[mask] = ...``
            out = x.clone()
            for i, expert in enumerate(self.experts):
                picked = e[:, 0] == i
                out[picked] = expert(x[picked]) * w[picked, :1]
            out = out - x
        else:
            xs = x.repeat_interleave(2, dim=0)
            flat = e.view(-1)
            y = torch.empty_like(xs)
            for i, expert in enumerate(self.experts):
                y[flat == i] = expert(xs[flat == i])
            out = (y.view(*w.shape, -1) * w.unsqueeze(-1)).sum(dim=1)
        return F.cross_entropy(self.head(h + out.view(b, t, d)).flatten(0, 1), tgt.flatten())


class MaskedDepthLoss(torch.nn.Module):
    """GLPN's scale-invariant log loss: the pixels with a depth (``target > 0``) picked by
    a boolean mask and averaged (means over them, and over their squares). Their number
    is the data's: they once ran whole on every rank, the mask's nonzero gathered; traced
    as sums over every pixel with the others zeroed out (passes/masked_reductions.py), each
    rank sums its own and nothing is gathered."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.out = torch.nn.Conv2d(4, 1, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pred = self.out(F.gelu(self.conv(x))).squeeze(1).exp()
        valid = target > 0
        d = torch.log(target[valid]) - torch.log(pred[valid])
        return torch.sqrt((d ** 2).mean() - 0.5 * d.mean() ** 2)


def _depth():
    g = torch.Generator().manual_seed(1)
    return MaskedDepthLoss, [(torch.randn(8, 3, 8, 8, generator=g), torch.rand(8, 8, 8, generator=g) - 0.3)
                             for _ in range(3)]


def _small_bert():
    import transformers

    return transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=64,
                                   max_position_embeddings=32, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)


class MaskedRegression(torch.nn.Module):
    """A per-token regression head on BERT whose loss is a mean squared error over the
    tokens with a target (``F.mse_loss(pred[has], target[has])``) plus an L1 term over
    them: traced over every token with the others zeroed out (passes/masked_reductions.py),
    on a mesh that cuts the hidden dim (x) and the batch."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.m = transformers.BertModel(_small_bert(), add_pooling_layer=False)
        self.head = torch.nn.Linear(32, 3)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pred = self.head(self.m(input_ids=ids).last_hidden_state)
        has = ~torch.isnan(target[..., 0])
        return F.mse_loss(pred[has], target[has]) + 0.1 * F.l1_loss(pred[has], target[has])


def _regression():
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        target = torch.randn(8, 16, 3, generator=g)
        target[torch.rand(8, 16, generator=g) > 0.6] = float("nan")  # 40% without a target
        batches.append((torch.randint(0, 64, (8, 16), generator=g), target))
    return MaskedRegression, batches


class HandMaskedLM(torch.nn.Module):
    """A masked language model whose loss the training script writes over the labelled
    tokens only, ``cross_entropy(logits.view(-1, V)[active], labels.view(-1)[active])``:
    traced as the loss over every token with the unlabelled ones ignored
    (passes/masked_losses.py), so every rank keeps its own tokens."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.m = transformers.BertForMaskedLM(_small_bert())

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.m(input_ids=ids).logits
        active = labels.view(-1) != -100
        return F.cross_entropy(logits.view(-1, 64)[active], labels.view(-1)[active])


def _hand_masked_lm():
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 64, (8, 16), generator=g)
        labels = ids.masked_fill(torch.rand(8, 16, generator=g) > 0.3, -100)  # 30% labelled
        batches.append((ids, labels))
    return HandMaskedLM, batches


# ELECTRA's discriminator: a binary loss over the attended tokens only,
# ``logits.view(-1, S)[attention_mask == 1]``, traced over every token with the padding
# zeroed out of the sum (passes/masked_losses.py); it gathered the mask's nonzero before
_ELECTRA = _hf_loss("ElectraConfig", "ElectraForPreTraining", _PAD_KEYS, vocab_size=64,
                    embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=32)


def _replaced_tokens():
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        lengths = torch.randint(8, 17, (8,), generator=g)
        mask = torch.arange(16)[None] < lengths[:, None]
        ids = torch.randint(3, 64, (8, 16), generator=g).masked_fill(~mask, 0)
        batches.append((ids, mask.long(), torch.randint(0, 2, (8, 16), generator=g)))
    return _ELECTRA, batches


def _dbrx():
    """DBRX, whose only experts kernel loops over the experts the batch hit and indexes its
    stacked weights by each (``w1.view(-1, F, H)[expert_idx]``): traced with the entry as
    data (passes/hit_loops.py), since its one-hot has an extra class no weight has."""
    import transformers

    cfg = transformers.DbrxConfig(d_model=32, n_heads=8, n_layers=2, max_seq_len=16, vocab_size=64,
                                  use_cache=False, tie_word_embeddings=False,
                                  attn_config={"kv_n_heads": 4, "clip_qkv": 8.0},
                                  ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4,
                                              "moe_top_k": 2})
    # transformers 5.24's DbrxAttention reads the rotary base from the attention's config,
    # which its config class no longer holds
    cfg.attn_config.rope_theta = cfg.rope_parameters["rope_theta"]
    return HFCausalLM(transformers.DbrxForCausalLM(cfg))


# (model, its batches) for those that are not causal language models
def _routed():
    from test_routing import Routed

    g = torch.Generator().manual_seed(1)
    return (lambda: Routed("norm")), [(torch.randn(8, 4, 8, generator=g),) for _ in range(3)]


def _tokens(make):
    import test_train_gloo as T

    return T._lm(make)


OTHERS = {"t5": (lambda: _tokens(T5), "x2y1z1d2"), "vit": (lambda: _images(ViT), "x2y1z1d2"),
          "cnn": (lambda: _images(CNN), "x1y1z2d2"), "lstm": (lambda: _tokens(LSTMNet), "x2y1z1d2"),
          "encoder": (lambda: _tokens(Encoder), "x1y2z2d1"), "writes": (_dense, "x1y1z2d2"),
          # a classifier of 3 classes straight after the final norm (DeiT's, BEiT's and
          # DINOv2's heads read it so): x does not divide its classes
          "vit3": (lambda: _images(lambda: ViT(labels=3), labels=3), "x2y2z1d1"),
          "odd": (_odd, "x2y2z1d1"),
          "batchnorm": (lambda: _images(BNNet), "x1y1z2d2"), "batchnorm-x": (lambda: _images(BNNet), "x2y1z1d2"),
          "resnet": (lambda: _images(ResNet), "x1y1z1d4"),
          "gpt2-dropout": (lambda: _tokens(_gpt2_dropout), "x2y1z1d2"),
          "deberta-v2": (lambda: _tokens(DebertaV2), "x2y1z1d2"),
          "swin": (lambda: _images(_SWIN, 32), "x2y1z1d2"),
          "convnext-v2": (lambda: _images(_CONVNEXTV2, 32), "x1y1z2d2"),
          "falcon": (lambda: _tokens(_FALCON), "x1y1z2d2"),
          "m2m100": (lambda: _tokens(_M2M100), "x1y1z2d2"),
          "clip": (_clip_batches, "x1y1z1d4"),
          "vit-mae-reshard": (_pixels, "x2y1z1d2", {"reshard_after_forward": True}),
          "xlm": (lambda: _tokens(_XLM), "x2y1z1d2"),
          "fnet": (lambda: _tokens(_FNET), "x1y1z2d2"),
          "longformer": (lambda: _tokens(_LONGFORMER), "x2y1z1d2"),
          "llama-padded": (lambda: _padded(_LLAMA_PADDED), "x1y1z2d2"),
          "bert-padded": (lambda: _padded(_BERT_PADDED, classes=3), "x2y1z1d2"),
          "hubert-ctc": (lambda: _speech(_HUBERT_CTC), "x1y1z2d2"),
          "ctc-head": (_ctc_head, "x2y1z1d2"),
          "segmentation": (_segmentation, "x2y1z1d2"),
          "per-sample": (_per_sample, "x1y1z1d4"),
          "kernel-head": (_kernel_head, "x2y1z1d2"),
          "rule-less": (_rule_less, "x2y1z1d2"),
          "torch-seq2seq": (lambda: _tokens(TorchSeq2Seq), "x1y1z2d2"),
          "patchtst": (_series, "x2y1z1d2"),
          "gpt-neo": (lambda: _tokens(_GPT_NEO), "x2y1z1d2"),
          "albert": (lambda: _tokens(_ALBERT), "x2y1z1d2"),
          "mamba": (lambda: _tokens(_MAMBA), "x2y1z1d2"),
          "xlnet": (lambda: _tokens(_XLNET), "x2y1z1d2"),
          "llama-checkpointed": (lambda: _tokens(LlamaCheckpointed), "x1y1z2d2"),
          "routed": (_routed, "x1y1z1d4"),
          # looped experts: rows the data picks, at their bound; on meshes that cut the
          # batch and the weights (z) or the hidden dim (x)
          "looped-experts-where": (lambda: _tokens(lambda: LoopedExperts("where")), "x1y1z2d2"),
          "looped-experts-mask": (lambda: _tokens(lambda: LoopedExperts("mask")), "x2y1z1d2"),
          "looped-experts-switch": (lambda: _tokens(lambda: LoopedExperts("switch")), "x1y1z1d4"),
          # the batch whole on every rank: every rank picks the same rows
          "looped-experts-x": (lambda: _tokens(lambda: LoopedExperts("where")), "x2y2z1d1"),
          "masked-depth-loss": (_depth, "x1y1z2d2"),
          "masked-regression": (_regression, "x2y1z1d2"),
          # a loss over the labelled tokens, picked by a boolean mask
          "hand-masked-lm": (_hand_masked_lm, "x2y1z1d2"),
          # the rewritten loss in the last stage of a pipeline, and compiled whole by inductor
          "hand-masked-lm-pipe": (_hand_masked_lm, "p2x1y1z1d2"),
          "hand-masked-lm-inductor": (_hand_masked_lm, "x1y1z2d2", {"backend": "inductor"}),
          "electra-discriminator": (_replaced_tokens, "x1y1z2d2"),
          "dbrx": (lambda: _tokens(_dbrx), "x2y1z1d2"),
          "switch-transformers": (lambda: _tokens(SwitchMoE), "x1y1z2d2"),
          "looped-experts-inductor": (lambda: _tokens(lambda: LoopedExperts("mask")), "x1y1z2d2",
                                      {"backend": "inductor"})}


def _gathers_nothing(f) -> bool:
    return not f.gathered


# ops a model may run whole on a gathered input without failing its case: as_strided has
# no sharding rule (the windows it cuts cross the batch-times-heads dim it is cut on)
_ALLOWED = {"longformer": lambda f: not f.gathered or f.op == "aten.as_strided.default",
            # the transcripts' concatenation (its size is the data's) and the loss over the
            # gathered (time, batch, classes) log-probabilities run whole
            "hubert-ctc": lambda f: not f.gathered or f.op in ("aten.masked_select.default",
                                                               "shardc.ctc_loss.default"),
            "ctc-head": lambda f: not f.gathered or f.op in ("aten.masked_select.default",
                                                             "shardc.ctc_loss.default")}


# cases an older torch's export cannot trace: from which torch each trains, and below it
# the refusal compile gives (a TraceError saying the guard is on a size the data decides)
_EXPORT_TAKES = {
    # its loop over the experts hit indexes the weights by an entry held as data
    "dbrx": LOOP_ENTRIES_AS_DATA_FROM,
    # the stages cut the plain export, which takes the picked rows' loss from torch 2.10
    "hand-masked-lm-pipe": PICKED_LOSSES_FROM,
}


def _refused_by_this_torch(name: str) -> bool:
    """True where this torch cannot trace ``name``, after checking that compile refuses it
    with the reason, not with torch's raw error or a wrong program."""
    if torch_version() >= _EXPORT_TAKES.get(name, (0, 0)):
        return False
    import test_train_gloo as T

    make, batches = T.model_and_batches(name)
    spec = MODELS[name][1] if name in MODELS else OTHERS[name][1]
    with pytest.raises(shardc.TraceError, match="a size the data decides"):
        shardc.compile(make(), shardc.Mesh.parse(spec), batches[0])
    return True


def _one(rank: int, world_size: int, name: str) -> None:
    """One model of MODELS or OTHERS on its mesh, through test_train_gloo's checks."""
    import test_train_gloo as T
    import transformers.integrations.moe as moe

    # the float64 reference of a grouped_mm MoE: torch's CPU kernel takes no float64, so
    # every run, the reference too, takes transformers' own fallback (one GEMM per expert,
    # the op the compiled trace holds anyway)
    moe._can_use_grouped_mm = lambda *args, **kwargs: False

    if name in MODELS:
        make, spec = MODELS[name]
        T.MODELS[name] = (lambda m: (lambda: T._lm(m)))(make)
    else:
        T.MODELS[name] = OTHERS[name][0]
    if _refused_by_this_torch(name):
        return
    if name in MODELS:
        failures = T._case_failures(name, shardc.Mesh.parse(spec), allowed=_gathers_nothing)
    else:
        batches, spec, *options = OTHERS[name]
        failures = T._case_failures(name, shardc.Mesh.parse(spec),
                                    allowed=_ALLOWED.get(name, _gathers_nothing),
                                    **(options[0] if options else {}))
    if failures:
        raise AssertionError(f"{len(failures)} failures:\n" + "\n".join(failures))


CASES = [(name, spec) for name, (_, spec) in MODELS.items()] + \
    [(name, spec) for name, (_, spec, *_) in OTHERS.items()]


def test_every_name_is_one_case() -> None:
    assert not set(MODELS) & set(OTHERS)
    assert all(shardc.Mesh.parse(spec).world_size == 4 for _, spec in CASES)


@pytest.mark.parametrize("name", [pytest.param(n, id=f"{n}-{s}") for n, s in CASES])
@pytest.mark.slow
@pytest.mark.distributed
def test_more_architectures_train_like_one_device(ranks, name: str) -> None:
    ranks.run(_one, 4, name)
