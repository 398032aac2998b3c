"""Train on 2 gloo ranks with the torch names newer than shardc's floor removed.

Run as a script (``tests/test_torch_range.py`` does): the names are deleted from their
modules before anything imports shardc, here and in every spawned rank (spawn re-runs
this file's top level in each child before unpickling its job), so the project sees a
torch that lacks them, as the floor release does.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# shardc.core.compat by its path: importing it as shardc.core.compat would run shardc/__init__.py,
# which loads the runtime (and its choice of collective) before the names are gone
_spec = importlib.util.spec_from_file_location(
    "_shardc_compat", os.path.join(os.path.dirname(__file__), "..", "shardc", "core", "compat.py"))
assert _spec is not None and _spec.loader is not None
_compat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_compat)
NEWER_THAN_FLOOR: dict[str, str] = _compat.NEWER_THAN_FLOOR

assert "shardc.runtime.collectives" not in sys.modules, "hide the names before the runtime loads"
for qualified in NEWER_THAN_FLOOR:
    module, name = qualified.rsplit(".", 1)
    mod = importlib.import_module(module)
    if hasattr(mod, name):
        delattr(mod, name)


def check(rank: int, world_size: int) -> None:
    import copy

    import torch.distributed as dist

    import shardc
    from shardc.runtime import algorithms as A
    from shardc.runtime import collectives as C
    from shardc.tools.models import GPT, lm_batch

    for qualified in NEWER_THAN_FLOOR:
        module, name = qualified.rsplit(".", 1)
        assert not hasattr(importlib.import_module(module), name), qualified
    # the runtime took the fallback every release since 1.13 has
    assert C.all_gather_flat is dist.all_gather_into_tensor
    # (the runtime's reduce-scatter is its own on gloo, an all-to-all; torch's, the
    # fallback name, on every other backend)
    assert C.reduce_scatter_flat is A.reduce_scatter_flat
    assert A._native_reduce_scatter is dist.reduce_scatter_tensor
    torch.manual_seed(0)
    model = GPT()
    ref = copy.deepcopy(model)
    x, y = lm_batch(8, 16, 64)
    # z2 gathers every weight (all_gather_flat) and reduce-scatters its gradient
    # (reduce_scatter_flat); full_grads gathers again
    sm = shardc.compile(model, shardc.Mesh(z=2), example_inputs=(x, y))
    loss = sm(shardc.shard_batch(x, sm.mesh), shardc.shard_batch(y, sm.mesh))
    loss.backward()
    ref_loss = ref(x, y)
    ref_loss.backward()
    grads = sm.full_grads()
    # two summation orders of the same fp32 sums (shards, then the ring): ~1e-7 relative
    torch.testing.assert_close(shardc.global_mean(loss, sm.mesh), ref_loss, rtol=1e-5, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
    if rank == 0:
        print(f"trained without {', '.join(NEWER_THAN_FLOOR)}: loss {loss.item():.6f} == one "
              f"device {ref_loss.item():.6f}, {len(grads)} gradients equal")


if __name__ == "__main__":
    from harness import run_on_ranks

    # spawned: each rank re-runs this file's top level (the fork server would hand it a
    # shardc imported with the names present)
    run_on_ranks(check, 2, start_method="spawn")
