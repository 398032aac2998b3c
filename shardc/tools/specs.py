"""SPECs for the command line: ``load_spec`` reads one (``path/to/file.py:function`` or
``package.module:function``); the functions below are ready-made ones. Each returns
``(model, example_inputs)``."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

from shardc.core.errors import ShardcError
from shardc.tools.models import GPT, HFCausalLM, MLPChain, lm_batch


class SpecError(ShardcError):
    """A SPEC that names no loadable function, or one that returns something else."""


def load_spec(spec: str) -> tuple[torch.nn.Module, tuple]:
    """``file.py:function`` or ``module:function`` -> (model, example_inputs). A SPEC that
    names nothing loadable raises ``SpecError`` (the CLI prints its message and exits 1)."""
    if ":" not in spec:
        raise SpecError(f"shardc: SPEC must be 'path/to/file.py:function' or 'module:function', "
                        f"got {spec!r}.")
    where, fn_name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        if not os.path.exists(where):
            raise SpecError(f"shardc: no file {where!r} (from SPEC {spec!r}).")
        mod_spec = importlib.util.spec_from_file_location(f"_shardc_spec_{abs(hash(where))}", where)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise SpecError(f"shardc: {where} has no function {fn_name!r}.")
    out = fn()
    if not (isinstance(out, tuple) and len(out) == 2):
        raise SpecError(f"shardc: {spec} must return (model, example_inputs), got {type(out).__name__}.")
    model, inputs = out
    return model, tuple(inputs)


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


def moe_small() -> tuple[torch.nn.Module, tuple]:
    """A transformers Mixtral (2 layers, hidden 64, 8 experts, top 2; its default
    ``grouped_mm`` experts kernel), batch 8 x 32: for ``expert_axes`` (needs transformers)."""
    import transformers  # noqa: PLC0415 - optional dependency (the [test] extra)

    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                     num_local_experts=8, num_experts_per_tok=2,
                                     max_position_embeddings=32, use_cache=False,
                                     tie_word_embeddings=False, router_jitter_noise=0.0)
    torch.manual_seed(0)
    return HFCausalLM(transformers.MixtralForCausalLM(cfg)), lm_batch(8, 32, 256)


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


# Planning needs a batch that fits in memory; the paper does not state its global batch
# for Fig. 2, so these use 32 (20B, 32 GPUs), 64 (40B, 64 GPUs) and 16,384 (320B, 32,768
# GCDs) sequences of 2,048 tokens.
def plan_gpt_20b() -> tuple[torch.nn.Module, tuple]:
    return paper_gpt("gpt-20b", batch=32)


def plan_gpt_40b() -> tuple[torch.nn.Module, tuple]:
    return paper_gpt("gpt-40b", batch=64)


def plan_gpt_320b() -> tuple[torch.nn.Module, tuple]:
    return paper_gpt("gpt-320b", batch=16384)
