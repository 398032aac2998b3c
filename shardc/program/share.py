"""One trace of the step program for every rank whose program is the same.

Tracing the joint step program (``passes/joint.py``: ``make_fx`` on fake tensors, then the
step passes) is most of what a rank spends before its first step: 0.9-2.3 s for the
tests' GPT, against 0.13 s for the rest of ``compile``, and every rank paid it. The ranks of
a pure data mesh, and the ranks of one z group, run the same program: the same forward
program, the same shapes, the same collectives over their own groups. On a machine with
fewer cores than ranks (a CPU test, a node's ranks compiling at once) each of them tracing
is time the others wait for.

So ``build`` (``step_program.py``) asks first what each rank would trace:

* **The signature**: a hash of everything the trace reads except the rank, namely the
  forward program (its graph, its nodes' metadata and constants), the compile context with
  its rank left out, the arguments' shapes, strides and dtypes and which need gradients,
  and the runtime's agreed GEMM forms. Written with the same encoder as the shared
  program (``_Encoder``), so anything the encoder cannot write makes the rank trace alone.
* **The coordinates the trace may bake in**: a traced program holds constants computed
  from the rank's coordinates (a weight's block, a dropout mask's rows), so ranks share
  only where their coordinates agree on the axes the forward program's runtime calls will
  read while traced (``baked_axes``). Every other coordinate lives in what the signature
  already holds (the forward program, which the lowering wrote for this rank, and the
  arguments' shapes) or is read when the program runs (``runtime.ops.mesh_coord``: a
  vocabulary shard's first row): the ranks of a ``data``/``z`` group, and those of an
  ``x`` or ``y`` group where no block is cut out by coordinate, trace one program between
  them.

The lowest rank of each class traces, as before, and sends its program to the others
(``broadcast_object_list``), who decode it in place of tracing. The trace logs every read of
the rank through the runtime (``Runtime.reads``): a program that read a coordinate on which
a receiving rank differs from the tracer's (or read the rank itself) is not taken, and that
rank traces its own. What differs between equal programs is written as tokens and put back
by each receiver: the runtime's key (``rt``) and the process groups' names (each rank's own
group for the collective's axis).

Every collective is still issued by every rank in the same order (the decoded program is the
tracer's, node for node), and ``tests/test_share.py`` holds the claim that makes this
exact: for the tests' models on every mesh of 8, a rank's own trace encodes to the same
bytes as the program it received.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import inspect
import io
import pickle
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule

from shardc.core.context import CompileContext
from shardc.core.ir import StepProgram
from shardc.core.mesh import ALL_AXES
from shardc.runtime import collectives as C
from shardc.runtime import functional as F
from shardc.runtime import ops as R

ANY = "*"  # Runtime.reads: the rank itself was read (every coordinate)


# False: every rank traces its own (for measuring what sharing saves)
ENABLED = True
# how this process's step programs came: "traced" (alone, or for others too), "received",
# "retraced" (received one it could not take); tests read it
COUNTS: collections.Counter[str] = collections.Counter()


class Unshareable(Exception):
    """The program holds something the encoder cannot write faithfully."""


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A node of the graph being written, by name (a node's arguments, its metadata)."""
    name: str


_GROUP = ("group",)  # a run_* node's group name: the receiver's own group for that axis


