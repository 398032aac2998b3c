"""Every rank must compile the same program: check it before the first collective.

A rank that built a different model (another width, an extra layer, another seed),
passed another mesh or option, or traced another path through ``forward`` would issue
collectives its peers do not: the run hangs, or silently computes garbage when the
shapes happen to match. ``shardc.compile`` therefore ends with :func:`settle`: every rank
contributes a 32-byte digest of what it compiled (or the fact that it failed) to one
small all-gather; only when they differ do the ranks exchange the full descriptions, so
that every rank can raise the same error naming the first difference.

Compiling itself needs no communication, so a rank that fails to compile (bad input on
that rank only) still reaches the exchange: its peers learn of the failure there and
raise too, instead of waiting in their first collective for a rank that is gone.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from shardc.core.errors import ShardcError
from shardc.core.mesh import Mesh
from shardc.runtime.collectives import guarded
from shardc.runtime.groups import default_device

# (subject, ((field, value), ...)): "parameter 'fc.weight'", (("shape", "[16, 8]"), ...)
Item = tuple[str, tuple[tuple[str, str], ...]]

_SAMPLES = 8  # elements of each parameter and buffer whose values are compared

_HINTS = {
    "torch": "Run every rank with the same torch installation.",
    "mode": "Put the model in the same mode (model.train() or model.eval()) on every rank.",
    "mesh": "Pass the same mesh to shardc.compile on every rank.",
    "option": "Pass the same compile options on every rank.",
    "input": ("Pass the same global-shaped example_inputs on every rank (the batch one device "
              "would see, not this rank's shard_batch slice)."),
    "values": ("Every rank must start from the same weights: call torch.manual_seed(seed) with "
               "the same seed before building the model, or load the same checkpoint."),
    "model": "Build the same model (code and configuration) on every rank.",
    "op": ("forward took a different path on this rank. Two causes are common: Python control "
           "flow that depends on the rank (make it depend only on the inputs' shapes and the "
           "model's configuration), or iteration over a set (or a dict built from one) of "
           "strings, whose order follows each process's hash seed, deciding what is computed "
           "(iterate sorted(...) instead, or start every rank with the same PYTHONHASHSEED). "
           "A set's order that changes only the order of the same ops is aligned by shardc."),
}


def _tensor_fields(t: torch.Tensor, values: bool) -> tuple[tuple[str, str], ...]:
    fields = [("shape", str(list(t.shape))), ("dtype", str(t.dtype).replace("torch.", "")),
              ("requires_grad", str(t.requires_grad))]
    if values and t.device.type != "meta" and t.numel():
        # A few elements at fixed positions: cheap at any size, and two independently
        # initialised models differ in all of them.
        flat = t.detach().reshape(-1)
        idx = torch.linspace(0, flat.numel() - 1, min(_SAMPLES, flat.numel())).long()
        sample = repr(flat[idx.to(flat.device)].cpu().tolist())
        fields.append(("values", hashlib.sha256(sample.encode()).hexdigest()[:12]))
    return tuple(fields)


def _node_text(n: fx.Node) -> str:
    val = n.meta.get("val")
    out = ""
    if isinstance(val, torch.Tensor):
        out = f" -> {list(val.shape)} {str(val.dtype).replace('torch.', '')}"
    return f"{n.op} {n.target}{fx.node.map_arg(n.args, lambda a: a.name)}{out}"


def describe(model: nn.Module, mesh: Mesh, example_inputs: Sequence[Any], options: Any,
             input_layouts: Mapping[int, Any] | None, graph: fx.Graph) -> list[Item]:
    """What this rank compiled, in the order a difference is reported (the cause before
    its consequences: a different parameter before the graph ops it changes)."""
    items: list[Item] = [
        ("torch version", (("torch", torch.__version__),)),
        ("model mode", (("mode", "training" if model.training else "eval"),)),
        ("mesh", (("mesh", mesh.spec()),)),
    ]
    for f in dataclasses.fields(options):
        items.append((f"option {f.name}", (("option", repr(getattr(options, f.name))),)))
    items.append(("option input_layouts", (("option", repr(sorted(
        (input_layouts or {}).items(), key=lambda kv: repr(kv[0])))),)))
    for i, x in enumerate(example_inputs):
        fields = _tensor_fields(x, values=False) if isinstance(x, torch.Tensor) else \
            (("value", f"{type(x).__name__} {x!r}"[:200]),)
        items.append((f"example input {i}", tuple(("input " + k, v) for k, v in fields)))
    for name, p in model.named_parameters():
        items.append((f"parameter {name!r}", _tensor_fields(p, values=True)))
    for name, b in model.named_buffers():
        items.append((f"buffer {name!r}", _tensor_fields(b, values=True)))
    for i, n in enumerate(graph.nodes):
        items.append((f"traced op #{i}", (("op", _node_text(n)),)))
    return items


_SECTIONS = ("torch version", "model mode", "mesh", "option", "example input", "parameter",
             "buffer", "traced op")


def _section(subject: str) -> str:
    return next(sec for sec in _SECTIONS if subject.startswith(sec))


def _digest(items: list[Item]) -> bytes:
    return hashlib.sha256(repr(items).encode()).digest()


def _hint(field: str, subject: str) -> str:
    if field.startswith("input"):
        return _HINTS["input"]
    if field in _HINTS:
        return _HINTS[field]
    if subject.startswith(("parameter", "buffer")):
        return _HINTS["values"] if field == "values" else _HINTS["model"]
    return _HINTS["model"]


def first_difference(mine: list[Item], theirs: list[Item], me: int, them: int) -> str:
    """The first item (in ``mine``'s order, then ``theirs``'s) on which ranks ``me`` and
    ``them`` differ, as a sentence with its fix."""
    a, b = dict(mine), dict(theirs)
    # section by section, so that a parameter only one rank has is named before the
    # traced ops it shifts
    order = [s for sec in _SECTIONS for s in
             [s for s, _ in mine if _section(s) == sec] +
             [s for s, _ in theirs if _section(s) == sec and s not in a]]
    for subject in order:
        fa, fb = a.get(subject), b.get(subject)
        if fa == fb:
            continue
        if fa is None or fb is None:
            has, lacks, fields = (them, me, fb) if fa is None else (me, them, fa)
            assert fields is not None  # fa == fb when both are None
            shown = ", ".join(f"{k} {v}" for k, v in fields if k != "values")
            first_field = fields[0][0]
            return (f"rank {has} compiled {subject} ({shown}), which rank {lacks} does not have. "
                    + _hint("model" if subject.startswith(("parameter", "buffer")) else first_field,
                            subject))
        da, db = dict(fa), dict(fb)
        for k in list(da) + [k for k in db if k not in da]:
            if da.get(k) != db.get(k):
                if k == "values":
                    return (f"rank {them} compiled {subject} with other values than rank {me} "
                            f"(at {_SAMPLES} sampled positions). " + _hint(k, subject))
                if len(fa) == len(fb) == 1:  # "mesh", "option overlap": the subject is the value's name
                    return (f"rank {them} has {subject} = {db.get(k)}, rank {me} has {da.get(k)}. "
                            + _hint(k, subject))
                return (f"rank {them} compiled {subject} with {k} {db.get(k)}, rank {me} with "
                        f"{k} {da.get(k)}. " + _hint(k, subject))
    return f"ranks {me} and {them} describe their programs differently, but no item differs."


def _all_gather_bytes(payload: bytes, device: torch.device) -> list[bytes]:
    """Every rank's ``payload`` (any length), in rank order."""
    world = dist.get_world_size()
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if payload else \
        torch.zeros(0, dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    got = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(got, padded)
    return [bytes(g[:int(s.item())].cpu().tolist()) for g, s in zip(got, sizes)]


# ------------------------------------------------------------ the traced order
def _target_name(target: Any) -> str:
    """A target's name that is the same in every process (a function's repr holds its
    address)."""
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    return f"{getattr(target, '__module__', '')}.{name}" if name else repr(target)


def _digest_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def node_keys(graph: fx.Graph) -> dict[fx.Node, str]:
    """Each node's key: what it computes (its op and, recursively, its inputs) and what
    reads it (recursively, its users and the argument it is to each). Two ranks' nodes
    have the same key exactly when they stand in the same place of the same computation,
    whatever order and names each rank's trace gave them; equal keys within one graph
    are nodes no computation tells apart.

    A pass over the inputs then one over the users, repeated while they still split
    nodes apart (Weisfeiler-Lehman refinement, each pass carried through the whole graph
    in its direction): two checks of two equal-looking views of the same tensor differ
    only through what reads those views, which takes the second round."""
    key: dict[fx.Node, str] = {}

    def arg_text(a: Any) -> str:
        if isinstance(a, fx.Node):
            return f"%{key[a]}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(arg_text(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{arg_text(v)}" for k, v in a.items()) + "}"
        return repr(a) if not callable(a) else _target_name(a)

    nodes = list(graph.nodes)
    for n in nodes:
        # a placeholder by its name (export names them by parameter and argument); any
        # other node by its op, then by its place among the others
        own = n.name if n.op == "placeholder" else ""
        key[n] = _digest_text(f"{n.op}|{_target_name(n.target)}|{own}")
    distinct = 0
    for _ in range(16):
        for n in nodes:
            key[n] = _digest_text(f"{key[n]}|{arg_text(n.args)}|{arg_text(n.kwargs)}")
        for n in reversed(nodes):
            reads = []
            for u in n.users:
                flat = pytree.tree_leaves((u.args, u.kwargs))
                reads.append(f"{key[u]}@" + ",".join(str(i) for i, a in enumerate(flat) if a is n))
            key[n] = _digest_text(f"{key[n]}|{'|'.join(sorted(reads))}")
        now = len(set(key.values()))
        if now == distinct:
            break
        distinct = now
    return key


