"""How a rank's program runs: ``backend="eager"`` (torch's own bindings, ``direct_calls``)
or ``backend="inductor"``.

Under inductor, each part of the step program (``passes/joint.py``: forward, backward) is
compiled as **one graph** (``WholePart``): ``passes/ordered_ops.py`` turns every collective
into an issue op and a wait op of ``runtime/ordered_ops.py`` and every random draw into a
draw op, all threaded in program order by a token, and ``compile_fx`` compiles the part with
them inside. The parts run inside one autograd node, so each compiles as an inference graph.

``torch.compile`` of the module cannot do this: the runtime's collectives carry the in-flight
``Work`` of an async call as a Python attribute of the buffer they return, which dynamo cannot
trace (``InternalTorchDynamoError`` at ``collectives.wait``). That is why the forward program
(run without gradients, with ``step_graph=False``, or under ``no_sync``), and a part that
cannot be compiled whole, are still cut instead (``InductorProgram``): every node that talks
to ``torch.distributed``, draws a random number or writes in place runs alone and eagerly;
each run of compute between them becomes a submodule (``torch.fx.passes.split_module``)
compiled with ``torch.compile``. The prefetch schedule survives there as it is (an in-flight
buffer reaches compiled code only after its wait), and the draws are the eager program's
(inductor's own Philox generator drew other masks: a GPT with dropout 0.1 on x2 lost 4.17842
compiled against 4.16936, same seed).
"""
from __future__ import annotations

import copy
import hashlib
import operator
import socket
import time
import warnings
from typing import Any, Callable, cast

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._dynamo.utils import GmWrapper, counters
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.split_module import split_module
from torch.utils._python_dispatch import TorchDispatchMode

from shardc.core.options import BACKENDS
from shardc.passes.ordered_ops import NotCompilable, ordered_ops_pass
from shardc.runtime import collectives as C
from shardc.runtime import functional as F
from shardc.runtime import ops as R
from shardc.runtime.ordered_ops import OPS as ORDERED_OPS

# Runtime functions that hand tensors to torch.distributed (or wait on them): the
# forward program's and the step program's (passes/joint.py). Every other call in
# a program is local compute, pure given its inputs and the rank.
_COLLECTIVE_FUNCTIONS = frozenset({
    C.all_gather_start, C.all_reduce_start, C.reduce_scatter_start, C.all_to_all_start,
    C.wait, C.grad_all_reduce,
    *F.RUN_FUNCTIONS, F.WAIT,
})
# Namespaces of ATen collectives (functional collectives and c10d's own ops), so a program
# that calls those instead is cut the same way.
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d",
                                    "_c10d_functional_autograd"})


def is_collective(node: fx.Node) -> bool:
    """Does ``node`` communicate (or wait on communication)?"""
    if node.op != "call_function":
        return False
    t = node.target
    if t in _COLLECTIVE_FUNCTIONS:
        return True
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return t.namespace in _COLLECTIVE_NAMESPACES
    return str(getattr(t, "__module__", "")).startswith("torch.distributed")


def is_random(node: fx.Node) -> bool:
    """Does ``node`` draw from a random generator?"""
    if node.op != "call_function":
        return False
    t = node.target
    if t is R.global_dropout or t is R.global_bernoulli or t is R.global_draw_like:
        return True
    if isinstance(t, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in t.tags
    return False


def writes_in_place(node: fx.Node) -> bool:
    """Does ``node`` write into one of its arguments? ``make_fx``'s step program keeps
    a few in-place ops (dropout's ``div_`` of the mask it just drew), where export's forward
    program has none."""
    t = node.target
    return (node.op == "call_function" and isinstance(t, torch._ops.OpOverload)
            and t._schema.is_mutable)


def runs_eagerly(node: fx.Node) -> bool:
    """Nodes the inductor backend leaves out of every compiled piece: a piece is then a
    pure function of its inputs, safe to run again eagerly if compiling it failed."""
    return is_collective(node) or is_random(node) or writes_in_place(node)


def split_at_collectives(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str], list[str]]:
    """Cut ``gm`` into submodules: each node that runs eagerly (``runs_eagerly``) alone,
    each run of compute between two of them together. Returns the split module and the
    names of its compute and eager submodules, in program order."""
    part: dict[fx.Node, int] = {}
    current = 0
    kinds: dict[int, str] = {}
    prev_eager = True
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if runs_eagerly(node):
            current += 1
            kinds[current] = "eager"
            part[node] = current
            prev_eager = True
        else:
            if prev_eager:
                current += 1
                kinds[current] = "compute"
            part[node] = current
            prev_eager = False
    split = split_module(gm, gm, lambda n: part[n], keep_original_order=True)
    compute = [f"submod_{i}" for i, k in kinds.items() if k == "compute" and hasattr(split, f"submod_{i}")]
    eager = [f"submod_{i}" for i, k in kinds.items() if k == "eager" and hasattr(split, f"submod_{i}")]
    return split, compute, eager


