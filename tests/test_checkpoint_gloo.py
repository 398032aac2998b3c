"""Sharded checkpoints on real gloo processes: the project's GPT and transformers' GPT-2
(both with a fused QKV projection whose columns are sharded interleaved, and a tied LM
head) trained with AdamW, saved on x2y1z1d2 (4 ranks), and loaded

- into a fresh compile on the same mesh: the next steps' losses and the parameters are
  bitwise those of the uninterrupted run;
- into another mesh (GPT: x1y2z2d1; both: one rank): parameters and optimizer state are
  bitwise the saved ones (resharding only copies), and training goes on like the
  uninterrupted run within fp32 noise;

and GPT saved on x2y2z2d1 (8 ranks) loaded on x1y2z2d1 (4) and on one rank the same way.
Plus ``dcp_to_torch_save`` giving the single-device state dict, the safety cases (a save
that fails mid-write or before publishing leaves the previous checkpoint current,
``keep``, truncated, corrupted and incomplete checkpoints, another model's checkpoint),
each with the error every rank raises.

Ranks are spawned once per world size (8, then 4); the one-rank loads run in the test
process itself.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from models import GPT, gpt2
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.testing import assert_close

import shardc
import shardc.checkpoint as ckpt

pytestmark: list = []  # the test on ranks is slow and distributed

# Another mesh sums the same products in another order, so the loss and gradients differ
# from the saved run's continuation by fp32 rounding (~1e-7 relative). As in
# test_train_gloo.py: AdamW divides each gradient entry by its own magnitude, so entries
# that are zero in exact arithmetic (rounding noise of either sign) would take full
# lr-sized steps; eps=1e-6 keeps those below lr * 1e-5 while every real gradient here is
# still normalised, and lr=1e-3 keeps two steps within fp32's resolution of the weights.
# The state right after loading is compared bitwise: resharding moves values, it never
# computes them.
LR, EPS = 1e-3, 1e-6
RTOL = ATOL = 1e-5

MODELS = {"gpt": GPT, "gpt2": gpt2}
N, M = 2, 2  # steps before the save, steps after it


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
            for _ in range(n)]


def _fresh(model: torch.nn.Module, mesh: shardc.Mesh, batch: tuple) -> tuple[Any, torch.optim.Optimizer]:
    # compile never changes the model: compiling the same initial model again is a fresh
    # start whose values all come from the checkpoint
    sm = shardc.compile(model, mesh, example_inputs=batch)
    return sm, torch.optim.AdamW(sm.parameters(), lr=LR, eps=EPS)


def _train(sm: Any, opt: torch.optim.Optimizer, batches: list[tuple]) -> list[float]:
    losses = []
    for b in batches:
        loss = sm(*[shardc.shard_batch(t, sm.mesh) for t in b])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full_optimizer(sm: Any, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """name.key -> the full optimizer state tensor (gathered: test-only, collective)."""
    names = {id(p): n for n, p in sm.named_parameters()}
    out = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"{names[id(p)]}.{k}"] = sm._gather_full(names[id(p)], v) if v.dim() else v.clone()
    return out


def _interleaved(sm: Any) -> list[str]:
    return [n for n, lay in sm.param_layouts.items() if max(lay.interleave, default=1) > 1]


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k}"


# --------------------------------------------------------------------------- 8 ranks
def _eight(rank: int, world: int, root: str) -> None:
    """Train and save on x2y2z2d1 (AxoNN 4D); the 4-rank and one-rank runs load it."""
    batches = _batches(2)
    torch.manual_seed(0)
    sm, opt = _fresh(GPT(), shardc.Mesh.parse("x2y2z2d1"), batches[0])
    assert _interleaved(sm) == [f"blocks.{i}.qkv.{w}" for i in range(2) for w in ("weight", "bias")]
    _train(sm, opt, batches[:1])
    ckpt.save(sm, opt, f"{root}/gpt8", step=1)
    saved, saved_opt = sm.full_state_dict(), _full_optimizer(sm, opt)
    ref = _train(sm, opt, batches[1:])
    ref_final = sm.full_state_dict()
    if rank == 0:
        torch.save({"saved": saved, "saved_opt": saved_opt, "ref_losses": ref,
                    "ref_final": ref_final}, f"{root}/gpt8.pt")


# --------------------------------------------------------------------------- 4 ranks
def _four(rank: int, world: int, root: str) -> None:
    batches = _batches(N + M)
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = make()
        mesh = shardc.Mesh.parse("x2y1z1d2")
        sm, opt = _fresh(model, mesh, batches[0])
        assert len(_interleaved(sm)) == 4, name  # both fused QKV weights and biases
        ckpt.save(sm, opt, f"{root}/{name}-init", step=0)  # for dcp_to_torch_save
        _train(sm, opt, batches[:N])
        ckpt.save(sm, opt, f"{root}/{name}", step=N)
        saved, saved_opt = sm.full_state_dict(), _full_optimizer(sm, opt)
        ref_losses = _train(sm, opt, batches[N:])  # the uninterrupted run
        ref_final = sm.full_state_dict()
        if rank == 0:
            torch.save({"saved": saved, "saved_opt": saved_opt, "ref_losses": ref_losses,
                        "ref_final": ref_final}, f"{root}/{name}.pt")

        # same mesh: bitwise
        sm2, opt2 = _fresh(model, mesh, batches[0])
        assert ckpt.load(sm2, opt2, f"{root}/{name}") == N
        _assert_equal(sm2.full_state_dict(), saved, f"{name} same mesh, loaded")
        assert _train(sm2, opt2, batches[N:]) == ref_losses, name
        _assert_equal(sm2.full_state_dict(), ref_final, f"{name} same mesh, trained on")
        if name != "gpt":
            continue  # GPT-2 on another mesh: the one-rank part

        # another mesh: the fused QKV's interleaved blocks land on other ranks
        other = shardc.Mesh.parse("x1y2z2d1")
        sm3, opt3 = _fresh(model, other, batches[0])
        assert ckpt.load(sm3, opt3, f"{root}/{name}") == N
        _assert_equal(sm3.full_state_dict(), saved, f"{name} {other}, loaded")
        _assert_equal(_full_optimizer(sm3, opt3), saved_opt, f"{name} {other}, optimizer")
        assert_close(_train(sm3, opt3, batches[N:]), ref_losses, rtol=RTOL, atol=ATOL)
        final3 = sm3.full_state_dict()
        for k in ref_final:
            assert_close(final3[k], ref_final[k], rtol=RTOL, atol=ATOL, msg=f"{name} {other} {k}")

        # the 8-rank checkpoint into 4 ranks (another world size): QKV saved interleaved
        # over z and x nested, loaded plain (x1y2z2d1) and interleaved over x alone
        assert _interleaved(sm) and not _interleaved(sm3)
        ref8 = torch.load(f"{root}/gpt8.pt", weights_only=True)
        for s, o in ((sm3, opt3), (sm2, opt2)):
            assert ckpt.load(s, o, f"{root}/gpt8") == 1
            _assert_equal(s.full_state_dict(), ref8["saved"], f"x2y2z2d1 into {s.mesh}, loaded")
            _assert_equal(_full_optimizer(s, o), ref8["saved_opt"], f"x2y2z2d1 into {s.mesh}, optimizer")
            assert_close(_train(s, o, _batches(2)[1:]), ref8["ref_losses"], rtol=RTOL, atol=ATOL)

        _safety(rank, root, sm, opt, sm2, opt2)


def _safety(rank: int, root: str, sm: Any, opt: torch.optim.Optimizer, sm2: Any,
            opt2: torch.optim.Optimizer) -> None:
    d = f"{root}/safety"
    ckpt.save(sm, opt, d, step=1)
    good = sm.full_state_dict()
    _train(sm, opt, _batches(1))

    # a rank fails while writing its file (half of it written, then the disk is full)
    def failing_write(self: Any, plan: Any, planner: Any) -> Any:
        with open(os.path.join(str(self.path), f"__{rank}_0.distcp"), "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(28, "No space left on device (simulated)")

    msg = r"writing step 2 .* failed \(rank 1: OSError: .*No space left.*\)\. The previous checkpoint"
    if rank == 1:
        with mock.patch.object(ckpt.FileSystemWriter, "write_data", failing_write):
            with pytest.raises(RuntimeError, match=msg):
                ckpt.save(sm, opt, d, step=2)
    else:
        with pytest.raises(RuntimeError, match=msg):
            ckpt.save(sm, opt, d, step=2)
    assert ckpt.latest(d) == os.path.join(d, "step_00000001")
    assert os.path.isdir(os.path.join(d, ".tmp-step_00000002"))  # the partial save, ignored
    # every rank has looked before rank 0's next save clears the partial directory (a
    # slow rank otherwise asserts after it is gone, dies, and its peers see only
    # "Connection closed by peer")
    torch.distributed.barrier()

    # the job dies after every rank wrote, before rank 0 published
    def dying_publish(*args: Any, **kwargs: Any) -> None:
        raise OSError("killed (simulated)")

    with mock.patch.object(ckpt, "_publish", dying_publish):
        with pytest.raises(RuntimeError, match="publishing step 2"):
            ckpt.save(sm, opt, d, step=2)
    assert ckpt.latest(d) == os.path.join(d, "step_00000001")
    assert ckpt.load(sm2, opt2, d) == 1
    _assert_equal(sm2.full_state_dict(), good, "after failed saves, the previous checkpoint")

    # keep=2: the next saves publish, clean up the partial directory, keep the last two
    ckpt.save(sm, opt, d, step=2)
    ckpt.save(sm, opt, d, step=3)
    assert sorted(os.listdir(d)) == ["latest", "step_00000002", "step_00000003"]
    assert ckpt.latest(d) == os.path.join(d, "step_00000003")
    last = sm.full_state_dict()

    # damaged copies: every rank names the same file, whichever rank hashed it
    src = os.path.join(d, "step_00000003")
    files = sorted(f for f in os.listdir(src) if f.endswith(".distcp"))
    if rank == 0:
        shutil.copytree(src, f"{root}/truncated")
        with open(f"{root}/truncated/{files[2]}", "r+b") as f:
            f.truncate(os.path.getsize(f"{root}/truncated/{files[2]}") // 2)
        shutil.copytree(src, f"{root}/flipped")
        with open(f"{root}/flipped/{files[1]}", "r+b") as f:
            f.seek(os.path.getsize(f"{root}/flipped/{files[1]}") // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    with pytest.raises(shardc.ShardcError, match=rf"is damaged: {files[2]} has the wrong size"):
        ckpt.load(sm2, opt2, f"{root}/truncated")
    with pytest.raises(shardc.ShardcError, match=rf"is damaged: {files[1]} does not match its SHA-256"):
        ckpt.load(sm2, opt2, f"{root}/flipped")
    # the process group is still usable and the model untouched
    _assert_equal(sm2.full_state_dict(), good, "after refused loads")
    assert ckpt.load(sm2, opt2, d) == 3
    _assert_equal(sm2.full_state_dict(), last, "the last checkpoint")


# ---------------------------------------------------------------------- one rank
class _OneRank:
    def __enter__(self) -> "_OneRank":
        self.dir = tempfile.mkdtemp()
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{self.dir}/store", rank=0, world_size=1)
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.destroy_process_group()
        shutil.rmtree(self.dir, ignore_errors=True)


def _one_rank_resume(root: str, names: list[str], make: Any, steps: list[int],
                     batches: list[list]) -> None:
    """Each checkpoint of ``names`` into one compile on one rank, one after another: a
    load replaces every parameter and all optimizer state."""
    torch.manual_seed(0)
    sm, opt = _fresh(make(), shardc.Mesh(), batches[0][0])
    for name, step, bs in zip(names, steps, batches):
        ref = torch.load(f"{root}/{name}.pt", weights_only=True)
        assert ckpt.load(sm, opt, f"{root}/{name}") == step
        _assert_equal(sm.full_state_dict(), ref["saved"], f"{name} on one rank, loaded")
        _assert_equal(_full_optimizer(sm, opt), ref["saved_opt"], f"{name} on one rank, optimizer")
        assert_close(_train(sm, opt, bs), ref["ref_losses"], rtol=RTOL, atol=ATOL)
        final = sm.full_state_dict()
        for k in ref["ref_final"]:
            assert_close(final[k], ref["ref_final"][k], rtol=RTOL, atol=ATOL, msg=f"{name} one rank {k}")


def _dcp_to_torch(root: str, name: str, tmp: str) -> dict:
    out = os.path.join(tmp, f"{name}.torch")
    dcp_to_torch_save(ckpt.latest(f"{root}/{name}"), out)
    return torch.load(out, weights_only=True)


@pytest.mark.slow
@pytest.mark.distributed
def test_checkpoints_reshard_and_resume(ranks) -> None:
    with tempfile.TemporaryDirectory() as root:
        ranks.run(_eight, 8, root)
        ranks.run(_four, 4, root)
        batches = _batches(N + M)
        with _OneRank():
            _one_rank_resume(root, ["gpt", "gpt8"], GPT, [N, 1], [batches[N:], _batches(2)[1:]])
            _one_rank_resume(root, ["gpt2"], gpt2, [N], [batches[N:]])

        # DCP's own converter yields the single-device state dict: at step 0 the model's
        # initial state_dict() bitwise (tied names included), after training the
        # gathered one, and the optimizer's state under the parameters' names
        for name, make in MODELS.items():
            torch.manual_seed(0)
            model = make()
            init = _dcp_to_torch(root, f"{name}-init", root)
            _assert_equal(init["model"], model.state_dict(), f"{name} dcp_to_torch_save at step 0")
            trained = _dcp_to_torch(root, name, root)
            ref = torch.load(f"{root}/{name}.pt", weights_only=True)
            _assert_equal(trained["model"], ref["saved"], f"{name} dcp_to_torch_save")
            flat = {f"{p}.{k}": v for p, st in trained["optimizer"]["state"].items() for k, v in st.items()}
            _assert_equal(flat, ref["saved_opt"], f"{name} dcp_to_torch_save optimizer")
            groups = trained["optimizer"]["param_groups"]
            assert groups[0]["lr"] == LR and groups[0]["eps"] == EPS
            assert sorted(groups[0]["params"]) == sorted(n for n, _ in model.named_parameters())


def _copy_with_metadata(src: str, dst: str, edit: Any) -> None:
    """A copy of checkpoint ``src`` whose DCP metadata went through ``edit`` (manifest
    updated to match, so that only the metadata's content is wrong)."""
    import hashlib
    import json
    shutil.copytree(src, dst)
    md = ckpt.read_metadata(dst)
    edit(md)
    with open(f"{dst}/.metadata", "wb") as f:
        pickle.dump(md, f)
    man = json.load(open(f"{dst}/shardc.json"))
    raw = open(f"{dst}/.metadata", "rb").read()
    man["files"][".metadata"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    json.dump(man, open(f"{dst}/shardc.json", "w"))


def test_wrong_and_damaged_checkpoints_are_named() -> None:
    """One rank (the 4-rank test covers every rank agreeing): each refusal names what is
    wrong and what to do, and leaves the model as it was."""
    batches = _batches(1)
    with tempfile.TemporaryDirectory() as root, _OneRank():
        torch.manual_seed(0)
        sm, opt = _fresh(GPT(), shardc.Mesh(), batches[0])
        _train(sm, opt, batches)
        src = ckpt.save(sm, opt, f"{root}/gpt", step=1)
        before = sm.full_state_dict()

        def refused(model: torch.nn.Module, path: str, match: str, optimizer: bool = True,
                    **kw: Any) -> None:
            s, o = _fresh(model, shardc.Mesh(), batches[0])
            with pytest.raises(shardc.ShardcError, match=match):
                ckpt.load(s, o if optimizer else None, path, **kw)

        refused(GPT(dim=64, heads=8), src, r"does not match this model \(shapes differ: 'tok.weight' "
                r"is \[64, 32\] in the checkpoint, \[64, 64\] in the model")
        refused(GPT(layers=3), src, r"missing from the checkpoint: 'blocks.2.ln1.weight'")
        refused(GPT(layers=1), src, r"in the checkpoint but not in this model: 'blocks.1.ln1.weight'")
        refused(GPT(), f"{root}/nothing", r"no checkpoint in .*nothing")

        # a tensor whose chunks do not cover it (a rank's shards lost from the metadata)
        def drop_chunk(md: Any) -> None:
            md.state_dict_metadata["model.blocks.0.fc1.weight"].chunks.pop()
        _copy_with_metadata(src, f"{root}/holed", drop_chunk)
        refused(GPT(), f"{root}/holed", r"holds only 0 of the 4096 elements of 'blocks.0.fc1.weight'")

        # a save that never finished has no manifest
        shutil.copytree(src, f"{root}/unfinished")
        os.remove(f"{root}/unfinished/shardc.json")
        refused(GPT(), f"{root}/unfinished", r"has no shardc.json: its save did not finish")

        # garbage metadata, read without verification
        shutil.copytree(src, f"{root}/garbage")
        with open(f"{root}/garbage/.metadata", "wb") as f:
            f.write(b"\x80\x04this is not a pickle")
        refused(GPT(), f"{root}/garbage", r"garbage/.metadata is damaged or not DCP metadata",
                verify=False)

        # an optimizer built with other groups
        s, _ = _fresh(GPT(), shardc.Mesh(), batches[0])
        params = list(s.parameters())
        two = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:], "lr": 0.1}])
        with pytest.raises(shardc.ShardcError, match=r"has 1 optimizer param groups, this optimizer 2"):
            ckpt.load(s, two, src)
        # ... or the same parameters in another order: refused before any is overwritten
        fresh = s.full_state_dict()
        rev = torch.optim.AdamW(params[::-1])
        with pytest.raises(shardc.ShardcError, match=r"optimizer param group 0 holds 'ln_f.bias', .* here "
                           r"but 'tok.weight', .* in checkpoint .*same groups and order"):
            ckpt.load(s, rev, src)
        _assert_equal(s.full_state_dict(), fresh, "a refused optimizer leaves the model as it was")

        # a model-only checkpoint into an optimizer
        ckpt.save(sm, None, f"{root}/model-only", step=1)
        refused(GPT(), f"{root}/model-only", r"holds no optimizer state .*optimizer=None")
        s, _ = _fresh(GPT(), shardc.Mesh(), batches[0])
        assert ckpt.load(s, None, f"{root}/model-only") == 1
        _assert_equal(s.full_state_dict(), before, "model-only load")
        _assert_equal(sm.full_state_dict(), before, "refusals leave the source untouched")


class _Boom:
    """Unpickling this would create a file (stands for any code a pickle can run)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def test_metadata_is_unpickled_with_an_allowlist(tmp_path: Any) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    marker = tmp_path / "pwned"
    with open(d / ".metadata", "wb") as f:
        pickle.dump({"state_dict_metadata": _Boom(str(marker))}, f)
    with pytest.raises(shardc.ShardcError, match=r"refused global .*open.*nothing was executed"):
        ckpt.read_metadata(str(d))
    assert not marker.exists()