def reorder_like(ep: Any, order: list[tuple[str, str]]) -> bool:
    """Rebuild ``ep``'s graph with its nodes in ``order`` ((key, name) as rank 0 traced
    them), each taking rank 0's name. False, and the graph untouched, when the keys are
    not this graph's or that order is not one this graph can run in."""
    gm = ep.graph_module
    old = gm.graph
    keys = node_keys(old)
    by_key: dict[str, list[fx.Node]] = {}
    for n in old.nodes:
        by_key.setdefault(keys[n], []).append(n)
    for nodes in by_key.values():
        nodes.reverse()  # pop() takes them in this graph's order
    if sorted(keys.values()) != sorted(k for k, _ in order):
        return False
    new = fx.Graph(owning_module=gm, tracer_cls=old._tracer_cls, tracer_extras=old._tracer_extras)
    new._codegen = old._codegen
    env: dict[fx.Node, fx.Node] = {}
    renamed: dict[str, str] = {}
    try:
        for key, name in order:
            n = by_key[key].pop()
            m = new.create_node(n.op, n.target, fx.node.map_arg(n.args, env.__getitem__),
                                fx.node.map_arg(n.kwargs, env.__getitem__), name=name,
                                type_expr=n.type)
            m.meta = dict(n.meta)
            env[n] = m
            renamed[n.name] = m.name
    except KeyError:  # a node before its input: not an order of this graph
        return False
    gm.graph = new
    for spec in ep.graph_signature.output_specs:
        if hasattr(spec.arg, "name") and spec.arg.name in renamed:
            spec.arg = dataclasses.replace(spec.arg, name=renamed[spec.arg.name])
    gm.recompile()
    return True


