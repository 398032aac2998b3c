"""Trace a model to an ATen graph with torch.export (non-strict).

Reads:  the user's nn.Module and global-shaped example inputs
Writes: an ExportedProgram whose ops the sharding rules know (ops with a rule are kept
        whole, everything else decomposed to core ATen so that e.g. ``mse_loss`` arrives
        as sub/pow/mean, which have rules)

The trace depends only on the model's code, the inputs' shapes and the compute dtype of
the precision policy, never on parameter values or on the mesh, so one trace serves
every mesh a model is compiled for.

Under a mixed-precision policy the model is traced as it runs under that policy on one
device: each floating parameter cast to the compute dtype where it is read, floating
inputs cast on entry. Casting the traced graph afterwards would not do: the model's own
dtype decisions (``x.to(input_dtype)`` in Llama's RMSNorm, ``logits.float()``) are
recorded as constants at trace time, and a later cast would leave them contradicting
the parameters (an fp32 activation meeting a bf16 weight in a GEMM).
"""
from __future__ import annotations

import contextlib
import logging
import operator
import random
import re
import warnings
import weakref
from typing import Any, Iterator

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental import symbolic_shapes

from shardc.core.errors import ShardcError, ShardcWarning, TraceError
from shardc.core.ir import source_of, where
from shardc.core.precision import CastAtUse
from shardc.passes.autograd_functions import (
    check_backwards,
    is_user_file,
    record_autograd_functions,
    record_gradient_hooks,
    refuse_gradient_hooks,
)
from shardc.passes.branch_checks import Unchecked, add_branch_checks, mark_branch_checks
from shardc.passes.causal_masks import fold_causal_masks
from shardc.passes.data_sized import pad_data_sized
from shardc.passes.decompose import decompose
from shardc.passes.hit_loops import MAX_ITERATIONS, loops_over_hits, mask_hit_loops
from shardc.passes.lower import FIXED_SIZE, data_sized_origin
from shardc.passes.masked_losses import unpick_losses
from shardc.passes.masked_reductions import unpick_reductions
from shardc.passes.picked_weights import group_picked_gemms
from shardc.passes.recompute_calls import record_recompute_calls, unique
from shardc.passes.rules import RULES
from shardc.passes.rules.common import existing_ops
from shardc.runtime.ctc import traceable_ctc_loss

_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, dict[Any, torch.export.ExportedProgram]]" = \
    weakref.WeakKeyDictionary()
# torch.utils.checkpoint calls seen while tracing (export inlines them: no recompute)
CHECKPOINTED: "weakref.WeakKeyDictionary[torch.export.ExportedProgram, tuple[str, ...]]" = \
    weakref.WeakKeyDictionary()


def signature(inputs: tuple) -> Any:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in inputs)


