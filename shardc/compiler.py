"""``shardc.compile`` and the small collective helpers around it."""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from shardc.core.errors import OptionError, ShardcError
from shardc.core.launch import check_device
from shardc.core.mesh import CONTEXT, SEQUENCE_DIM, Mesh
from shardc.core.options import Options, options_from
from shardc.core.placement import Layout
from shardc.core.precision import check_no_autocast
from shardc.passes.trace import trace
from shardc.planning.planner import plan
from shardc.program import validate
from shardc.program.agreement import align, describe, settle
from shardc.program.build import build, check_batch
from shardc.program.module import ShardedModule
from shardc.program.pipeline import compile_pipeline, refuse_with_stages
from shardc.runtime.collectives import guarded


def _check_mesh(mesh: Any, world_size: int | None) -> Mesh:
    if isinstance(mesh, str):
        mesh = Mesh.parse(mesh)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"shardc.compile: mesh must be a shardc.Mesh, a spec like 'x2y1z2d2' or "
                        f"'auto', got {type(mesh).__name__}.")
    if world_size is not None and mesh.world_size != world_size:
        raise ShardcError(
            f"shardc.compile: {mesh} has {mesh.world_size} ranks (sizes multiply to "
            f"{mesh.world_size}) but torch.distributed's world size is {world_size}. Choose sizes "
            f"whose product is {world_size}, e.g. one of shardc.Mesh.all({world_size}).")
    return mesh


def compile(model: nn.Module, mesh: Mesh | str, example_inputs: tuple | list | None = None, *,
            options: Options | None = None, machine: Any = None,
            input_layouts: Mapping[int, Layout] | None = None, **option_keywords: Any) -> ShardedModule:
    """Compile ``model`` into this rank's program for ``mesh``. Collective: call it on
    every rank, after ``torch.distributed.init_process_group``, with the same model and
    global-shaped ``example_inputs``.

    The options are ``shardc.Options``' fields, given as ``options=Options(...)``, as
    keywords (``overlap=False``), or both (the keywords override ``options``); each is
    described there and in the README's options table. ``mesh="auto"`` asks the planner
    for the mesh, on ``machine`` (a ``shardc.Machine``).

    ``input_layouts`` (advanced) says how input ``i`` arrives on the ranks, as a
    ``shardc.Layout`` of its global shape: a shard of any dim over any axis, replicated,
    or a partial sum (each rank passes an addend). The default splits dim 0 over data and
    z (``shard_batch``). An input whose example tensor requires grad gets its gradient:
    the matching piece of the single-device gradient on every rank.

    ``torch.autocast`` around ``compile`` or the compiled module is refused (the comm
    report would not match what moves; use ``precision``). A model that calls
    ``torch.utils.checkpoint`` on its submodules has those submodules recomputed in
    backward (its own checkpointing, honoured: torch.export would inline it); a call on a
    function or the root compiles with a warning."""
    if not dist.is_available() or not dist.is_initialized():
        raise ShardcError(
            "shardc.compile: torch.distributed is not initialised. Call "
            "torch.distributed.init_process_group(backend, ...) on every rank first "
            "(gloo on CPU, nccl on CUDA; torchrun sets the rank and world size).")
    if not (isinstance(mesh, str) and mesh == "auto") and _check_mesh(mesh, None).pipe > 1:
        return _compile_pipeline(model, _check_mesh(mesh, dist.get_world_size()), example_inputs, options,
                                 option_keywords, input_layouts)
    # Compile locally (no communication but two small exchanges: the traces' digests
    # before lowering, the whole description's after), then settle with the other ranks: a
    # rank whose compile fails still reaches each exchange, so its peers raise too instead
    # of waiting in a collective it will never issue (shardc/program/agreement.py).
    seen: dict[str, Any] = {}
    sm: ShardedModule | None = None
    failure: Exception | None = None
    try:
        prepared = _prepare(model, mesh, example_inputs, seen, options, option_keywords, machine,
                            input_layouts)
    except Exception as e:  # noqa: BLE001 - align() and settle() re-raise it on this rank
        failure = e
    # every rank lowers the same graph in the same order (a model that traces the same
    # ops in a per-process order is given rank 0's); a rank that failed stops them all
    seen["items"] = align(seen.get("ep"), seen.get("items"), failure,
                          seen.get("redescribe", list))
    if failure is None:
        try:
            mesh, example_inputs, options = prepared
            sm = build(model, mesh, example_inputs, options, dist.get_rank(), input_layouts)
            validate.after_compile(sm, model, example_inputs)
        except Exception as e:  # noqa: BLE001 - settle() re-raises it on this rank
            failure = e
    settle(seen.get("items"), failure)
    assert sm is not None
    return sm