def align(ep: Any, items: list[Item] | None, failure: BaseException | None,
          redescribe: Callable[[], list[Item]]) -> list[Item] | None:
    """Collective, before any rank lowers its trace: give every rank's traced graph rank
    0's order and names where the ranks traced the same computation in different orders.

    A model may trace its ops in an order that changes from process to process: Gemma 3
    iterates ``set(config.layer_types)``, and a set of strings has the order of each
    process's hash seed, so each rank built its masks in its own order. Such ranks
    compute the same program, but lowered as traced they would issue their collectives
    in different orders. When the descriptions' digests differ, rank 0 sends every
    node's key (``node_keys``) in its order, and each rank rebuilds its graph in that
    order when it holds exactly those keys. What still differs afterwards is a real
    difference, which ``settle`` names. Returns the description to settle with."""
    if dist.get_backend() == "fake" or dist.get_world_size() == 1:
        return items
    device = default_device()
    got = _exchange_digests(items, failure, device)
    if any(g[0] for g in got):
        settle(items, failure)  # every rank saw the failure: every rank raises there
    if all(g == got[0] for g in got):
        return items
    rank = dist.get_rank()
    payload = b""
    if rank == 0:
        keys = node_keys(ep.graph_module.graph)
        payload = json.dumps([[keys[n], n.name] for n in ep.graph.nodes]).encode()
    with guarded(None, "all_gather", None, "shardc.compile's agreement"):
        order = json.loads(_all_gather_bytes(payload, device)[0])
    if reorder_like(ep, [(k, name) for k, name in order]):
        return redescribe()
    return items


