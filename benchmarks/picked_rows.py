"""What the padded regions of rows the data picks (passes/data_sized.py and
passes/rules/picked.py) cost and save, on a mixture of experts looped over as transformers
4.x's Mixtral wrote it (``torch.where`` of the expert mask, ``index_add_`` back).

    python benchmarks/picked_rows.py [--mesh x1y1z2d2] [--hidden 256] [--experts 8] [--steps 5]

Compiled on one process under torch's fake process group (collectives are not executed,
so the time is a rank's compute alone; the bytes are the comm report's), with each rank
picking its own rows and with the picks gathered over the batch axes (every rank picks,
and computes, the whole batch's rows), beside the model itself on one device with no
padding (each expert computes exactly its rows) on the global batch. Prints the bytes of a
step, each rank's forward + backward time, and the rows an expert computes on a rank.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoopedMoE(nn.Module):
    def __init__(self, hidden: int, experts: int, vocab: int = 512) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))
            for _ in range(experts))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        b, t, d = h.shape
        x = h.view(-1, d)
        w, e = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(e, len(self.experts)).permute(2, 1, 0)
        for i, expert in enumerate(self.experts):
            slot, tok = torch.where(mask[i])
            out.index_add_(0, tok, expert(x[None, tok].reshape(-1, d)) * w[tok, slot, None])
        return F.cross_entropy(self.head(h + out.view(b, t, d)).flatten(0, 1), tgt.flatten())


def _step_time(fn, steps: int) -> float:
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="x1y1z2d2")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import shardc
    import shardc.passes.lower as lower

    torch.manual_seed(0)
    model = LoopedMoE(args.hidden, args.experts)
    ids = torch.randint(0, 512, (args.batch, args.seq))
    batch = (ids, ids)
    one = _step_time(lambda: model(*batch).backward(), args.steps)
    print(f"one device, unpadded: {one * 1e3:8.1f} ms a step (global batch {args.batch}x{args.seq})")
    mesh = shardc.Mesh.parse(args.mesh)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=mesh.world_size)
    picked = lower.picked_rules
    for own in (True, False):
        lower.picked_rules = picked if own else (lambda graph: {})  # type: ignore[assignment]
        try:
            sm = shardc.compile(model, mesh, example_inputs=batch)
        finally:
            lower.picked_rules = picked
        rep = shardc.comm_report(sm)
        local = tuple(shardc.shard_batch(t, sm.mesh) for t in batch)
        t = _step_time(lambda: sm(*local).backward(), args.steps)
        bound = args.batch * args.seq * 2
        rows = bound // mesh.size("data") // mesh.size("z") if own else bound
        print(f"{args.mesh} {'own rows' if own else 'gathered'}: {rep.total_bytes():>10,} bytes a step, "
              f"{t * 1e3:8.1f} ms a rank's forward+backward, {rows} rows an expert computes on a rank")


if __name__ == "__main__":
    main()