def _compile_pipeline(model: nn.Module, mesh: Mesh, example_inputs: Any, options: Options | None,
                      option_keywords: dict[str, Any], input_layouts: Any) -> Any:
    """A mesh with pipeline stages: shardc/program/pipeline.py."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"shardc.compile: model must be a torch.nn.Module, got {type(model).__name__}.")
    check_device(model)
    if example_inputs is None:
        raise ShardcError("shardc.compile: example_inputs is required: the global-shaped inputs a "
                          "single device would see, e.g. example_inputs=(tokens, targets).")
    validate.check_example_inputs(model, example_inputs)
    check_no_autocast("shardc.compile")
    return compile_pipeline(model, mesh, tuple(example_inputs), options_from(options, option_keywords),
                            input_layouts)


def _prepare(model: nn.Module, mesh: Mesh | str, example_inputs: tuple | list | None,
             seen: dict[str, Any], options: Options | None, option_keywords: dict[str, Any],
             machine: Any, input_layouts: Mapping[int, Layout] | None) -> tuple[Mesh, tuple, Options]:
    """``compile`` on this rank alone, up to the trace: the checked mesh, inputs and
    options. ``seen`` gets what the ranks compare (``items``), the trace (``ep``) and how
    to describe it again once aligned (``redescribe``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"shardc.compile: model must be a torch.nn.Module, got {type(model).__name__}.")
    check_device(model)  # under NCCL: the model on this rank's own GPU
    if example_inputs is None:
        raise ShardcError("shardc.compile: example_inputs is required: the global-shaped inputs a "
                          "single device would see, e.g. example_inputs=(tokens, targets).")
    validate.check_example_inputs(model, example_inputs)
    if isinstance(mesh, str) and mesh == "auto":
        if machine is None:
            raise ShardcError("shardc.compile: mesh='auto' needs machine=shardc.Machine(...) or a preset "
                              "(machine=shardc.Machine.preset('perlmutter')), or pass a mesh.")
        points = options_from(options, option_keywords).split_points
        if points is not None:
            raise OptionError(
                f"shardc.compile: split_points={points!r} fixes {len(points) + 1} pipeline stages, which "
                "mesh='auto' would choose for itself; pass a mesh with that many stages (pipe x "
                "virtual_stages), or leave split_points unset for the planner.")
        fixed = {k: v for k, v in option_keywords.items() if k == "expert_axes"}
        try:  # stages are a candidate only where the options given run with them
            refuse_with_stages(options_from(options, option_keywords), input_layouts)
            stages: bool | None = None
        except OptionError:
            stages = False
        cands = plan(model, world_size=dist.get_world_size(), machine=machine,
                     example_inputs=tuple(example_inputs), pipeline=stages, **fixed)
        best = cands[0]
        if not fixed and (options is None or options.expert_axes is None):
            option_keywords = {**option_keywords, **best.options}  # experts cut, if planned
        if best.mesh.pipe > 1:  # the planner's stages, with its micro-batches
            return _compile_pipeline(model, _check_mesh(best.mesh, dist.get_world_size()), example_inputs,
                                     options, {**option_keywords, **best.options}, input_layouts)
        mesh = best.mesh
    mesh = _check_mesh(mesh, dist.get_world_size())
    example_inputs = tuple(example_inputs)
    check_batch(example_inputs, mesh, input_layouts or {})
    check_no_autocast("shardc.compile")
    options = options_from(options, option_keywords)
    if options.microbatches not in (None, 1):
        raise OptionError(f"shardc.compile: microbatches={options.microbatches} cuts a step for pipeline "
                          f"stages, and {mesh} has none (pipe=1). Use a mesh with pipe > 1, or "
                          "accumulate gradients over calls under sm.no_sync().")
    if options.split_points is not None:
        raise OptionError(f"shardc.compile: split_points={options.split_points!r} cuts the model into "
                          f"pipeline stages, and {mesh} has none (pipe=1). Use a mesh with pipe > 1.")
    if options.virtual_stages not in (None, 1):
        raise OptionError(f"shardc.compile: virtual_stages={options.virtual_stages} cuts the model into "
                          f"chunks for pipeline stages, and {mesh} has none (pipe=1). Use a mesh with "
                          "pipe > 1 and schedule='interleaved'.")
    if dist.get_backend() != "fake" and dist.get_world_size() > 1:
        ep = trace(model, example_inputs, options.precision.compute)
        checked = mesh

        def redescribe() -> list:
            return describe(model, checked, example_inputs, options, input_layouts, ep.graph)

        seen.update(ep=ep, redescribe=redescribe, items=redescribe())
    return mesh, example_inputs, options


