"""Build one rank's program from a model: trace it, check what the trace shows, run the
passes and wrap the result in a ``ShardedModule``.

``shardc.compile`` calls ``build`` on every rank between its exchanges with the other
ranks (``agreement.py``); ``offline.compile_offline`` calls it in one process, for any
rank of any mesh, with no process group.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from shardc.core.compat import RECOMPUTE_COMPILED_FROM, torch_version
from shardc.core.context import CompileContext
from shardc.core.errors import ShardcError, ShardcWarning
from shardc.core.ir import Selective
from shardc.core.mesh import Mesh
from shardc.core.options import Options
from shardc.core.placement import Layout
from shardc.passes import aliases, run_pipeline
from shardc.passes.recompute import RECOMPUTE, mark_and_split, mark_blocks, repeated_blocks
from shardc.passes.trace import checkpointed_modules, trace
from shardc.program.backend import build_runner, compile_segments
from shardc.program.module import ShardedModule
from shardc.runtime.collectives import Runtime


def check_batch(example_inputs: tuple, mesh: Mesh, laid_out: Mapping[int, Layout] | None = None) -> None:
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


_WRITE_BACK = ("shardc writes back only buffers (running statistics). Return the new value "
               "from forward instead of writing it into an input.")


def _refuse_input_writes(ep: torch.export.ExportedProgram, user_inputs: list[str]) -> None:
    """Refuse an in-place op that writes into a user input (or a view of one).

    A decomposed trace is functional and shows such a write as a USER_INPUT_MUTATION
    output (refused above); a trace whose ops all have rules keeps the op in place, and
    the rank's program would write into its own piece of the input (or into the copy that
    entry makes of it), which is not what the model does on one device."""

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


def build(model: nn.Module, mesh: Mesh, example_inputs: tuple, options: Options,
             rank: int, input_layouts: Mapping[int, Layout] | None = None,
             blocks: list[str] | None = None, cast_at_use: bool = True) -> ShardedModule:
    """``blocks``: the repeated blocks recompute cuts (default: found in ``model``);
    ``cast_at_use=False``: ``model``'s graph already casts its weights and inputs as the
    precision policy does (a pipeline stage cut from a cast graph), so it is traced as it
    is."""
    ep = trace(model, example_inputs, options.precision.compute if cast_at_use else torch.float32)
    own_blocks, lost = _checkpointed_blocks(model, ep)
    if own_blocks and (options.reshard_after_forward or options.gemm_modes != "default"
                       or (options.backend != "eager" and torch_version() < RECOMPUTE_COMPILED_FROM)):
        # those run the step program, which the recompute does not wrap (and compiled
        # segments lost gradient hooks on older torch): keep the user's explicit option
        # and say what is not honoured
        lost, own_blocks = own_blocks + lost, []
    if lost:
        warnings.warn(
            f"shardc.compile: {type(model).__name__} calls torch.utils.checkpoint on "
            f"{', '.join(lost)}, which the compiled program cannot recompute (a function or the "
            "root rather than a submodule, with reshard_after_forward or gemm_modes "
            "options, which run the step program, or with backend='inductor' on torch older than "
            f"{'.'.join(map(str, RECOMPUTE_COMPILED_FROM))}); torch.export inlines it, so these "
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
    if (options.recompute or options.recompute_in_step) and blocks == []:
        pass  # a pipeline stage that holds no block (the embeddings alone): nothing to recompute
    elif options.recompute or options.recompute_in_step:
        # a pipeline stage's program is a GraphModule cut from the model's graph: its
        # blocks are the ones the cut gave it, by the model's module names
        blocks = repeated_blocks(model) if blocks is None else blocks
        if not blocks:
            raise ShardcError(
                f"shardc.compile: activation_checkpoint={options.activation_checkpoint!r} found "
                f"no repeated blocks in {type(model).__name__} (a ModuleList or Sequential of "
                "two or more modules of one class). Use activation_checkpoint='none'.")
        selective = options.activation_checkpoint if isinstance(options.activation_checkpoint,
                                                                Selective) else None
        if options.recompute_in_step:
            # backend="inductor": the policy is a pass of the step program
            # (passes/remat.py), which reads each node's block from this mark
            mark_blocks(program, blocks)
            what = "block" if options.activation_checkpoint == "blocks" else "selective"
            sm.decisions.append(f"{what} recompute inside the step program: {len(blocks)} blocks; "
                                "what the policy does not save is recomputed in backward (remat)")
            # where the forward program runs with gradients instead (no_sync micro-batches,
            # a step program that could not be built), the policy runs as under the eager
            # backend: autograd's checkpoint over a copy, whose recompute marks the report
            # of the step program must not read
            object.__setattr__(sm, "_recompute_fallback", mark_and_split(
                copy.deepcopy(program), blocks, runtime.key, selective))
        else:
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
            # (passes/recompute_calls.py), so this is a module whose ops still land with
            # its caller's (called some other way inside the checkpointed function)
            warnings.warn(
                f"shardc.compile: {type(model).__name__} calls torch.utils.checkpoint on "
                f"{', '.join(missed)}, whose ops the trace does not attribute to it (is it "
                "called other than as module(x)?); these activations are kept. Checkpoint "
                "the module itself: checkpoint(self.block, x, use_reentrant=False).",
                ShardcWarning, stacklevel=3)
    if options.backend != "eager":
        sm.set_runner(build_runner(program, options.backend))
        segments = sm.__dict__["_recompute"]  # set by object.__setattr__: not a submodule
        if segments is not None:
            compiled, programs = compile_segments(segments)
            object.__setattr__(sm, "_recompute_compiled", compiled)
            object.__setattr__(sm, "_recompute_programs", programs)
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