class _Encoder(pickle.Pickler):
    """Writes a step program (or a forward program, for the signature) without what differs
    between equal ranks' programs: the runtime key becomes a token; fake tensors become
    their shape, strides, dtype and storage (shared storages stay shared); ops and graph
    modules are written by name and by node."""

    def __init__(self, f: io.BytesIO, rt: str) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.rt = rt
        self.fakes: dict[int, int] = {}
        self.storages: dict[int, int] = {}
        self.keep: list[Any] = []  # what ``fakes`` keys by id, alive while writing

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, str):
            return ("rt",) if obj == self.rt else None
        if type(obj) in (set, frozenset):
            # in the order of their elements' reprs: a set of strings iterates in an order
            # that differs between processes (hash randomization), and so would the bytes
            return ("set", type(obj) is frozenset, sorted(obj, key=repr))
        if isinstance(obj, FakeTensor):
            return self._fake(obj)
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return ("packet", obj._qualified_op_name)
        if isinstance(obj, fx.GraphModule):
            return ("gm", _plain(obj))
        if isinstance(obj, fx.Node):
            # a node of another graph than the one it is written with: no name can say which
            raise Unshareable(f"a reference to node {obj.name} outside its graph")
        if isinstance(obj, torch.Tensor) and type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise Unshareable(f"a tensor of type {type(obj).__name__}")
        return None

    def _fake(self, t: FakeTensor) -> tuple:
        seen = self.fakes.get(id(t))
        if seen is not None:
            return ("fake_again", seen)
        self.fakes[id(t)] = len(self.fakes)
        self.keep.append(t)
        st = t.untyped_storage()
        sid = self.storages.setdefault(st._cdata, len(self.storages))
        return ("fake", tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype,
                str(t.device), t.requires_grad, sid, st.nbytes())


class _Decoder(pickle.Unpickler):
    def __init__(self, f: io.BytesIO, rt: str) -> None:
        super().__init__(f)
        self.rt = rt
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.fakes: list[torch.Tensor] = []
        self.storages: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "rt":
            return self.rt
        if kind == "set":
            return (frozenset if pid[1] else set)(pid[2])
        if kind == "fake_again":
            return self.fakes[pid[1]]
        if kind == "fake":
            t = self._fake(*pid[1:])
            self.fakes.append(t)
            return t
        if kind == "op":
            ns, name = pid[1].split("::")
            return getattr(getattr(getattr(torch.ops, ns), name), pid[2])
        if kind == "packet":
            ns, name = pid[1].split("::")
            return getattr(getattr(torch.ops, ns), name)
        if kind == "gm":
            return _graph_module_from(pid[1], self.rt)
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")

    def _fake(self, shape: tuple, stride: tuple, offset: int, dtype: torch.dtype, device: str,
              requires_grad: bool, sid: int, nbytes: int) -> torch.Tensor:
        # built on meta tensors and wrapped, not made under the mode: a fake op costs ~1 ms
        # and a step program holds thousands of values (dispatching made decoding as slow
        # as tracing)
        base = self.storages.get(sid)
        if base is None:
            base = self.storages[sid] = torch.empty((nbytes,), dtype=torch.uint8, device="meta")
        size = dtype.itemsize
        typed = base[: nbytes - nbytes % size].view(dtype)
        elem = typed.as_strided(shape, stride, offset)
        t = FakeTensor(self.mode, elem, torch.device(device))
        return t.requires_grad_(True) if requires_grad else t


def _plain(gm: fx.GraphModule) -> dict[str, Any]:
    """A graph module as data: its nodes in order (references to its own nodes by name), its
    metadata, and the values its ``get_attr`` nodes read."""
    g = gm.graph
    if type(g._codegen) is not fx.graph.CodeGen:
        raise Unshareable(f"a graph with {type(g._codegen).__name__}")
    mine = set(g.nodes)

    def ref(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a not in mine:
                raise Unshareable(f"a reference to node {a.name} outside its graph")
            return _Ref(a.name)
        if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
            return type(a)(ref(x) for x in a) if type(a) in (list, tuple) else [ref(x) for x in a]
        if isinstance(a, dict) and type(a) is dict:
            return {k: ref(v) for k, v in a.items()}
        return a

    nodes = []
    attrs: dict[str, Any] = {}
    for n in g.nodes:
        if n.op == "call_module":
            raise Unshareable("a call_module node")
        if n.op == "get_attr":
            attrs[n.target] = _attr(gm, n.target)
        args, kwargs = n.args, n.kwargs
        if n.op == "call_function" and n.target in F.RUN_FUNCTIONS:
            args, kwargs = _with_group(n.target, args, kwargs, _GROUP)
        nodes.append((n.op, n.name, n.target, ref(tuple(args)), ref(dict(kwargs)), n.type,
                      ref(dict(n.meta))))
    return {"nodes": nodes, "meta": ref(dict(gm.meta)), "attrs": attrs}


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, torch.nn.Module):
        raise Unshareable(f"a submodule ({target})")
    return obj


