"""More transformers architectures than the sweep's, each on one mesh of 4 gloo ranks,
through the same checks as tests/test_train_gloo.py (each step's gradients against
float64, three AdamW steps against one device, measured == reported): Qwen2, Mistral,
Gemma, BLOOM (alibi), GPT-J (parallel attention and MLP, interleaved rotary), StableLM,
OLMo and Qwen3 (q/k norms), tiny configurations of each.

Some run a few ops replicated (BLOOM's alibi ``repeat``, GPT-J's sin/cos table
``index``, ``repeat`` and ``gather``): allowed here as long as they gather nothing, that
is, they read only replicated values (position tables), which ``Fallback.gathered``
says; a fallback that gathers a sharded tensor still fails the case.
"""
from __future__ import annotations

import pytest

import shardc
from harness import run_on_ranks
from shardc.models import HFCausalLM

pytestmark = pytest.mark.distributed

_NO_DROPOUT = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")


def _hf(config: str, model: str, **kw):
    def make():
        import transformers

        cfg = getattr(transformers, config)(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                            use_cache=False, tie_word_embeddings=False, **kw)
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
}


def _gathers_nothing(f) -> bool:
    return not f.gathered


def _all(rank: int, world_size: int) -> None:
    import test_train_gloo as T

    failures: list[str] = []
    for name, (make, spec) in MODELS.items():
        T.MODELS[name] = (lambda m: (lambda: T._lm(m)))(make)
        failures += T._case_failures(name, shardc.Mesh.parse(spec), allowed=_gathers_nothing)
    if failures:
        raise AssertionError(f"{len(failures)} failures:\n" + "\n".join(failures))


def test_more_architectures_train_like_one_device() -> None:
    run_on_ranks(_all, 4)
