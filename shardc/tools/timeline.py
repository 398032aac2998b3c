"""Overlap you can see: one training step per rank under ``torch.profiler``, written as a
Chrome/Perfetto trace in which every collective of the step program is one span
from its issue to its wait, on a track of its own per mesh axis, beside the compute it
overlapped.

``trace_step(sm, inputs, out_dir)`` does it for user code (call it on every rank: a
step is collective); ``shardc trace SPEC --mesh M --out DIR`` does it for a SPEC on
local gloo ranks, and ``--png`` draws rank 0's step as a picture (needs matplotlib,
``pip install shardc[plot]``).

The runtime marks each collective's issue and wait with a short profiler range
(``shardc.issue#K ...`` and ``shardc.wait#K``, see ``runtime/functional.py``); both
ranges carry the profiler's own timestamps, so joining them needs no clock alignment.
Open the JSON in https://ui.perfetto.dev or chrome://tracing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shardc
from shardc.tools.specs import load_spec

_ISSUE = re.compile(r"shardc\.issue#(\d+) (\w+)@(\w+) (\w+) (\d+)B")
_WAIT = re.compile(r"shardc\.wait#(\d+)")
_AXIS_TID = {"x": 1_000_001, "y": 1_000_002, "z": 1_000_003, "data": 1_000_004}


def trace_step(sm: Any, inputs: tuple, out_dir: str, warmup: int = 1) -> str:
    """Profile one forward and backward of ``sm`` on ``inputs`` (this rank's) after
    ``warmup`` untraced ones; write ``out_dir/rank{R}.json``; return its path.

    Collective: every rank must call it. The parameters' ``.grad`` are set to None
    before and after (the traced steps' gradients are not kept)."""

    rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(out_dir, exist_ok=True)

    def step() -> None:
        sm(*inputs).backward()
        for p in sm.parameters():
            p.grad = None

    for p in sm.parameters():
        p.grad = None
    for _ in range(warmup):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
    path = os.path.join(out_dir, f"rank{rank}.json")
    with tempfile.TemporaryDirectory() as d:
        raw = os.path.join(d, "raw.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            trace = json.load(f)
    add_collective_spans(trace)
    # expert parallelism: how the traced step's rows were spread (sm.expert_load()),
    # beside the timeline (the trace viewers ignore keys they do not know)
    load = sm.expert_load() if hasattr(sm, "expert_load") else {}
    if load:
        trace["shardcExpertLoad"] = {m: dataclasses.asdict(v) for m, v in load.items()}
    # a pipeline rank: its stage, the schedule's actions as they ran (also profiler ranges
    # "shardc.pipe F0", ..., and "shardc.pipe wait ..." where it waited on another stage),
    # the idle share measured and the schedule's formula
    if hasattr(sm, "last_timeline"):
        trace["shardcPipeline"] = {
            "stage": sm.index, "stages": sm.mesh.pipe, "schedule": sm.schedule,
            "microbatches": sm.microbatches, "idle_fraction": sm.idle_fraction(),
            "chunks": sm.chunks, "bubble_formula": sm.bubble_formula(),
            "timeline": [{"action": sm.label(kind, k, c), "start_s": a, "end_s": b, "waited_s": w}
                         for kind, k, a, b, w, c in sm.last_timeline]}
    with open(path, "w") as f:
        json.dump(trace, f)
    return path


def expert_load_lines(files: list[str]) -> list[str]:
    """One line per MoE layer and rank of the traces ``files`` (``trace_step``'s): the rows
    each rank's experts computed in the traced step, expert by expert, and their total
    against the mean over ranks (the busiest rank sets the step's pace), and under a
    capacity factor the rank's rows dropped (its experts' rows then include the padding)."""
    loads: dict[str, list[tuple[int, list[int], int]]] = {}
    for f in files:
        if not f.endswith(".json"):
            continue
        rank = int(os.path.basename(f)[len("rank"):-len(".json")])
        with open(f) as fh:
            for module, v in json.load(fh).get("shardcExpertLoad", {}).items():
                loads.setdefault(module, []).append(
                    (rank, v["received_per_expert"], sum(v.get("dropped_per_expert", []))))
    out = []
    for module, ranks in loads.items():
        mean = sum(sum(r) for _, r, _ in ranks) / len(ranks)
        for rank, rows, dropped in sorted(ranks):
            out.append(f"{module}: rank {rank} computed {sum(rows)} rows ({sum(rows) / mean:.2f}x the "
                       f"mean), by local expert {rows}"
                       + (f"; {dropped} of its own rows dropped past the capacity" if dropped else ""))
    return out


def pipeline_lines(files: list[str]) -> list[str]:
    """One line per pipeline rank of the traces ``files``: its stage, the share of the
    step it waited on other stages beside the schedule's bubble with equal stages, and
    its actions with their times (ms from the step's start)."""
    out = []
    for f in files:
        if not f.endswith(".json"):
            continue
        rank = int(os.path.basename(f)[len("rank"):-len(".json")])
        with open(f) as fh:
            pipe = json.load(fh).get("shardcPipeline")
        if not pipe:
            continue
        acts = " ".join(f"{a['action']} {a['start_s'] * 1e3:.1f}-{a['end_s'] * 1e3:.1f}" for a in pipe["timeline"])
        chunks = f"{pipe['chunks']} chunks a rank, " if pipe.get("chunks", 1) > 1 else ""
        out.append(f"rank {rank}, stage {pipe['stage']} of {pipe['stages']} ({pipe['schedule']}, {chunks}"
                   f"{pipe['microbatches']} micro-batches): idle {pipe['idle_fraction']:.1%} of the step "
                   f"(bubble with equal stages {pipe['bubble_formula']:.1%}); {acts}")
    return out


def collective_spans(trace: dict) -> list[dict]:
    """Each collective of the traced step: name, axis, phase, bytes, start and end (us),
    and the compute ops (``aten::*`` ranges on the issuing thread) that ran in flight."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    issues: dict[str, tuple[dict, re.Match]] = {}
    waits: dict[str, dict] = {}
    for e in events:
        name = e.get("name", "")
        m = _ISSUE.match(name)
        if m:
            issues[m.group(1)] = (e, m)
            continue
        m = _WAIT.match(name)
        if m:
            waits[m.group(1)] = e
    spans = []
    for k, (e, m) in sorted(issues.items(), key=lambda kv: kv[1][0]["ts"]):
        w = waits.get(k)
        if w is None:
            continue
        start, end = float(e["ts"]), float(w["ts"]) + float(w.get("dur", 0))
        inside = [o for o in events if o.get("tid") == e.get("tid") and
                  o.get("name", "").startswith("aten::") and
                  float(e["ts"]) + float(e.get("dur", 0)) <= float(o["ts"]) and
                  float(o["ts"]) + float(o.get("dur", 0)) <= float(w["ts"])]
        spans.append({"collective": m.group(2), "axis": m.group(3), "phase": m.group(4),
                      "bytes": int(m.group(5)), "start": start, "end": end,
                      "pid": e.get("pid"), "overlapped": [o["name"] for o in inside]})
    return spans


def add_collective_spans(trace: dict) -> dict:
    """Add one span per collective to ``trace`` (in place), on a track per axis."""
    spans = collective_spans(trace)
    evs = trace.setdefault("traceEvents", [])
    pids = {s["pid"] for s in spans}
    for pid in pids:
        for axis, tid in _AXIS_TID.items():
            evs.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                        "args": {"name": f"shardc collectives over {axis}"}})
    for s in spans:
        gemms = sum(1 for n in s["overlapped"] if _is_gemm(n))
        evs.append({"ph": "X", "name": f"{s['collective']}@{s['axis']} {s['phase']}",
                    "cat": "shardc", "pid": s["pid"], "tid": _AXIS_TID[s["axis"]],
                    "ts": s["start"], "dur": max(s["end"] - s["start"], 0.0),
                    "args": {"bytes": s["bytes"], "phase": s["phase"],
                             "ops in flight": len(s["overlapped"]), "GEMMs in flight": gemms}})
    return trace


def _is_gemm(name: str) -> bool:
    return name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                    "aten::baddbmm")


def render_png(trace_path: str, png_path: str, title: str = "") -> None:
    """Draw one rank's step: the GEMMs and other ops of the issuing thread, and each
    collective's flight on its axis' row."""
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency (the [plot] extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - optional dependency (the [plot] extra)
    except ImportError as missing:  # an optional extra
        raise RuntimeError("shardc trace --png needs matplotlib: pip install 'shardc[plot]'"
                           ) from missing
    with open(trace_path) as f:
        trace = json.load(f)
    spans = collective_spans(trace)
    if not spans:
        raise RuntimeError(f"{trace_path} holds no shardc collective (a mesh of one rank?)")
    tid = next(e["tid"] for e in trace["traceEvents"] if _ISSUE.match(e.get("name", "")))
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("tid") == tid
           and e.get("name", "").startswith("aten::")]
    t0 = min(min(float(e["ts"]) for e in ops), min(s["start"] for s in spans))
    axes = [a for a in _AXIS_TID if any(s["axis"] == a for s in spans)]
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.6 * (len(axes) + 1)))
    rows = {"compute": 0, **{a: i + 1 for i, a in enumerate(axes)}}
    for e in ops:
        gemm = _is_gemm(e["name"])
        ax.broken_barh([((float(e["ts"]) - t0) / 1e3, float(e.get("dur", 0)) / 1e3)],
                       (-0.4, 0.8), color="tab:blue" if gemm else "lightgray")
    colors = {"forward": "tab:green", "backward": "tab:orange", "step": "tab:red"}
    for s in spans:
        ax.broken_barh([((s["start"] - t0) / 1e3, (s["end"] - s["start"]) / 1e3)],
                       (rows[s["axis"]] - 0.35, 0.7), color=colors.get(s["phase"], "gray"),
                       alpha=0.7, edgecolor="black", linewidth=0.3)
    ax.set_yticks(list(rows.values()))
    ax.set_yticklabels(["compute (blue: GEMM)"] + [f"collectives @{a}" for a in axes])
    ax.set_xlabel("ms (green: forward, orange: backward, red: post-backward reductions)")
    ax.set_title(title or os.path.basename(trace_path))
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------- the CLI command
def _rank_main(rank: int, world: int, store: str, spec: str, mesh_spec: str, out: str,
               overrides: dict) -> None:


    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model, inputs = load_spec(spec)
        mesh = shardc.Mesh.parse(mesh_spec)
        sm = shardc.compile(model, mesh, example_inputs=inputs, **overrides)
        trace_step(sm, tuple(shardc.shard_batch(x, mesh) for x in inputs), out)
    finally:
        dist.destroy_process_group()


def run_trace(spec: str, mesh_spec: str, out: str, png: bool = False, **overrides: Any) -> list[str]:
    """``shardc trace``: every rank of ``mesh_spec`` on local gloo processes traces one
    step of SPEC; returns the trace files (and rank 0's picture with ``png``)."""


    world = shardc.Mesh.parse(mesh_spec).world_size
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank_main, args=(world, os.path.join(d, "store"), spec, mesh_spec, out, overrides),
                 nprocs=world)
    files = [os.path.join(out, f"rank{r}.json") for r in range(world)]
    if png:
        path = os.path.join(out, "rank0.png")
        render_png(files[0], path, title=f"{spec} on {mesh_spec}, rank 0: one training step")
        files.append(path)
    return files
