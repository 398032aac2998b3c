"""Machine: presets, JSON round trip, error messages, the bandwidth model (eq. 7), and a real
(tiny) bandwidth profile."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from shardc.core.machine import PRESETS, Machine
from shardc.core.mesh import AXES, Mesh

pytestmark: list = []  # fast, but for the tests marked slow one by one

GB = 1e9


@pytest.mark.parametrize("name", ["perlmutter", "frontier", "alps", "local"])
def test_presets_load_and_cover_their_node(name: str) -> None:
    m = Machine.preset(name)
    assert m.name == name
    assert m.gpus_per_node >= 1 and m.memory_bytes > 0 and m.inter_node_bandwidth > 0
    # Every shape that tiles a node is in the table, so power-of-two meshes always plan.
    g = m.gpus_per_node
    for inner in range(1, g + 1):
        for size in range(2, g // inner + 1):
            if g % (inner * size) == 0:
                assert (inner, size) in m.intra_node_bandwidth


def test_preset_figures_from_the_paper() -> None:
    p, f, a = (Machine.preset(n) for n in ("perlmutter", "frontier", "alps"))
    assert (p.gpus_per_node, p.memory_bytes) == (4, 40 * GB)
    assert (f.gpus_per_node, f.memory_bytes) == (8, 64 * GB)
    assert (a.gpus_per_node, a.memory_bytes) == (4, 96 * GB)
    for m in (p, f, a):
        assert m.inter_node_bandwidth == 4 * 25 * GB  # four Slingshot NICs of 25 GB/s
    loc = Machine.preset("LOCAL ")
    assert loc.gpus_per_node == 8 and loc.memory_bytes == 24 * 2**30 / 8


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match=r"unknown machine 'summit'.*perlmutter"):
        Machine.preset("summit")


def test_json_round_trip(tmp_path: Path) -> None:
    for name in PRESETS:
        m = Machine.preset(name)
        path = tmp_path / f"{name}.json"
        m.save(path)
        back = Machine.load(path)
        assert back == m
        assert Machine.from_json(m.to_json()) == m
    custom = Machine(gpus_per_node=2, memory_bytes=1e9, inter_node_bandwidth=5e9,
                     intra_node_bandwidth={(1, 2): 7e9})
    assert Machine.from_json(custom.to_json()) == custom
    assert custom.name == "custom"


def _write(tmp_path: Path, obj: object) -> Path:
    p = tmp_path / "m.json"
    p.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return p


def _good() -> dict[str, Any]:
    d: dict[str, Any] = json.loads(Machine.preset("perlmutter").to_json())
    return d


def test_load_errors_name_file_and_field(tmp_path: Path) -> None:
    p = _write(tmp_path, "{not json")
    with pytest.raises(ValueError, match=r"m\.json.*not valid JSON"):
        Machine.load(p)

    with pytest.raises(ValueError, match=r"cannot read .*missing\.json"):
        Machine.load(tmp_path / "missing.json")

    p = _write(tmp_path, [1, 2])
    with pytest.raises(ValueError, match=r"m\.json.*top level must be a JSON object"):
        Machine.load(p)

    d = _good()
    del d["gpus_per_node"]
    with pytest.raises(ValueError, match=r"m\.json.*'gpus_per_node' is missing"):
        Machine.load(_write(tmp_path, d))

    d = _good()
    d["memory_bytes"] = "lots"
    with pytest.raises(ValueError, match=r"m\.json.*'memory_bytes' must be a positive"):
        Machine.load(_write(tmp_path, d))

    d = _good()
    d["inter_node_bandwidth"] = -1
    with pytest.raises(ValueError, match=r"'inter_node_bandwidth' must be a positive"):
        Machine.load(_write(tmp_path, d))

    d = _good()
    d["gpus_per_node"] = 2.5
    with pytest.raises(ValueError, match=r"'gpus_per_node' must be a positive integer"):
        Machine.load(_write(tmp_path, d))

    d = _good()
    d["intra_node_bandwidth"][1]["bytes_per_s"] = 0
    with pytest.raises(ValueError, match=r"'intra_node_bandwidth\[1\]'.*bytes_per_s"):
        Machine.load(_write(tmp_path, d))

    d = _good()
    d["intra_node_bandwidth"].append({"inner": 4, "size": 2, "bytes_per_s": 1e9})
    with pytest.raises(ValueError, match=r"'intra_node_bandwidth\[3\]' spans 8 ranks"):
        Machine.load(_write(tmp_path, d))

    d = _good()
    d["intra_node_bandwidth"].append(dict(d["intra_node_bandwidth"][0]))
    with pytest.raises(ValueError, match=r"repeats the key \(inner=1, size=2\)"):
        Machine.load(_write(tmp_path, d))

    d = _good()
    d["intra_node_bandwidth"] = {"1,2": 5}
    with pytest.raises(ValueError, match=r"'intra_node_bandwidth' must be a list"):
        Machine.load(_write(tmp_path, d))

    d = _good()
    d["bandwidth"] = 1
    with pytest.raises(ValueError, match=r"'bandwidth' is not a machine field"):
        Machine.load(_write(tmp_path, d))

    d = _good()
    d["format"] = "other/9"
    with pytest.raises(ValueError, match=r"'format' is 'other/9'"):
        Machine.load(_write(tmp_path, d))


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="gpus_per_node must be a positive integer"):
        Machine(gpus_per_node=0, memory_bytes=1e9, inter_node_bandwidth=1e9)
    with pytest.raises(ValueError, match="memory_bytes must be a positive finite"):
        Machine(gpus_per_node=4, memory_bytes=math.inf, inter_node_bandwidth=1e9)
    with pytest.raises(ValueError, match="inter_node_bandwidth must be a positive"):
        Machine(gpus_per_node=4, memory_bytes=1e9, inter_node_bandwidth=0)
    with pytest.raises(ValueError, match=r"key \(2, 4\) describes groups spanning 8"):
        Machine(gpus_per_node=4, memory_bytes=1e9, inter_node_bandwidth=1e9,
                intra_node_bandwidth={(2, 4): 1e9})
    with pytest.raises(ValueError, match=r"key \(1, 1\) needs inner >= 1 and size >= 2"):
        Machine(gpus_per_node=4, memory_bytes=1e9, inter_node_bandwidth=1e9,
                intra_node_bandwidth={(1, 1): 1e9})
    with pytest.raises(ValueError, match=r"key '12' must be a tuple"):
        Machine(gpus_per_node=4, memory_bytes=1e9, inter_node_bandwidth=1e9,
                intra_node_bandwidth={"12": 1e9})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"\[\(1, 2\)\] must be a positive finite"):
        Machine(gpus_per_node=4, memory_bytes=1e9, inter_node_bandwidth=1e9,
                intra_node_bandwidth={(1, 2): -3.0})


# A machine with distinct numbers everywhere so a wrong lookup cannot pass by accident.
TOY = Machine(
    gpus_per_node=4,
    memory_bytes=40e9,
    inter_node_bandwidth=100e9,
    intra_node_bandwidth={(1, 2): 11e9, (2, 2): 22e9, (1, 4): 14e9},
    name="toy",
)


def _eq7(machine: Machine, mesh: Mesh, axis: str) -> float:
    """Section V-B written out independently of Machine.axis_bandwidth."""
    sizes = [mesh.x, mesh.y, mesh.z, mesh.data]
    i = AXES.index(axis)
    if sizes[i] == 1:
        return math.inf
    prod_inner = math.prod(sizes[:i])
    if prod_inner * sizes[i] <= machine.gpus_per_node:  # case 1: inside a node
        return machine.intra_node_bandwidth[(prod_inner, sizes[i])]
    return machine.inter_node_bandwidth / min(machine.gpus_per_node, prod_inner)  # eq. 7


@pytest.mark.parametrize(
    "spec, expect",
    [
        # x4 fills the node; y, z, data all span nodes with 4 rings side by side
        ("x4y2z2d1", {"x": 14e9, "y": 100e9 / 4, "z": 100e9 / 4, "data": math.inf}),
        # x2 y2 inside the node, z with inner=4: beta_inter/4; data inner=8: capped at 4
        ("x2y2z2d2", {"x": 11e9, "y": 22e9, "z": 100e9 / 4, "data": 100e9 / 4}),
        # one ring spanning nodes (inner = 1): the full beta_inter (Figure 3)
        ("x8y1z1d1", {"x": 100e9, "y": math.inf, "z": math.inf, "data": math.inf}),
        # two rings across two nodes (Figure 4): beta_inter / 2
        ("x2y4z1d1", {"x": 11e9, "y": 100e9 / 2, "z": math.inf, "data": math.inf}),
        # data parallel only: one ring over all 16 ranks, inner = 1
        ("x1y1z1d16", {"x": math.inf, "y": math.inf, "z": math.inf, "data": 100e9}),
        ("x1y1z2d2", {"x": math.inf, "y": math.inf, "z": 11e9, "data": 22e9}),
    ],
)
def test_axis_bandwidth_matches_equation_7(spec: str, expect: dict[str, float]) -> None:
    mesh = Mesh.parse(spec)
    for axis in AXES:
        got = TOY.axis_bandwidth(mesh, axis)
        assert got == expect[axis], (spec, axis)
        assert got == _eq7(TOY, mesh, axis)


def test_axis_bandwidth_presets_against_hand_eq7() -> None:
    per = Machine.preset("perlmutter")
    mesh = Mesh.parse("x4y2z2d1")
    assert per.axis_bandwidth(mesh, "x") == 300e9
    assert per.axis_bandwidth(mesh, "y") == 100e9 / 4
    assert per.axis_bandwidth(mesh, "z") == 100e9 / 4
    fro = Machine.preset("frontier")
    mesh = Mesh.parse("x2y2z4d2")  # x in-package, y across packages, z spans nodes
    assert fro.axis_bandwidth(mesh, "x") == 200e9
    assert fro.axis_bandwidth(mesh, "y") == 50e9
    assert fro.axis_bandwidth(mesh, "z") == 100e9 / 4
    assert fro.axis_bandwidth(mesh, "data") == 100e9 / 8  # min(G_node=8, 32)
    for name in ("perlmutter", "frontier", "alps", "local"):
        m = Machine.preset(name)
        for world in (1, 2, 4, 8, 16, 32):
            for mesh in Mesh.all(world):
                for axis in AXES:
                    assert m.axis_bandwidth(mesh, axis) == _eq7(m, mesh, axis)


def test_axis_bandwidth_missing_key_lists_keys() -> None:
    # a group of 3 ranks inside a 4-GPU node was never measured
    with pytest.raises(ValueError, match=r"key \(1, 3\).*keys \(1, 2\), \(1, 4\), \(2, 2\)"):
        TOY.axis_bandwidth(Mesh(x=3), "x")
    # ...but an axis of size 1 never communicates, whatever the table says
    assert TOY.axis_bandwidth(Mesh(x=3), "y") == math.inf


@pytest.mark.slow
@pytest.mark.distributed
def test_profile_machine_two_ranks() -> None:
    from shardc.runtime.profile import profile_machine, profile_shapes, shape_groups

    assert profile_shapes(8) == [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)]
    assert shape_groups(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape_groups(8, 1, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shape_groups(8, 2, 2) == Mesh(x=2, y=2, z=2).groups("y")

    m = profile_machine(2, message_bytes=4096, iters=2, progress=False, backend="gloo")
    assert m.name == "profiled" and m.gpus_per_node == 2
    assert set(m.intra_node_bandwidth) == {(1, 2)}
    bw = m.intra_node_bandwidth[(1, 2)]
    assert 0 < bw < math.inf
    assert m.inter_node_bandwidth == bw
    # every step-time term measured: a call costs time, GEMMs and memory have a rate
    assert set(m.intra_node_latency) == {(1, 2)} and m.intra_node_latency[(1, 2)] > 0
    assert m.inter_node_latency == m.intra_node_latency[(1, 2)]
    assert m.gemm_flops > 0 and m.memory_bandwidth > 0 and m.op_overhead > 0
    assert 0 <= m.bandwidth_overlap <= 1 and 0 <= m.latency_overlap <= 1
    assert m.models_step()
    assert m.memory_bytes > 0
    assert m.axis_bandwidth(Mesh(x=2), "x") == bw
    assert Machine.from_json(m.to_json()) == m
    with pytest.raises(ValueError, match=r"ranks must be an integer >= 2"):
        profile_machine(1)
    with pytest.raises(ValueError, match=r"backend must be 'gloo', 'nccl' or None"):
        profile_machine(2, backend="mpi")


STEPPED = dict(gpus_per_node=4, memory_bytes=1e9, inter_node_bandwidth=1e9,
               intra_node_bandwidth={(1, 2): 4e9, (2, 2): 3e9, (1, 4): 2e9},
               intra_node_latency={(1, 2): 1e-5, (2, 2): 2e-5, (1, 4): 3e-5},
               inter_node_latency=7e-5, gemm_flops=1e12, memory_bandwidth=1e11,
               op_overhead=1e-6, bandwidth_overlap=0.5, latency_overlap=0.25)


def test_step_terms_round_trip_and_old_files_still_load(tmp_path: Path) -> None:
    m = Machine(**STEPPED, name="stepped")
    assert m.models_step()
    assert Machine.from_json(m.to_json()) == m
    # a file written before the step-time terms existed: bandwidth alone, as before
    old = json.loads(m.to_json())
    for k in ("intra_node_latency", "inter_node_latency", "gemm_flops", "memory_bandwidth",
              "op_overhead", "bandwidth_overlap", "latency_overlap"):
        del old[k]
    back = Machine.load(_write(tmp_path, old))
    assert not back.models_step()
    assert back.intra_node_bandwidth == m.intra_node_bandwidth
    assert not any(Machine.preset(n).models_step() for n in PRESETS)


def test_step_terms_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"bandwidth_overlap must be in \[0, 1\]"):
        Machine(**{**STEPPED, "bandwidth_overlap": 1.5})
    with pytest.raises(ValueError, match=r"gemm_flops must be a finite number >= 0"):
        Machine(**{**STEPPED, "gemm_flops": -1.0})
    with pytest.raises(ValueError, match=r"intra_node_latency has the key \(4, 2\)"):
        Machine(**{**STEPPED, "intra_node_latency": {(4, 2): 1e-5}})
    with pytest.raises(ValueError, match=r"intra_node_latency\[\(1, 2\)\] must be a finite"):
        Machine(**{**STEPPED, "intra_node_latency": {(1, 2): math.nan}})
    d = json.loads(Machine(**STEPPED).to_json())
    d["latency_overlap"] = 2
    with pytest.raises(ValueError, match=r"m.json.*latency_overlap must be in \[0, 1\]"):
        Machine.load(_write(tmp_path, d))
    d = json.loads(Machine(**STEPPED).to_json())
    d["intra_node_latency"][0] = {"inner": 1, "size": 2}
    with pytest.raises(ValueError, match=r"'intra_node_latency\[0\]' must be an object"):
        Machine.load(_write(tmp_path, d))
    d["intra_node_latency"][0] = {"inner": 4, "size": 2, "seconds": 1e-5}
    with pytest.raises(ValueError, match=r"'intra_node_latency\[0\]' has no row"):
        Machine.load(_write(tmp_path, d))
    d["intra_node_latency"] = [{"inner": 1, "size": 2, "seconds": -1}]
    with pytest.raises(ValueError, match=r"'intra_node_latency\[0\]' needs a finite number"):
        Machine.load(_write(tmp_path, d))


def test_axis_latency_follows_the_bandwidth_table() -> None:
    m = Machine(**STEPPED)
    assert m.axis_latency(Mesh(x=2, y=2), "x") == 1e-5  # (1, 2)
    assert m.axis_latency(Mesh(x=2, y=2), "y") == 2e-5  # (2, 2)
    assert m.axis_latency(Mesh(x=4), "x") == 3e-5  # (1, 4)
    assert m.axis_latency(Mesh(x=4, y=2), "y") == 7e-5  # spans nodes
    assert m.axis_latency(Mesh(x=4), "y") == 0.0  # size 1: no call
    with pytest.raises(ValueError, match=r"no intra-node latency for axis 'y'.*\(1, 2\)"):
        Machine(**{**STEPPED, "intra_node_latency": {(2, 2): 1e-5}}).axis_latency(Mesh(y=2), "y")
    # no table: latency is not modelled inside a node
    assert Machine(**{**STEPPED, "intra_node_latency": {}}).axis_latency(Mesh(x=2), "x") == 0.0