def _graph_module_from(plain: dict[str, Any], rt: str) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[str, fx.Node] = {}

    def deref(a: Any) -> Any:
        if isinstance(a, _Ref):
            return env[a.name]
        if type(a) in (list, tuple):
            return type(a)(deref(x) for x in a)
        if type(a) is dict:
            return {k: deref(v) for k, v in a.items()}
        return a

    metas = []
    for op, name, target, args, kwargs, type_expr, meta in plain["nodes"]:
        args, kwargs = deref(args), deref(kwargs)
        if op == "call_function" and target in F.RUN_FUNCTIONS:
            args, kwargs = _with_group(target, args, kwargs, None, rt)
        n = g.create_node(op, target, tuple(args), dict(kwargs), name=name, type_expr=type_expr)
        if n.name != name:
            raise pickle.UnpicklingError(f"node {name} came back as {n.name}")
        env[name] = n
        metas.append((n, meta))
    for n, meta in metas:  # metadata may name later nodes
        n.meta.update(deref(meta))
    root = torch.nn.Module()
    for target, value in plain["attrs"].items():
        *path, last = target.split(".")
        owner = root
        for p in path:
            if not hasattr(owner, p):
                owner.add_module(p, torch.nn.Module())
            owner = getattr(owner, p)
        setattr(owner, last, value)
    gm = _LazyGraphModule(root, g)  # as passes/joint.py makes them: code written when first run
    gm.meta.update(deref(plain["meta"]))
    return gm


_SIGNATURES: dict[Any, inspect.Signature] = {}


def _signature_of(fn: Callable) -> inspect.Signature:
    sig = _SIGNATURES.get(fn)
    if sig is None:
        sig = _SIGNATURES[fn] = inspect.signature(fn)
    return sig


def _with_group(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any], value: Any,
                rt: str | None = None) -> tuple[tuple, dict[str, Any]]:
    """The node's arguments with its group name replaced, where it was given: by ``value``,
    or (``rt`` given) by this rank's group name for the node's axis."""
    names = list(_signature_of(fn).parameters)
    args, kwargs = list(args), dict(kwargs)

    def where(name: str) -> tuple[Any, Any]:
        i = names.index(name)
        return (args, i) if i < len(args) else (kwargs, name)

    if rt is not None:
        box, at = where("axis")
        value = C.get_runtime(rt).group(box[at]).group_name
    box, at = where("group_name")
    box[at] = value
    return tuple(args), kwargs


def encode(obj: Any, rt: str) -> bytes:
    f = io.BytesIO()
    _Encoder(f, rt).dump(obj)
    return f.getvalue()


def decode(data: bytes, rt: str) -> Any:
    return _Decoder(io.BytesIO(data), rt).load()


def _descr(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), tuple(a.stride()), a.dtype, a.device.type, a.requires_grad)
    return a


def signature(program: fx.GraphModule, ctx: CompileContext, args: Sequence[Any],
              needs: Sequence[bool], names: Sequence[str | None]) -> str:
    """What the step program's trace reads, but the rank: equal on two ranks, their traces
    are equal but for the constants the trace computed from coordinates (``Runtime.reads``)."""
    rt = C.get_runtime(ctx.rt)
    what = (program, dataclasses.replace(ctx, rank=-1), [_descr(a) for a in args], list(needs),
            list(names), sorted(rt.gemm_forms.items(), key=repr))
    return hashlib.sha256(encode(what, ctx.rt)).hexdigest()


def _cut_axes(dims: Any) -> set[str]:
    return {a for axes in dims for a in axes} if isinstance(dims, (list, tuple)) else {ANY}


def _draws(p: Any, train: Any, dims: Any) -> set[str]:
    return set() if train is False or p == 0.0 else _cut_axes(dims)


# The runtime functions of a forward program that read a coordinate while the step program
# is traced, and which: the trace bakes it into a constant (a narrow's start, the rows of a
# random mask). By their parameters' names; ``Runtime.reads`` catches any other.
_BAKES: dict[Callable, Callable[[dict[str, Any]], set[str]]] = {
    C.local_chunk: lambda a: {a["axis"]},
    # a gradient that is a slice of the gathered one: this rank's block, by coordinate
    C.all_gather_start: lambda a: set() if a["grad"] == "reduce_scatter" else {a["axis"]},
    R.global_dropout: lambda a: _draws(a["p"], a["train"], a["dims"]),
    R.global_bernoulli: lambda a: _cut_axes(a["dims"]),
    R.global_draw_like: lambda a: _cut_axes(a["dims"]),
}


