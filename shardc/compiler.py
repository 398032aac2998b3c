"""``shardc.compile`` and the small collective helpers around it."""
from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from shardc.program import validate
from shardc.program.agreement import align, describe, settle
from shardc.core.context import CompileContext, Options
from shardc.core.errors import ShardcError, ShardcWarning
from shardc.core.launch import check_device
from shardc.core.mesh import Mesh
from shardc.program.module import ShardedModule
from shardc.core.placement import Layout
from shardc.passes import run_pipeline
from shardc.passes.recompute import RECOMPUTE, Selective, mark_and_split, repeated_blocks
from shardc.passes.trace import checkpointed_modules, trace
from shardc.core.precision import check_no_autocast
from shardc.runtime.collectives import Runtime, guarded


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


def _check_batch(example_inputs: tuple, mesh: Mesh, laid_out: Mapping[int, Layout] | None = None) -> None:
    n = mesh.size("data") * mesh.size("z")
    for i, x in enumerate(example_inputs):
        if i in (laid_out or {}):  # checked against its own layout by _input_layouts
            continue
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == 0:
            raise ShardcError(
                f"shardc.compile: example input {i} is an empty batch (0 rows in dim 0): there is "
                f"nothing to trace a step on. Pass a global batch of a positive multiple of {n} rows.")
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] % n:
            raise ShardcError(
                f"shardc.compile: example input {i} has batch size {x.shape[0]} (dim 0), which "
                f"data x z = {mesh.size('data')} x {mesh.size('z')} = {n} does not divide. "
                f"Use a global batch that is a multiple of {n}, or smaller 'data'/'z' axes.")


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name a parameter has in the state dict -> the one named_parameters() uses
    (tied weights have several)."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters():
        first.setdefault(id(p), name)
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first[id(p)]
    return out


