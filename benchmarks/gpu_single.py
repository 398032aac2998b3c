"""One device: the eager model vs torch.compile(model) vs shardc on a mesh of one.

    python benchmarks/gpu_single.py                    # GPT-2 small and a ~0.5B GPT, bf16
    python benchmarks/gpu_single.py --tiny             # a tiny shape, minutes on a CPU
    python benchmarks/gpu_single.py --variants eager,torch.compile:cudagraphs,shardc:inductor --profile 12
    OMP_NUM_THREADS=1 python benchmarks/gpu_single.py --shapes peer,medium   # the CPU shapes

On a GPU, shardc runs on NCCL with a world of one (this process); without one, on gloo
and the CPU. Each variant trains the same model (same seed) with AdamW for ``--warmup``
steps (compilation, allocator) and then ``--steps`` timed steps; the variants take turns
step by step (eager, compiled, shardc, eager, ...) so that a machine whose speed drifts
shifts all of them alike. Prints the median step time, tokens/s, MFU (model FLOPs from
``shardc.planning.throughput`` over the device's peak) and memory. On a GPU that is the most a
variant's step allocates above what was resident when it began (activations, gradients,
workspace; CUDA's allocator, its peak reset before each step): the variants share one
process, so the resident weights and optimizer states of all of them are there throughout
and are left out. On the CPU it is the process's peak RSS, the same for every row.

Precision on the GPU: parameters in bf16 (``--dtype``), the same for all variants; shardc
compiles that model as it is.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import shardc
from shardc.planning.throughput import ModelFlops, device_peak_flops, model_flops, throughput
from shardc.tools.models import GPT, lm_batch

# (layers, hidden, heads, seq, vocab, batch)
SHAPES = {
    "gpt2-small": (12, 768, 12, 1024, 50304, 8),   # 124M (GPT-2's vocabulary padded to 64)
    "gpt-0.5b": (24, 1280, 20, 1024, 50304, 4),    # 0.54B
    "tiny": (2, 64, 4, 64, 512, 4),
    # CPU shapes: the peers' small GPT's size (benchmarks/vs_torch.py) and a medium one
    "peer": (4, 256, 4, 64, 512, 16),
    "medium": (4, 512, 8, 128, 512, 8),
}


@dataclass
class Variant:
    name: str
    step: Callable[[], float]   # one training step; returns the loss
    peak: int = 0               # bytes: see the module docstring


def _gpt(shape: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, tuple]:
    layers, dim, heads, seq, vocab, batch = SHAPES[shape]
    torch.manual_seed(0)
    model = GPT(vocab=vocab, dim=dim, layers=layers, heads=heads, seq=seq).to(device, dtype)
    return model, lm_batch(batch, seq, vocab, device=str(device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(fn: Callable[..., torch.Tensor], opt: torch.optim.Optimizer, batch: tuple) -> Callable[[], float]:
    def step() -> float:
        loss = fn(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())  # synchronises: the step is done when this returns
    return step


def _measured_step(v: Variant, device: torch.device) -> tuple[float, float]:
    """(loss, seconds) of ``v.step()``; raises ``v.peak`` to what this step allocated above
    what was resident (the bookkeeping outside the timed span)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    _sync(device)
    t = time.perf_counter()
    loss = v.step()
    _sync(device)
    seconds = time.perf_counter() - t
    if cuda:
        v.peak = max(v.peak, torch.cuda.max_memory_allocated(device) - resident)
    else:
        v.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return loss, seconds


def build(shape: str, device: torch.device, dtype: torch.dtype, which: list[str]) -> tuple[list[Variant], ModelFlops]:
    out = []
    model, batch = _gpt(shape, device, dtype)
    flops = model_flops(model, batch)
    for name in which:
        m, _ = _gpt(shape, device, dtype)  # each variant its own copy, same weights
        if name == "eager":
            fn: Callable[..., torch.Tensor] = m
            params = m.parameters()
        elif name in ("torch.compile", "torch.compile:cudagraphs"):
            # torch's own CUDA graphs: mode="reduce-overhead"
            fn = torch.compile(m, mode="reduce-overhead" if name.endswith("cudagraphs") else None)
            params = m.parameters()
        elif name.startswith("shardc"):
            sm = shardc.compile(m, shardc.Mesh(), example_inputs=batch,
                                backend=name.split(":")[1] if ":" in name else "eager")
            fn, params = sm, sm.parameters()
        else:
            raise SystemExit(f"gpu_single: unknown variant {name!r}")
        opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
        out.append(Variant(name, _train_step(fn, opt, batch)))
    return out, flops


