"""One-process tests (fake process group) of compile(precision=...): what the program
casts where, what explain says, and the policy's own checks. Training under the policy
is tested against one device on real gloo ranks in test_precision_gloo.py."""
from __future__ import annotations

import pytest
import torch
from models import GPT, llama

import shardc
from shardc.core.context import GLOBAL_VAL, KIND
from shardc.runtime import collectives as C

pytestmark: list = []  # one process, fast: the fast tier


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)


def test_policies_by_name_and_value() -> None:
    assert shardc.Precision() == shardc.Precision(torch.bfloat16, torch.float32)
    assert str(shardc.Precision()) == "bf16 compute, fp32 gradient reductions"
    assert str(shardc.Precision(torch.bfloat16, torch.bfloat16)) == "bf16 compute, bf16 gradient reductions"
    assert not shardc.Precision(torch.float32, torch.float32).mixed
    with pytest.raises(ValueError, match="fp16 would need loss scaling"):
        shardc.Precision(torch.float16)
    with pytest.raises(ValueError, match="narrower dtype than the fp32 compute"):
        shardc.Precision(torch.float32, torch.bfloat16)


@pytest.mark.parametrize("make", [GPT, llama])
def test_weights_gathered_in_bf16_from_fp32_shards(fake_world, make) -> None:
    """Every weight all-gather sends bf16 from an fp32 stored shard and reduce-scatters
    the gradient in fp32; the stored parameters stay fp32."""
    fake_world(4)
    torch.manual_seed(0)
    sm = shardc.compile(make(), "x1y1z2d2", example_inputs=_batch(), precision="bf16")
    gathers = [n for n in sm.graph_module.graph.nodes if n.target is C.all_gather_start
               and n.args[0].op == "placeholder"]
    assert gathers
    for n in gathers:
        assert n.args[0].meta[GLOBAL_VAL].dtype == torch.float32, n.format_node()
        assert n.kwargs.get("dtype") == torch.bfloat16, n.format_node()
        # reduce-scattered in the parameter's own dtype, fp32 (None: no change)
        assert n.kwargs.get("reduce_dtype") is None, n.format_node()
    assert {p.dtype for p in sm.parameters()} == {torch.float32}
    # nothing gathers a weight in fp32 and casts it afterwards
    for n in sm.graph_module.graph.nodes:
        if n.op == "call_function" and n.meta.get(KIND) == "collective":
            assert n.args[0].meta.get(KIND) != "param" or n.kwargs.get("dtype"), n.format_node()
    text = shardc.explain(sm)
    assert "precision: bf16 compute, fp32 gradient reductions" in text
    assert "send=bfloat16, reduce=float32" in text


def test_bf16_reductions_cast_the_step_reductions(fake_world) -> None:
    fake_world(4)
    torch.manual_seed(0)
    model, batch = GPT(), _batch()
    f32 = shardc.comm_report(shardc.compile(model, "x1y1z1d4", example_inputs=batch))
    b16 = shardc.comm_report(shardc.compile(model, "x1y1z1d4", example_inputs=batch,
                                            precision=shardc.Precision(torch.bfloat16, torch.bfloat16)))
    step32, step16 = f32.total_bytes(phase="step"), b16.total_bytes(phase="step")
    assert step32 > 0 and step16 * 2 == step32


def test_trace_keeps_the_models_input_names(fake_world) -> None:
    """The policy traces a wrapper; the inputs keep the model's own names, which the
    input checks' messages use."""
    fake_world(4)
    torch.manual_seed(0)
    sm = shardc.compile(GPT(), "x1y1z2d2", example_inputs=_batch(), precision="bf16")
    names = [n.name for n in sm.graph_module.graph.nodes
             if n.op == "placeholder" and n.meta.get(KIND) == "input"]
    assert names == ["idx", "targets"], names
    with pytest.raises(shardc.ShardcError, match="input 0 \\('idx'\\)"):
        sm(torch.zeros(1, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))


def test_cast_at_use_is_the_one_device_policy() -> None:
    """CastAtUse runs the model's own parameters (shared, fp32) with bf16 compute: its
    loss is the bf16 model's, and its gradients land on the fp32 parameters."""
    torch.manual_seed(0)
    model = GPT()
    tok, tgt = _batch()
    wrapped = shardc.CastAtUse(model, torch.bfloat16)
    assert dict(wrapped.named_parameters()).keys() == dict(model.named_parameters()).keys()
    loss = wrapped(tok, tgt)
    loss.backward()
    assert loss.dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    bf16 = GPT()
    bf16.load_state_dict(model.state_dict())
    assert torch.equal(loss, bf16.to(torch.bfloat16)(tok, tgt))


def test_autocast_error_names_the_policy(fake_world) -> None:
    fake_world(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(shardc.ShardcError, match="precision='bf16'"):
            shardc.compile(GPT(), "x1y1z2d2", example_inputs=_batch())
