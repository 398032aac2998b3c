"""The types the layers share: what the passes hand the runtime and the readouts.

A lowered value (``Val``), where an op came from (``SourceInfo``) and why it ran
replicated (``Fallback``); the step program the runtime runs (``StepProgram``) and an
output whose tail is deferred past its collective (``Deferred``); the selective
recompute policy (``Selective``). They live below ``runtime/`` and ``passes/`` so that
each of those can name them without importing the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from shardc.core.errors import OptionError, OptionTypeError
from shardc.core.placement import Layout


@dataclass
class Val:
    """A value of the global program as this rank holds it."""

    node: fx.Node | None  # node of the new graph (None: a parameter not yet materialised)
    layout: Layout | None  # None: a parameter whose layout its first use will choose
    val: Any  # the global fake tensor (shape, dtype)
    param: str | None = None  # set when the value is a parameter, maybe transposed
    ptrans: bool = False  # the value is the parameter transposed (t / permute)
    pchain: tuple = ()  # dtype casts applied to the parameter, replayed after gathering
    # a narrowing cast (fp32 -> bf16) applied to the parameter: done before gathering, by
    # the all-gather itself, so the weight travels in the narrow dtype
    pcast: Any = None

    @property
    def shape(self) -> list[int]:
        return list(self.val.shape)

    @property
    def ndim(self) -> int:
        return len(self.val.shape)


@dataclass
class SourceInfo:
    op: str
    module: str
    line: str


@dataclass
class Fallback:
    op: str
    module: str
    line: str
    gathered: list[str]

    def __str__(self) -> str:
        where = f" in {self.module}" if self.module else ""
        g = f"; gathered {', '.join(self.gathered)}" if self.gathered else ""
        return f"{self.op}{where} at {self.line}: no sharding rule, ran replicated{g}"


def where(s: SourceInfo) -> str:
    return f"in {s.module or 'the top module'} at {s.line or '?'}"


def source_of(node: fx.Node) -> SourceInfo:
    stack = node.meta.get("nn_module_stack") or {}
    module = ""
    if stack:
        module = list(stack.values())[-1][0]
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    line = ""
    # the innermost frame outside torch itself: the model's own line, not nn.Linear's
    files = [ln.strip() for ln in trace if ln.strip().startswith("File ")]
    user = [ln for ln in files if "/torch/" not in ln]
    for ln in reversed(user or files):
        if ln.startswith("File "):
            parts = ln.split(",")
            f = parts[0][5:].strip().strip('"').split("/")[-1]
            no = parts[1].strip().replace("line ", "") if len(parts) > 1 else "?"
            line = f"{f}:{no}"
            break
    op = str(node.target)
    return SourceInfo(op, module, line)


@dataclass
class StepProgram:
    """What the step runs: ``forward(*primals) -> (*outputs, *saved)`` and
    ``backward(*saved, *tangents) -> grads`` (one per entry of ``grad_of``)."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    n_outputs: int
    diff_outputs: list[int]  # outputs that take a tangent
    grad_of: list[int]  # primal index of each gradient backward returns
    joint: fx.GraphModule  # the unsplit graph (for explain and tests)
    # what the step calls for each part: the GraphModule itself, or its compiled form
    # (backend="inductor": shardc/program/backend.py); set by ShardedModule when it is built
    run_forward: Any = None
    run_backward: Any = None

    def runners(self) -> tuple[Any, Any]:
        return (self.run_forward or self.forward, self.run_backward or self.backward)


DEFERRED = "shardc_deferred"  # gm.meta: list[Deferred]


@dataclass
class Deferred:
    index: int  # the output's place among the user's outputs
    tail: fx.GraphModule  # tail(*inputs) -> the output's value
    n_inputs: int  # how many values the forward returns for it, after the saved ones
    like: Any  # the output's traced (fake) value: its shape, strides and dtype


# GEMMs and attention as they reach the dispatcher (linear is addmm/mm there; the fused
# attention kernels of each backend); only those this torch has are used
DEFAULT_SAVE = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm",
                "aten._scaled_dot_product_flash_attention",
                "aten._scaled_dot_product_flash_attention_for_cpu",
                "aten._scaled_dot_product_efficient_attention",
                "aten._scaled_dot_product_cudnn_attention")


def op_named(name: str) -> Any:
    """``"aten.mm"`` -> torch.ops.aten.mm (an overload packet), or None."""
    ns, _, op = name.partition(".")
    if not op or "." in op:
        return None
    try:
        return getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        return None


@dataclass(frozen=True)
class Selective:
    """A selective activation-checkpointing policy: inside each repeated block, keep the
    outputs of the ops in ``save`` (names like ``"aten.mm"``: ATen overload packets) and
    recompute everything else in backward. ``Selective()`` saves GEMMs and attention."""

    save: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = tuple(self.save) if self.save else tuple(n for n in DEFAULT_SAVE if op_named(n))
        if isinstance(self.save, str):
            raise OptionTypeError(f"shardc.Selective: save must be a list of op names, got the string "
                            f"{self.save!r}; write save=[{self.save!r}].")
        bad = [n for n in names if not isinstance(n, str) or op_named(n) is None]
        if bad:
            raise OptionError(f"shardc.Selective: {', '.join(map(repr, bad))} name no op this torch "
                             "has; name ATen ops as 'aten.<op>' (an overload packet, e.g. "
                             "'aten.mm', 'aten.addmm', 'aten._scaled_dot_product_flash_attention').")
        object.__setattr__(self, "save", names)

    def policy(self) -> Callable[..., Any]:
        keep = {op_named(n) for n in self.save}

        def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            packet = getattr(op, "overloadpacket", op)
            return CheckpointPolicy.MUST_SAVE if packet in keep else CheckpointPolicy.PREFER_RECOMPUTE
        return decide