def shard_batch(batch: Any, mesh: Mesh | str) -> Any:
    """This rank's slice of a global batch: along dim 0 (split over data, then z) and, on a
    mesh with a context axis, along dim 1 (the sequence) over context, as the compiled
    program expects its inputs. ``batch`` is a tensor, or a tuple, list or dict of them
    (``(ids, labels)``, a tokenizer's output): each tensor in it is sliced, anything else
    passes as it is."""
    if not dist.is_initialized():
        raise ShardcError("shardc.shard_batch: torch.distributed is not initialised.")
    if isinstance(mesh, str):
        mesh = Mesh.parse(mesh)
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)  # transformers' BatchEncoding, which pytree does not open
    if not isinstance(batch, torch.Tensor):
        leaves = pytree.tree_leaves(batch)
        if not any(isinstance(t, torch.Tensor) for t in leaves):
            raise ShardcError(
                f"shardc.shard_batch: the batch is a {type(batch).__name__} that holds no tensor; "
                "pass a tensor, or a tuple, list or dict of tensors.")
        return pytree.tree_map(lambda t: shard_batch(t, mesh) if isinstance(t, torch.Tensor) else t,
                               batch)
    n = mesh.size("data") * mesh.size("z")
    if batch.shape[0] % n:
        raise ShardcError(
            f"shardc.shard_batch: a batch of {batch.shape[0]} (dim 0) cannot be split evenly over "
            f"data x z = {mesh.size('data')} x {mesh.size('z')} = {n} ranks. Use a multiple of {n}.")
    c = mesh.coords(dist.get_rank())
    i = c["data"] * mesh.size("z") + c["z"]
    step = batch.shape[0] // n
    out = batch[i * step:(i + 1) * step]
    g = mesh.size(CONTEXT)
    if g > 1 and batch.dim() > SEQUENCE_DIM:
        seq = batch.shape[SEQUENCE_DIM]
        if seq % g:
            raise ShardcError(
                f"shardc.shard_batch: a sequence of {seq} (dim {SEQUENCE_DIM}) cannot be split "
                f"evenly over context = {g} ranks. Use a multiple of {g}.")
        out = out.narrow(SEQUENCE_DIM, c[CONTEXT] * (seq // g), seq // g)
    return out


def global_mean(value: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The mean over the batch shards of a per-rank scalar (e.g. the local mean loss).
    Ranks that hold the same batch shard hold the same value, so averaging over every
    rank equals averaging over the shards."""
    t = value.detach().clone().to(torch.float64)
    with guarded(None, "all_reduce", None, "shardc.global_mean"):
        dist.all_reduce(t)
    return (t / dist.get_world_size()).to(value.dtype)
