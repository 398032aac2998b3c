"""What ``gemm_modes`` buys on this machine: the three forms of a transformer layer's
GEMMs, and a training step with and without the choice.

    python benchmarks/gemm_forms.py                        # CPU, TinyGPT's shapes
    python benchmarks/gemm_forms.py --shape large --device cuda --dtype bfloat16

Part 1 times, for each GEMM of one transformer layer (forward x W^T, backward dI = g W
and dW = g^T x, for the attention and MLP weights) on ``--tokens`` x ``--dim``, the
product as autograd lays its operands out ("traced") and in each of NN, NT and TN, the
copy into that form included (``shardc.runtime.gemm.time_forms``, what
``gemm_modes="auto"`` measures on the first batch). Part 2 trains ``benchmarks/vs_torch``'s
TinyGPT on a world of one (gloo on the CPU, NCCL on a GPU; ``--dtype`` there too) with
``gemm_modes="default"`` and ``"auto"``, interleaved over
``--rounds`` rounds, and prints the median step times, their ratio, and the forms auto
chose. Figures are for the machine they ran on; compare ratios, not milliseconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from vs_torch import SHAPES, _batch, _model  # noqa: E402


def layer_gemms(tokens: int, dim: int, device: torch.device, dtype: torch.dtype) -> list[tuple]:
    """(name, op, operands as autograd lays them out) for one transformer layer."""
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)
    out = []
    for name, fan_in, fan_out in (("qkv", dim, 3 * dim), ("proj", dim, dim),
                                  ("fc1", dim, 4 * dim), ("fc2", 4 * dim, dim)):
        x, w, g = t(tokens, fan_in), t(fan_out, fan_in), t(tokens, fan_out)
        out += [(f"{name} forward x W^T", torch.ops.aten.mm.default, [x, w.t()]),
                (f"{name} dI = g W", torch.ops.aten.mm.default, [g, w]),
                (f"{name} dW = g^T x", torch.ops.aten.mm.default, [g.t(), x])]
    return out


def part1(args: argparse.Namespace) -> None:
    from shardc.runtime.gemm import MODES, form, time_forms

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    s = SHAPES[args.shape]
    tokens = args.tokens or s["batch"] * s["seq"]
    print(f"\nGEMMs of one layer: tokens {tokens}, hidden {s['dim']}, {args.dtype}, {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| GEMM | traced form | traced (ms) | NN | NT | TN | best / traced |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, op, vals in layer_gemms(tokens, s["dim"], device, dtype):
        times = time_forms(op, vals, device)
        traced = form(*vals)
        row = {m: times.get(m, times["traced"] if m == traced else None) for m in MODES}
        best = min(times.values())
        cells = " | ".join(f"{1e3 * row[m]:.3f}" for m in MODES)
        print(f"| {name} | {traced} | {1e3 * times['traced']:.3f} | {cells} | "
              f"{best / times['traced']:.2f}x |")


def part2(args: argparse.Namespace) -> None:
    import shardc

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as d:
        # a world of one: NCCL where the model is on a GPU
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            s = SHAPES[args.shape]
            mesh = shardc.Mesh()
            batch = tuple(t.to(device) for t in _batch(s))
            steps = {}
            for mode in ("default", "auto"):
                sm = shardc.compile(_model(s).to(device, dtype), mesh, example_inputs=batch,
                                    gemm_modes=mode)
                opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)

                def step(sm=sm, opt=opt) -> float:
                    loss = sm(*batch)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    return loss.item()
                step()  # the first step builds the program (and, auto, times the forms)
                steps[mode] = (sm, step)
            med: dict[str, list[float]] = {m: [] for m in steps}
            for _ in range(args.rounds):
                for mode, (_, step) in steps.items():
                    times = []
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        step()
                        times.append(time.perf_counter() - t0)
                    med[mode].append(statistics.median(times))
            a, b = statistics.median(med["default"]), statistics.median(med["auto"])
            print(f"\nTinyGPT {args.shape} {s}, {args.dtype} on {device}, median of {args.rounds} "
                  f"interleaved rounds of {args.steps} steps:\n")
            print("| gemm_modes | step (ms) | vs default |")
            print("| --- | --- | --- |")
            print(f"| default | {1e3 * a:.1f} | 1.00x |")
            print(f"| auto | {1e3 * b:.1f} | {b / a:.2f}x |")
            print("\n" + "\n".join(line for line in shardc.explain(steps["auto"][0]).splitlines()
                                   if "GEMM forms" in line))
            chosen = steps["auto"][0].runtime.gemm_forms
            changed = {k: v for k, v in chosen.items() if v != "traced"}
            print(f"auto chose another form for {len(changed)} of {len(chosen)} GEMM shapes: "
                  + ", ".join(f"{k[0].split('.')[1]} {k[1]} {k[2]}->{v}" for k, v in changed.items()))
        finally:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--tokens", type=int, default=0, help="rows of the GEMMs (default batch x seq)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-step", action="store_true", help="part 1 only")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    part1(args)
    if not args.skip_step:
        part2(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
