"""The communication report: rows equal the paper's equations 1-5 exactly (integers and
sympy), every other collective is itemised, JSON round trip, diff, the CI gate, and
paper-sized models on meta tensors."""
from __future__ import annotations

import os
import resource

import pytest
import sympy
import torch
from models import GPT, MLPChain

import shardc
from shardc.program.report import SYMBOLS
from shardc.tools.cli import compile_offline
from shardc.tools.cli import main as cli_main
from shardc.tools.gate import assert_comm_within_baseline, check_against_baseline

pytestmark: list = []  # one process, fast: the fast tier

Gx, Gy, Gz, Gd = (SYMBOLS[a] for a in ("x", "y", "z", "data"))


def paper_equations(m: int, k: int, n: int, transposed: bool, b: int = 4) -> dict:
    """Equations 1-5 of the AxoNN paper (bytes: element counts times ``b``), keyed by
    (collective, axis, phase); x and y swap roles on a transposed layer."""
    gx, gy, ax, ay = (Gy, Gx, "y", "x") if transposed else (Gx, Gy, "x", "y")
    return {
        ("all_gather", "z", "forward"): (Gz - 1) * k * n / (gx * gy * Gz) * b,  # (1)
        ("reduce_scatter", "z", "backward"): (Gz - 1) / Gz * k * n / (gx * gy) * b,  # (2)
        ("all_reduce", ay, "forward"): 2 * (gy - 1) / gy * m * n / (Gz * gx) * b,  # (3)
        ("all_reduce", ax, "backward"): 2 * (gx - 1) / gx * m * k / (Gz * gy) * b,  # (4)
        ("all_reduce", "data", "step"): 2 * (Gd - 1) / Gd * k * n / (gx * gy * Gz) * b,  # (5)
    }


def _check_gemm(rep: shardc.CommReport, mesh: shardc.Mesh, module: str, weight: str,
                m_global: int, k: int, n: int, transposed: bool, has_input_grad: bool) -> None:
    sizes = {Gx: mesh.x, Gy: mesh.y, Gz: mesh.z, Gd: mesh.data}
    ones = {s: 1 for s, v in sizes.items() if v == 1}
    m = sympy.Integer(m_global) / Gd  # the tokens one data-parallel replica multiplies
    eqs = paper_equations(m, k, n, transposed)
    for (coll, axis, phase), eq in eqs.items():
        rows = [r for r in rep.rows if r.module == module and r.collective == coll and
                r.axis == axis and r.phase == phase and
                (r.param == weight if coll != "all_reduce" or axis == "data" else r.param is None)]
        expected = eq.subs(sizes)
        if phase == "backward" and coll == "all_reduce" and not has_input_grad:
            expected = 0  # the first layer's input is data: no dI, no all-reduce
        got = sum(r.bytes for r in rows)
        assert got == expected, (module, coll, axis, phase, got, expected)
        assert len(rows) == (1 if expected else 0), (module, coll, axis, phase, rows)
        if rows:
            # the row's own formula is the paper's, once absent axes (size 1) are set to 1
            assert sympy.simplify((rows[0].formula - eq).subs(ones)) == 0, (rows[0].formula, eq)


@pytest.mark.parametrize("mesh", shardc.Mesh.all(8) + [shardc.Mesh(x=2, y=2, z=2, data=2)], ids=str)
def test_mlp_chain_rows_are_equations_1_to_5(mesh: shardc.Mesh) -> None:
    model = MLPChain(dim=16, layers=6)
    sm = compile_offline(model, (torch.randn(32, 16), torch.randn(32, 16)), mesh)
    rep = shardc.comm_report(sm)
    for i in range(6):
        lay = sm.param_layouts[f"layers.{i}.weight"]
        transposed = not (lay.shard_dim("y") == 1 or lay.shard_dim("x") == 0) and (mesh.x > 1 or mesh.y > 1)
        _check_gemm(rep, mesh, f"layers.{i}", f"layers.{i}.weight", 32, 16, 16, transposed, i > 0)


@pytest.mark.parametrize("mesh", shardc.Mesh.all(8), ids=str)
def test_gpt_gemm_rows_are_equations_and_the_rest_is_itemised(mesh: shardc.Mesh) -> None:
    model = GPT()  # fused QKV with bias, tied head; hidden 32, 8 heads
    B, T = 8, 16
    # the equations are Algorithm 1's, which all-reduces a GEMM's partial output; sequence
    # parallelism trades that for a reduce-scatter and the next GEMM's all-gather
    # (test_sequence_parallel.py holds it to the same bytes)
    sm = compile_offline(model, (torch.randint(0, 64, (B, T)),) * 2, mesh, sequence_parallel=False)
    rep = shardc.comm_report(sm)
    for blk in range(2):
        for name, (k, n) in {"qkv": (32, 96), "proj": (32, 32), "fc1": (32, 128),
                             "fc2": (128, 32)}.items():
            module = f"blocks.{blk}.{name}"
            lay = sm.param_layouts[f"{module}.weight"]
            transposed = not (lay.shard_dim("y") == 1 or lay.shard_dim("x") == 0) and (mesh.x > 1 or mesh.y > 1)
            _check_gemm(rep, mesh, module, f"{module}.weight", B * T, k, n, transposed, True)
    modules = {name for name, _ in model.named_modules()}  # "" is the model itself
    for r in rep.rows:
        assert r.op and r.module in modules, r
        assert r.collective in ("all_gather", "reduce_scatter", "all_reduce") and r.bytes > 0