def trace(model: torch.nn.Module, example_inputs: tuple, compute: torch.dtype = torch.float32
          ) -> torch.export.ExportedProgram:
    """``compute``: the policy's compute dtype (``shardc.core.precision``); fp32 traces the
    model as it is."""

    key = (signature(example_inputs), model.training, compute)
    per_model = _CACHE.setdefault(model, {})
    if key in per_model:
        return per_model[key]
    found: list[str] = []
    functions: dict[type, Any] = {}
    hooks: list[str] = []
    # The trace must not consume the default generator: a compiled model has to draw the
    # same dropout masks as the single-device model seeded identically.
    with torch.random.fork_rng(devices=[]), _host_draws_frozen(model), \
            record_recompute_calls(model, found), record_autograd_functions(functions), \
            record_gradient_hooks(hooks), traceable_ctc_loss():
        try:
            root = model if compute == torch.float32 else CastAtUse(model, compute)
            args = _traced_copies(tuple(example_inputs))
            specialized = ""
            ep = _export(root, args)
        except Exception as e:  # noqa: BLE001 - re-raised with the cause named
            if not _data_dependent(e):
                raise TraceError(explain_trace_failure(model, e)) from e
            ep, guards = _draft(model, root, args, e)
            where = sorted({w for _, _, w in guards})
            specialized, cause = "; ".join(where), e
            try:
                add_branch_checks(ep.graph_module, guards)
            except Unchecked as u:
                # traced on the examples' side with no check, a batch taking the other
                # side would be computed wrong: the export's error stands
                raise TraceError(
                    f"{explain_trace_failure(model, e)}\n(draft_export traced the side the "
                    f"example inputs take, but shardc cannot check its guard {u} at every "
                    f"step on torch {torch.__version__}.)") from e
        _refuse_valueless_constants(model, ep)
        _detach_no_grad_regions(ep.graph_module)
        mask_hit_loops(ep.graph_module)
        # before the decompositions, which cannot take the picked rows' size
        unpick_losses(ep.graph_module)
        unpick_reductions(ep.graph_module)
        if not all(_has_rule(n.target, RULES) for n in ep.graph.nodes if n.op == "call_function"):
            # decompose what has no rule: in place where the graph is functional, else
            # by re-tracing the whole (which costs about twice the export)
            table = torch.export.default_decompositions()
            keep_whole = existing_ops(*_KEEP_WHOLE)
            for op in list(table):
                if _has_rule(op, RULES) or op in keep_whole:
                    table.pop(op)
            try:
                ep = decompose(ep, table, lambda op: _has_rule(op, RULES))
            except ShardcError:
                raise
            except Exception as e:  # noqa: BLE001 - see below
                if not specialized:
                    # torch's own decompositions failing (torch 2.6 and 2.7, below the
                    # floor, on an index whose size is the data's: "possible memo disaster")
                    raise TraceError(_decomposition_failure(model, ep, e)) from e
                # a draft's fixed branch that its own re-trace contradicts (BatchNorm with
                # momentum=None divides by its step count, which the draft fixed to 1):
                # the export's error is the one that says what is wrong
                raise TraceError(explain_trace_failure(model, cause)) from e
    # after the decompositions, which would trace the masks' subgraphs back in
    fold_causal_masks(ep.graph_module)
    # after them too: a grouped GEMM is an op no decomposition table knows
    group_picked_gemms(ep.graph_module)
    pad_data_sized(ep.graph_module)
    refuse_gradient_hooks(model, hooks)
    with torch.random.fork_rng(devices=[]):
        check_backwards(functions, type(model).__name__)
    if specialized:
        warnings.warn(
            f"shardc.compile: {type(model).__name__} branches on tensor values at "
            f"{specialized}, which torch.export cannot trace. shardc traced the branch "
            "the example inputs take (torch.export.draft_export) and checks it at every "
            "step: a batch that would take another branch stops every rank with a "
            "RuntimeError instead of computing the wrong thing, and the step runs the "
            "forward program with autograd's backward (no step passes). Branching on "
            "shapes, or torch.cond, compiles without the check.", ShardcWarning,
            stacklevel=4)
        # after the decompositions, which trace the graph anew
        mark_branch_checks(ep.graph_module, specialized)
    CHECKPOINTED[ep] = tuple(unique(found))
    per_model[key] = ep
    return ep


def _export(root: torch.nn.Module, args: tuple) -> torch.export.ExportedProgram:
    """``torch.export`` (non-strict). Where it fails on a size the data decides, again with a
    loop over the entries a mask holds traced over every entry it could hold
    (``passes/hit_loops.py``): each a constant first, so that the model may branch on it;
    where that fails too, as data. Where neither helps, the first export's error stands."""
    try:
        return torch.export.export(root, args, strict=False)
    except Exception as e:  # noqa: BLE001 - re-raised below unless a loop was the cause
        if not _data_dependent(e):
            raise
        plain = e
    for by_value in (False, True):
        with loops_over_hits(by_value) as loops:
            try:
                return torch.export.export(root, args, strict=False)
            except Exception:  # noqa: BLE001 - the first export's error says more
                if not loops.loops:
                    break
    raise plain


