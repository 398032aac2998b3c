"""Performance model: equations 1-5 written out independently, per-axis time, memory,
and a real (tiny) bandwidth profile."""
from __future__ import annotations

import math

import pytest

from shardc.machine import Machine
from shardc.mesh import AXES, Mesh
from shardc.perfmodel import (
    BYTES_PER_PARAMETER,
    Gemm,
    activation_bytes,
    enumerate_meshes,
    gemm_volumes,
    local_weight_elements,
    memory_per_rank,
    network_volumes,
    predict_comm_seconds,
    predict_gemms_seconds,
    replica_gemm,
)

M, K, N = 4096, 1024, 3072


def _paper(
    m: int, k: int, n: int, gx: int, gy: int, gz: int, gd: int, b: int
) -> dict[str, float]:
    """Equations 1-5 exactly as printed in the paper (element counts times b)."""
    return {
        "eq1": (gz - 1) * (k * n) / (gx * gy * gz) * b,
        "eq2": ((gz - 1) / gz) * (k * n) / (gx * gy) * b,
        "eq3": 2 * ((gy - 1) / gy) * (m * n) / (gz * gx) * b,
        "eq4": 2 * ((gx - 1) / gx) * (m * k) / (gz * gy) * b,
        "eq5": 2 * ((gd - 1) / gd) * (k * n) / (gx * gy * gz) * b,
    }


@pytest.mark.parametrize("spec", ["x2y2z2d2", "x4y2z1d3", "x1y8z2d1", "x3y1z4d2"])
@pytest.mark.parametrize("b", [4, 2])
def test_gemm_volumes_equal_equations_1_to_5(spec: str, b: int) -> None:
    mesh = Mesh.parse(spec)
    gx, gy, gz, gd = mesh.x, mesh.y, mesh.z, mesh.data
    vols = gemm_volumes(Gemm("fc1", M, K, N, transposed=False, bytes_per_element=b), mesh)
    e = _paper(M, K, N, gx, gy, gz, gd, b)
    want = {
        ("all_gather", "z", "forward"): e["eq1"],
        ("reduce_scatter", "z", "backward"): e["eq2"],
        ("all_reduce", "y", "forward"): e["eq3"],
        ("all_reduce", "x", "backward"): e["eq4"],
        ("all_reduce", "data", "step"): e["eq5"],
    }
    want = {key: v for key, v in want.items() if mesh.size(key[1]) > 1}
    assert vols.keys() == want.keys()
    for key in want:
        assert vols[key] == pytest.approx(want[key], rel=1e-12), key


@pytest.mark.parametrize("spec", ["x2y4z2d2", "x4y2z1d1", "x2y2z1d1"])
def test_transposed_layers_swap_x_and_y(spec: str) -> None:
    mesh = Mesh.parse(spec)
    gx, gy, gz, gd = mesh.x, mesh.y, mesh.z, mesh.data
    vols = gemm_volumes(Gemm("fc2", M, K, N, transposed=True), mesh)
    e = _paper(M, K, N, gy, gx, gz, gd, 4)  # Gx and Gy swapped
    want = {
        ("all_gather", "z", "forward"): e["eq1"],
        ("reduce_scatter", "z", "backward"): e["eq2"],
        ("all_reduce", "x", "forward"): e["eq3"],  # partial outputs reduce over x now
        ("all_reduce", "y", "backward"): e["eq4"],  # input grads over y
        ("all_reduce", "data", "step"): e["eq5"],
    }
    want = {key: v for key, v in want.items() if mesh.size(key[1]) > 1}
    assert vols.keys() == want.keys()
    for key in want:
        assert vols[key] == pytest.approx(want[key], rel=1e-12), key
    # by hand for x2y4z2d2: forward all-reduce over x of 2*(1/2)*m*n/(Gz*Gy) elements
    if spec == "x2y4z2d2":
        assert vols[("all_reduce", "x", "forward")] == pytest.approx(M * N / 8 * 4)
        assert vols[("all_reduce", "y", "backward")] == pytest.approx(2 * 3 / 4 * M * K / 4 * 4)


def test_special_cases_ddp_fsdp_megatron() -> None:
    g = Gemm("w", M, K, N, transposed=False)
    # DDP: only the gradient all-reduce, 2(G-1)/G * kn
    assert gemm_volumes(g, Mesh(data=8)) == {
        ("all_reduce", "data", "step"): pytest.approx(2 * 7 / 8 * K * N * 4)
    }
    # FSDP: gather and reduce-scatter of (G-1)/G * kn each
    v = gemm_volumes(g, Mesh(z=4))
    assert v == {
        ("all_gather", "z", "forward"): pytest.approx(3 / 4 * K * N * 4),
        ("reduce_scatter", "z", "backward"): pytest.approx(3 / 4 * K * N * 4),
    }
    # Megatron MLP (column-parallel then row-parallel = x only, alternating transpose):
    # one all-reduce of the m x h activations forward, one backward.
    mesh = Mesh(x=4)
    h = K
    pair = network_volumes(
        [Gemm("fc1", M, h, 4 * h, False), Gemm("fc2", M, 4 * h, h, True)], mesh
    )
    assert pair == {
        ("all_reduce", "x", "backward"): pytest.approx(2 * 3 / 4 * M * h * 4),
        ("all_reduce", "x", "forward"): pytest.approx(2 * 3 / 4 * M * h * 4),
    }
    # a 1-rank mesh moves nothing
    assert gemm_volumes(g, Mesh()) == {}