def test_report_totals_json_and_diff() -> None:
    mesh = shardc.Mesh(x=2, y=2, z=2)
    sm = compile_offline(MLPChain(), (torch.randn(16, 16), torch.randn(16, 16)), mesh)
    rep = shardc.comm_report(sm)
    assert rep.total_bytes() == sum(r.bytes for r in rep.rows)
    assert rep.total_bytes(axis="z", phase="backward") == sum(
        r.bytes for r in rep.rows if r.axis == "z" and r.phase == "backward")
    back = shardc.CommReport.from_json(rep.to_json())
    assert back.rows == rep.rows  # every field but the formula...
    assert all(sympy.simplify(a.formula - b.formula) == 0 for a, b in zip(back.rows, rep.rows))
    assert rep.diff(back) == []
    total = rep.formula()
    assert total.subs({Gx: 2, Gy: 2, Gz: 2, Gd: 1}) == rep.total_bytes()
    other = shardc.comm_report(compile_offline(MLPChain(), (torch.randn(16, 16),) * 2, shardc.Mesh(z=8)))
    assert rep.diff(other)
    text = str(rep)
    assert "layers.0" in text and "all_gather" in text and "total over z" in text
    with pytest.raises(ValueError, match="not a shardc comm report"):
        shardc.CommReport.from_json('{"rows": [{"bogus": 1}]}')


def test_comm_gate_fails_on_growth_and_passes_unchanged(tmp_path, capsys) -> None:
    here = os.path.dirname(__file__)
    spec = os.path.join(here, "gate_specs.py")
    base = str(tmp_path / "base.json")
    assert cli_main(["comm", f"{spec}:mlp", "--mesh", "x2y2z2d1", "--baseline", base,
                     "--update-baseline"]) == 0
    assert cli_main(["comm", f"{spec}:mlp", "--mesh", "x2y2z2d1", "--baseline", base, "--check",
                     "--quiet"]) == 0
    assert "OK: no growth" in capsys.readouterr().out
    # a change that adds a collective (an op without a rule, gathered) fails the gate
    assert cli_main(["comm", f"{spec}:mlp_with_extra_collective", "--mesh", "x2y2z2d1",
                     "--baseline", base, "--check", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: communication volume grew" in out and "aten.logcumsumexp" not in out
    assert "all_gather" in out  # the grown row: module, collective, axis, phase, before, after
    # a worse mesh for the same model fails it too (x8: whole activations all-reduced)
    assert cli_main(["comm", f"{spec}:mlp", "--mesh", "x8y1z1d1", "--baseline", base,
                     "--check", "--quiet"]) == 1
    # ... unless the tolerance allows it
    json_out = str(tmp_path / "now.json")
    assert cli_main(["comm", f"{spec}:mlp", "--mesh", "x2y2z2d1", "--json", json_out, "--quiet"]) == 0
    assert shardc.CommReport.from_json(open(json_out).read()).total_bytes() > 0


def test_pytest_gate_helper(tmp_path) -> None:
    rep = shardc.comm_report(compile_offline(MLPChain(), (torch.randn(16, 16),) * 2, shardc.Mesh(z=4, x=2)))
    base = str(tmp_path / "b.json")
    assert_comm_within_baseline(rep, base, update=True)
    assert_comm_within_baseline(rep, base)
    worse = shardc.comm_report(compile_offline(MLPChain(), (torch.randn(16, 16),) * 2, shardc.Mesh(x=8)))
    with pytest.raises(AssertionError, match="grew"):
        assert_comm_within_baseline(worse, base)
    # the same bytes attributed to another module (a reporting change) is not growth
    moved = shardc.CommReport.from_json(rep.to_json())
    moved.rows[0].module = "somewhere.else"
    ok, text = check_against_baseline(moved, base)
    assert ok and "only moved between modules" in text


def test_gpt20b_report_on_32_and_4096_ranks_without_weights() -> None:
    from shardc.tools.specs import gpt_paper_20b

    model, inputs = gpt_paper_20b()
    assert all(p.is_meta for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    assert 19e9 < params < 21e9
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for spec in ("x2y2z8d1", "x8y4z8d16"):
        sm = compile_offline(model, inputs, spec)
        rep = shardc.comm_report(sm)
        assert rep.total_bytes(axis="z", phase="forward") > 0 and not sm.fallbacks
    # 20B bf16 weights would be 40 GB; the whole run stays far below that
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kib < 2 * 2**20, f"peak RSS grew {grown_kib / 2**20:.1f} GiB"
