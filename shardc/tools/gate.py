"""Gate communication volume in CI: compare a report with a committed baseline."""
from __future__ import annotations

import os
from typing import Any

from shardc.program.report import CommReport


def grown_rows(before: CommReport, after: CommReport, tolerance: float = 0.0) -> list[dict[str, Any]]:
    """Rows (module, collective, axis, phase) whose bytes grew by more than ``tolerance``
    (relative; a row that did not exist before always counts)."""
    out = []
    for d in before.diff(after):
        b, a = float(d["before"]), float(d["after"])
        if a > b * (1 + tolerance) and a > b:
            out.append(d)
    return out


def grown_totals(before: CommReport, after: CommReport, tolerance: float = 0.0
                 ) -> list[tuple[tuple[str, str, str], float, float]]:
    """(collective, axis, phase) totals that grew beyond ``tolerance``: what the gate
    judges, so a collective that is only attributed to another module does not fail it."""
    b, a = before.by_key(), after.by_key()
    return [(k, float(b.get(k, 0)), float(a[k])) for k in sorted(a)
            if float(a[k]) > float(b.get(k, 0)) * (1 + tolerance) and float(a[k]) > float(b.get(k, 0))]


def check_against_baseline(rep: CommReport, baseline_path: str, tolerance: float = 0.0
                           ) -> tuple[bool, str]:
    """(ok, text to print). Not ok when the total, or the total of any (collective, axis,
    phase), grew past the tolerance; the text lists the module rows that grew."""
    if not os.path.exists(baseline_path):
        return False, (f"no baseline at {baseline_path}: create it with --baseline {baseline_path} "
                       "--update-baseline")
    with open(baseline_path) as f:
        base = CommReport.from_json(f.read())
    totals = grown_totals(base, rep, tolerance)
    total_b, total_a = float(base.total_bytes()), float(rep.total_bytes())
    ok = not totals and total_a <= total_b * (1 + tolerance)
    lines = [f"total bytes per step: baseline {total_b:,.0f}, now {total_a:,.0f}"]
    for (coll, axis, phase), b, a in totals:
        lines.append(f"{coll} over {axis} in {phase}: {b:,.0f} -> {a:,.0f} bytes")
    grown = grown_rows(base, rep, tolerance)
    if grown:
        lines.append(f"{len(grown)} row(s) grew beyond a tolerance of {tolerance:g}"
                     + ("" if not ok else " (only moved between modules: totals unchanged)") + ":")
        lines.append(f"  {'module':40s} {'collective':15s} {'axis':5s} {'phase':9s} {'before':>14s} {'after':>14s}")
        for d in grown:
            lines.append(f"  {d['module'] or '-':40s} {d['collective']:15s} {d['axis']:5s} "
                         f"{d['phase']:9s} {float(d['before']):14,.0f} {float(d['after']):14,.0f}")
    shrunk = [d for d in base.diff(rep) if float(d["after"]) < float(d["before"])]
    if shrunk and not grown:
        lines.append(f"{len(shrunk)} row(s) moved fewer bytes (update the baseline to keep the gain).")
    lines.append("OK: no growth" if ok else "FAIL: communication volume grew")
    return ok, "\n".join(lines)


def assert_comm_within_baseline(rep: CommReport, baseline_path: str, tolerance: float = 0.0,
                                update: bool | None = None) -> None:
    """pytest helper: fail when ``rep`` moves more than the baseline. With ``update`` (or
    SHARDC_UPDATE_BASELINES=1 in the environment) rewrite the baseline instead."""
    if update is None:
        update = os.environ.get("SHARDC_UPDATE_BASELINES") == "1"
    if update:
        with open(baseline_path, "w") as f:
            f.write(rep.to_json())
        return
    ok, text = check_against_baseline(rep, baseline_path, tolerance)
    assert ok, text
