"""ShardedModule: one rank's compiled program plus its parameter shards."""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import MutableMapping
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from shardc.core.context import KIND, PARAM, PLACEMENT, PROGRAM, SOURCE, CompileContext
from shardc.core.errors import ShardcError
from shardc.core.mesh import Mesh
from shardc.core.placement import Layout, blocks, local_slice
from shardc.core.precision import check_no_autocast, reduce_dtype
from shardc.passes.coalesce import block_of
from shardc.passes.reshard import REGATHER
from shardc.passes.step_nodes import collective_nodes
from shardc.program import step_program, validate
from shardc.runtime import collectives as C
from shardc.runtime import zero
from shardc.runtime.experts import EXPERT_REGION
from shardc.runtime.grad_buckets import ALL_REDUCE, REDUCE_SCATTER, GradBuckets, Spec
from shardc.runtime.groups import axis_groups, stage_group, stage_ranks
from shardc.runtime.ops import check_branch
from shardc.runtime.pending import PendingOutput, settle_all
from shardc.runtime.step import StepRunner
from shardc.runtime.volume import as_number


def _check_same(name: str, new: torch.Tensor, old: torch.Tensor) -> None:
    if (new.shape, new.dtype, new.device) != (old.shape, old.dtype, old.device):
        raise ValueError(
            f"shardc: parameter {name!r} was replaced after compile by a tensor of shape "
            f"{tuple(new.shape)}, {new.dtype} on {new.device}; the compiled program reads this "
            f"rank's piece of it: shape {tuple(old.shape)}, {old.dtype} on {old.device}. Load "
            "pieces shaped like sm.state_dict()'s (or copy into the parameter), or compile again.")


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule a dotted name's last part belongs to, empty ones created on the way,
    so that what is registered there keeps the original model's name."""
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    return mod, leaf


def _set_param(root: nn.Module, name: str, p: nn.Parameter) -> None:
    """Register ``p`` under a dotted name, so that ``named_parameters()`` gives back the
    original model's names."""
    mod, leaf = _owner(root, name)
    mod.register_parameter(leaf, p)


