"""Tokens per second and model FLOPs utilisation (MFU).

Model FLOPs of one training step, read from the model's traced graph (the same
``torch.export`` trace ``shardc.compile`` makes)::

    flops/step = 6 · N · T  +  3 · Σ_attention 2 · B · h · S_q · S_kv · (d_qk + d_v)
               = T · (6 · N + 12 · L · S · H)        for L layers of self-attention over
                                                     S tokens with h · d = H

- ``N`` is the number of parameter elements a GEMM reads (``linear``, ``mm``, ``matmul``,
  ``addmm``, ... whose weight is a parameter, through views and transposes; a tied LM
  head counts once, as the GEMM it is). A GEMM of M rows through a k×n weight costs
  2·M·k·n FLOPs forward and twice that backward (dI and dW), so 6·k·n per row; every
  GEMM of a transformer sees each of the T tokens once, which gives 6·N·T. Embedding
  lookups read parameters but multiply nothing and are not in N.
- A mixture of experts' grouped GEMM (torch's, transformers' or shardc's, rows by a
  stacked [E, in, out] weight) counts each row once, through its own expert's weight:
  6·in·out a row, the experts the router chose and no other; its N counts every expert.
- Attention (``scaled_dot_product_attention``, or a matmul of two activations) costs
  2·B·h·S_q·S_kv·d for the scores and as much for the weighted sum, forward, and twice
  that backward; counted at its full S_q × S_kv even when causal, as PaLM's appendix B
  and Megatron count it (the masked half is computed by most kernels anyway).
- Not counted: biases, norms, activations, softmax, the loss, the optimizer: O(H) per
  token against the GEMMs' O(H²), the usual MFU convention.

MFU = model FLOPs per step / (step time × the summed peak FLOP/s of the ranks). A GPU's
peak comes from ``PEAK_FLOPS`` by its name (dense tensor-core figures from the vendors'
data sheets); a CPU has no data sheet figure that a rank sharing cores would see, so its
peak is measured: the FLOP/s of a large matmul in this process (``measure_cpu_peak``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from shardc.passes.rules.routing import grouped_gemms
from shardc.passes.trace import trace

_aten = torch.ops.aten

# ops that are one GEMM: (operand a, operand b) positions; linear's weight is (n, k)
_GEMMS: dict[Any, tuple[int, int]] = {
    _aten.linear.default: (0, 1), _aten.mm.default: (0, 1), _aten.matmul.default: (0, 1),
    _aten.addmm.default: (1, 2), _aten.bmm.default: (0, 1), _aten.baddbmm.default: (1, 2),
}
_ATTENTION = (_aten.scaled_dot_product_attention.default,)
# ops a weight may pass through on its way to a GEMM without changing what is multiplied
_VIEWS = {_aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.view.default,
          _aten.reshape.default, _aten._unsafe_view.default, _aten.expand.default,
          _aten.alias.default, _aten.detach.default, _aten._to_copy.default,
          _aten.clone.default, _aten.contiguous.default, _aten.unsqueeze.default,
          _aten.squeeze.dim, _aten.squeeze.default}


@dataclass(frozen=True)
class ModelFlops:
    """Model FLOPs of one training step on the global batch the counts were made with."""

    matmul_params: int       # N: parameter elements a GEMM reads
    tokens: int              # T: tokens in the global batch
    gemm_flops: float        # 6·N·T, counted GEMM by GEMM (2·M·k·n each, ×3)
    attention_flops: float   # 3 × the attention matmuls' forward FLOPs
    layers: int              # L: attention calls
    seq: int                 # S: the longest key length an attention call sees
    hidden: int              # H: heads × head dim of the widest attention call

    @property
    def per_step(self) -> float:
        return self.gemm_flops + self.attention_flops

    @property
    def per_token(self) -> float:
        return self.per_step / self.tokens


def _param_behind(node: Any, params: set[str], seen: int = 0) -> str | None:
    """The parameter placeholder ``node`` is (through views), else None."""
    while isinstance(node, fx.Node) and seen < 16:
        if node.op == "placeholder":
            return node.name if node.name in params else None
        if node.op == "call_function" and node.target in _VIEWS:
            node = node.args[0]
            seen += 1
            continue
        return None
    return None


def _shape(node: Any) -> list[int]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return [int(s) for s in val.shape] if isinstance(val, torch.Tensor) else []


def count_flops(ep: torch.export.ExportedProgram, tokens: int) -> ModelFlops:
    """Count the model FLOPs of one training step from an exported program whose
    example batch holds ``tokens`` tokens (see the module docstring for the formula)."""
    sig = ep.graph_signature
    params = {s.arg.name for s in sig.input_specs if s.kind.name == "PARAMETER"}
    gemm = attention = 0.0
    weights: set[str] = set()
    layers = seq = hidden = 0
    # a mixture of experts' grouped GEMMs: rows x [E, in, out], each row through one expert
    gemms = {**_GEMMS, **{op: (0, 1) for op in grouped_gemms()}}
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in gemms:
            ia, ib = gemms[n.target]
            a, b = n.args[ia], n.args[ib]
            sa, sb = _shape(a), _shape(b)
            if not sa or not sb:
                continue
            w = _param_behind(b, params) or _param_behind(a, params)
            if n.target is _aten.linear.default:
                k, cols = sb[-1], sb[0]  # weight (n, k)
            else:
                k, cols = sb[-2] if len(sb) > 1 else sb[0], sb[-1] if len(sb) > 1 else 1
            out = _shape(n)
            rows = math.prod(out) // cols if cols else 0
            if w is not None:
                weights.add(w)
                gemm += 3 * 2 * rows * k * cols
            else:  # two activations: the attention of a model that writes it out
                attention += 3 * 2 * rows * k * cols
        elif n.target in _ATTENTION:
            q, key, v = (_shape(x) for x in n.args[:3])
            *lead, s_q, d_qk = q
            s_kv, d_v = key[-2], v[-1]
            heads = math.prod(q[1:-2]) if len(q) > 2 else 1
            attention += 3 * 2 * math.prod(lead) * s_q * s_kv * (d_qk + d_v)
            layers += 1
            seq = max(seq, s_kv)
            hidden = max(hidden, heads * d_qk)
    numel = {s.arg.name: s.target for s in sig.input_specs if s.kind.name == "PARAMETER"}
    state = dict(ep.named_parameters())
    n_params = sum(state[numel[w]].numel() for w in weights if numel[w] in state)
    return ModelFlops(matmul_params=n_params, tokens=tokens, gemm_flops=gemm,
                      attention_flops=attention, layers=layers, seq=seq, hidden=hidden)


def model_flops(model: torch.nn.Module, example_inputs: tuple, tokens: int | None = None) -> ModelFlops:
    """Model FLOPs of one training step of ``model`` on ``example_inputs`` (the global
    batch). ``tokens`` defaults to the number of elements of the first input (token
    ids of shape (batch, seq))."""

    ep = trace(model, tuple(example_inputs))  # cached: free after shardc.compile
    if tokens is None:
        first = example_inputs[0]
        tokens = int(first.numel()) if isinstance(first, torch.Tensor) else 1
    return count_flops(ep, tokens)


# ------------------------------------------------------------------------ peaks
# Dense (no structured sparsity) peak FLOP/s per device as torch sees it, from the vendors'
# data sheets: (bf16/fp16 tensor core, tf32, fp32 without tf32). Matched by substring of
# torch.cuda.get_device_name, first match wins (so the specific names come first). AMD's
# MI250X is two GCDs, each its own torch device: the figures are per GCD (half the card's).
PEAK_FLOPS: list[tuple[str, tuple[float, float, float]]] = [
    ("GH200", (989e12, 494.7e12, 66.9e12)),
    ("H200", (989e12, 494.7e12, 66.9e12)),
    ("H100 PCIe", (756e12, 378e12, 51.2e12)),
    ("H100 NVL", (835e12, 417.5e12, 60e12)),
    ("H100", (989e12, 494.7e12, 66.9e12)),        # SXM5 ("NVIDIA H100 80GB HBM3")
    ("B200", (2250e12, 1100e12, 80e12)),
    ("A100", (312e12, 156e12, 19.5e12)),          # SXM4 and PCIe, 40 and 80 GB
    ("A10G", (70e12, 35e12, 31.2e12)),
    ("A10", (125e12, 62.5e12, 31.2e12)),
    ("L40S", (362e12, 183e12, 91.6e12)),
    ("L4", (121e12, 60e12, 30.3e12)),
    ("V100", (125e12, 15.7e12, 15.7e12)),         # fp16 tensor cores; no bf16, no tf32
    ("MI300X", (1307.4e12, 653.7e12, 163.4e12)),
    ("MI325X", (1307.4e12, 653.7e12, 163.4e12)),
    ("MI250X", (191.5e12, 47.9e12, 47.9e12)),     # per GCD; fp32 matrix cores
    ("MI250", (181e12, 45.3e12, 45.3e12)),        # per GCD
]


def gpu_peak_flops(name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Peak FLOP/s of the GPU called ``name`` for GEMMs in ``dtype`` (fp32 with
    ``tf32`` uses the TF32 figure); None for a GPU not in the table."""
    for key, (half, tf, fp32) in PEAK_FLOPS:
        if key.lower() in name.lower():
            if dtype in (torch.bfloat16, torch.float16):
                return half
            return tf if tf32 else fp32
    return None


