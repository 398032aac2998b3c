"""The ``shardc`` command: demo, inspect, comm, plan, profile-machine, bench.

SPEC arguments name a function that returns ``(model, example_inputs)``:
``path/to/file.py:function`` or ``package.module:function``; ``shardc.tools.specs`` has
ready-made ones (``shardc.tools.specs:gpt_peer``, ``shardc.tools.specs:gpt_paper_20b``, ...).
"""
from __future__ import annotations

import argparse
from typing import Callable, Sequence

from rich.console import Console

import shardc
from shardc.planning.planner import print_plan
from shardc.program.offline import compile_offline
from shardc.runtime.profile import profile_machine
from shardc.tools.bench import run_bench
from shardc.tools.demo import run_demo
from shardc.tools.gate import check_against_baseline
from shardc.tools.specs import SpecError, load_spec
from shardc.tools.timeline import expert_load_lines, pipeline_lines, run_trace


# ---------------------------------------------------------------------- commands
def cmd_inspect(args: argparse.Namespace) -> int:

    model, inputs = load_spec(args.spec)
    sm = compile_offline(model, inputs, args.mesh, rank=args.rank)
    print(shardc.explain(sm))
    return 0


def cmd_comm(args: argparse.Namespace) -> int:


    model, inputs = load_spec(args.spec)
    sm = compile_offline(model, inputs, args.mesh)
    rep = shardc.comm_report(sm)
    rep.title = f"{args.spec} on {sm.mesh}: bytes one rank sends per training step"
    console = Console()
    if not args.quiet:
        console.print(rep)
    if args.json:
        with open(args.json, "w") as f:
            f.write(rep.to_json())
    if args.baseline:
        if args.update_baseline:
            with open(args.baseline, "w") as f:
                f.write(rep.to_json())
            console.print(f"baseline {args.baseline} written")
            return 0
        ok, text = check_against_baseline(rep, args.baseline, tolerance=args.tolerance)
        console.print(text)
        if args.check and not ok:
            return 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:

    run_demo(ranks=args.ranks, mesh=args.mesh, steps=args.steps, backend=args.backend)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:

    model, inputs = load_spec(args.spec)
    print_plan(model, inputs, world_size=args.world_size, machine=args.machine, top=args.top,
               checkpointing=args.checkpointing, pipeline=args.pipeline, context=args.context)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:

    machine = profile_machine(args.ranks, message_bytes=int(args.message_mib * 2**20), iters=args.iters,
                              backend=None if args.backend == "auto" else args.backend)
    text = machine.to_json()
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:

    run_bench(args)
    return 0