def _reason(e: BaseException) -> str:
    """The root cause of a compiler error, in one line: dynamo wraps a backend's error
    (``BackendCompilerFailed: backend='inductor' raised:``) around the one that says why."""
    root = e
    while True:
        inner = root.__cause__ or getattr(root, "inner_exception", None)
        if not isinstance(inner, BaseException) or inner is root:
            break
        root = inner
    lines = str(root).strip().splitlines()
    why = f"{type(root).__name__}: {lines[0] if lines else ''}"
    return why if root is e else f"{type(e).__name__} from {why}"


def _is_view(n: fx.Node) -> bool:
    t = n.target
    if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    rets = t._schema.returns
    return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write


def mutates(piece: fx.GraphModule) -> bool:
    """Does a piece write in place into one of its inputs (or a view of one)? ``make_fx``'s
    step program keeps in-place ops (dropout's ``div_``) where export's forward program is
    functional; one on a tensor the piece itself made is harmless."""
    for n in piece.graph.nodes:
        t = n.target
        if not (n.op == "call_function" and isinstance(t, torch._ops.OpOverload)
                and t._schema.is_mutable):
            continue
        written = [a for a, arg in zip(n.args, t._schema.arguments)
                   if arg.alias_info is not None and arg.alias_info.is_write]
        for a in written:
            while isinstance(a, fx.Node) and _is_view(a):
                a = a.args[0]
            if not isinstance(a, fx.Node) or a.op == "placeholder":
                return True
    return False


def _structure(piece: fx.GraphModule) -> tuple:
    """What ``piece`` computes, independent of its nodes' names: each node's kind, target
    and arguments, the arguments as positions of earlier nodes. Two pieces with the same
    structure called on inputs with the same metadata run the same code (a model's
    repeated blocks cut at the same collectives give one piece each per block). An
    attribute a piece reads enters as the object it is, so pieces reading different
    constants differ."""
    index: dict[fx.Node, int] = {}

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(a)
        if isinstance(a, torch.Tensor):  # its repr elides the values of a large one
            return ("tensor", id(a))
        return (type(a).__name__, repr(a))

    out = []
    for i, n in enumerate(piece.graph.nodes):
        index[n] = i
        if n.op in ("get_attr", "call_module"):
            target: Any = ("object", id(piece.get_submodule(n.target) if n.op == "call_module"
                                      else getattr(piece, str(n.target))))
        elif callable(n.target):
            target = (getattr(n.target, "__module__", ""), getattr(n.target, "__qualname__", ""),
                      str(n.target), id(n.target))
        else:  # a method's name, a placeholder's or the output's
            target = ("name", str(n.target)) if n.op == "call_method" else None
        out.append((n.op, target, arg(n.args), arg(n.kwargs)))
    return tuple(out)


def _inputs_key(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad)
                 if isinstance(a, torch.Tensor) else (type(a).__name__, repr(a)) for a in args)