def baked_axes(program: fx.GraphModule) -> set[str]:
    """The axes whose coordinates tracing ``program``'s step will bake in (``_BAKES``)."""
    out: set[str] = set()
    for n in program.graph.nodes:
        f = _BAKES.get(n.target) if n.op == "call_function" else None
        if f is not None:
            try:
                out |= f(_signature_of(n.target).bind(*n.args, **n.kwargs).arguments)
            except (TypeError, KeyError):
                out.add(ANY)
    return out


@contextlib.contextmanager
def reads_logged(rt: str) -> Iterator[set[str]]:
    """The axes whose coordinate the runtime ``rt`` gave out while inside (``ANY``: the rank)."""
    r = C.get_runtime(rt)
    log: set[str] = set()
    r.reads = log
    try:
        yield log
    finally:
        r.reads = None


@dataclasses.dataclass
class _Shared:
    program: bytes | None  # the encoded StepProgram, None where it could not be built
    error: str
    reads: frozenset[str]  # Runtime.reads of the trace
    coords: dict[str, int]  # the tracer's


def class_of(key: str, coords: dict[str, int], baked: set[str]) -> tuple:
    """The class of a rank whose trace has signature ``key`` and will bake in its
    coordinates on ``baked``: ranks of one class trace one program between them."""
    return key, tuple((a, coords[a]) for a in ALL_AXES if a in baked)


def build_shared(build: Callable[[], StepProgram], ctx: CompileContext,
                 key: str | None, baked: set[str], device: torch.device
                 ) -> tuple[StepProgram | None, str]:
    """``build()``'s result, traced once for each class of ranks with equal ``key`` (the
    ``signature``, None where it could not be written) and equal coordinates on the
    ``baked`` axes. Collective over every rank. Returns
    (program, error) as ``build``."""
    world, me = dist.get_world_size(), dist.get_rank()
    coords = ctx.mesh.coords(ctx.rank)
    mine = None if key is None or ANY in baked else class_of(key, coords, baked)
    classes: list[Any] = [None] * world
    dist.all_gather_object(classes, mine)
    tracer = me if mine is None else classes.index(mine)
    followed = [r for r in range(world) if classes[r] is not None
                and classes.index(classes[r]) == r and classes.count(classes[r]) > 1]

    def traced(how: str = "traced") -> tuple[StepProgram | None, str, frozenset[str]]:
        COUNTS[how] += 1
        with reads_logged(ctx.rt) as log:
            try:
                return build(), "", frozenset(log)
            except Exception as e:  # noqa: BLE001 - the forward program is always there
                return None, f"{type(e).__name__}: {e}", frozenset(log)

    jp: StepProgram | None = None
    err = ""
    reads: frozenset[str] = frozenset()
    if tracer == me:
        jp, err, reads = traced()
    dev = None if device.type == "cpu" else device
    for r in followed:
        if r == me:
            data = None
            if jp is not None:
                try:
                    data = encode(jp, ctx.rt)
                except Exception:  # noqa: BLE001 - the others trace their own
                    data = None
            objects = [_Shared(data, err, reads, coords) if (data is not None or err) else None]
        else:
            objects = [None]
        dist.broadcast_object_list(objects, src=r, device=dev)
        if r == tracer and r != me:
            got = objects[0]
            if got is None:
                jp, err, _ = traced("retraced")
            elif got.program is None:
                jp, err = None, got.error
            elif ANY in got.reads or any(got.coords[a] != coords[a] for a in got.reads):
                jp, err, _ = traced("retraced")
            else:
                try:
                    jp = decode(got.program, ctx.rt)
                    COUNTS["received"] += 1
                except Exception:  # noqa: BLE001 - a program this rank cannot read: trace it
                    jp, err, _ = traced("retraced")
    return jp, err