def show_kernels(variants: list[Variant], device: torch.device, top: int) -> None:
    """Where each variant's step spends the device's time: two steps under torch.profiler,
    the kernels (CPU ops on the CPU) with the most self time, and how many ran."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415 - only --profile

    cuda = device.type == "cuda"
    for v in variants:
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as p:
            for _ in range(2):
                v.step()
            _sync(device)
        events = [e for e in p.key_averages()
                  if (e.device_type == torch.autograd.DeviceType.CUDA) == cuda]
        key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        total = sum(key(e) for e in events) / 2
        launched = sum(e.count for e in events) / 2
        print(f"\n{v.name}: {total / 1e3:.1f} ms of {'kernels' if cuda else 'CPU ops'} a step, "
              f"{launched:,.0f} launched; the {top} longest:")
        for e in sorted(events, key=key, reverse=True)[:top]:
            print(f"  {key(e) / 2e3:8.2f} ms {e.count // 2:6d}x  {e.key[:110]}")


def run(shape: str, device: torch.device, dtype: torch.dtype, which: list[str], warmup: int,
        steps: int, top: int = 0) -> None:
    variants, flops = build(shape, device, dtype, which)
    peak, source = device_peak_flops(device, dtype)
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    losses: dict[str, list[float]] = {v.name: [] for v in variants}
    for i in range(warmup + steps):
        for v in variants:  # interleaved: every variant sees the same machine
            loss, seconds = _measured_step(v, device)
            losses[v.name].append(loss)
            if i >= warmup:
                times[v.name].append(seconds)
    print(f"\n{shape}: {flops.matmul_params / 1e6:.1f}M matmul parameters, {flops.tokens} tokens/step, "
          f"{flops.per_token / 1e6:,.2f} MFLOP/token (6N + 12LSH); {dtype}; {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}; peak {peak / 1e12:.3f} TFLOP/s ({source})")
    mem = "step mem" if device.type == "cuda" else "peak RSS"
    print(f"{'variant':<18}{'step (ms)':>11}{'vs eager':>10}{'tokens/s':>12}{'MFU':>8}{mem:>12}"
          f"{'last loss':>11}")
    base = statistics.median(times[which[0]])
    for v in variants:
        med = statistics.median(times[v.name])
        tp = throughput(flops, med, 1, peak)
        print(f"{v.name:<18}{med * 1e3:>11.1f}{med / base:>9.3f}x{tp.tokens_per_s_per_rank:>12,.0f}"
              f"{100 * tp.mfu:>7.2f}%{v.peak / 2**20:>9.0f} MiB{losses[v.name][-1]:>11.4f}")
    if top:
        show_kernels(variants, device, top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="only the tiny shape (CPU-friendly)")
    p.add_argument("--shapes", default="gpt2-small,gpt-0.5b")
    p.add_argument("--variants", default="eager,torch.compile,shardc,shardc:inductor",
                   help="comma-separated: eager, torch.compile, torch.compile:cudagraphs (mode="
                        "'reduce-overhead'), shardc, shardc:inductor")
    p.add_argument("--dtype", default=None, help="bf16 (default on GPU) or fp32 (default on CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then profile two steps of each variant and print its N longest kernels")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: torch.bfloat16 if cuda else torch.float32}[args.dtype]
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    with tempfile.TemporaryDirectory() as d:
        # shardc needs a process group; a world of one: NCCL on the GPU, gloo on the CPU
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{d}/store",
                                rank=0, world_size=1)
        try:
            for shape in shapes:
                run(shape, device, dtype, args.variants.split(","), args.warmup, args.steps, args.profile)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
