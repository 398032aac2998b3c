"""shardc on a CUDA device: real models train on meshes of 8 ranks with every tensor on
the GPU, like the single-device model, by the same checks as ``test_train_gloo`` (each
step's gradients against a float64 copy, the losses, the weights after three AdamW steps,
the bytes moved equal to the comm report's).

One GPU cannot hold 8 NCCL ranks (NCCL refuses two ranks on one device), so the ranks
are the threads of torch's threaded process group (``rules_sweep.ThreadedWorld``), all on
the one GPU: what this checks is that the rank programs shardc writes run on CUDA (no
tensor made on the CPU by a rule, a collective's buffer or the step program, no host
sync that breaks), not NCCL itself, which ``benchmarks/gpu_single.py`` drives with a
world of one. Without a GPU the test is skipped: CI has none, and the gloo suite runs the
same cases on CPU processes. On a GPU machine:

    pytest tests/test_gpu.py
    python tests/test_gpu.py --device cpu      # the same cases on CPU threads
"""
from __future__ import annotations

import argparse
import sys

import pytest
import rules_sweep as S
import test_train_gloo as T
import torch

import shardc
from shardc.passes.trace import trace

pytestmark = pytest.mark.slow  # real models on 8 threaded ranks (skipped without a GPU)

# The models and meshes of the gloo suite that exercise every kind of collective the
# runtime issues: data parallel (d8: gradient buckets), ZeRO-3 over z (weight all-gathers,
# gradient reduce-scatters), tensor parallel over x with data (forward all-reduces,
# vocabulary-parallel embedding), and all four axes at once.
CASES = [(model, mesh) for model in ("gpt", "llama", "gpt2")
         for mesh in ("x1y1z1d8", "x1y1z8d1", "x4y1z1d2", "x2y2z2d1", "x2y1z2d2")]


def failures(device: str, cases: list[tuple[str, str]] = CASES) -> list[str]:
    out: list[str] = []
    world = S.ThreadedWorld(8)
    try:
        for name, spec in cases:
            # torch.export must not run in several threads at once: the main thread
            # builds the model and traces it; the ranks' compiles reuse that trace
            build, batches = T.model_and_batches(name, device)
            trace(build(), batches[0])
            got: dict[int, list[str]] = {}

            def job(rank: int, name: str = name, spec: str = spec) -> None:
                got[rank] = T._case_failures(name, shardc.Mesh.parse(spec), device=device)

            err = world.run(job, timeout=600)
            if err is not None:
                out.append(f"{name}@{spec} on {device}: {err}")
            out += sorted({line for lines in got.values() for line in lines})
            if world.broken:
                world = S.ThreadedWorld(8)
    finally:
        world.close()
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_models_train_on_cuda_like_one_device() -> None:
    bad = failures("cuda")
    assert not bad, "\n".join(bad)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("cases", nargs="*", help="MODEL@MESH (default: all of CASES)")
    a = ap.parse_args()
    chosen = [tuple(c.split("@")) for c in a.cases] or CASES
    bad = failures(a.device, chosen)  # type: ignore[arg-type]
    print("\n".join(bad) or f"{len(chosen)} cases pass on {a.device}")
    sys.exit(1 if bad else 0)