class _CompiledPiece(torch.nn.Module):
    """A compute piece compiled on its first call; if compiling fails, the piece runs
    eagerly from then on and a warning says why (the rest of the program stays compiled).
    A piece that writes in place into an input is never compiled: running it again
    eagerly after a compiled attempt failed partway would apply its writes twice.

    Pieces of one program (or of every segment of ``compile_segments``) that compute the
    same thing on inputs of the same metadata share one compiled function (``shared``):
    each of a model's repeated blocks would otherwise be traced by dynamo and compiled
    again (a cache hit in inductor, still half a second of tracing per piece)."""

    def __init__(self, name: str, piece: fx.GraphModule, options: dict[str, Any],
                 shared: dict[tuple, Callable[..., Any]]) -> None:
        super().__init__()
        self.name = name
        self.eager = piece
        self.tried = False
        self.failure: str | None = None
        self.compiled: Callable[..., Any] | None = None
        self._options = options
        self._shared = shared
        self._structure: tuple = ()
        if mutates(piece):
            self.failure = "writes into an input in place"
        else:
            self._structure = _structure(piece)

    def forward(self, *args: Any) -> Any:
        if self.tried:
            return self.eager(*args) if self.compiled is None else self.compiled(*args)
        self.tried = True
        if self.failure is not None:
            return self.eager(*args)
        key = (self._structure, _inputs_key(args))
        compiled = self._shared.get(key)
        if compiled is None:
            compiled = torch.compile(self.eager, backend="inductor", dynamic=False, options=self._options)
        try:
            out = compiled(*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: run it eagerly
            # A piece holds no collective and no random draw, and the program is functional
            # (export's), so running it again eagerly is the same step even if the compiled
            # code failed partway.
            self.failure = _reason(e)
            warnings.warn(f"shardc: inductor could not compile {self.name} ({self.failure}); it runs "
                          "eagerly.", RuntimeWarning, stacklevel=2)
            return self.eager(*args)
        self.compiled = self._shared.setdefault(key, compiled)
        return out


class InductorProgram:
    """The rank's program as a callable: compute pieces through inductor, collectives and
    random draws eager. ``pieces`` and ``eager_nodes`` count what was cut; ``fallbacks``
    lists the pieces that run eagerly because inductor failed on them."""

    def __init__(self, gm: fx.GraphModule, shared: dict[tuple, Callable[..., Any]] | None = None) -> None:
        self.split, compute, eager = split_at_collectives(gm)
        shared = {} if shared is None else shared
        # a random op not recognised by is_random would otherwise draw from inductor's
        # own generator
        options = {"fallback_random": True}
        self._pieces: dict[str, _CompiledPiece] = {}
        for name in compute:
            piece = _CompiledPiece(name, getattr(self.split, name), options, shared)
            self._pieces[name] = piece
            setattr(self.split, name, piece)
        self.eager_nodes = len(eager)

    @property
    def pieces(self) -> int:
        return len(self._pieces)

    @property
    def fallbacks(self) -> list[str]:
        """Pieces that run eagerly: inductor failed on them, or they write into an input."""
        return [f"{n}: {p.failure}" for n, p in self._pieces.items() if p.failure]

    def __call__(self, *args: Any) -> Any:
        return self.split(*args)


class _Compiled(torch.nn.Module):
    """An ``InductorProgram`` in a module's place (``Checkpointed.inner``, a segment of the
    recompute's split): a module attribute must stay a module."""

    def __init__(self, program: InductorProgram) -> None:
        super().__init__()
        self.program = program
        self.split = program.split  # registered, so the split's own modules stay visible

    def forward(self, *args: Any) -> Any:
        return self.program(*args)


def compile_segments(split: torch.nn.Module) -> tuple[torch.nn.Module, list[InductorProgram]]:
    """Block recompute under ``backend="inductor"``: a copy of ``split`` in which each
    segment (``passes/recompute.py``'s, the checkpointed ones' inner program too) is
    compiled the way the forward program is, cut at its collectives, and the compiled
    programs in segment order (for ``explain``). ``split`` itself stays as it was: the
    memory estimate traces it. A checkpointed segment's recompute calls the same compiled
    pieces again (torch's checkpoint replays the segment with its saved random state; a
    piece is an autograd function whose saved tensors go through the checkpoint's hooks,
    so they are freed after forward as eager ones are)."""
    split = copy.deepcopy(split)
    programs = []
    shared: dict[tuple, Callable[..., Any]] = {}  # the blocks' segments compile their pieces once
    for name, child in list(split.named_children()):
        inner = getattr(child, "inner", None)
        if isinstance(inner, fx.GraphModule):  # a checkpointed segment: compile what it runs
            program = InductorProgram(inner, shared)
            child.inner = _Compiled(program)
        else:
            program = InductorProgram(cast(fx.GraphModule, child), shared)
            setattr(split, name, _Compiled(program))
        programs.append(program)
    return split, programs


# Inductor settings for a whole part. Off: the two passes that move nodes for locality
# and for peak memory, which would move an issue down to its wait (its token's only reader)
# and undo the overlap the schedule pass made. On: ``fallback_random``, so that a random op
# calls torch's own kernel on the default generator, as the eager program does, and draws
# the masks one device draws (inductor's Philox draws others).
WHOLE_CONFIG = {"reorder_for_locality": False, "reorder_for_peak_memory": False,
                "fallback_random": True}


class WholePart:
    """A part of the step program compiled by inductor as one graph, collectives included
    (as ``runtime.ordered_ops``'s ops: ``passes.ordered_ops.py``). It compiles on its
    first call, from that call's inputs, and only then runs. If the part cannot be handed
    over whole (``NotCompilable``) or inductor fails on it, the part runs cut at its
    collectives (``InductorProgram``) and a warning says why. Compiling runs nothing, so
    the fallback repeats no collective."""

    def __init__(self, gm: fx.GraphModule, name: str) -> None:
        self.gm = gm
        self.name = name
        self.compiled: Callable[..., Any] | None = None
        self.pieces: InductorProgram | None = None
        self.failure: str | None = None
        self.compile_seconds: float | None = None
        self.cache: str | None = None  # "hit" or "miss": inductor's FX graph cache
        self.tried = False
        try:
            self.whole: fx.GraphModule | None = ordered_ops_pass(gm)
        except NotCompilable as e:
            self.whole = None
            self._fall_back(str(e))

    def _fall_back(self, why: str) -> None:
        self.failure = why
        self.pieces = InductorProgram(self.gm)
        warnings.warn(f"shardc: inductor could not compile the step program's {self.name} part "
                      f"whole ({why}); it runs cut at its collectives.", RuntimeWarning,
                      stacklevel=3)

    def _compile(self, args: tuple) -> None:
        assert self.whole is not None
        # inductor takes seconds to import; only this backend needs it
        from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415 - see above
        from torch._inductor.lowering import lowerings, make_fallback  # noqa: PLC0415 - see above

        for op in ORDERED_OPS:
            # our ops run as they are (a fallback kernel). Registered up front: inductor
            # (2.8) otherwise formats each op's arguments for a log line when it meets it
            # first, and an argument of a token chain prints the whole chain before it,
            # along every path; at a bucket's all-reduce after two blocks that took
            # longer than ten minutes
            if op not in lowerings:
                make_fallback(op, warn=False)
        t0 = time.perf_counter()
        before = dict(counters["inductor"])
        try:
            # a tracing context with a shape environment, as dynamo makes one: without it
            # inductor's FX graph cache and AOTAutograd's cache are bypassed ("No shape env")
            # and every process compiles every part from nothing
            context = TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
            with tracing(context):
                # what dynamo would call: the compiled part, taking the part's arguments
                # wrapped as dynamo wraps a graph whose inputs may be freed early: the
                # compiled part then takes its arguments as one list and empties it, so
                # each input (a saved activation) is freed after its last read
                boxed = cast(fx.GraphModule, GmWrapper(self.whole, _as_listed))
                self.compiled = cast(Callable[..., Any], compile_fx(
                    boxed, list(args), config_patches=dict(WHOLE_CONFIG)))
        except Exception as e:  # noqa: BLE001 - any compiler failure: run the part in pieces
            self._fall_back(_reason(e))
        self.compile_seconds = time.perf_counter() - t0
        hits = counters["inductor"]["fxgraph_cache_hit"] - before.get("fxgraph_cache_hit", 0)
        self.cache = "hit" if hits else "miss"

    def _compile_in_turn(self, args: tuple) -> None:
        """Compile, the ranks of one machine whose parts are the same graph on the same
        shapes taking turns: the lowest compiles first and fills inductor's caches, the
        others then compile from them (a cache hit: about 2 s for a TinyGPT part against
        8-15 s cold, measured here). Every rank of a pure data mesh, and the ranks of a
        z group, have the same program; on a machine with fewer cores than ranks the
        rest would otherwise all compile at once. Every rank takes part (two small
        gathers), a part that fell back included, so no rank waits for one that never comes."""
        if not (dist.is_initialized() and dist.get_world_size() > 1
                and dist.get_backend() not in ("fake",)):
            if self.whole is not None:
                self._compile(args)
            return
        shapes = [(tuple(a.shape), tuple(a.stride()), a.dtype) for a in args if isinstance(a, torch.Tensor)]
        mine = None if self.whole is None else (
            socket.gethostname(), hashlib.sha256(f"{self.whole.code}{shapes}".encode()).hexdigest())
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        first = mine is not None and everyone.index(mine) == dist.get_rank()
        if first:
            self._compile(args)
        dist.all_gather_object(everyone, None)  # the first of each kind has compiled
        if mine is not None and not first:
            self._compile(args)

    def describe(self) -> str:
        """One line for ``explain``: how the part runs, and what compiling it took."""
        if self.pieces is not None:
            return (f"{self.name}: cut at its collectives ({self.failure}); "
                    f"{self.pieces.pieces} pieces compiled separately")
        assert self.whole is not None
        kinds: dict[str, int] = {}
        for n in self.whole.graph.nodes:
            if n.op == "call_function" and n.target in ORDERED_OPS:
                name = n.target._schema.name.split("::")[1].replace("_in_place", "")
                kinds[name] = kinds.get(name, 0) + 1
        ops = ", ".join(f"{k} {kinds.get(k, 0)}" for k in ("issue", "wait", "draw", "hand_off"))
        if self.compiled is None:
            return f"{self.name}: one graph for inductor ({ops}); compiled on its first call"
        return (f"{self.name}: one inductor graph ({ops}), compiled in {self.compile_seconds:.1f} s "
                f"(inductor's FX graph cache: {self.cache})")

    @property
    def fallbacks(self) -> list[str]:
        """Why the part is not one compiled graph, and its pieces that run eagerly."""
        if self.pieces is None:
            return []
        return [f"{self.name}: {self.failure}", *self.pieces.fallbacks]

    def __call__(self, *args: Any) -> Any:
        return self.call_boxed(list(args))

    def call_boxed(self, args: list) -> Any:
        """The part on ``args``, which it empties: what only ``args`` holds is freed as
        soon as the part has read it for the last time (backward's saved activations)."""
        if not self.tried:
            self.tried = True
            self._compile_in_turn(tuple(args))
        if self.pieces is not None:
            inputs = tuple(args)
            args.clear()
            return self.pieces(*inputs)
        assert self.compiled is not None
        return self.compiled(args)


def _as_listed(args: list) -> list:
    """GmWrapper's unflattening: the part's inputs are its arguments, in order."""
    return args


class BoxedPart:
    """An eager part of the step program called with its arguments as one list that it
    empties (``call_boxed``), as inductor's parts are: the graph reads them through
    ``getitem`` nodes, which fx's code frees after their last use, so backward drops each
    saved activation once it has read it instead of holding all of them to its end.
    ``part(*args)`` still works."""

    def __init__(self, gm: fx.GraphModule) -> None:
        graph = fx.Graph()
        box = graph.placeholder("args")
        env: dict[fx.Node, Any] = {}
        i = 0
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                env[n] = graph.call_function(operator.getitem, (box, i))
                env[n].meta.update(n.meta)
                i += 1
        graph.call_method("clear", (box,))
        for n in gm.graph.nodes:
            if n.op == "output":
                graph.output(fx.map_arg(n.args[0], env.__getitem__))
            elif n.op != "placeholder":
                env[n] = graph.node_copy(n, env.__getitem__)
        self.boxed = fx.GraphModule(gm, graph)
        self.graph, self.meta = gm.graph, gm.meta  # the part as it was (what tests read)

    def __call__(self, *args: Any) -> Any:
        return self.boxed(list(args))

    def call_boxed(self, args: list) -> Any:
        return self.boxed(args)


# ---------------------------------------------------------------- the eager backend
class _FirstOp(TorchDispatchMode):
    """Records the first ATen call a call dispatches (on meta tensors: no compute)."""

    def __init__(self) -> None:
        super().__init__()
        self.call: Any = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.call is None:
            self.call = (func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


_MISSING = object()


def _by_name(op: Any, args: Any, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by the schema's names, defaults filled in."""
    out: dict[str, Any] = {}
    # a schema lists its positional arguments first, so i is also the positional index
    for i, a in enumerate(op._schema.arguments):
        if not a.kwarg_only and i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else _MISSING
    return out


def _same(a: Any, b: Any) -> bool:
    """The probe's arguments against what the op received: the very tensors, and equal
    values (a Python number may arrive as the 0-dim tensor the binding wrapped it in, as
    the boxed call wraps it)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if a is b:
            return True
        if isinstance(b, torch.Tensor) and isinstance(a, (bool, int, float)) \
                and b.dim() == 0 and b.device.type != "meta":
            return bool(b.item() == a) and type(b.item()) is type(a)
        return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b) if not (a is _MISSING or b is _MISSING) else a is b


class _NoProbe(Exception):
    pass


def _on_meta(v: Any) -> Any:
    """An argument of a node as the probe passes it: a tensor as an empty meta tensor of
    its shape, strides and dtype; anything else as it is."""
    if isinstance(v, fx.Node):
        val = v.meta.get("val")
        if isinstance(val, torch.Tensor):
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        if isinstance(val, (bool, int, float)):
            return val
        raise _NoProbe
    if isinstance(v, (list, tuple)):
        return type(v)(_on_meta(a) for a in v)
    if isinstance(v, (torch.device, torch.Tensor)):  # a factory call would allocate
        raise _NoProbe
    return v


def _binding(node: fx.Node, seen: dict[tuple, Any]) -> Any:
    """torch's Python binding that runs exactly ``node``'s overload with ``node``'s
    arguments, or None. ``torch.ops.aten.X.Y(...)`` is a boxed call through the JIT
    operator table; ``torch.X`` / ``Tensor.X`` is the generated unboxed binding, a few
    microseconds less a call. The overload a binding picks depends on the arguments' types
    (``torch.add(x, 2)`` is ``add.Tensor`` with a wrapped number, as the boxed call is), so
    each candidate is tried once on meta tensors of the node's own shapes and dtypes, and
    kept only if the first op it dispatches is the node's, with the node's arguments."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload) or t.namespace != "aten":
        return None
    if t is torch.ops.aten.reshape.default and not node.kwargs:
        # composite: its binding dispatches the view (or the copy) it decides on, never
        # reshape itself, so the probe below cannot match it; the boxed call would run
        # that same binding's code
        return torch.Tensor.reshape
    if any(isinstance(a, (list, tuple)) and any(x is None for x in a)
           for a in (*node.args, *node.kwargs.values())):
        # an optional tensor list (``index_put(x, [None, i], v)``, the backward of
        # ``x[None, i]``): the probe on meta tensors takes the None, while the binding
        # refuses it on real ones
        return None
    key = (t, tuple(type(a) for a in node.args), tuple(sorted(node.kwargs)))
    if key in seen:
        return seen[key]
    name = t._schema.name.split("::")[-1]
    found = None
    try:
        args, kwargs = _on_meta(list(node.args)), _on_meta(dict(node.kwargs))
    except _NoProbe:
        args = None
    if args is not None and args and isinstance(args[0], torch.Tensor):
        for fn in (getattr(torch._C._VariableFunctions, name, None),
                   getattr(torch.Tensor, name, None)):
            # generated bindings only (C functions and method descriptors): a method that
            # torch writes in Python (Tensor.split, Tensor.norm) may read its arguments
            # its own way
            if fn is None or type(fn).__name__ not in ("builtin_function_or_method",
                                                       "method_descriptor"):
                continue
            probe = _FirstOp()
            try:
                with probe:
                    fn(*args, **kwargs)
            except Exception:  # noqa: BLE001 - no such form, or not on meta: keep the op
                continue
            if probe.call is None or probe.call[0] is not t:
                continue
            want, got = _by_name(t, args, kwargs), _by_name(t, *probe.call[1:])
            if all(_same(want[k], got[k]) for k in want):
                found = fn
                break
    seen[key] = found
    return found


def direct_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` that calls each ATen op through torch's Python binding where one
    runs the same overload (``_binding``); ``gm`` itself, which the passes, ``explain`` and
    the reports read, keeps its ``OpOverload`` targets. The same kernels run on the same
    arguments in the same order, so every value is the same bit for bit; what changes is
    the Python cost of a call: about 4% of the CPU of the TinyGPT's forward and backward on
    ``x1y1z1d8`` (docs/direct_calls.md)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    seen: dict[tuple, Any] = {}
    changed = False
    for node in graph.nodes:
        if node.op == "call_function":
            fn = _binding(node, seen)
            if fn is not None:
                node.target = fn
                changed = True
    if not changed:
        return gm
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    return copy


def build_runner(gm: fx.GraphModule, backend: str, part: str | None = None) -> Callable[..., Any]:
    """What ``ShardedModule.forward`` calls for ``backend``: for the forward program, or,
    with ``part`` ("forward", "backward"), for that part of the step program."""
    if backend == "eager":
        return BoxedPart(direct_calls(gm)) if part == "backward" else direct_calls(gm)
    if backend == "inductor":
        return WholePart(gm, part) if part else InductorProgram(gm)
    raise ValueError(f"shardc.compile: backend={backend!r} is not one of {BACKENDS}.")
