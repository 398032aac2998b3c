"""One trace of the step program for every rank whose program is the same
(``shardc/program/share.py``).

What makes sharing exact is a claim about tracing: two ranks in one class (equal signature,
equal coordinates on every axis outside ``data`` and ``z`` and on the axes the trace bakes
in) trace programs that encode to the same bytes, runtime key and group names written as
tokens. These tests trace every rank of a mesh of 8 in one process (a fake group, re-made
for each rank) and check it for each class, together with what the sharing leans on:

* the coordinates a trace read (``Runtime.reads``) are all predicted (``baked_axes``) or
  agree within the class anyway, so no rank of these programs has to trace again after it
  received one;
* a decoded program is the encoded one: the same code for each part, and it encodes again
  to the same structure;
* where the batch axes' coordinates are not baked in, ranks do share (a class has more than
  one rank), so the test fails if the signature stops being rank-independent.

``tests/test_step_graph_gloo.py::test_ranks_of_one_class_trace_once`` runs the sharing
itself on 4 gloo processes and trains the received programs against float64.
"""
from __future__ import annotations

import collections
import io
import pickle
from typing import Any, Callable

import pytest
import torch
from models import GPT, llama

import shardc
from shardc.passes import run_step_pipeline
from shardc.passes.joint import trace_joint
from shardc.program import share
from shardc.tools.models import lm_batch

pytestmark: list = []  # one process, fake group

MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt": lambda: GPT(vocab=64, dim=32, layers=2, heads=4, seq=16),
    "gpt-dropout": lambda: GPT(vocab=64, dim=32, layers=2, heads=4, seq=16, dropout=0.1),
    "llama": lambda: llama(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, seq=16),
}
# (model, mesh, whether some class holds more than one rank, false where the trace bakes
# in the batch axes' coordinates as dropout's masks do, or how many classes there are)
_SLOW = pytest.mark.slow
CASES = [pytest.param(m, s, shares, id=f"{m}-{s}", marks=marks) for m, s, shares, marks in [
    ("gpt", "x1y1z1d8", True, ()),
    ("gpt", "x2y1z2d2", True, ()),
    ("gpt-dropout", "x1y1z2d4", False, ()),
    ("llama", "x1y2z2d2", True, ()),
    ("llama", "x1y1z8d1", True, ()),
    # tensor parallel: the vocabulary shard's offset is read when the program runs
    # (runtime.ops.mesh_coord), so the ranks of an x group trace one program too
    ("gpt", "x4y1z1d2", 1, _SLOW),
    ("llama", "x2y2z2d1", 1, _SLOW),
]]


class _Raw(pickle.Unpickler):
    """An encoded program as plain data, tokens left as they are."""

    def persistent_load(self, pid: Any) -> Any:
        return ("pid", pid)


def _traced(model: torch.nn.Module, mesh: shardc.Mesh, batch: tuple) -> dict[str, Any]:
    sm = shardc.compile(model, mesh, example_inputs=batch)
    args, needs = sm._example_args()
    names = [t if role == "param" else None for role, t in sm._feeds]
    key = share.signature(sm.graph_module, sm.ctx, args, needs, names)
    baked = share.baked_axes(sm.graph_module)
    with share.reads_logged(sm.ctx.rt) as reads:
        jp = run_step_pipeline(trace_joint(sm.graph_module, sm.ctx, args, needs, names), sm.ctx)
    coords = mesh.coords(sm.ctx.rank)
    klass = share.class_of(key, coords, baked)
    return {"class": klass, "data": share.encode(jp, sm.ctx.rt), "reads": set(reads),
            "baked": baked, "coords": coords, "jp": jp, "rt": sm.ctx.rt}