def test_network_volumes_sum_layers() -> None:
    mesh = Mesh.parse("x2y2z2d2")
    a, b = Gemm("a", M, K, N, False), Gemm("b", M, N, K, True)
    total = network_volumes([a, b], mesh)
    va, vb = gemm_volumes(a, mesh), gemm_volumes(b, mesh)
    for key in set(va) | set(vb):
        assert total[key] == pytest.approx(va.get(key, 0.0) + vb.get(key, 0.0))


def test_replica_gemm_divides_tokens_by_data() -> None:
    g = Gemm("a", 1024, K, N, False)
    assert replica_gemm(g, Mesh(data=4, x=2)).m == 256
    with pytest.raises(ValueError, match=r"m=1024 tokens, which G_data=3"):
        replica_gemm(g, Mesh(data=3))


def test_gemm_validation() -> None:
    with pytest.raises(ValueError, match=r"Gemm 'bad': k must be a positive integer"):
        Gemm("bad", 1, 0, 1, False)
    with pytest.raises(ValueError, match=r"transposed must be True or False"):
        Gemm("bad", 1, 1, 1, 1)  # type: ignore[arg-type]


def test_predict_comm_seconds_per_axis() -> None:
    machine = Machine.preset("perlmutter")
    mesh = Mesh.parse("x4y2z2d1")  # 16 GPUs, 4 nodes
    g = Gemm("a", M, K, N, False, bytes_per_element=2)
    vols = gemm_volumes(g, mesh)
    secs = predict_comm_seconds(vols, mesh, machine)
    assert set(secs) == set(AXES)
    e = _paper(M, K, N, 4, 2, 2, 1, 2)
    assert secs["x"] == pytest.approx(e["eq4"] / 300e9)
    assert secs["y"] == pytest.approx(e["eq3"] / 25e9)
    assert secs["z"] == pytest.approx((e["eq1"] + e["eq2"]) / 25e9)
    assert secs["data"] == 0.0
    assert predict_gemms_seconds([g], mesh, machine) == secs
    with pytest.raises(ValueError, match=r"unknown axis 'w'"):
        predict_comm_seconds({("all_reduce", "w", "forward"): 1.0}, mesh, machine)
    with pytest.raises(ValueError, match=r"must be non-negative"):
        predict_comm_seconds({("all_reduce", "x", "forward"): -1.0}, mesh, machine)


def test_model_prefers_fewer_bytes_on_faster_links() -> None:
    """Sanity: on Perlmutter a large-batch small-weight layer on 4 GPUs prefers pure
    data/z parallelism over tensor parallelism, whose activation all-reduces are big."""
    machine = Machine.preset("perlmutter")
    best = min(
        enumerate_meshes(4),
        key=lambda mesh: sum(predict_gemms_seconds(
            [replica_gemm(Gemm("a", 65536, 256, 256, False), mesh)], mesh, machine
        ).values()),
    )
    assert best.x == 1 and best.y == 1


def test_memory_per_rank_and_weights() -> None:
    mesh = Mesh.parse("x2y2z2d4")
    g = Gemm("a", M, K, N, False)
    local = local_weight_elements(g, mesh)
    assert local == K * N / 8
    assert BYTES_PER_PARAMETER == 16
    assert memory_per_rank(local) == local * 16
    assert memory_per_rank(local, 1e6, transient_bytes=5.0) == local * 16 + 1e6 + 5.0
    with pytest.raises(ValueError, match=r"activation_bytes must be >= 0"):
        memory_per_rank(local, -1.0)


def test_activation_bytes_formula() -> None:
    s_b, h, layers = 2048, 1024, 4
    # Korthikanti: 34 s b h bytes per layer (2-byte activations), divided over t
    assert activation_bytes(s_b, h, layers) == 34 * s_b * h * layers
    assert activation_bytes(s_b, h, layers, tensor_parallel=4) == 34 * s_b * h * layers / 4
    assert activation_bytes(s_b, h, layers, bytes_per_element=4) == 2 * 34 * s_b * h * layers
    # with materialized attention scores: + 5 a s per token
    a, s = 16, 512
    assert activation_bytes(s_b, h, layers, heads=a, seq_len=s) == pytest.approx(
        layers * s_b * h * (34 + 5 * a * s / h)
    )
    # checkpointing: layer inputs (2 s b h each) plus one layer being recomputed
    assert activation_bytes(s_b, h, layers, checkpointing=True) == (
        layers * 2 * s_b * h + 34 * s_b * h
    )
    assert activation_bytes(s_b, h, 0) == 0.0
    with pytest.raises(ValueError, match=r"hidden must be an integer >= 1"):
        activation_bytes(s_b, 0, layers)


def test_enumerate_meshes() -> None:
    meshes = enumerate_meshes(8)
    assert len(meshes) == len(set(meshes)) == 20  # ordered 4-factorizations of 2^3
    assert all(m.world_size == 8 for m in meshes)
    assert meshes == Mesh.all(8)


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
    assert m.memory_bytes > 0
    assert m.axis_bandwidth(Mesh(x=2), "x") == bw
    assert Machine.from_json(m.to_json()) == m
    with pytest.raises(ValueError, match=r"ranks must be an integer >= 2"):
        profile_machine(1)
    with pytest.raises(ValueError, match=r"backend must be 'gloo', 'nccl' or None"):
        profile_machine(2, backend="mpi")
