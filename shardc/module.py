"""ShardedModule: one rank's compiled program plus its parameter shards."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from shardc.context import KIND, PARAM, PLACEMENT, PROGRAM, CompileContext
from shardc.errors import ShardcError
from shardc.mesh import Mesh
from shardc.placement import Layout, local_slice, shard_offsets
from shardc.runtime import collectives as C
from shardc.runtime.groups import axis_groups


def _set_param(root: nn.Module, name: str, p: nn.Parameter) -> None:
    """Register ``p`` under a dotted name, creating empty submodules on the way, so that
    ``named_parameters()`` gives back the original model's names."""
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    mod.register_parameter(leaf, p)


def write_local(full: torch.Tensor, layout: Layout, coords: dict[str, int], mesh: Mesh,
                shard: torch.Tensor) -> None:
    """Copy ``shard`` into the block of ``full`` that the rank at ``coords`` holds."""
    t, s = full, shard
    for d, idx, n in sorted(shard_offsets(layout, list(full.shape), coords, mesh), reverse=True):
        k = layout.interleave[d]
        size = t.shape[d]
        if k == 1:
            t = t.narrow(d, idx * (size // n), size // n)
        else:
            t = t.unflatten(d, (k, size // k)).narrow(d + 1, idx * (size // k // n), size // k // n)
            s = s.unflatten(d, (k, s.shape[d] // k))
    t.copy_(s)


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
        # what forward calls: the program itself, or a compiled form of it (shardc.backend)
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
        # parameters the program never reads still belong to the model (and its state)
        for name, full in named.items():
            if name not in res.storage:
                self._global_shapes[name] = full.shape
        self._buffers_full = {k: v for k, v in model.named_buffers()}
        self._ep_constants = dict(ep.constants)
        self._out_spec = ep.call_spec.out_spec
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
        for name, axes in self.grad_reductions.items():
            p = self.get_parameter(name)
            for axis in axes:
                p.register_hook(C.grad_reduce_hook(runtime.key, axis))

    # ------------------------------------------------------------------- running
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        axis_groups(self.mesh)  # collective on first use: every rank creates every group
        flat, _ = pytree.tree_flatten((inputs, kwargs))
        if len(flat) != len(self._user_inputs):
            raise ShardcError(
                f"ShardedModule: expected {len(self._user_inputs)} inputs (as in example_inputs), "
                f"got {len(flat)}.")
        batch = self.mesh.size("data") * self.mesh.size("z")
        it = iter(flat)
        args: list[Any] = []
        for role, target in self._feeds:
            if role == "param":
                args.append(self.get_parameter(target))
            elif role == "buffer":
                args.append(self._buffers_full[target])
            elif role == "constant":
                args.append(self._ep_constants[target])
            else:
                args.append(next(it))
        for x, gval, lay in zip(flat, self._user_inputs, self._input_layouts):
            if isinstance(x, torch.Tensor) and isinstance(gval, torch.Tensor) and gval.dim() > 0:
                want = lay.local_shape(gval.shape, self.mesh) if isinstance(lay, Layout) else \
                    [gval.shape[0] // batch] + list(gval.shape[1:])
                if list(x.shape) != want:
                    raise ShardcError(
                        f"ShardedModule: an input has shape {list(x.shape)}, but this rank's piece "
                        f"of the example input {list(gval.shape)} laid out as {lay} is {want} "
                        f"(by default dim 0 is split over data x z = {batch}). Pass "
                        "shardc.shard_batch(global_batch, mesh).")
        out = self._runner(*args)
        return pytree.tree_unflatten(list(out), self._out_spec)

    def set_runner(self, runner: Any) -> None:
        """Run ``runner(*program_inputs)`` instead of ``graph_module`` (same inputs and
        outputs); not a submodule, so parameters and state dicts are unchanged."""
        object.__setattr__(self, "_runner", runner)

    # ------------------------------------------------------------- full tensors
    def _gather_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        layout = self.param_layouts[name]
        world = dist.get_world_size()
        flat = local.detach().contiguous().reshape(-1)
        buf = flat.new_empty(world * flat.numel())
        C.all_gather_flat(buf, flat)
        full = local.new_empty(self._global_shapes[name])
        for r in range(world):
            piece = buf[r * flat.numel():(r + 1) * flat.numel()].view(local.shape)
            write_local(full, layout, self.mesh.coords(r), self.mesh, piece)
        return full

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors with the names and shapes of ``model.state_dict()`` (collective)."""
        out: dict[str, torch.Tensor] = {}
        gathered: dict[str, torch.Tensor] = {}
        for key in self._state_keys:
            if key in self._canonical:
                name = self._canonical[key]
                if name not in gathered:
                    gathered[name] = self._gather_full(name, self.get_parameter(name).detach())
                out[key] = gathered[name]
            else:
                out[key] = self._buffers_full[key].detach().clone()
        return out

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Inverse of ``full_state_dict``: each rank keeps its shard (no communication)."""
        missing = [k for k in self._state_keys if k not in state_dict]
        if missing:
            raise ShardcError(f"load_full_state_dict: missing keys {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}.")
        coords = self.mesh.coords(self.ctx.rank)
        with torch.no_grad():
            for key in self._state_keys:
                t = state_dict[key]
                if key in self._canonical:
                    name = self._canonical[key]
                    if list(t.shape) != list(self._global_shapes[name]):
                        raise ShardcError(
                            f"load_full_state_dict: {key!r} has shape {list(t.shape)}, the model's is "
                            f"{list(self._global_shapes[name])}.")
                    if name in self.param_layouts:
                        p = self.get_parameter(name)
                        p.copy_(local_slice(t.to(p.device, p.dtype), self.param_layouts[name], coords, self.mesh))
                else:
                    self._buffers_full[key].copy_(t)

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Parameter name -> full gradient (collective); None where there is none."""
        out: dict[str, torch.Tensor | None] = {}
        for name, p in self.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            full = self._gather_full(name, g)
            out[name] = full if p.grad is not None else None
        return out

    # ----------------------------------------------------------------- inspection
    def measured_comm(self) -> dict[tuple[str, str, str], int | float]:
        """Bytes handed to torch.distributed since the last reset, per (collective, axis,
        phase), ring model."""
        from shardc.runtime.volume import as_number
        return {k: as_number(v) for k, v in self.runtime.measured.items() if v}

    def reset_measured_comm(self) -> None:
        self.runtime.reset_counters()

    def local_param_elements(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def extra_repr(self) -> str:
        return f"mesh={self.mesh}, parameters={len(self.param_layouts)}"

    def parameter_report(self) -> Iterator[tuple[str, list[int], list[int], Layout]]:
        for name, layout in self.param_layouts.items():
            yield name, list(self._global_shapes[name]), list(self.get_parameter(name).shape), layout