@pytest.mark.parametrize("name,spec,shares", CASES)
def test_ranks_of_a_class_trace_the_same_program(fake_world: Any, name: str, spec: str,
                                                 shares: bool | int) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    batch = lm_batch(8, 16, 64)
    mesh = shardc.Mesh.parse(spec)
    ranks = []
    for r in range(mesh.world_size):
        fake_world(mesh.world_size, r)
        ranks.append(_traced(model, mesh, batch))
    classes: dict[Any, list[int]] = collections.defaultdict(list)
    for r, t in enumerate(ranks):
        assert share.ANY not in t["baked"]
        classes[t["class"]].append(r)
    for members in classes.values():
        first = ranks[members[0]]
        for r in members[1:]:
            # what the rank would receive needs no second trace: every coordinate the trace
            # read agrees with the tracer's
            assert share.ANY not in first["reads"]
            assert all(first["coords"][a] == ranks[r]["coords"][a] for a in first["reads"]), \
                (r, sorted(first["reads"]))
            assert ranks[r]["data"] == first["data"], f"rank {r} traced another program than rank {members[0]}"
    if isinstance(shares, bool):
        assert (max(map(len, classes.values())) > 1) == shares, dict(classes)
    else:
        assert len(classes) == shares, dict(classes)


@pytest.mark.parametrize("name,spec", [("gpt-dropout", "x2y1z2d2"), ("llama", "x1y2z2d2")])
def test_a_decoded_program_is_the_encoded_one(fake_world: Any, name: str, spec: str) -> None:
    torch.manual_seed(0)
    mesh = shardc.Mesh.parse(spec)
    fake_world(mesh.world_size, 3)
    t = _traced(MODELS[name](), mesh, lm_batch(8, 16, 64))
    back = share.decode(t["data"], t["rt"])
    for part in ("forward", "backward", "joint"):
        assert getattr(back, part).code == getattr(t["jp"], part).code, part
    for field in ("n_outputs", "diff_outputs", "grad_of"):
        assert getattr(back, field) == getattr(t["jp"], field)
    raw = _Raw(io.BytesIO(t["data"])).load()
    assert repr(_Raw(io.BytesIO(share.encode(back, t["rt"]))).load()) == repr(raw)
    # fake values keep their shapes, strides, dtypes, and which share storage
    vals = [(n.meta.get("val"), m.meta.get("val")) for n, m in
            zip(t["jp"].backward.graph.nodes, back.backward.graph.nodes)]
    tensors = [(a, b) for a, b in vals if isinstance(a, torch.Tensor)]
    assert tensors
    for a, b in tensors:
        assert (a.shape, a.stride(), a.dtype, a.storage_offset()) == \
            (b.shape, b.stride(), b.dtype, b.storage_offset())
    for (a1, b1), (a2, b2) in zip(tensors, tensors[1:]):
        same = a1.untyped_storage()._cdata == a2.untyped_storage()._cdata
        assert same == (b1.untyped_storage()._cdata == b2.untyped_storage()._cdata)


def test_the_signature_leaves_the_rank_out_and_reads_the_shapes(fake_world: Any) -> None:
    torch.manual_seed(0)
    model = MODELS["gpt"]()
    mesh = shardc.Mesh.parse("x1y1z1d4")
    keys = []
    for r, seq in ((0, 16), (1, 16), (0, 8)):
        fake_world(4, r)
        sm = shardc.compile(model, mesh, example_inputs=lm_batch(8, seq, 64))
        args, needs = sm._example_args()
        names = [t if role == "param" else None for role, t in sm._feeds]
        keys.append(share.signature(sm.graph_module, sm.ctx, args, needs, names))
    assert keys[0] == keys[1]
    assert keys[0] != keys[2]


def test_sets_are_written_in_one_order() -> None:
    """A set's iteration order depends on the process's hash seed; its encoding must not
    (two ranks' signatures would differ, and nothing would be shared)."""
    a = {"wq", "wk", "wv", "wo", "w1", "w2"}
    b = set(sorted(a, reverse=True))
    assert share.encode(frozenset(a), "rt0") == share.encode(frozenset(b), "rt0")
    assert share.decode(share.encode(a, "rt0"), "rt1") == a