def _exchange_digests(items: list[Item] | None, failure: BaseException | None,
                      device: torch.device) -> list[bytes]:
    """Every rank's 33 bytes, in rank order: a status byte (1 = failed) and the sha256 of
    its description."""
    mine = torch.zeros(33, dtype=torch.uint8, device=device)
    if failure is not None or items is None:
        mine[0] = 1
    else:
        mine[1:] = torch.frombuffer(bytearray(_digest(items)), dtype=torch.uint8).to(device)
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    with guarded(None, "all_gather", None, "shardc.compile's agreement"):
        dist.all_gather(rows, mine)
    return [bytes(r.cpu().tolist()) for r in rows]


def _items(decoded: list) -> list[Item]:
    """JSON's lists back into the tuples ``describe`` made."""
    return [(s, tuple((k, v) for k, v in fields)) for s, fields in decoded]


def settle(items: list[Item] | None, failure: BaseException | None) -> None:
    """Collective. Return when every rank compiled the same program; otherwise raise on
    every rank: this rank's own compile error, or a ``ShardcError`` naming the first rank
    that failed or the first difference from rank 0."""
    if dist.get_backend() == "fake" or dist.get_world_size() == 1:
        # A fake group has one real process compiling for a simulated world, and its
        # collectives return garbage: there is nobody to disagree with.
        if failure is not None:
            raise failure
        return
    device = default_device()
    got = _exchange_digests(items, failure, device)
    failed = [r for r, g in enumerate(got) if g[0]]
    if not failed and all(g == got[0] for g in got):
        return
    # Every rank saw the same rows, so every rank takes this branch: the exchange below
    # is matched.
    rank = dist.get_rank()
    text = "" if failure is None else (str(failure).strip() or type(failure).__name__)
    # JSON, not pickle: nothing a peer sends is ever executed
    detail = json.dumps([items if not failed else None, type(failure).__name__, text])
    with guarded(None, "all_gather", None, "shardc.compile's agreement"):
        everyone = [json.loads(b) for b in _all_gather_bytes(detail.encode(), device)]
    if failed:
        if failure is not None:
            raise failure
        first = failed[0]
        _, kind, msg = everyone[first]
        others = f" (and on ranks {failed[1:]})" if len(failed) > 1 else ""
        raise ShardcError(f"shardc.compile failed on rank {first}{others}, so no rank can go on. "
                          f"Rank {first}'s error: {kind}: {msg}")
    differ = [r for r, g in enumerate(got) if g != got[0]]
    first_other = differ[0]
    diff = first_difference(_items(everyone[0][0]), _items(everyone[first_other][0]), 0, first_other)
    raise ShardcError(
        f"shardc.compile: the ranks did not compile the same program: {diff} "
        f"(ranks that differ from rank 0: {differ}; this is rank {rank}.)")