def _traced_copies(example_inputs: tuple) -> tuple:
    """A fresh contiguous copy of every tensor among the inputs, for export to trace.

    Contiguous: export bakes an input's strides into the views it records (a language
    model's ``data[:, :-1]`` slice made ``targets.flatten()`` a view that cannot exist);
    the program's inputs are made contiguous on entry to match (ShardedModule.forward).
    Fresh, always (``contiguous()`` hands back the tensor itself): export identifies
    inputs by their tensor, so the same tensor passed twice (``labels=input_ids``,
    transformers' idiom) or two views of one storage became one input read in both
    places, and every later call computed with the first argument where the second was
    passed."""
    return pytree.tree_map(
        lambda a: a.detach().clone(memory_format=torch.contiguous_format)
        .requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a,
        example_inputs)


def _detach_no_grad_regions(gm: torch.fx.GraphModule) -> None:
    """Inline each ``torch.no_grad()`` region of the forward (export's
    ``wrap_with_set_grad_enabled(False, submodule, *args)``) and detach its outputs.

    The region's submodule is otherwise inlined by the decompositions, or by the rank
    program's own tracing, as plain ops: gradients then flowed through a target computed
    under no_grad (``with torch.no_grad(): t = self.b(h)``), wrong for every parameter
    before it. Detaching the outputs is the region's meaning for the gradient: its values
    are the same, and nothing flows back through them."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    if hop is None:
        return
    g = gm.graph
    changed = False
    for n in list(g.nodes):
        if not (n.op == "call_function" and n.target is hop and n.args[0] is False):
            continue
        sub = getattr(gm, n.args[1].target)
        _detach_no_grad_regions(sub)  # a region inside the region
        env: dict[torch.fx.Node, Any] = {}
        args = iter(n.args[2:])
        out: Any = None
        with g.inserting_before(n):
            for sn in sub.graph.nodes:
                if sn.op == "placeholder":
                    env[sn] = next(args)
                elif sn.op == "get_attr":
                    name = f"_no_grad_{n.name}_{sn.target}".replace(".", "_")
                    setattr(gm, name, getattr(sub, sn.target))
                    env[sn] = g.get_attr(name)
                elif sn.op == "output":
                    out = sn.args[0]
                else:
                    env[sn] = g.node_copy(sn, lambda a: env[a])

            def detached(a: Any) -> Any:
                if not isinstance(a, torch.fx.Node) or not isinstance(a.meta.get("val"), torch.Tensor):
                    return a
                d = g.call_function(torch.ops.aten.detach.default, (a,))
                d.meta.update(a.meta)
                return d

            outs = torch.fx.node.map_arg(out, lambda a: detached(env[a]))
        if isinstance(outs, (tuple, list)):
            for user in list(n.users):
                if user.op == "call_function" and user.target is operator.getitem:
                    user.replace_all_uses_with(outs[user.args[1]])
                    g.erase_node(user)
        if n.users:
            n.replace_all_uses_with(outs)
        holder = n.args[1]
        g.erase_node(n)
        if not holder.users:
            g.erase_node(holder)
        changed = True
    if changed:
        gm.recompile()


def _data_dependent(e: BaseException) -> bool:
    """Did export fail on a branch on tensor values (a guard on a data-dependent value)?"""

    kind = getattr(symbolic_shapes, "GuardOnDataDependentSymNode", None)
    seen = set()
    while e is not None and id(e) not in seen and kind is not None:
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def _draft(model: torch.nn.Module, root: torch.nn.Module, args: tuple, cause: Exception
           ) -> tuple[torch.export.ExportedProgram, list[tuple[str, str, str]]]:
    """``torch.export.draft_export`` of ``root``: the branches export could not decide are
    fixed to the ones ``args`` take, each with runtime checks (``_assert_scalar``) that a
    later input takes it too. Accepted only when every problem it reports is such a branch
    (not, say, an op without a fake kernel); otherwise the export's own error stands.
    Returns the program and each fixed branch's guard: (expression, the value it had,
    where in the model's code)."""

    draft = getattr(torch.export, "draft_export", None)
    if draft is None:  # torch < 2.8 (below the floor) has it only under a private name
        raise TraceError(explain_trace_failure(model, cause)) from cause
    # its report is a page long, and it logs each branch it fixes: the warning says it once
    logs = [logging.getLogger(n) for n in ("torch.export._draft_export",
                                           "torch.fx.experimental.symbolic_shapes")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        ep = draft(root, args)
    except Exception as e:  # noqa: BLE001 - the export's error is the one to show
        raise TraceError(explain_trace_failure(model, cause)) from e
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    failures = list(getattr(getattr(ep, "_report", None), "failures", None) or [])
    kinds = {getattr(getattr(f, "failure_type", None), "name", None) for f in failures}
    if not failures or kinds != {"DATA_DEPENDENT_ERROR"}:
        raise TraceError(explain_trace_failure(model, cause)) from cause
    return ep, [(str(f.data.get("expr")), str(f.data.get("result")), _user_line(f))
                for f in failures]


def _user_line(failure: Any) -> str:
    """``file:line (code)`` of the model's line that a draft_export failure points at."""
    frames = (getattr(failure, "data", None) or {}).get("user_stack") or []
    if not frames:
        return "an unknown line"
    f = frames[-1]
    try:  # the report names files by their index in torch's structured-log table
        from torch._logging.structured import INTERN_TABLE  # noqa: PLC0415 - a private torch module; without it only the file name is lost

        files = {v: k for k, v in INTERN_TABLE.items()}
        name = files.get(f.get("filename"), "?")
    except ImportError:
        name = "?"
    return f"{name}:{f.get('line', '?')} ({str(f.get('loc', '')).strip()})"


@contextlib.contextmanager
def _host_draws_frozen(model: torch.nn.Module) -> Iterator[None]:
    """Warn when the traced forward draws from Python's or numpy's generator, and put
    their state back (compile must not consume the user's random streams, as it does not
    consume torch's). export runs that code once and records its numbers as constants,
    so the compiled program reuses them every step: transformers' wav2vec2 draws its
    SpecAugment mask with numpy, and would train with one frozen mask."""
    py = random.getstate()
    npst = np.random.get_state()
    try:
        yield
    finally:
        drew = []
        if random.getstate() != py:
            drew.append("Python's random")
            random.setstate(py)
        if np is not None:
            now = np.random.get_state()
            if not (now[0] == npst[0] and np.array_equal(now[1], npst[1])  # type: ignore[index]
                    and tuple(now[2:]) == tuple(npst[2:])):  # type: ignore[index]
                drew.append("numpy.random")
                np.random.set_state(npst)
        if drew:
            warnings.warn(
                f"shardc.compile: {type(model).__name__}'s forward draws random numbers from "
                f"{' and '.join(drew)} while it is traced. torch.export records them as "
                "constants, so every step of the compiled program reuses the trace's numbers "
                "where the model on one device draws new ones (wav2vec2's SpecAugment mask, "
                "for one). Draw them from torch's generator (torch.rand, torch.bernoulli) or "
                "switch that feature off (mask_time_prob=0) to train like one device.",
                ShardcWarning, stacklevel=4)


def checkpointed_modules(ep: torch.export.ExportedProgram) -> tuple[str, ...]:
    """Modules (or functions) the traced model wraps in ``torch.utils.checkpoint``."""
    return CHECKPOINTED.get(ep, ())


# Ops whose decomposition checks its result for errors by a side effect
# (``_linalg_check_errors``: a singular matrix raises), which export threads through the
# program as an effect token that no rank program carries: kept whole, they raise as they
# do on one device.
_KEEP_WHOLE = ("linalg_solve.default", "linalg_cholesky.default", "linalg_inv.default",
               "inverse.default", "linalg_matrix_power.default", "linalg_lu_factor.default",
               "linalg_ldl_factor.default", "linalg_tensorinv.default",
               "linalg_tensorsolve.default", "cholesky_solve.default")


def _has_rule(op: Any, rules: dict) -> bool:
    if op in rules or getattr(op, "overloadpacket", None) in rules:
        return True
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags


def _data_read(model: torch.nn.Module, what: str) -> str:
    return (f"shardc.compile: torch.export could not trace {type(model).__name__}: {what}\n"
            "The usual cause is a tensor's `.data` read in forward (e.g. `self.weight.data`): "
            "export cannot follow it. `.detach()` means the same for reading (the value, no "
            "gradient) and traces.")


def _refuse_valueless_constants(model: torch.nn.Module, ep: torch.export.ExportedProgram) -> None:
    """torch 2.6's export keeps a ``.data`` read in forward as a constant that is a fake
    tensor (newer releases raise): a program holding it computes with no values at all,
    its loss a FakeTensor whose ``.item()`` is a symbol."""
    fake = [name for name, v in ep.constants.items() if isinstance(v, FakeTensor)]
    if fake:
        raise TraceError(_data_read(model, f"the exported program's constant {fake[0]!r} is a "
                                           "fake tensor (it has no values)"))


def _decomposition_failure(model: torch.nn.Module, ep: torch.export.ExportedProgram,
                           e: Exception) -> str:
    """torch's decompositions failed on the exported program: where it makes a size that
    depends on the data (the usual cause on older torch), that and the rewrite."""

    origin = data_sized_origin(ep.graph)
    if origin is None:
        return explain_trace_failure(model, e)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return (f"shardc.compile: torch {torch.__version__}'s export could not decompose "
            f"{type(model).__name__} ({type(e).__name__}: {first}), which works on a size that "
            f"depends on the data, made by {origin.target} {where(source_of(origin))}. "
            f"{FIXED_SIZE}")


def explain_trace_failure(model: torch.nn.Module, e: Exception) -> str:
    msg = str(e).strip().splitlines()
    where = ""
    tb = e.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for f in reversed(frames):
        fn = f.f_code.co_filename
        if is_user_file(fn):
            where = f" at {fn}:{f.f_lineno}"
            break
    first = msg[0] if msg else type(e).__name__
    if "fake tensor in the exported program constant" in str(e):
        # torch's own words name an internal attribute (lifted_tensor_0), not the cause
        return _data_read(model, f"{type(e).__name__}: {first}")
    if re.search(r"Size-like symbols: (?!none)", str(e)):
        # a guard on a size the data decides: torch's advice (insert torch._check) does
        # not apply to a model the user did not write; what shardc can take does
        return (f"shardc.compile: torch {torch.__version__}'s export could not trace "
                f"{type(model).__name__}{where}: {type(e).__name__}: {first}\nThe guard is on "
                "a size the data decides: the rows of a boolean index `x[mask]`, `nonzero` or "
                "`masked_select`, or the trip count of a Python loop over such a tensor "
                "that shardc could not trace over every entry the mask could hold (over more "
                f"than {MAX_ITERATIONS} entries, or, before torch 2.13, a loop whose body "
                "cannot take an entry the mask never holds and indexes by the entry: DBRX's "
                "experts; transformers' default `grouped_mm` kernel sorts instead). Older "
                "torches guard on more of these (2.8's export cannot take a `log_softmax` "
                f"of picked rows). {FIXED_SIZE}")
    return (f"shardc.compile: torch.export could not trace {type(model).__name__}{where}: "
            f"{type(e).__name__}: {first}\nshardc needs a model torch.export can trace "
            "(non-strict; a branch on tensor values is traced on the example inputs' side "
            "with torch.export.draft_export, which could not help here). The usual causes: "
            "Python work on tensor data (.numpy(), a NumPy or Python library called on a "
            "tensor), an op with no fake (meta) kernel, or, with torch < 2.8 (no draft_export), "
            "a branch on tensor values; use torch.cond or make it depend on shapes.")