class _Buffers(MutableMapping):
    """The model's buffers by name, whole, as the program reads them: registered in the
    module's tree under the model's names (``_set_param``'s submodules), so that
    ``named_buffers()``, attribute paths (``sm.bn.running_mean``, what
    ``torch.distributed.checkpoint``'s state-dict helpers resolve each key by) and
    ``share_memory()`` reach them. Registered as non-persistent: ``ShardedModule``'s own
    state-dict hooks write the model's persistent ones (``_state_keys``; a pipeline stage
    answers for the keys it holds). A name that cannot be registered (a root-level buffer
    named like one of ShardedModule's attributes) is kept aside, still read and written
    here."""

    def __init__(self, root: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        self._where: dict[str, tuple[dict[str, Any], str]] = {}
        for name, t in tensors.items():
            mod, leaf = _owner(root, name)
            try:
                mod.register_buffer(leaf, t, persistent=False)
                self._where[name] = (mod._buffers, leaf)
            except KeyError:
                self._where[name] = ({leaf: t}, leaf)

    def __getitem__(self, name: str) -> torch.Tensor:
        table, leaf = self._where[name]
        return table[leaf]

    def __setitem__(self, name: str, t: torch.Tensor) -> None:
        table, leaf = self._where[name]
        table[leaf] = t

    def __delitem__(self, name: str) -> None:
        raise TypeError("a compiled model's buffers are the model's: none can be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _device_of(args: list[Any]) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def write_local(full: torch.Tensor, layout: Layout, coords: dict[str, int], mesh: Mesh,
                shard: torch.Tensor) -> None:
    """Copy ``shard`` into the blocks of ``full`` that the rank at ``coords`` holds."""
    for start, size, at in blocks(layout, full.shape, coords, mesh):
        dst, src = full, shard
        for d, (a, n, b) in enumerate(zip(start, size, at)):
            dst, src = dst.narrow(d, a, n), src.narrow(d, b, n)
        dst.copy_(src)


class ShardedModule(nn.Module):
    """What ``shardc.compile`` returns: call it with this rank's inputs (``shard_batch``).

    ``named_parameters()`` keeps the model's names; each tensor is this rank's shard
    (its layout is ``sm.param_layouts[name]``). Collective methods (``full_state_dict``,
    ``load_full_state_dict``, ``full_grads``) must be called on every rank.
    """

    graph_module: fx.GraphModule
    ctx: CompileContext
    runtime: C.Runtime
    _runner: Callable[..., Any]

    def __init__(self, program: fx.GraphModule, ctx: CompileContext, model: nn.Module,
                 ep: torch.export.ExportedProgram, canonical: dict[str, str],
                 runtime: C.Runtime) -> None:
        super().__init__()
        res = program.meta[PROGRAM]
        object.__setattr__(self, "graph_module", program)
        object.__setattr__(self, "ctx", ctx)
        object.__setattr__(self, "runtime", runtime)
        # the program split into checkpointed block segments (activation_checkpoint="blocks");
        # not a submodule: it owns no parameters, the program reads this module's
        object.__setattr__(self, "_recompute", None)
        # under backend="inductor", a copy of it whose segments run compiled (what forward
        # calls; backend.compile_segments) and their programs
        object.__setattr__(self, "_recompute_compiled", None)
        object.__setattr__(self, "_recompute_programs", [])
        # a policy applied inside the step program (Options.recompute_in_step): the forward
        # program split and checkpointed as under the eager backend, for the calls that run
        # the forward program with gradients (no_sync micro-batches, a step program that
        # could not be built), which would otherwise keep every activation
        object.__setattr__(self, "_recompute_fallback", None)
        # what forward calls: the program itself, or a compiled form of it (shardc.program.backend)
        object.__setattr__(self, "_runner", program)
        self.mesh: Mesh = ctx.mesh
        self.param_layouts: dict[str, Layout] = dict(res.storage)
        self.fallbacks = list(res.fallbacks)
        self.decisions = list(res.decisions)
        self.grad_reductions: dict[str, list[str]] = dict(res.reduce_params)
        self._canonical = canonical  # every state_dict name of a parameter -> its canonical name
        self._global_shapes: dict[str, torch.Size] = {}
        self._state_keys = list(model.state_dict().keys())
        coords = self.mesh.coords(ctx.rank)
        named = dict(model.named_parameters())
        for name, layout in res.storage.items():
            full = named[name]
            self._global_shapes[name] = full.shape
            local = local_slice(full.detach(), layout, coords, self.mesh)
            p = nn.Parameter(local.clone(), requires_grad=full.requires_grad)
            _set_param(self, name, p)
        # the stored shards as the program reads them; ``param_layouts`` are the
        # registered parameters', which differ where the optimizer's slice is cut over data
        self._program_layouts: dict[str, Layout] = dict(res.storage)
        self._zero: dict[str, zero.ZeroParam] = {}
        if ctx.options.shard_optimizer:
            self._shard_optimizer(res.reduce_params)
        # parameters the program never reads still belong to the model (and its state)
        for name, full in named.items():
            if name not in res.storage:
                self._global_shapes[name] = full.shape
        # copies, as the parameters' pieces are: the compiled module neither reads what the
        # user later writes into the model's buffers nor writes into them itself (a
        # load_full_state_dict once wrote the loaded statistics into the original model)
        self._buffers_full = _Buffers(self, {k: v.detach().clone() for k, v in model.named_buffers()})
        self.register_load_state_dict_post_hook(ShardedModule._buffers_expected)
        self._ep_constants = dict(ep.constants)
        self._out_spec = ep.call_spec.out_spec
        # (output index, buffer): outputs that are a buffer's new value (BatchNorm's
        # running statistics), written back after each call; the rest are the user's
        self._mutations = [(i, spec.target) for i, spec in enumerate(ep.graph_signature.output_specs)
                           if spec.kind.name == "BUFFER_MUTATION"]
        self._in_spec = ep.call_spec.in_spec
        self._feeds: list[tuple[str, str]] = []
        roles = ctx.role_map
        for n in program.graph.nodes:
            if n.op != "placeholder":
                continue
            kind = n.meta.get(KIND)
            if kind == "param":
                self._feeds.append(("param", n.meta[PARAM]))
            else:
                role, target = roles.get(n.target, ("input", n.target))
                self._feeds.append((role, target))
        self._user_inputs = [(n.meta.get("shardc_global_val")) for n in program.graph.nodes
                             if n.op == "placeholder" and n.meta.get(KIND) == "input"]
        self._input_layouts = [n.meta.get(PLACEMENT) for n in program.graph.nodes
                               if n.op == "placeholder" and n.meta.get(KIND) == "input"]
        # The eager program sums parameter gradients over these axes in hooks; the whole-
        # step program does it inside its backward graph, so the hooks stand aside then.
        self._joint: dict[tuple, Any] = {}
        self._joint_failed: str | None = None

        if any(n.target is check_branch for n in program.graph.nodes):
            # the checks read a value (``.item()``) that make_fx's fake tensors do not have
            self._joint_failed = ("the program checks, each step, a branch on tensor values "
                                  "that compile fixed (draft_export)")
        self._offline: Any = None  # the step program traced for the report (reshard)
        self._hooks_active = True
        # a gradient summed over one axis goes into a bucket (runtime/grad_buckets.py), and
        # so does a weight's reduce-scatter, with the all-reduce of its shard after it
        # under HSDP; a gradient summed over several axes keeps a hook per axis, each sum
        # reading the one before, and so does shard_optimizer's program copy, whose
        # reduce-scatter over data (a post-accumulate hook) reads .grad already summed over
        # its other axes
        gathers = self._weight_gathers()
        scatters = self._scattered_weights(gathers)
        specs = []
        for role, name in self._feeds:
            if role != "param" or name in self._zero:
                continue
            t = self._program_param(name)
            red = reduce_dtype(t.dtype, ctx.options.precision) or t.dtype
            axes = self.grad_reductions.get(name, [])
            if name in scatters and t.requires_grad and len(axes) <= 1:
                # the weight's reduce-scatter, then (HSDP) its all-reduce over the replicas
                key, axis, red_rs = scatters[name]
                specs.append(Spec(name, t, REDUCE_SCATTER, axis, red_rs or t.dtype, key,
                                  axes[0] if axes else None))
            elif len(axes) == 1:
                specs.append(Spec(name, t, ALL_REDUCE, axes[0], red))
        self._grad_buckets = GradBuckets(runtime.key, specs, ctx.options.bucket_bytes,
                                         ctx.options.first_bucket_bytes)
        runtime.grad_buckets = self._grad_buckets
        self._gather_groups: list[C.GatherGroup] = []
        if ctx.options.bucket_bytes > 0:
            self._group_gathers(gathers)
        # the tensor each parameter feed read when its hooks were registered: a parameter
        # the user replaces later (load_state_dict(..., assign=True)) is hooked in turn
        # at the next forward (_rebind), or its gradient would go unreduced
        self._bound: dict[str, torch.Tensor] = {}
        self._hooked: set[str] = set()
        for role, name in self._feeds:
            if role == "param" and name not in self._zero:
                self._bound[name] = self._program_param(name)
                self._hook_param(name, self._bound[name])
        # a program copy's sums over its other axes (a norm's weight replicated over x):
        # the step program makes them itself, but autograd's backward over the forward
        # program (step_graph=False, activation_checkpoint, the synced backward after
        # no_sync) needs these hooks as every other parameter does; without them such a
        # gradient was reduce-scattered over data unsummed over x
        for name, zp in self._zero.items():
            self._hook_param(name, zp.full)
        self._zero_buckets = zero.Buckets(runtime.key, list(self._zero.values()),
                                          ctx.options.bucket_bytes)
        # after those (hooks run in the order registered): the sum over every other axis
        # is in the program copy's .grad when it is reduce-scattered over data
        for zp in self._zero.values():
            zp.full.register_post_accumulate_grad_hook(self._zero_hook(zp))

    # ------------------------------------------------------- optimizer over data
    def _shard_optimizer(self, reduce_params: dict[str, list[str]]) -> None:
        """Split each parameter whose gradient is summed over data into the program copy
        and this rank's slice of it (runtime/zero.py); the slice becomes the parameter."""
        gd = self.mesh.size("data")
        if gd == 1:
            return
        coords = self.mesh.coords(self.ctx.rank)
        for name, axes in list(reduce_params.items()):
            p = self.get_parameter(name)
            if "data" not in axes or not p.requires_grad:
                continue
            lay = self._program_layouts[name]
            # a dim of the stored shard that data divides, not interleaved (a fused QKV
            # dim's pieces are not contiguous blocks of it)
            dim = next((d for d, n in enumerate(p.shape)
                        if n % gd == 0 and lay.interleave[d] == 1), None)
            if dim is None:
                self.decisions.append(f"shard_optimizer: {name} {list(p.shape)} kept whole over "
                                      f"data (no dim of its shard divides by {gd})")
                continue
            full = p.detach().clone().requires_grad_(True)
            piece = nn.Parameter(zero.slice_of(full.detach(), dim, coords["data"], gd).clone())
            _set_param(self, name, piece)
            self.param_layouts[name] = lay.with_shard("data", dim).clean(self.mesh)
            zp = zero.ZeroParam(name, full, piece, dim, seen=piece._version,
                                reduce_dtype=reduce_dtype(p.dtype, self.ctx.options.precision))
            self._zero[name] = zp
            rest = [a for a in axes if a != "data"]
            if rest:
                reduce_params[name] = rest
            else:
                del reduce_params[name]
        self.grad_reductions = dict(reduce_params)

    def _zero_hook(self, zp: Any) -> Any:
        key, rt = f"zero:{zp.name}", self.runtime

        def hook(_: torch.Tensor) -> None:
            if not rt.sync:  # no_sync: the program copy's .grad accumulates locally
                rt.unreduced.add(key)
                return
            self._zero_buckets.arrived(zp)
        return hook

    def _weight_gathers(self) -> list[Any]:  # fx.Node, whose args fx types loosely
        """The forward program's all-gathers of a weight whose backward reduce-scatters
        its gradient (grad_sync gives exactly those a ``key``), where the gather reads the
        parameter itself. A gather of something made from it (an op with no rule reads an
        LSTM's weight whole: its gradient is summed over data on the way, by a
        ``grad_all_reduce`` between the parameter and the gather) keeps autograd's own
        path, which runs that sum; a bucket would add the gather's sum to ``.grad``
        past it."""
        return [n for n in self.graph_module.graph.nodes
                if n.op == "call_function" and n.target is C.all_gather_start
                and n.kwargs.get("key") is not None and PARAM in n.args[0].meta]

    def _scattered_weights(self, gathers: list[Any]
                           ) -> dict[str, tuple[str, str, torch.dtype | None]]:
        """Parameter -> (all-gather node, axis, reduce dtype) for each weight whose
        gradient one all-gather's backward reduce-scatters: the one gather of it that
        does (a weight gathered by two would get two sums into one ``.grad``)."""
        found: dict[str, list[tuple[str, str, torch.dtype | None]]] = {}
        for n in gathers:
            found.setdefault(n.args[0].meta[PARAM], []).append(
                (n.kwargs["key"], n.args[2], n.kwargs.get("reduce_dtype")))
        return {name: v[0] for name, v in found.items() if len(v) == 1}

    def _group_gathers(self, gathers: list[Any]) -> None:
        """The forward program's weight all-gathers, one collective a block at run time
        (collectives.GatherGroup): by (block, axis, cast dtype), in the program's order."""

        groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
        for n in gathers:
            src = n.meta.get("shardc_source")
            p = self._program_param(n.args[0].meta[PARAM])
            k = (block_of(src.module if src is not None else ""), n.args[2],
                 n.kwargs.get("dtype"), p.dtype, p.device)
            groups.setdefault(k, []).append((n.kwargs["key"], p))
        for (block, axis, dtype, _, _), members in groups.items():
            if len(members) > 1:
                g = C.GatherGroup(self.runtime.key, axis, members, dtype, block or "(top)")
                self._gather_groups.append(g)
                for key, _ in members:
                    self.runtime.gather_groups[key] = g

    def _program_param(self, name: str) -> torch.Tensor:
        """The tensor the program reads for parameter ``name``."""
        zp = self._zero.get(name)
        return zp.full if zp is not None else self.get_parameter(name)

    def read_param(self, name: str) -> torch.Tensor:
        """The tensor the program reads for parameter ``name`` this step: the parameter
        itself, or under ``shard_optimizer`` the program copy made from this rank's slice
        (the tensor autograd accumulates the gradient into before it is reduce-scattered)."""
        return self._current_param(name)

    def _hook_param(self, name: str, t: torch.Tensor) -> None:
        """Autograd's-backward gradient reductions of parameter ``name`` on tensor ``t``."""
        if not t.requires_grad:  # hooked when it needs a gradient (_current_param)
            self._hooked.discard(name)
            return
        self._hooked.add(name)
        if name in self._grad_buckets:
            t.register_hook(self._eager_only(self._grad_buckets.grad_hook(name)))
            t.register_post_accumulate_grad_hook(self._grad_buckets.accumulated_hook(name))
        axes = self.grad_reductions.get(name)
        if axes:
            dt = reduce_dtype(t.dtype, self.ctx.options.precision)
            if name not in self._grad_buckets:
                for axis in axes:
                    t.register_hook(self._eager_only(C.grad_reduce_hook(self.runtime.key, axis,
                                                                        name, dt)))
            # acts only after no_sync, which the forward program runs (never the step's)
            t.register_post_accumulate_grad_hook(
                C.grad_reduce_after_accumulate(self.runtime.key, axes, name, dt))

    def _current_param(self, name: str) -> torch.Tensor:
        """What the program reads for parameter ``name`` this step. A parameter replaced
        since compile (``load_state_dict(..., assign=True)``, ``module.weight =
        nn.Parameter(...)``) takes the old one's place: its gradient hooks, its bucket,
        its gather group, or (shard_optimizer) the slice its program copy is made from."""
        zp = self._zero.get(name)
        if zp is not None:
            p = self._param_now(name)
            if p is not zp.slice:
                _check_same(name, p, zp.slice)
                zp.slice, zp.seen = p, -1  # -1: refresh() makes the program copy from it
            return zp.full
        p = self._param_now(name)
        old = self._bound[name]
        if p is not old or (p.requires_grad and name not in self._hooked):
            _check_same(name, p, old)
            self._bound[name] = p
            self._hook_param(name, p)
            self._grad_buckets.rebind(name, p)
            for g in self._gather_groups:
                g.rebind(old, p)
        return p

    def _param_now(self, name: str) -> torch.Tensor:
        """``self.get_parameter(name)`` through the module dicts directly: every call
        reads the modules as they are now, without ``get_parameter``'s getattr walk (0.7
        ms a step for TinyGPT's 45 parameters, on a 12 ms forward)."""
        *path, leaf = name.split(".")
        mod: Any = self
        try:
            for key in path:
                mod = mod._modules[key]
            p = mod._parameters[leaf]
        except (KeyError, AttributeError, TypeError):
            p = None
        return p if p is not None else self.get_parameter(name)  # its error, if any

    def _eager_only(self, hook: Any) -> Any:
        def run(g: torch.Tensor) -> torch.Tensor:
            return hook(g) if self._hooks_active else g
        return run

    # ------------------------------------------------------------------- running
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        check_no_autocast("ShardedModule.forward")
        flat, _ = pytree.tree_flatten((inputs, kwargs))
        validate.check_inputs(self, inputs, kwargs, flat)  # before anything is communicated
        params = {t: self._current_param(t) for role, t in self._feeds if role == "param"}
        axis_groups(self.mesh)  # collective on first use: every rank creates every group
        settle_all()  # a loss from a step with no backward, still unread: wait for it now
        self._zero_buckets.refresh()  # slices the optimizer stepped: gather them
        self._grad_buckets.new_step()
        for g in self._gather_groups:
            g.new_step()
        it = iter(flat)
        args: list[Any] = []
        for role, target in self._feeds:
            if role == "param":
                args.append(params[target])
            elif role == "buffer":
                args.append(self._buffers_full[target])
            elif role == "constant":
                args.append(self._ep_constants[target])
            else:
                # the program was traced on contiguous inputs (passes/trace.py): a slice
                # such as `data[:, :-1]` is copied once here rather than failing in a view
                x = next(it)
                args.append(x.contiguous() if isinstance(x, torch.Tensor) else x)
        out = list(self._run(args))
        if self._mutations:
            for i, target in self._mutations:
                new = out[i].value() if isinstance(out[i], PendingOutput) else out[i]
                # the new value takes the buffer's place rather than being copied into it:
                # a recomputed block saved the old one for backward, and torch refuses a
                # saved tensor written in place
                self._buffers_full[target] = new.detach()
            written = {i for i, _ in self._mutations}
            out = [o for j, o in enumerate(out) if j not in written]
        return pytree.tree_unflatten(out, self._out_spec)

    def _forward_program(self, args: list[Any]) -> Any:
        """The forward program, whose backward is autograd's (with no_sync's and
        recompute's runtime behaviour)."""
        self._hooks_active = True
        fallback = self._recompute_fallback if torch.is_grad_enabled() else None
        run: Any = next(r for r in (self._recompute_compiled, self._recompute, fallback, self._runner)
                        if r is not None)
        return run(*args)

    def _run(self, args: list[Any]) -> Any:
        """The step program when a backward may follow, else the forward program.

        The forward program runs instead: without gradients; with step_graph=False; under
        ``no_sync`` and until the synced backward after it (no_sync defers reductions the
        forward program's backward issues); with activation_checkpoint (the recompute runs
        autograd's checkpoint over the forward program). With backend="inductor" the
        step program's parts run with their compute compiled (shardc/program/backend.py)."""
        needs = [isinstance(a, torch.Tensor) and a.requires_grad and
                 (role == "param" or (role == "input" and target in self.ctx.grad_inputs))
                 for a, (role, target) in zip(args, self._feeds)]
        eager = (not (self.ctx.options.step_graph and torch.is_grad_enabled() and any(needs))
                 or self._joint_failed is not None or self._recompute is not None
                 or not self.runtime.sync or self.pending_reductions() > 0)
        if eager:
            return self._forward_program(args)
        key = tuple((tuple(a.shape), a.dtype, w) if isinstance(a, torch.Tensor) else (repr(a),)
                    for a, w in zip(args, needs))
        jp = self._joint.get(key)
        if jp is None:
            jp = self._build_joint(args, needs)
            if jp is None:
                return self._forward_program(args)
            self._joint[key] = jp

        self._hooks_active = False
        return StepRunner.apply(jp, *args)

    def _build_joint(self, args: list[Any], needs: list[bool]) -> Any:
        names = [target if role == "param" else None for role, target in self._feeds]
        jp, failed = step_program.build(self.graph_module, self.ctx, args, needs, names,
                                        _device_of(args))
        if jp is None:
            self._joint_failed = failed
            warnings.warn("shardc: the step program could not be built "
                          f"({self._joint_failed}); running the forward program with "
                          "autograd's backward (no overlap or bucketing passes).", stacklevel=3)
        return jp

    def regathered(self) -> list[str]:
        """With ``reshard_after_forward``: the forward program's all-gather nodes whose
        weight the step program gathers again in backward (and, with a selective policy
        inside the step program, whose activation it gathers again). Traced offline (fake
        tensors, no communication) when no step has run yet."""

        if not (self.ctx.options.reshard_after_forward or self.ctx.options.recompute_in_step):
            return []
        built = [jp for jp in self._joint.values()]
        if built:
            jp = built[-1]
        else:
            try:
                jp = self.offline_step()
            except Exception:  # noqa: BLE001 - then the first step falls back too (below)
                jp = None
        if jp is None:
            # the step program could not be built: the forward program runs with
            # autograd's backward, which keeps forward's gathered weights
            return []
        out: list[str] = []
        for n in collective_nodes(jp.backward.graph):
            v = n.meta.get(REGATHER)  # a list where coalesce_pass packed several
            out += [] if v is None else v if isinstance(v, list) else [v]
        return out

    def offline_step(self) -> Any:
        """The step program (a ``StepProgram``) as the first training step builds
        it, traced on fake tensors without communication, for what reads its structure
        (the comm report under ``reshard_after_forward``, the planner's step-time model).
        Not for running. The step passes run on it, except that ``gemm_modes="auto"``
        times nothing here (its choice changes copies, not collectives)."""
        if self._offline is None:
            args, needs = self._example_args()
            names = [t if role == "param" else None for role, t in self._feeds]
            self._offline = step_program.build_offline(self.graph_module, self.ctx, args, needs, names)
        return self._offline

    def _example_args(self) -> tuple[list[Any], list[bool]]:
        """Arguments shaped like this rank's (empty inputs of the local shapes)."""
        batch = self.mesh.size("data") * self.mesh.size("z")
        inputs = iter(zip(self._user_inputs, self._input_layouts))
        args: list[Any] = []
        needs: list[bool] = []
        for role, target in self._feeds:
            if role == "param":
                p = self._program_param(target)
                args.append(p)
                needs.append(p.requires_grad)
            elif role == "buffer":
                args.append(self._buffers_full[target])
                needs.append(False)
            elif role == "constant":
                args.append(self._ep_constants[target])
                needs.append(False)
            else:
                gval, lay = next(inputs)
                if isinstance(gval, torch.Tensor):
                    shape = lay.local_shape(gval.shape, self.mesh) if isinstance(lay, Layout) else \
                        ([gval.shape[0] // batch] + list(gval.shape[1:]) if gval.dim() else [])
                    # on the example's device: a model planned on meta tensors stays there
                    args.append(torch.zeros(shape, dtype=gval.dtype, device=gval.device))
                    needs.append(target in self.ctx.grad_inputs)
                else:
                    args.append(gval)
                    needs.append(False)
        return args, needs

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation without communication, as DDP's and FSDP's ``no_sync``:
        the backward calls made inside skip every parameter-gradient reduction (the
        step-phase all-reduces and the weights' reduce-scatters) and keep the local,
        unreduced gradients; the first backward outside reduces their sum once, so
        ``.grad`` is then the shard of the single-device gradient of all micro-batches.
        Inside the block ``.grad`` holds local partial sums: step the optimizer (or clip)
        only after a synced backward. Activation collectives (tensor parallelism's
        all-reduces of dI, gathers of activations) still run: backward needs them.
        These micro-batches, and the synced one after them, run the forward program with
        autograd's backward (the step program's reductions are not deferrable)."""
        prev = self.runtime.sync
        self.runtime.sync = False
        try:
            yield
        finally:
            self.runtime.sync = prev

    @contextlib.contextmanager
    def backward_in_parts(self) -> Iterator[None]:
        """The backward calls made inside are parts of one synced backward (each part a
        few parameters' gradients, as the zero-bubble schedule's weight passes run them):
        ``shard_optimizer``'s bucketed reduce-scatters wait for the part that completes
        them, and what is left is issued once, when the block ends, not at the end of
        every part (which sent the gradients of later parts twice)."""
        self._zero_buckets.in_parts = True
        try:
            yield
        except BaseException:
            self._zero_buckets.end_parts(ok=False)
            raise
        self._zero_buckets.end_parts(ok=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and drop the gradients ``no_sync`` holds for the next
        synced backward (an optimizer's ``zero_grad`` cannot reach those)."""
        super().zero_grad(set_to_none)
        for zp in self._zero.values():
            zp.full.grad = None
        self.runtime.deferred.clear()
        self.runtime.unreduced.clear()

    def pending_reductions(self) -> int:
        """How many gradient reductions ``no_sync`` has deferred and no synced backward has
        done yet (0 when every ``.grad`` is complete)."""
        return len(self.runtime.deferred) + len(self.runtime.unreduced)

    def set_runner(self, runner: Any) -> None:
        """Run ``runner(*program_inputs)`` instead of ``graph_module`` (same inputs and
        outputs); not a submodule, so parameters and state dicts are unchanged."""
        object.__setattr__(self, "_runner", runner)

    # ------------------------------------------------------------- full tensors
    # the local pieces one all-gather carries at most: one collective a parameter was most of
    # full_grads() on a small model (a GPT's 30-odd tensors, each a round trip), and one for
    # the whole model would hold every rank's copy of it at once
    GATHER_BUCKET_BYTES = 32 << 20

    def _gather_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return self._gather_full_many([(name, local)])[name]

    def _gather_full_many(self, items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Parameter name -> the full tensor of each (name, this rank's piece), gathered over
        the stage's ranks in buckets of one dtype and device (collective: every rank of the
        stage passes the same names in the same order)."""
        # a pipeline stage's parameters live on its own ranks only (the world when pipe is 1)
        ranks = stage_ranks(self.mesh, self.ctx.rank)
        by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.Tensor]]] = {}
        shapes = {}
        for name, local in items:
            flat = local.detach().contiguous().reshape(-1)
            by_kind.setdefault((flat.dtype, flat.device), []).append((name, flat))
            shapes[name] = local.shape
        buckets: list[list[tuple[str, torch.Tensor]]] = []
        for kind in by_kind.values():
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, flat in kind:
                nbytes = flat.numel() * flat.element_size()
                if bucket and size + nbytes > self.GATHER_BUCKET_BYTES:
                    buckets.append(bucket)
                    bucket, size = [], 0
                bucket.append((name, flat))
                size += nbytes
            buckets.append(bucket)
        out: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            mine = torch.cat([flat for _, flat in bucket]) if len(bucket) > 1 else bucket[0][1]
            n = mine.numel()
            buf = mine.new_empty(len(ranks) * n)
            with C.guarded(self.runtime.key, "all_gather", None, "gathering full tensors"):
                C.all_gather_flat(buf, mine, group=stage_group(self.mesh))
            at = 0
            for name, flat in bucket:
                full = flat.new_empty(self._global_shapes[name])
                for i, r in enumerate(ranks):
                    piece = buf[i * n + at:i * n + at + flat.numel()].view(shapes[name])
                    write_local(full, self.param_layouts[name], self.mesh.coords(r), self.mesh, piece)
                out[name] = full
                at += flat.numel()
        return out

    # ---------------------------------------------------------- torch's module API
    # nn.Module's .to(), .cuda(), .half(), .double(), .bfloat16() and to_empty() all come
    # here. The program was traced for the parameters' dtype and laid out on their device:
    # a cast went through to the tensors and failed later inside the program (FX's dtype
    # error), and a move of parameters and buffers still left the program's constants
    # behind. So a change is refused, before anything is changed; a call that changes
    # nothing (sm.float() of an fp32 model, sm.to(its own device)) passes.
    def _apply(self, fn: Any, recurse: bool = True) -> "ShardedModule":
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            try:
                # what the call would make of this tensor, tried on an empty one like it
                probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            except Exception:  # noqa: BLE001 - torch's own call then says what is wrong
                break
            if not isinstance(probe, torch.Tensor):
                break
            if probe.dtype != t.dtype or probe.device != t.device:
                raise ShardcError(
                    f"ShardedModule: a compiled model cannot change its device or dtype ({name!r} "
                    f"would go from {t.dtype} on {t.device} to {probe.dtype} on {probe.device}): "
                    "its program was traced for the first and its parameters laid out there. "
                    "Move or cast the model before shardc.compile (model.to(...), then "
                    "compile); for mixed precision, compile with precision='bf16'.")
        return super()._apply(fn, recurse)

    # torch's state_dict(), buffers included. The buffers are registered non-persistent
    # (_Buffers), so nn.Module's own state_dict() leaves them out, as it once left out all
    # of them: torch.save(sm.state_dict()) lost BatchNorm's statistics and a resume through
    # sm.load_state_dict() restarted them silently. These hooks write and read the model's
    # persistent buffers (a pipeline stage: those it holds), under the model's names,
    # beside this rank's pieces of the parameters.
    def _state_buffers(self) -> list[str]:
        return [k for k in self._state_keys if k not in self._canonical]

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key in self._state_buffers():
            t = self._buffers_full[key]
            destination[prefix + key] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        for key in self._state_buffers():
            t, have = state_dict.get(prefix + key), self._buffers_full[key]
            if t is None:
                missing_keys.append(prefix + key)
            elif not isinstance(t, torch.Tensor) or t.shape != have.shape:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                error_msgs.append(f"size mismatch for {prefix + key}: copying a param with shape "
                                  f"{got} from checkpoint, the shape in current model is "
                                  f"{list(have.shape)}.")
            elif assign:
                self._buffers_full[key] = t
            else:
                with torch.no_grad():
                    have.copy_(t)
        self._loading_prefix = prefix

    @staticmethod
    def _buffers_expected(module: "ShardedModule", incompatible: Any) -> None:
        """After the load (a post hook): the buffers' keys are this module's, but they are
        registered non-persistent (``_Buffers``), so torch's walk called them unexpected."""
        prefix = module.__dict__.pop("_loading_prefix", None)
        if prefix is None:
            return
        mine = {prefix + k for k in module._state_buffers()}
        incompatible.unexpected_keys[:] = [k for k in incompatible.unexpected_keys if k not in mine]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors with the names and shapes of ``model.state_dict()`` (collective)."""
        out: dict[str, torch.Tensor] = {}
        names = list(dict.fromkeys(self._canonical[k] for k in self._state_keys if k in self._canonical))
        gathered = self._gather_full_many([(n, self.get_parameter(n).detach()) for n in names])
        for key in self._state_keys:
            if key in self._canonical:
                out[key] = gathered[self._canonical[key]]
            else:
                out[key] = self._buffers_full[key].detach().clone()
        return out

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Inverse of ``full_state_dict``: each rank keeps its shard (no communication)."""
        missing = [k for k in self._state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._state_keys]
        if missing or unexpected:
            # a renamed key would otherwise leave its tensor at its initial value, silently
            parts = [f"{what} keys {ks[:5]}{' ...' if len(ks) > 5 else ''}"
                     for what, ks in (("missing", missing), ("unexpected", unexpected)) if ks]
            raise ShardcError(f"load_full_state_dict: {'; '.join(parts)}. Pass the state_dict() of "
                              "the model that was compiled (or sm.full_state_dict()), with the same "
                              "names.")
        for key in self._state_keys:  # every shape first: refuse before changing anything
            t = state_dict[key]
            want = self._global_shapes[self._canonical[key]] if key in self._canonical else \
                self._buffers_full[key].shape
            if not isinstance(t, torch.Tensor) or list(t.shape) != list(want):
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ShardcError(
                    f"load_full_state_dict: {key!r} has shape {got}, the model's is {list(want)}. "
                    "Pass full (unsharded) tensors of the model that was compiled, e.g. "
                    "sm.full_state_dict().")
        coords = self.mesh.coords(self.ctx.rank)
        with torch.no_grad():
            for key in self._state_keys:
                t = state_dict[key]
                if key in self._canonical:
                    name = self._canonical[key]
                    if name in self.param_layouts:
                        p = self.get_parameter(name)
                        p.copy_(local_slice(t.to(p.device, p.dtype), self.param_layouts[name], coords, self.mesh))
                else:
                    self._buffers_full[key].copy_(t)

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Parameter name -> full gradient (collective); None where there is none."""
        params = list(self.named_parameters())
        full = self._gather_full_many(
            [(name, p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in params])
        return {name: full[name] if p.grad is not None else None for name, p in params}

    # ----------------------------------------------------------------- inspection
    def measured_comm(self) -> dict[tuple[str, str, str], int | float]:
        """Bytes handed to torch.distributed since the last reset, per (collective, axis,
        phase), ring model."""
        return {k: as_number(v) for k, v in self.runtime.measured.items() if v}

    def reset_measured_comm(self) -> None:
        self.runtime.reset_counters()

    def expert_load(self) -> dict[str, Any]:
        """With ``expert_axes``: for each expert segment (keyed by the module of its first
        grouped GEMM), how its rows were spread in the last step on this rank: rows sent to
        each expert, rows received from each rank, rows each local expert computed
        (``shardc.runtime.experts.ExpertLoad``). Not collective; empty before a step."""
        out = {}
        for n in self.graph_module.graph.nodes:
            if n.target is EXPERT_REGION and n.args[6] in self.runtime.expert_load:
                module = getattr(n.meta.get(SOURCE), "module", "") or n.name
                out[module if module not in out else f"{module}#{n.name}"] = \
                    self.runtime.expert_load[n.args[6]]
        return out

    def local_param_elements(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def extra_repr(self) -> str:
        return f"mesh={self.mesh}, parameters={len(self.param_layouts)}"

    def parameter_report(self) -> Iterator[tuple[str, list[int], list[int], Layout]]:
        for name, layout in self.param_layouts.items():
            yield name, list(self._global_shapes[name]), list(self.get_parameter(name).shape), layout
