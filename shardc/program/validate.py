"""Checks of what the user hands shardc, made on each rank before anything is
communicated, so that a bad input fails with a message naming the cause and its fix
instead of a shape error deep inside the program or a collective that never returns.

Every check here is local. When all ranks make the same mistake, all raise the same
error and the process group stays usable. When one rank alone does, that rank raises;
``compile`` still settles with the others (``agreement.settle``), and at run time its
peers' next collective fails with a ``CollectiveError`` once the rank exits or the
process group's timeout passes.
"""
from __future__ import annotations

import inspect
import math
import warnings
import weakref
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardc.core.context import GLOBAL_VAL, KIND, PLACEMENT
from shardc.core.errors import ShardcError
from shardc.core.placement import Layout
from shardc.runtime.groups import default_device


def check_example_inputs(model: nn.Module, example_inputs: Any) -> None:
    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
        raise ShardcError(
            f"shardc.compile: example_inputs must be a tuple of forward's positional arguments, "
            f"got a {type(example_inputs).__name__}. Wrap a single input: example_inputs=(x,).")
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C forward: nothing to check against
        return
    try:
        sig.bind(*example_inputs)
    except TypeError as e:
        raise ShardcError(
            f"shardc.compile: example_inputs has {len(example_inputs)} element(s), which do not "
            f"fit {type(model).__name__}.forward{sig} ({e}). Pass one example per positional "
            "argument, unnested, e.g. example_inputs=(tokens, targets).") from None
    _refuse_model_state_as_input(model, example_inputs)


def _refuse_model_state_as_input(model: nn.Module, example_inputs: Any) -> None:
    """An example input that is (a view of) one of the model's parameters or buffers.

    The compiled module holds its own shards of the model's state, so such an input would
    be read as data apart from them: its gradient (a parameter's) would go to the tensor
    passed, not to the parameter the optimizer steps, and a later call passing the
    parameter would read the original model's full tensor. The same tensor passed twice,
    or views of one storage, are separate inputs and need nothing (passes/trace.py)."""
    owners: dict[int | None, str] = {}
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            owners.setdefault(_storage_id(t), f"{kind} {name!r}")
    owners.pop(None, None)
    flat, _ = pytree.tree_flatten(tuple(example_inputs))
    for i, x in enumerate(flat):
        owner = owners.get(_storage_id(x)) if isinstance(x, torch.Tensor) else None
        if owner is not None:
            raise ShardcError(
                f"shardc.compile: example input {i} is the model's {owner} (or a view of it). "
                "The compiled model keeps its own shards of its parameters and buffers, so an "
                "input that is one of them "
                "would be read apart from them (a parameter's gradient would not reach it). Read "
                "it inside forward (self.<name>), or pass a copy if it is only data: "
                "example_inputs=(..., t.detach().clone(), ...).")