def cmd_trace(args: argparse.Namespace) -> int:

    opts: dict = {}
    if args.no_overlap:
        opts["overlap"] = False
    if args.bucket_mb is not None:
        opts["bucket_mb"] = args.bucket_mb
    if args.expert_axes:
        opts["expert_axes"] = tuple(args.expert_axes.split(","))
    if args.expert_capacity is not None:
        opts["expert_capacity"] = args.expert_capacity
    if args.microbatches is not None:
        opts["microbatches"] = args.microbatches
    if args.schedule is not None:
        opts["schedule"] = args.schedule
    if args.virtual_stages is not None:
        opts["virtual_stages"] = args.virtual_stages
    files = run_trace(args.spec, args.mesh, args.out, png=args.png, **opts)
    for path in files:
        print(f"wrote {path}")
    for line in expert_load_lines(files) + pipeline_lines(files):
        print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shardc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="train a GPT on CPU ranks (gloo) and summarise its traffic")
    d.add_argument("--ranks", type=int, default=8)
    d.add_argument("--mesh", default="x2y2z2d1")
    d.add_argument("--steps", type=int, default=5)
    d.add_argument("--backend", choices=("eager", "inductor"), default="eager",
                   help="how each rank runs its program (compile(..., backend=))")
    d.set_defaults(fn=cmd_demo)

    i = sub.add_parser("inspect", help="print the compiled program of one rank (shardc.explain)")
    i.add_argument("spec")
    i.add_argument("--mesh", required=True)
    i.add_argument("--rank", type=int, default=0)
    i.set_defaults(fn=cmd_inspect)

    c = sub.add_parser("comm", help="communication report; --check gates it against a baseline")
    c.add_argument("spec")
    c.add_argument("--mesh", required=True)
    c.add_argument("--json", help="write the report as JSON")
    c.add_argument("--baseline", help="a report JSON to compare with")
    c.add_argument("--check", action="store_true", help="exit 1 when volume grew past --tolerance")
    c.add_argument("--tolerance", type=float, default=0.0,
                   help="relative growth allowed per row (0.01 = 1%%)")
    c.add_argument("--update-baseline", action="store_true", help="rewrite --baseline with this report")
    c.add_argument("--quiet", action="store_true", help="print only the comparison")
    c.set_defaults(fn=cmd_comm)

    pl = sub.add_parser("plan", help="rank the meshes of a world size by predicted communication time")
    pl.add_argument("spec")
    pl.add_argument("--world-size", type=int, required=True)
    pl.add_argument("--machine", default="local", help="a preset name or a machine JSON file")
    pl.add_argument("--top", type=int, default=10)
    pl.add_argument("--checkpointing", action="store_true",
                    help="estimate activation memory as with per-block activation checkpointing "
                         "(the paper's setting); default: every intermediate kept")
    pl.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                    help="rank meshes with pipeline stages too (needs a machine that states its "
                         "compute); default: where the world spans nodes on such a machine, or "
                         "when no 4D mesh fits")
    pl.add_argument("--context", action=argparse.BooleanOptionalAction, default=None,
                    help="rank meshes with the sequence cut over context too (attention by a "
                         "ring); default: for a model that attends, when no mesh without it fits")
    pl.set_defaults(fn=cmd_plan)

    pm = sub.add_parser("profile-machine", help="measure the intra-node bandwidth table")
    pm.add_argument("--ranks", type=int, default=8)
    pm.add_argument("--message-mib", type=float, default=16.0)
    pm.add_argument("--iters", type=int, default=5)
    pm.add_argument("--out", help="write the machine JSON here")
    pm.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                    help="auto: NCCL with one rank per GPU when CUDA is available, else gloo")
    pm.set_defaults(fn=cmd_profile)

    b = sub.add_parser("bench", help="measure step times of meshes and compare with the plan")
    b.add_argument("--ranks", type=int, default=8)
    b.add_argument("--steps", type=int, default=3, help="measured steps per mesh per round")
    b.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the meshes")
    b.add_argument("--machine", default="local")
    b.add_argument("--out", default="bench")
    b.add_argument("--meshes", default="", help="comma-separated specs (default: all)")
    b.set_defaults(fn=cmd_bench)

    t = sub.add_parser("trace", help="record one training step per rank with torch.profiler "
                       "(Chrome/Perfetto traces; each collective a span from issue to wait)")
    t.add_argument("spec")
    t.add_argument("--mesh", required=True)
    t.add_argument("--out", default="trace")
    t.add_argument("--png", action="store_true", help="also draw rank 0's step (needs matplotlib)")
    t.add_argument("--no-overlap", action="store_true", help="compile with overlap=False")
    t.add_argument("--bucket-mb", type=float, default=None)
    t.add_argument("--expert-axes", default="", help="compile with expert_axes (e.g. data or z,data); "
                   "prints the rows each rank's experts computed")
    t.add_argument("--expert-capacity", type=float, default=None,
                   help="with --expert-axes: a capacity factor (padded all-to-alls); prints the "
                        "rows each rank dropped past it")
    t.add_argument("--microbatches", type=int, default=None,
                   help="a mesh with pipeline stages: micro-batches a step (default: pipe); prints "
                        "each rank's schedule as it ran and its idle share")
    t.add_argument("--schedule", default=None,
                   help="a mesh with pipeline stages: gpipe, 1f1b, interleaved or zero_bubble")
    t.add_argument("--virtual-stages", type=int, default=None,
                   help="with --schedule interleaved: the model chunks a rank holds (default 2)")
    t.set_defaults(fn=cmd_trace)

    args = p.parse_args(argv)
    fn: Callable[[argparse.Namespace], int] = args.fn
    try:
        return fn(args)
    except SpecError as e:  # a mistyped SPEC is a usage error, not a crash: no traceback
        raise SystemExit(str(e)) from None


if __name__ == "__main__":
    raise SystemExit(main())