def compile(model: nn.Module, mesh: Mesh | str, example_inputs: tuple | list | None = None, *,
            transpose_alternate: bool = True, overlap: bool = True, prefetch_depth: int = 1,
            gemm_modes: str = "default", step_graph: bool = True, bucket_mb: float | None = None,
            reshard_after_forward: bool = False, machine: Any = None,
            input_layouts: Mapping[int, Layout] | None = None,
            activation_checkpoint: Any = "none", precision: Any = "fp32",
            shard_optimizer: bool = False, backend: str = "eager") -> ShardedModule:
    """Compile ``model`` into this rank's program for ``mesh``. Collective: call it on
    every rank, after ``torch.distributed.init_process_group``, with the same model and
    global-shaped ``example_inputs``.

    ``input_layouts`` (advanced) says how input ``i`` arrives on the ranks, as a
    ``shardc.Layout`` of its global shape: a shard of any dim over any axis, replicated,
    or a partial sum (each rank passes an addend). The default splits dim 0 over data and
    z (``shard_batch``). An input whose example tensor requires grad gets its gradient:
    the matching piece of the single-device gradient on every rank.

    ``step_graph`` (default True) runs forward and backward as one traced program whose
    passes move and pack the backward collectives: ``overlap`` schedules them against
    compute (OAR, ORS, early buckets) and returns an output whose last step is a
    collective (a loss averaged over data) before that collective is waited, as a
    ``shardc.PendingOutput`` that waits on its first read (``loss.backward()`` does not
    read it); ``bucket_mb`` packs the post-backward gradient reductions into buckets of
    that many MiB (0: one per gradient); left unset it is DDP's default, 25 MiB buckets
    after a first one of 1 MiB, and a size given caps every bucket, the first too, as
    DDP's ``bucket_cap_mb`` does. ``step_graph=False``
    runs autograd's own backward over the forward program (bitwise the same gradients as
    the step program with ``bucket_mb=0``). ``reshard_after_forward`` frees each gathered
    weight after forward and gathers it again in backward (FSDP2's default): less memory,
    one more all-gather per such weight, counted by the comm report.

    ``activation_checkpoint="blocks"`` recomputes every repeated block in backward (run
    with autograd's backward over the forward program: the step passes do not apply);
    ``"selective"`` (or ``shardc.Selective(save=[...])``) cuts the same blocks but keeps
    the outputs of their GEMMs and attention (or of the ops named) and recomputes the
    rest, as torch's selective activation checkpointing does.
    ``precision="bf16"`` computes and communicates in bf16 with fp32 parameters and
    gradient reductions; a ``shardc.Precision(compute, reduce)`` says both dtypes (see
    ``shardc.core.precision``). ``shard_optimizer=True`` shards the optimizer state
    over data (ZeRO-1/2): ``sm.parameters()`` are then each rank's 1/G_data slices of the
    stored shards (``runtime/zero.py``).
    ``torch.autocast`` around ``compile`` or the compiled module is refused (the comm
    report would not match what moves; use ``precision``).

    A model that calls ``torch.utils.checkpoint`` on its submodules has those
    submodules recomputed in backward (its own checkpointing, honoured: torch.export
    would inline it); a call on a function or the root compiles with a warning.

    ``prefetch_depth`` (default 1) issues each weight's all-gather that many GEMMs ahead,
    in forward and in a recompute's replay of a block (a gather stays in its block's
    segment: one issued ahead of a block boundary runs with the next block).

    ``gemm_modes`` ("default", "NN", "NT", "TN", "auto") puts each GEMM of the step
    program in a form (operand layouts); "auto" times the forms on the first batch.

    ``backend="inductor"`` compiles the compute between the program's collectives with
    ``torch.compile`` (the collectives stay eager; see ``shardc.program.backend``), in both parts
    of the step program (and in the forward program, which runs without gradients)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ShardcError(
            "shardc.compile: torch.distributed is not initialised. Call "
            "torch.distributed.init_process_group(backend, ...) on every rank first "
            "(gloo on CPU, nccl on CUDA; torchrun sets the rank and world size).")
    # Compile locally (no communication but two small exchanges: the traces' digests
    # before lowering, the whole description's after), then settle with the other ranks: a
    # rank whose compile fails still reaches each exchange, so its peers raise too instead
    # of waiting in a collective it will never issue (shardc/program/agreement.py).
    seen: dict[str, Any] = {}
    sm: ShardedModule | None = None
    failure: Exception | None = None
    try:
        prepared = _prepare(model, mesh, example_inputs, seen, transpose_alternate=transpose_alternate,
                            overlap=overlap, prefetch_depth=prefetch_depth, gemm_modes=gemm_modes,
                            step_graph=step_graph, bucket_mb=bucket_mb,
                            reshard_after_forward=reshard_after_forward,
                            machine=machine, input_layouts=input_layouts,
                            activation_checkpoint=activation_checkpoint, precision=precision,
                            shard_optimizer=shard_optimizer, backend=backend)
    except Exception as e:  # noqa: BLE001 - align() and settle() re-raise it on this rank
        failure = e
    # every rank lowers the same graph in the same order (a model that traces the same
    # ops in a per-process order is given rank 0's); a rank that failed stops them all
    seen["items"] = align(seen.get("ep"), seen.get("items"), failure,
                          seen.get("redescribe", list))
    if failure is None:
        try:
            mesh, example_inputs, options = prepared
            sm = _compile(model, mesh, example_inputs, options, dist.get_rank(), input_layouts)
            validate.after_compile(sm, model, example_inputs)
        except Exception as e:  # noqa: BLE001 - settle() re-raises it on this rank
            failure = e
    settle(seen.get("items"), failure)
    assert sm is not None
    return sm


def _prepare(model: nn.Module, mesh: Mesh | str, example_inputs: tuple | list | None,
             seen: dict[str, Any], *, transpose_alternate: bool, overlap: bool,
             prefetch_depth: int, gemm_modes: str, step_graph: bool, bucket_mb: float | None,
             reshard_after_forward: bool, machine: Any,
             input_layouts: Mapping[int, Layout] | None, activation_checkpoint: Any,
             precision: Any, shard_optimizer: bool, backend: str
             ) -> tuple[Mesh, tuple, Options]:
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
        from shardc.planning.planner import plan  # noqa: PLC0415 - optional feature

        if machine is None:
            raise ShardcError("shardc.compile: mesh='auto' needs machine=shardc.Machine(...) or a preset "
                              "(machine=shardc.Machine.preset('perlmutter')), or pass a mesh.")
        cands = plan(model, world_size=dist.get_world_size(), machine=machine,
                     example_inputs=tuple(example_inputs))
        mesh = cands[0].mesh
    mesh = _check_mesh(mesh, dist.get_world_size())
    example_inputs = tuple(example_inputs)
    _check_batch(example_inputs, mesh, input_layouts or {})
    validate.check_option_types(Options, transpose_alternate=transpose_alternate, overlap=overlap,
                                prefetch_depth=prefetch_depth, gemm_modes=gemm_modes,
                                step_graph=step_graph, bucket_mb=bucket_mb,
                                reshard_after_forward=reshard_after_forward)
    check_no_autocast("shardc.compile")
    options = Options(transpose_alternate=transpose_alternate, overlap=overlap,
                      prefetch_depth=prefetch_depth, gemm_modes=gemm_modes,
                      step_graph=step_graph, bucket_mb=bucket_mb,
                      reshard_after_forward=reshard_after_forward,
                      activation_checkpoint=activation_checkpoint, precision=precision,
                      shard_optimizer=shard_optimizer, backend=backend)
    if dist.get_backend() != "fake" and dist.get_world_size() > 1:
        ep = trace(model, example_inputs, options.precision.compute)
        checked = mesh

        def redescribe() -> list:
            return describe(model, checked, example_inputs, options, input_layouts, ep.graph)

        seen.update(ep=ep, redescribe=redescribe, items=redescribe())
    return mesh, example_inputs, options


_WRITE_BACK = ("shardc writes back only buffers (running statistics). Return the new value "
               "from forward instead of writing it into an input.")


def _refuse_input_writes(ep: torch.export.ExportedProgram, user_inputs: list[str]) -> None:
    """Refuse an in-place op that writes into a user input (or a view of one).

    A decomposed trace is functional and shows such a write as a USER_INPUT_MUTATION
    output (refused above); a trace whose ops all have rules keeps the op in place, and
    the rank's program would write into its own piece of the input (or into the copy that
    entry makes of it), which is not what the model does on one device."""
    from shardc.passes import aliases

    inputs = set(user_inputs)
    root: dict[torch.fx.Node, str] = {}  # node -> the user input it is a view of
    for n in ep.graph.nodes:
        if n.op == "placeholder" and n.name in inputs:
            root[n] = n.name
            continue
        for val in aliases.written(n):
            if val in root:
                where = n.meta.get("stack_trace", "").strip().splitlines()
                at = f" ({where[-2].strip()})" if len(where) >= 2 else ""
                raise ShardcError(
                    f"shardc.compile: the model writes into its input {root[val]!r} during forward "
                    f"({n.target}{at}); {_WRITE_BACK}")
        base = aliases.view_of(n)  # select, slice, view, transpose, ...
        if base is not None and base in root:
            root[n] = root[base]


def _compile(model: nn.Module, mesh: Mesh, example_inputs: tuple, options: Options,
             rank: int, input_layouts: Mapping[int, Layout] | None = None) -> ShardedModule:
    ep = trace(model, example_inputs, options.precision.compute)
    own_blocks, lost = _checkpointed_blocks(model, ep)
    if own_blocks and (options.backend != "eager" or options.reshard_after_forward
                       or options.gemm_modes != "default"):
        # those run the whole-step program, which the recompute does not wrap: keep the
        # user's explicit option and say what is not honoured
        lost, own_blocks = own_blocks + lost, []
    if lost:
        warnings.warn(
            f"shardc.compile: {type(model).__name__} calls torch.utils.checkpoint on "
            f"{', '.join(lost)}, which the compiled program cannot recompute (a function or the "
            "root rather than a submodule, or with backend, reshard_after_forward or gemm_modes "
            "options, which run the whole-step program); torch.export inlines it, so these "
            "activations are kept. Results are unchanged. Checkpoint submodules "
            "(checkpoint(self.block, x)) with the default options, or use "
            "compile(..., activation_checkpoint='blocks').", ShardcWarning, stacklevel=3)
    canonical = _canonical_names(model)
    roles: dict[str, tuple[str, str]] = {}
    sig = ep.graph_signature
    user_inputs: list[str] = []
    for spec in sig.input_specs:
        name = spec.arg.name
        kind = spec.kind.name
        if kind == "PARAMETER":
            roles[name] = ("param", canonical.get(spec.target, spec.target))
        elif kind == "BUFFER":
            roles[name] = ("buffer", spec.target)
        elif kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
            roles[name] = ("constant", spec.target)
        else:
            roles[name] = ("input", name)
            user_inputs.append(name)
    for spec in sig.output_specs:
        # a running statistic (BatchNorm's) is an output of the program that the
        # module writes back into its buffer (ShardedModule.forward)
        if spec.kind.name not in ("USER_OUTPUT", "BUFFER_MUTATION"):
            raise ShardcError(
                f"shardc.compile: the model mutates state during forward ({spec.kind.name} of "
                f"{spec.target!r}); {_WRITE_BACK}")
    _refuse_input_writes(ep, user_inputs)
    runtime = Runtime(mesh, rank)
    trainable = frozenset(canonical[n] for n, p in model.named_parameters() if p.requires_grad)
    layouts, grad_inputs = _input_layouts(example_inputs, user_inputs, input_layouts or {}, mesh)
    ctx = CompileContext(mesh=mesh, options=options, rt=runtime.key, roles=tuple(roles.items()),
                         trainable=trainable, rank=rank, input_layouts=layouts,
                         grad_inputs=grad_inputs)
    program = run_pipeline(ep.graph_module, ctx)
    sm = ShardedModule(program, ctx, model, ep, canonical, runtime)
    if options.recompute:
        blocks = repeated_blocks(model)
        if not blocks:
            raise ShardcError(
                f"shardc.compile: activation_checkpoint={options.activation_checkpoint!r} found "
                f"no repeated blocks in {type(model).__name__} (a ModuleList or Sequential of "
                "two or more modules of one class). Use activation_checkpoint='none'.")
        selective = options.activation_checkpoint if isinstance(options.activation_checkpoint,
                                                                Selective) else None
        object.__setattr__(sm, "_recompute", mark_and_split(program, blocks, runtime.key, selective))
    elif own_blocks:
        # the model's own torch.utils.checkpoint calls on submodules, honoured: those
        # modules' segments of the rank's program are recomputed in backward
        object.__setattr__(sm, "_recompute", mark_and_split(program, own_blocks, runtime.key))
        marked = {n.meta.get(RECOMPUTE) for n in program.graph.nodes}
        done = [b for b in own_blocks if b in marked]
        missed = [b for b in own_blocks if b not in marked]
        if done:
            sm.decisions.append("recompute in backward, as the model's torch.utils.checkpoint "
                                f"calls ask: {', '.join(done)}")
        if missed:
            # export records a module only when it is called (module(x)); the trace turns
            # both checkpoint forms, and a checkpointed module.forward, into such a call
            # (passes/checkpoint_calls.py), so this is a module whose ops still land with
            # its caller's (called some other way inside the checkpointed function)
            warnings.warn(
                f"shardc.compile: {type(model).__name__} calls torch.utils.checkpoint on "
                f"{', '.join(missed)}, whose ops the trace does not attribute to it (is it "
                "called other than as module(x)?); these activations are kept. Checkpoint "
                "the module itself: checkpoint(self.block, x, use_reentrant=False).",
                ShardcWarning, stacklevel=3)
    if options.backend != "eager":
        from shardc.program.backend import build_runner  # noqa: PLC0415 - imports torch's compiler stack

        sm.set_runner(build_runner(program, options.backend))
    return sm


def _checkpointed_blocks(model: nn.Module, ep: Any) -> tuple[list[str], list[str]]:
    """The model's torch.utils.checkpoint calls (recorded while tracing): (submodules the
    program can recompute as blocks, other calls it cannot: functions, the root)."""
    modules = {name for name, _ in model.named_modules() if name}
    calls = list(checkpointed_modules(ep))
    return [c for c in calls if c in modules], [c for c in calls if c not in modules]


def _input_layouts(example_inputs: tuple, names: list[str], given: Mapping[int, Layout],
                   mesh: Mesh) -> tuple[tuple[tuple[str, Layout], ...], frozenset[str]]:
    """Check ``input_layouts`` against the example inputs; key them by placeholder name."""
    flat, _ = pytree.tree_flatten(example_inputs)
    if len(flat) != len(names):  # export keeps one placeholder per tensor leaf
        flat = [x for x in flat if isinstance(x, torch.Tensor)]
    if given and (len(flat) != len(example_inputs) or len(flat) != len(names)):
        raise ShardcError("shardc.compile: input_layouts needs example_inputs to be a flat tuple of "
                          "tensors (its keys are positions in it); nest nothing, or pass no "
                          "input_layouts.")
    out = []
    for i, lay in given.items():
        if not isinstance(i, int) or not 0 <= i < len(flat) or not isinstance(flat[i], torch.Tensor):
            raise ShardcError(f"shardc.compile: input_layouts key {i!r} is not the position of a "
                              f"tensor in example_inputs (0..{len(flat) - 1}).")
        if not isinstance(lay, Layout) or lay.ndim != flat[i].dim():
            raise ShardcError(f"shardc.compile: input_layouts[{i}] must be a shardc.Layout with "
                              f"ndim={flat[i].dim()} (the input's), got {lay!r}.")
        if not lay.divides(flat[i].shape, mesh):
            raise ShardcError(f"shardc.compile: input_layouts[{i}] = {lay} does not evenly divide "
                              f"the input's shape {list(flat[i].shape)} on {mesh}. Cut only dims "
                              "that the sizes of their axes divide, or resize the input.")
        out.append((names[i], lay.clean(mesh)))
    wants_grad = [isinstance(x, torch.Tensor) and x.requires_grad for x in flat]
    if any(wants_grad) and len(flat) != len(names):
        raise ShardcError("shardc.compile: an example input requires grad, but the inputs do not "
                          "map one to one onto the traced program's inputs; pass a flat tuple of "
                          "tensors.")
    grads = frozenset(n for n, w in zip(names, wants_grad) if w)
    return tuple(out), grads


def shard_batch(batch: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This rank's slice of a global batch along dim 0 (split over data, then z)."""
    if not dist.is_initialized():
        raise ShardcError("shardc.shard_batch: torch.distributed is not initialised.")
    n = mesh.size("data") * mesh.size("z")
    if batch.shape[0] % n:
        raise ShardcError(
            f"shardc.shard_batch: a batch of {batch.shape[0]} (dim 0) cannot be split evenly over "
            f"data x z = {mesh.size('data')} x {mesh.size('z')} = {n} ranks. Use a multiple of {n}.")
    c = mesh.coords(dist.get_rank())
    i = c["data"] * mesh.size("z") + c["z"]
    step = batch.shape[0] // n
    return batch[i * step:(i + 1) * step]


def global_mean(value: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The mean over the batch shards of a per-rank scalar (e.g. the local mean loss).
    Ranks that hold the same batch shard hold the same value, so averaging over every
    rank equals averaging over the shards."""
    t = value.detach().clone().to(torch.float64)
    with guarded(None, "all_reduce", None, "shardc.global_mean"):
        dist.all_reduce(t)
    return (t / dist.get_world_size()).to(value.dtype)