def _storage_id(t: torch.Tensor) -> int | None:
    """What two views of one storage share (a meta tensor's storage is its own too);
    None for a tensor subclass without a storage of its own."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _original_placeholders(sm: Any) -> list[tuple[str, Any, Any]]:
    """(name, global value, layout) of each user input of the compiled program."""
    return [(n.target, n.meta.get(GLOBAL_VAL), n.meta.get(PLACEMENT))
            for n in sm.graph_module.graph.nodes
            if n.op == "placeholder" and n.meta.get(KIND) == "input"]


def after_compile(sm: Any, model: nn.Module, example_inputs: Sequence[Any]) -> None:
    """Record what the run-time checks need; note what compiles but deserves a word."""
    sm._shardc_inputs = _original_placeholders(sm)
    # The program was traced in one mode (dropout on or off); sm.eval() cannot change
    # it, so the module starts in that mode and forward refuses the other.
    sm._shardc_traced_training = model.training
    sm.train(model.training)
    sm.unused_parameters = [n.meta["shardc_param"] for n in sm.graph_module.graph.nodes
                            if n.op == "placeholder" and n.meta.get(KIND) == "param" and not n.users]
    trainable = any(p.requires_grad for p in model.parameters())
    if not trainable and not any(isinstance(x, torch.Tensor) and x.requires_grad
                                 for x in example_inputs):
        warnings.warn(
            f"shardc.compile: {type(model).__name__} has no parameter that requires grad and no "
            "example input requires grad: the program runs forward, but backward has nothing to "
            "compute.", stacklevel=3)
    for name, p in model.named_parameters():
        _remember_original(p, name)
    _install_optimizer_check()


def check_inputs(sm: Any, inputs: tuple, kwargs: dict, flat: list) -> None:
    """This rank's inputs against what the program was traced for: count, tensor or not,
    dtype, device, shape. Runs before the program's first collective."""
    traced = getattr(sm, "_shardc_inputs", None)
    if traced is None:  # a ShardedModule built without shardc.compile (offline)
        traced = sm._shardc_inputs = _original_placeholders(sm)
    traced_training = getattr(sm, "_shardc_traced_training", sm.training)
    if sm.training != traced_training:
        was, now = ("training", "eval") if traced_training else ("eval", "training")
        raise ShardcError(
            f"ShardedModule: the program was traced in {was} mode (dropout and the like are part "
            f"of it), but the module is now in {now} mode. Compile a second program from the "
            f"model in {now} mode (shardc.compile(model.{'eval' if now == 'eval' else 'train'}(), "
            "...)) and call that one.")
    names = ", ".join(n for n, _, _ in traced)
    positional = not kwargs and len(inputs) == len(traced)
    if not positional and len(flat) != len(traced):
        raise ShardcError(
            f"ShardedModule: expected {len(traced)} inputs ({names}), as in example_inputs, got "
            f"{len(flat)}. Call sm(*inputs) with this rank's piece of each "
            "(shardc.shard_batch(global_batch, mesh)).")
    got = list(inputs) if positional else flat
    device = _program_device(sm)
    batch = sm.mesh.size("data") * sm.mesh.size("z")
    for i, (x, (name, gval, lay)) in enumerate(zip(got, traced)):
        what = f"ShardedModule: input {i} ({name!r})"
        if not isinstance(gval, torch.Tensor):
            if not _same_constant(x, gval):
                # torch.export specialises a number (or string, flag) argument to the
                # example's value: the program computes with that one whatever is passed
                raise ShardcError(
                    f"{what} is {x!r}, but the program was traced with {gval!r} there, and a "
                    "number or other non-tensor argument is part of the program (torch.export "
                    "bakes its value in: the program would compute with "
                    f"{gval!r}). Pass it as a tensor (torch.tensor({x!r})) to change it from call "
                    "to call, or compile a program for each value.")
            continue
        if not isinstance(x, torch.Tensor):
            raise ShardcError(
                f"{what} is a {type(x).__name__}, but the program was traced with a tensor of "
                f"shape {list(gval.shape)} and dtype {_dt(gval.dtype)} there. Pass a tensor "
                "(torch.as_tensor(...)).")
        if x.dtype != gval.dtype:
            raise ShardcError(
                f"{what} has dtype {_dt(x.dtype)}, but the program was traced for {_dt(gval.dtype)}. "
                f"Cast it (x.to(torch.{_dt(gval.dtype)})), or compile with an example of dtype "
                f"{_dt(x.dtype)}.")
        if x.requires_grad and torch.is_grad_enabled() and name not in sm.ctx.grad_inputs:
            # the program computes gradients for the inputs whose example required one
            # (the lowering lays out and reduces those alone): another input's .grad would
            # stay None, and whatever computed it upstream would silently not train
            raise ShardcError(
                f"{what} requires grad, but the example input there did not, so the program "
                "was traced without its gradient: backward would leave it, and whatever "
                "computed it, without one. Compile with an example that requires grad there "
                "(example.requires_grad_()), or pass x.detach() where no gradient is wanted.")
        if device is not None and x.device != device:
            raise ShardcError(
                f"{what} is on device {x.device}, but the program runs on {device} (where its "
                f"parameters and collectives are). Move it: x.to('{device}').")
        if gval.dim() > 0:
            want = lay.local_shape(gval.shape, sm.mesh) if isinstance(lay, Layout) else \
                [gval.shape[0] // batch] + list(gval.shape[1:])
            if list(x.shape) != list(want):
                empty = " (an empty batch)" if x.dim() and x.shape[0] == 0 else ""
                raise ShardcError(
                    f"{what} has shape {list(x.shape)}{empty}, but this rank's piece of the example "
                    f"input {list(gval.shape)} laid out as {lay} is {list(want)} (by default dim 0 "
                    f"is split over data x z = {batch}). Pass shardc.shard_batch(global_batch, "
                    "mesh) of a global batch shaped like the example; a different shape needs its "
                    "own compile.")


def _same_constant(x: Any, traced: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return False
    if isinstance(x, float) and isinstance(traced, float) and math.isnan(x) and math.isnan(traced):
        return True
    try:
        return x is traced or bool(x == traced)
    except Exception:  # noqa: BLE001 - an argument that cannot be compared: trust it
        return True


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _program_device(sm: Any) -> torch.device | None:
    for p in sm.parameters():
        return None if p.device.type == "meta" else p.device

    return default_device()


# ----------------------------------------------------- optimizer over the wrong model
# A common slip is torch.optim.AdamW(model.parameters()) instead of sm.parameters():
# shardc trains its own shards, the original parameters never get a gradient, and
# opt.step() silently does nothing. An optimizer step pre-hook (process-wide) catches
# an optimizer that holds original parameters of a compiled model none of whose
# parameters has a gradient. One that trains the original as a single-device reference
# (its parameters do have gradients) passes.
_ORIGINALS: dict[int, tuple[weakref.ref, str]] = {}
_CHECKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_HOOKED = False


def _remember_original(p: torch.Tensor, name: str) -> None:
    key = id(p)

    def forget(_: Any, key: int = key) -> None:
        entry = _ORIGINALS.get(key)
        if entry is not None and entry[0]() is None:
            del _ORIGINALS[key]

    _ORIGINALS[key] = (weakref.ref(p, forget), name)


def _original_name(p: torch.Tensor) -> str | None:
    entry = _ORIGINALS.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


def _install_optimizer_check() -> None:
    global _HOOKED
    if not _HOOKED:

        register_optimizer_step_pre_hook(_check_optimizer)
        _HOOKED = True


def _check_optimizer(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if opt in _CHECKED:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    originals = [n for n in (_original_name(p) for p in params) if n is not None]
    if originals and all(p.grad is None for p in params):
        shown = ", ".join(repr(n) for n in originals[:3]) + (" ..." if len(originals) > 3 else "")
        raise ShardcError(
            f"shardc: {type(opt).__name__}.step() over the parameters of the model passed to "
            f"shardc.compile ({shown}), none of which has a gradient: shardc trains the compiled "
            "module's shards, never the original tensors, so this step would do nothing. Build "
            "the optimizer over the compiled module: torch.optim.AdamW(sm.parameters(), ...).")
    _CHECKED.add(opt)
