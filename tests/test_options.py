"""``shardc.Options``: one object holds every option of ``compile``, checked in one place,
and its mistakes are ``ShardcError``s that Python's own catches (ValueError, TypeError)
also catch. One process: options are checked before anything communicates."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from models import MLPChain

import shardc
from shardc.core.options import INTERNAL

pytestmark: list = []  # one process (fake process group), fast: the fast tier


def _mlp() -> tuple[torch.nn.Module, tuple]:
    return MLPChain(dim=16, layers=2), (torch.randn(8, 16), torch.randn(8, 16))


def test_options_object_and_keywords_compile_the_same_program(fake_world) -> None:
    fake_world(4)
    mesh = shardc.Mesh(x=2, data=2)
    model, inputs = _mlp()
    by_keyword = shardc.compile(model, mesh, inputs, overlap=False, bucket_mb=0.5, prefetch_depth=2)
    by_object = shardc.compile(model, mesh, inputs,
                               options=shardc.Options(overlap=False, bucket_mb=0.5, prefetch_depth=2))
    assert by_keyword.ctx.options == by_object.ctx.options
    assert by_keyword.ctx.options.overlap is False and by_object.ctx.options.bucket_mb == 0.5
    assert shardc.explain(by_keyword) == shardc.explain(by_object)
    # keywords override the object's fields
    both = shardc.compile(model, mesh, inputs, options=shardc.Options(overlap=False), overlap=True)
    assert both.ctx.options == shardc.Options(overlap=True)


def test_every_option_is_a_keyword_of_compile(fake_world) -> None:
    fake_world(2)
    model, inputs = _mlp()
    public = [f for f in dataclasses.fields(shardc.Options) if f.name not in INTERNAL]
    assert len(public) >= 11
    for f in public:  # each default given by name is accepted and kept
        default = getattr(shardc.Options(), f.name)
        sm = shardc.compile(model, shardc.Mesh(data=2), inputs, **{f.name: default})
        assert getattr(sm.ctx.options, f.name) == default


@pytest.mark.parametrize("kw, match", [
    ({"overlap": "no"}, r"option overlap='no' must be a bool \(True or False\), got str"),
    ({"prefetch_depth": "2"}, r"option prefetch_depth='2' must be an int, got str"),
    ({"prefetch_depth": True}, r"option prefetch_depth=True must be an int, got bool"),
    ({"bucket_mb": "25"}, r"option bucket_mb='25' must be a float \| None, got str"),
    ({"shard_optimizer": 1}, r"option shard_optimizer=1 must be a bool"),
    ({"selective": True}, r"no option named 'selective'; the options are activation_checkpoint, "),
    ({"refuse_indivisible": True}, r"no option named 'refuse_indivisible'"),
])
def test_an_option_of_the_wrong_type_or_name_is_a_type_error(fake_world, kw: dict, match: str) -> None:
    fake_world(2)
    model, inputs = _mlp()
    with pytest.raises(shardc.OptionTypeError, match=match) as e:
        shardc.compile(model, shardc.Mesh(data=2), inputs, **kw)
    assert isinstance(e.value, TypeError) and isinstance(e.value, shardc.ShardcError)


@pytest.mark.parametrize("kw, match", [
    ({"gemm_modes": "XX"}, r"gemm_modes='XX' is not one of"),
    ({"backend": "tvm"}, r"backend='tvm' is not one of"),
    ({"bucket_mb": -1.0}, r"bucket_mb must be >= 0"),
    ({"precision": "fp16"}, r"precision='fp16' is not one of"),
    ({"activation_checkpoint": "everything"}, r"activation_checkpoint='everything' is not one of"),
    # pairs that cannot work name both options and the way out
    ({"reshard_after_forward": True, "step_graph": False}, r"reshard_after_forward=True .* needs step_graph=True"),
    ({"activation_checkpoint": "selective", "backend": "inductor", "step_graph": False},
     r"selective recompute .* with backend='inductor' is applied inside the step program, which "
     r"step_graph=False does not run; use step_graph=True, activation_checkpoint='blocks', or backend='eager'"),
    ({"gemm_modes": "NT", "step_graph": False}, r"gemm_modes='NT' .* use gemm_modes='default' with them"),
])
def test_a_bad_value_or_pair_is_a_value_error_naming_the_options(kw: dict, match: str) -> None:
    with pytest.raises(shardc.OptionError, match=match) as e:
        shardc.Options(**kw)
    assert isinstance(e.value, ValueError) and not isinstance(e.value, TypeError)


def test_options_object_of_the_wrong_type_is_refused(fake_world) -> None:
    fake_world(2)
    model, inputs = _mlp()
    with pytest.raises(shardc.OptionTypeError, match="options must be a shardc.Options, got dict"):
        shardc.compile(model, shardc.Mesh(data=2), inputs, options={"overlap": False})


def test_selective_policy_errors_are_option_errors() -> None:
    with pytest.raises(shardc.OptionError, match="'mm' name no op"):
        shardc.Selective(save=["mm"])
    with pytest.raises(shardc.OptionTypeError):
        shardc.Selective(save="aten.mm")


def test_block_recompute_with_inductor_needs_the_torch_it_was_verified_on(monkeypatch) -> None:
    """The compiled segments under autograd's checkpoint (``step_graph=False``): accepted
    from ``RECOMPUTE_COMPILED_FROM`` (the gloo cases of test_recompute_gloo train it
    there); refused below, where torch 2.8 left some gradients unreduced."""
    from shardc.core.compat import RECOMPUTE_COMPILED_FROM

    monkeypatch.setattr(torch, "__version__", "2.8.0+cpu")
    with pytest.raises(shardc.OptionError, match=r"activation_checkpoint='blocks' with backend='inductor' "
                       r"needs torch >= 2\.11 \(this is 2\.8\.0\+cpu\): .* went unreduced"):
        shardc.Options(activation_checkpoint="blocks", backend="inductor", step_graph=False)
    shardc.Options(activation_checkpoint="blocks")  # eager recompute: every supported torch
    # with the step program the policy is a pass of it (no compiled code under a checkpoint)
    assert shardc.Options(activation_checkpoint="blocks", backend="inductor").recompute_in_step
    monkeypatch.setattr(torch, "__version__", ".".join(map(str, RECOMPUTE_COMPILED_FROM)) + ".0")
    assert shardc.Options(activation_checkpoint="blocks", backend="inductor", step_graph=False).recompute