_CPU_PEAK: dict[tuple[torch.dtype, int], float] = {}


def measure_cpu_peak(dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an n×n×n matmul on this process's CPU threads (best of ``repeats``):
    what a GEMM-bound step could at most reach here. Measure it while the other ranks
    on the machine measure theirs (they share the cores as training does)."""
    key = (dtype, torch.get_num_threads())
    if key in _CPU_PEAK:
        return _CPU_PEAK[key]
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(dtype)
    b = torch.randn(n, n, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch.mm(a, b)  # warm: thread pool, first-touch
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    _CPU_PEAK[key] = 2 * n ** 3 / best
    return _CPU_PEAK[key]


def device_peak_flops(device: torch.device | str, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from) for one rank on ``device``. A GPU not in
    the table is measured like a CPU, with a matmul on it."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
        peak = gpu_peak_flops(name, dtype, tf32)
        if peak is not None:
            return peak, f"{name} data sheet ({'tf32' if tf32 else str(dtype).split('.')[-1]})"
        return _measure_cuda_peak(device, dtype), f"{name}: measured matmul (not in the table)"
    return measure_cpu_peak(dtype), f"measured {torch.get_num_threads()}-thread CPU matmul"


def _measure_cuda_peak(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(5):
        start.record()
        torch.mm(a, b)
        end.record()
        torch.cuda.synchronize(device)
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * n ** 3 / best


def summed_peak_flops(device: torch.device | str, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """The peak FLOP/s of all ranks together (collective when torch.distributed is
    initialised: every rank measures or looks up its own, at the same time, and they are
    summed), with where the figures come from."""

    if not (dist.is_available() and dist.is_initialized()):
        return device_peak_flops(device, dtype)
    dist.barrier()  # measure together: ranks that share cores see their share
    peak, source = device_peak_flops(device, dtype)
    t = torch.tensor([peak], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    return float(t.item()), source


@dataclass(frozen=True)
class Throughput:
    tokens_per_s_per_rank: float
    mfu: float                # model FLOPs / (step time × summed peak of the ranks)
    step_s: float

    def __str__(self) -> str:
        return (f"{self.tokens_per_s_per_rank:,.0f} tokens/s per rank, MFU {100 * self.mfu:.2f}% "
                f"({self.step_s * 1e3:.1f} ms/step)")


def throughput(flops: ModelFlops, step_s: float, world_size: int, peak_flops: float) -> Throughput:
    """Tokens/s per rank and MFU of a step of ``step_s`` seconds over ``world_size`` ranks
    that together train on the global batch ``flops`` was counted for; ``peak_flops`` is
    the ranks' summed peak (``summed_peak_flops``)."""
    return Throughput(tokens_per_s_per_rank=flops.tokens / step_s / world_size,
                      mfu=flops.per_step / (step_s * peak_flops), step_s=step_s)
