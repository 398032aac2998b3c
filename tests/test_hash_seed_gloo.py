"""Ranks whose Python hash seeds differ, as separate interpreters launched by hand (a fork
server's ranks share its seed): transformers' Gemma 3 builds its attention masks by
iterating ``set(config.layer_types)``, whose order follows the hash seed, so the ranks
trace the same ops in different orders. shardc gives every rank rank 0's order
(``shardc.program.agreement.align``) and Gemma 3 trains like one device on x2y1z1d2: each of three
AdamW steps' gradients against float64, the weights after them, and the bytes moved
equal to the report's (``test_train_gloo._case_failures``). It once refused the model on
every mesh, naming a different path through forward.

The same ranks then train the tests' GPT on a pure data mesh: its step program is traced by
one rank and decoded by the three others (``shardc/program/share.py``), which needs each
rank's signature of the program to be the same bytes whatever the hash seed (the compile
context holds sets of parameter names).

``python tests/test_hash_seed_gloo.py RANK WORLD STORE`` is one rank.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 4
MESH = "x2y1z1d2"
LAYER_TYPES = ["sliding_attention", "full_attention"]


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from shardc.tools.models import HFCausalLM

    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=4,
                           max_position_embeddings=16, sliding_window=8, layer_types=LAYER_TYPES,
                           use_cache=False, tie_word_embeddings=False, attention_dropout=0.0)
    return HFCausalLM(Gemma3ForCausalLM(cfg))


def _set_order(seed: int) -> str:
    """The order a process started with this hash seed iterates the layer types in."""
    out = subprocess.run([sys.executable, "-c", f"print(list(set({LAYER_TYPES!r})))"],
                         env={**os.environ, "PYTHONHASHSEED": str(seed)}, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def _seeds() -> list[int]:
    """Hash seeds for the ranks, two of each set order (found, not assumed: the order a
    seed gives is the interpreter's)."""
    by_order: dict[str, list[int]] = {}
    for seed in range(64):
        by_order.setdefault(_set_order(seed), []).append(seed)
        if len(by_order) == 2 and all(len(v) >= 2 for v in by_order.values()):
            break
    a, b = by_order.values()
    return [a[0], b[0], a[1], b[1]]


def test_gemma3_trains_with_a_hash_seed_per_rank() -> None:
    seeds = _seeds()
    assert len({_set_order(s) for s in seeds}) == 2  # the ranks do trace in two orders
    with tempfile.TemporaryDirectory() as d:
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(r), str(WORLD),
                                   os.path.join(d, "store")],
                                  env={**os.environ, "PYTHONHASHSEED": str(seeds[r]),
                                       "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(WORLD)]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=600)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
    failed = [(r, o) for r, (p, o) in enumerate(zip(procs, outs)) if p.returncode != 0]
    assert not failed, "\n".join(f"rank {r}:\n{o[-4000:]}" for r, o in failed)
    assert all("trained like one device" in o for o in outs), outs[0][-2000:]
    shared = [o.split("shared: ")[1].split()[0] for o in outs]
    assert sorted(shared) == ["received", "received", "received", "traced"], shared


def _rank(rank: int, world: int, store: str) -> None:
    import torch
    import torch.distributed as dist

    import shardc

    sys.path.insert(0, HERE)
    import test_train_gloo as T

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        T.MODELS["gemma3"] = lambda: T._lm(gemma3)
        failures = T._case_failures("gemma3", shardc.Mesh.parse(MESH), allowed=lambda f: not f.gathered)
        if failures:
            raise AssertionError("\n".join(failures))
        print("trained like one device", flush=True)
        from models import GPT

        from shardc.program import share
        from shardc.tools.models import lm_batch

        torch.manual_seed(0)
        mesh = shardc.Mesh.parse("x1y1z1d4")
        batch = lm_batch(8, 16, 64)
        sm = shardc.compile(GPT(vocab=64, dim=32, layers=2, heads=4, seq=16), mesh, example_inputs=batch)
        before = dict(share.COUNTS)
        sm(*[shardc.shard_batch(x, mesh) for x in batch]).backward()
        how = [k for k in share.COUNTS if share.COUNTS[k] != before.get(k, 0)]
        print(f"shared: {','.join(how)}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
