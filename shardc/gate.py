"""Gate communication volume in CI: compare a report with a committed baseline."""
from __future__ import annotations

import os
from typing import Any

from shardc.report import CommReport


def grown_rows(before: CommReport, after: CommReport, tolerance: float = 0.0) -> list[dict[str, Any]]:
    """Rows (module, collective, axis, phase) whose bytes grew by more than ``tolerance``
    (relative; a row that did not exist before always counts)."""
    out = []
    for d in before.diff(after):
        b, a = float(d["before"]), float(d["after"])
        if a > b * (1 + tolerance) and a > b:
            out.append(d)
    return out


def check_against_baseline(rep: CommReport, baseline_path: str, tolerance: float = 0.0
                           ) -> tuple[bool, str]:
    """(ok, text to print). ok is False when any row grew past the tolerance or the total did."""
    if not os.path.exists(baseline_path):
        return False, (f"no baseline at {baseline_path}: create it with --baseline {baseline_path} "
                       "--update-baseline")
    with open(baseline_path) as f:
        base = CommReport.from_json(f.read())
    grown = grown_rows(base, rep, tolerance)
    total_b, total_a = float(base.total_bytes()), float(rep.total_bytes())
    lines = [f"total bytes per step: baseline {total_b:,.0f}, now {total_a:,.0f}"]
    if grown:
        lines.append(f"{len(grown)} row(s) grew beyond a tolerance of {tolerance:g}:")
        lines.append(f"  {'module':40s} {'collective':15s} {'axis':5s} {'phase':9s} {'before':>14s} {'after':>14s}")
        for d in grown:
            lines.append(f"  {d['module'] or '-':40s} {d['collective']:15s} {d['axis']:5s} "
                         f"{d['phase']:9s} {float(d['before']):14,.0f} {float(d['after']):14,.0f}")
    shrunk = [d for d in base.diff(rep) if float(d["after"]) < float(d["before"])]
    if shrunk:
        lines.append(f"{len(shrunk)} row(s) moved fewer bytes (update the baseline to keep the gain).")
    ok = not grown and total_a <= total_b * (1 + tolerance)
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
