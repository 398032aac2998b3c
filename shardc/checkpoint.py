"""Sharded checkpoints: every rank writes its own shards, any mesh reads them back.

``save(sm, optimizer, path, step=...)`` and ``load(sm, optimizer, path) -> step`` are
collective. The files are a ``torch.distributed.checkpoint`` (DCP) checkpoint of::

    {"model":     {name: tensor, ...},            # the names of model.state_dict()
     "optimizer": {"state": {param name: {"exp_avg": ..., "step": ...}},
                   "param_groups": [{"lr": ..., ..., "params": [param names]}]}}

so ``dcp_to_torch_save`` turns one into the single-device state dict.

How a shard is described. A parameter's layout may cut one dim over several axes and
read a dim as ``(k, size/k)`` (``Layout.interleave``: a fused QKV projection), so one
rank's piece of the global tensor is the product, over dims, of one or ``k`` disjoint
intervals. ``_Pieces`` lists those blocks as DCP chunks (global offsets and sizes) with
the matching view of the local tensor, and answers DCP's checkpointable protocol
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``). DCP's
own resharding (``create_read_items_for_chunk_list``) then intersects what a rank needs
with what was written, whatever the two meshes. The planners below call the protocol
themselves: DCP's default load planner replaces any state-dict leaf that is not a tensor
with ``None`` before planning (``_init_state_dict``, torch 2.6 to 2.13), and on save
they keep working where ``_create_write_items`` does not dispatch on the protocol.

Who writes what. A block held by several ranks (the axes a layout does not shard hold
copies) is written by one of them, chosen per tensor so that the writes spread over the
copies; plain replicated values (buffers, AdamW's ``step``, hyper-parameters) are
written by every rank's plan and deduplicated by DCP's ``dedup_save_plans``.

Directory layout (``path`` is a directory of checkpoints)::

    path/latest               "step_00000012": the current checkpoint, replaced atomically
    path/step_00000008/       an older complete checkpoint (keep=2 keeps two)
    path/step_00000012/       .metadata, __<rank>_<i>.distcp (DCP), shardc.json (manifest)
    path/.tmp-step_00000016/  a save in progress or one that crashed: never read

A save writes into ``.tmp-step_N``; after every rank's data and DCP's ``.metadata`` are
on disk (fsynced) rank 0 writes ``shardc.json`` (the step, the mesh, the size and SHA-256
of every file), renames the directory to ``step_N`` and replaces ``latest``. A crash at
any point leaves ``latest`` naming the previous complete checkpoint.

Loading never unpickles an arbitrary object: the manifest is JSON; DCP's ``.metadata``
is a pickle that DCP reads with ``pickle.load`` (anything in it would run), so it is read
here with an unpickler that accepts only DCP's metadata classes, torch's dtypes, sizes
and layouts and paths; tensors are read by DCP with ``torch.load(weights_only=True)``
and the few non-tensor values (hyper-parameters) by this planner with
``weights_only=True`` (DCP's default planner uses ``weights_only=False`` there).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import os
import pickle
import shutil
import time
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from shardc.core.errors import ShardcError
from shardc.core.mesh import CUT_AXES, Mesh
from shardc.core.placement import Block, Layout, blocks
from shardc.runtime.groups import default_device

__all__ = ["save", "load", "latest", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = "shardc-checkpoint/1"
MANIFEST = "shardc.json"
LATEST = "latest"
_STEP_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"

def _replica_index(layout: Layout, coords: dict[str, int], mesh: Mesh) -> tuple[int, int]:
    """(this rank's index among the ranks holding the same blocks, how many hold them)."""
    sharded = set(layout.sharded_axes())
    idx, n = 0, 1
    for a in CUT_AXES:
        if a not in sharded and mesh.size(a) > 1:
            idx = idx * mesh.size(a) + coords[a]
            n *= mesh.size(a)
    return idx, n


class _Pieces:
    """This rank's blocks of one global tensor, for DCP (see the module docstring)."""

    def __init__(self, local: torch.Tensor, global_shape: Iterable[int], blks: list[Block],
                 write: bool) -> None:
        self.local = local
        self.global_shape = torch.Size(list(global_shape))
        self.write = write
        self._views: dict[tuple[int, ...], torch.Tensor] = {}
        self._chunks: list[ChunkStorageMetadata] = []
        for goff, sizes, loff in blks:
            v = local
            for d, (o, s) in enumerate(zip(loff, sizes)):
                v = v.narrow(d, o, s)
            self._views[goff] = v
            self._chunks.append(ChunkStorageMetadata(offsets=torch.Size(goff), sizes=torch.Size(sizes)))

    def size(self) -> torch.Size:
        return self.global_shape

    # DCP's checkpointable protocol
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if not self.write:
            return []
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props, size=self.global_shape))
                for c in self._chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return list(self._chunks)

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset is not None, index
        return self._views[tuple(index.offset)]


# -------------------------------------------------------------------------------- planners
class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner (flattening, dedup of plain values) plus ``_Pieces``."""

    def create_local_plan(self) -> SavePlan:
        full = self.state_dict
        self.state_dict = {k: v for k, v in full.items() if not isinstance(v, _Pieces)}
        try:
            plan = super().create_local_plan()
        finally:
            self.state_dict = full
        extra = [wi for k, v in full.items() if isinstance(v, _Pieces)
                 for wi in v.__create_write_items__(k, v)]
        plan = dataclasses.replace(plan, items=list(plan.items) + extra)
        self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        obj = self.state_dict.get(write_item.index.fqn)
        if isinstance(obj, _Pieces):
            # a block of the local tensor is a strided view: torch.save would write the
            # whole storage behind it
            return obj.__get_tensor_shard__(write_item.index).detach().clone()
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
    """Reads a flat {DCP key: _Pieces | tensor | None (bytes)} dict in place. Keys were
    checked against the metadata before (``_check_model``)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.values: dict[str, Any] = {}

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False, *args: Any, **kwargs: Any) -> None:
        # not the default's: its _init_state_dict turns every _Pieces into None
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            if isinstance(md, BytesStorageMetadata):
                z = torch.Size((0,))
                items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn),
                                      dest_offsets=z, storage_index=MetadataIndex(fqn),
                                      storage_offsets=z, lengths=z))
            elif isinstance(obj, _Pieces):
                items += create_read_items_for_chunk_list(fqn, md, obj.__create_chunk_list__())
            else:
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * obj.dim()), sizes=obj.size())
                items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ShardcError(
                f"shardc.checkpoint.load: the value {read_item.dest_index.fqn!r} holds an object "
                f"that is not plain data ({e}); it was not unpickled. Checkpoints from "
                "shardc.checkpoint.save hold only tensors, numbers, strings and lists.") from None

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        obj = self.state_dict[read_item.dest_index.fqn]
        t = obj.__get_tensor_shard__(read_item.dest_index) if isinstance(obj, _Pieces) else obj
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t


# ----------------------------------------------------------------------- safe metadata
def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch", "strided"), ("torch", "sparse_coo"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata records: any other global (``os.system``,
    ``builtins.eval``, a class with side effects in ``__setstate__``) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or _is_dtype(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def read_metadata(ckpt_dir: str) -> Metadata:
    """DCP's ``.metadata`` of one checkpoint directory, unpickled with an allowlist."""
    path = os.path.join(ckpt_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise ShardcError(
            f"shardc.checkpoint.load: {ckpt_dir} has no .metadata: it is not a DCP checkpoint "
            "or its save did not finish. Load the previous one (path/latest names it).") from None
    except Exception as e:  # noqa: BLE001 - any decoding failure means a damaged file
        raise ShardcError(
            f"shardc.checkpoint.load: {path} is damaged or not DCP metadata ({type(e).__name__}: "
            f"{e}); nothing was executed. Load the previous checkpoint (keep=2 keeps one), "
            "or re-copy this one.") from None
    if not isinstance(md, Metadata):
        raise ShardcError(f"shardc.checkpoint.load: {path} does not hold DCP Metadata "
                          f"(got {type(md).__name__}).")
    return md


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(str(self.path))
        # what FileSystemReader.read_metadata adds after unpickling (torch >= 2.4)
        if hasattr(self, "load_id") and hasattr(md, "storage_meta"):
            if md.storage_meta is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
        return md


# ------------------------------------------------------------------------- state dicts
def _names(sm: Any) -> dict[int, str]:
    return {id(p): n for n, p in sm.named_parameters()}


def _writer_plan(sm: Any) -> dict[str, tuple[list[Block], int, int]]:
    """Per parameter: this rank's blocks, its replica index and the number of replicas."""
    coords = sm.mesh.coords(sm.ctx.rank)
    out = {}
    for name, layout in sm.param_layouts.items():
        r, nrep = _replica_index(layout, coords, sm.mesh)
        out[name] = (blocks(layout, sm._global_shapes[name], coords, sm.mesh), r, nrep)
    return out


def _model_items(sm: Any) -> list[tuple[str, str | None]]:
    """(state-dict key, canonical parameter name or None for a buffer) in model order.
    Parameters the program never reads hold no shard and are left out."""
    out: list[tuple[str, str | None]] = []
    for key in sm._state_keys:
        if key in sm._canonical:
            if sm._canonical[key] in sm.param_layouts:
                out.append((key, sm._canonical[key]))
        else:
            out.append((key, None))
    return out


def _stage_of(sm: Any) -> tuple[Any, Any]:
    """(the compiled program, the pipeline or None): a pipeline rank saves and loads its
    stage's program (its chunks' under the interleaved schedule, as one), whose keys are
    the model's it holds (shardc/program/pipeline.py)."""
    return (sm.held(), sm) if hasattr(sm, "stages") else (sm, None)


def _save_state(sm: Any, pipeline: Any, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    plan = _writer_plan(sm)
    counter = itertools.count()

    def pieces(name: str, local: torch.Tensor) -> _Pieces:
        blks, r, nrep = plan[name]
        # the k-th sharded tensor is written by replica k mod nrep: writes spread over copies
        return _Pieces(local, sm._global_shapes[name], blks, write=next(counter) % nrep == r)

    model: dict[str, Any] = {}
    written: dict[str, _Pieces] = {}
    for key, name in _model_items(sm):
        if name is None:
            model[key] = sm._buffers_full[key].detach()
        else:
            if name not in written:
                written[name] = pieces(name, sm.get_parameter(name).detach())
            model[key] = written[name]  # a tied alias is written under both names
    state: dict[str, Any] = {"model": model}
    if optimizer is None:
        return state
    names = _names(sm)
    if any(id(p) not in names for g in optimizer.param_groups for p in g["params"]):
        raise ShardcError(
            "shardc.checkpoint.save: the optimizer holds a tensor that is not a parameter of "
            "this ShardedModule. Build the optimizer over sm.parameters().")
    opt_state: dict[str, dict[str, Any]] = {}
    # in the module's order, the same on every rank: it decides which replica writes
    for name, p in sm.named_parameters():
        st = optimizer.state.get(p)
        if not st:
            continue
        entry: dict[str, Any] = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                if v.shape != p.shape:
                    raise ShardcError(
                        f"shardc.checkpoint.save: optimizer state {k!r} of {name!r} has shape "
                        f"{list(v.shape)}, neither the parameter shard's {list(p.shape)} nor a "
                        "scalar, so it cannot be resharded. Only element-wise optimizer state "
                        "(Adam, AdamW, SGD momentum, ...) is supported.")
                entry[k] = pieces(name, v.detach())
            else:
                entry[k] = v.detach() if isinstance(v, torch.Tensor) else v
        opt_state[name] = entry
    groups = []
    for g in optimizer.param_groups:
        h = {k: v for k, v in g.items() if k != "params"}
        h["params"] = [names[id(p)] for p in g["params"]]
        if pipeline is not None:  # the group over every stage: what one device's holds
            h["params"] = pipeline.group_names(h["params"])
        groups.append(h)
    state["optimizer"] = {"state": opt_state, "param_groups": groups}
    return state


# --------------------------------------------------------------------------- collectives
def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(ok: bool, what: str, detail: str = "") -> None:
    """Raise on every rank when any rank failed ``what``: a rank that raised alone would
    leave the others waiting in the next collective."""
    if _world()[1] > 1:
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=default_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        ok = ok and int(flag.item()) == 0
    if not ok:
        where = f" on this rank: {detail}" if detail else " on another rank (see its error)"
        raise RuntimeError(f"shardc.checkpoint: {what} failed{where}.")


def _failure(e: BaseException) -> str:
    """One line per failed rank of DCP's CheckpointException (its str is every traceback)."""
    fails = getattr(e, "failures", None)
    if not isinstance(fails, dict) or not fails:
        return f"{type(e).__name__}: {e}"
    out = []
    for r, w in sorted(fails.items()):
        # (exception, stack) in torch 2.13, a _WrappedException(exc, ...) in some versions
        exc = w[0] if isinstance(w, tuple) and w else getattr(w, "exc", w)
        out.append(f"rank {r}: {type(exc).__name__}: {exc}")
    return "; ".join(out)


def _gather_objects(obj: Any) -> list[Any]:
    if _world()[1] == 1:
        return [obj]
    out: list[Any] = [None] * _world()[1]
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------- files
def _step_dir(step: int) -> str:
    return f"{_STEP_PREFIX}{step:08d}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _data_files(d: str) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".distcp") or f == ".metadata")


def _read_manifest(ckpt_dir: str) -> dict[str, Any]:
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path) as f:
            man = json.load(f)
    except FileNotFoundError:
        raise ShardcError(
            f"shardc.checkpoint.load: {ckpt_dir} has no {MANIFEST}: its save did not finish, or it "
            "was not written by shardc.checkpoint.save. Load the previous checkpoint (path/latest "
            "names the last complete one), or pass verify=False to read a plain DCP checkpoint."
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ShardcError(f"shardc.checkpoint.load: {path} is damaged ({e}). Load the previous "
                          "checkpoint (keep=2 keeps one).") from None
    if not isinstance(man, dict) or man.get("format") != CHECKPOINT_FORMAT:
        raise ShardcError(f"shardc.checkpoint.load: {path} is not a {CHECKPOINT_FORMAT} manifest "
                          f"(format {man.get('format') if isinstance(man, dict) else None!r}).")
    return man


def _complete(path: str) -> list[tuple[float, str]]:
    """(save time, directory name) of every published checkpoint under ``path``."""
    out: list[tuple[float, str]] = []
    if not os.path.isdir(path):
        return out
    for d in os.listdir(path):
        if not d.startswith(_STEP_PREFIX):
            continue
        try:
            with open(os.path.join(path, d, MANIFEST)) as f:
                out.append((float(json.load(f)["saved_at"]), d))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out)


def latest(path: str | os.PathLike) -> str | None:
    """The directory of the current checkpoint under ``path`` (what ``load(path)``
    reads), or None when there is none. ``path`` may also be one checkpoint's directory."""
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    ptr = os.path.join(path, LATEST)
    if os.path.exists(ptr):
        with open(ptr) as f:
            name = f.read().strip()
        if name.startswith(_STEP_PREFIX) and os.sep not in name and \
                os.path.exists(os.path.join(path, name, MANIFEST)):
            return os.path.join(path, name)
    # no pointer, or it names a directory that is gone: the newest published one
    done = _complete(path)
    return os.path.join(path, done[-1][1]) if done else None


# ------------------------------------------------------------------------------ save
def save(sm: Any, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *,
         step: int, keep: int | None = 2) -> str:
    """Write ``sm``'s parameters and buffers and ``optimizer``'s state (may be None) as
    checkpoint ``step`` under the directory ``path`` (collective; each rank writes its
    own shards, nothing is gathered). Atomic: ``path/latest`` names the new checkpoint
    only once it is complete. ``keep`` newest checkpoints are kept (None: all). Returns
    the checkpoint's directory."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ShardcError(f"shardc.checkpoint.save: step must be a non-negative int, got {step!r}.")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ShardcError(f"shardc.checkpoint.save: keep must be a positive int or None, got {keep!r}.")
    root = os.path.abspath(os.fspath(path))
    name = _step_dir(step)
    tmp = os.path.join(root, _TMP_PREFIX + name)
    rank, world = _world()
    state = _save_state(*_stage_of(sm), optimizer)

    err = ""
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            for d in os.listdir(root):  # leftovers of saves that crashed
                if d.startswith(_TMP_PREFIX):
                    shutil.rmtree(os.path.join(root, d), ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
    _agree(not err, f"save: preparing {tmp}", err)

    try:
        dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True),
                 planner=_SavePlanner())
    except BaseException as e:  # DCP raises CheckpointException (a BaseException) on every rank
        if isinstance(e, KeyboardInterrupt):
            raise
        raise RuntimeError(
            f"shardc.checkpoint.save: writing step {step} into {tmp} failed ({_failure(e)}). "
            f"The previous checkpoint ({latest(root)}) is untouched; the next save removes "
            "the partial directory.") from e

    # every rank hashes a share of the files (DCP's .metadata is on disk once save returns)
    files = _data_files(tmp)
    mine: dict[str, Any] = {}
    try:
        for i, f in enumerate(files):
            if i % world == rank:
                mine[f] = (os.path.getsize(os.path.join(tmp, f)), _sha256(os.path.join(tmp, f)))
    except OSError as e:  # carried to every rank by the gather, not raised alone
        mine = {"": f"rank {rank}: {type(e).__name__}: {e}"}
    sums: dict[str, Any] = {}
    for part in _gather_objects(mine):
        sums.update(part)
    final = os.path.join(root, name)
    err = sums.get("", "")
    if err:
        raise RuntimeError(f"shardc.checkpoint.save: hashing the files of step {step} in {tmp} "
                           f"failed ({err}). The previous checkpoint ({latest(root)}) is untouched.")
    if rank == 0:
        try:
            _publish(root, tmp, final, name, {
                "format": CHECKPOINT_FORMAT, "step": step, "saved_at": time.time(),
                "mesh": str(sm.mesh), "world_size": world, "torch": torch.__version__,
                "files": {f: {"bytes": b, "sha256": h} for f, (b, h) in sorted(sums.items())}},
                keep)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            err = f"{type(e).__name__}: {e}"
    _agree(not err, f"save: publishing step {step} as {final}", err)
    return final


def _publish(root: str, tmp: str, final: str, name: str, manifest: dict[str, Any],
             keep: int | None) -> None:
    """Rank 0, after every rank's files are on disk: manifest, rename, pointer, pruning."""
    _write_atomic(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    old = None
    if os.path.exists(final):  # the same step saved again: swap, then drop the old one
        old = os.path.join(root, _TMP_PREFIX + "old-" + name)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_atomic(os.path.join(root, LATEST), name + "\n")
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep is not None:
        for _, d in _complete(root)[:-keep]:
            if d != name:
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)


# ------------------------------------------------------------------------------ load
_CODES = {1: "is missing or unreadable", 2: "has the wrong size (truncated or overwritten)",
          3: "does not match its SHA-256 (corrupted)"}


def _verify(ckpt_dir: str, man: dict[str, Any]) -> None:
    """Sizes on every rank (cheap); SHA-256 of a share of the files per rank; one
    all-reduce so that every rank names the same damaged files."""
    rank, world = _world()
    files = sorted(man.get("files", {}))
    if ".metadata" not in files:
        raise ShardcError(f"shardc.checkpoint.load: {ckpt_dir}/{MANIFEST} lists no .metadata.")
    codes = torch.zeros(len(files), dtype=torch.int64)
    for i, f in enumerate(files):
        p = os.path.join(ckpt_dir, f)
        want = man["files"][f]
        try:
            if os.path.getsize(p) != want["bytes"]:
                codes[i] = 2
            elif i % world == rank and _sha256(p) != want["sha256"]:
                codes[i] = 3
        except OSError:  # gone or unreadable: reported with the others, on every rank
            codes[i] = 1
    if world > 1:
        c = codes.to(default_device())
        dist.all_reduce(c, op=dist.ReduceOp.MAX)
        codes = c.cpu()
    bad = [(f, int(c)) for f, c in zip(files, codes.tolist()) if c]
    if bad:
        desc = "; ".join(f"{f} {_CODES[c]}" + (f" ({os.path.getsize(os.path.join(ckpt_dir, f))} bytes,"
                                               f" {man['files'][f]['bytes']} written)" if c == 2 else "")
                         for f, c in bad[:5])
        raise ShardcError(
            f"shardc.checkpoint.load: checkpoint {ckpt_dir} (step {man.get('step')}) is damaged: "
            f"{desc}{' ...' if len(bad) > 5 else ''}. Load the previous checkpoint (keep=2 keeps "
            "one: pass its step_* directory), or restore these files from a copy.")


def _paths(md: Metadata) -> dict[tuple[Any, ...], str]:
    """Path in the nested state dict (("model", name), ("optimizer", "state", name, k),
    ...) -> DCP key, from the flattening mappings DCP stores with the metadata."""
    pd = md.planner_data
    if not isinstance(pd, dict):
        return {(k,): k for k in md.state_dict_metadata}
    return {tuple(v): k for k, v in pd.items()}


def _describe(keys: list[str], n: int = 6) -> str:
    return ", ".join(repr(k) for k in keys[:n]) + (f" ... ({len(keys)} in all)" if len(keys) > n else "")


def _check_model(sm: Any, md: Metadata, paths: dict[tuple[Any, ...], str], where: str,
                 whole: set[str] | None = None) -> None:
    """Every model tensor is in the checkpoint with the model's shape, fully covered;
    nothing else is (``whole``: a pipeline stage, which holds some of the model: the
    checkpoint may hold the rest of ``whole``, the whole model's keys, and nothing else)."""
    want = {key: (list(sm._global_shapes[name]) if name else list(sm._buffers_full[key].shape))
            for key, name in _model_items(sm)}
    have = {p[1]: k for p, k in paths.items() if len(p) == 2 and p[0] == "model"}
    missing = [k for k in want if k not in have]
    unexpected = [k for k in have if k not in (want if whole is None else whole)]
    wrong = []
    for key, shape in want.items():
        if key in have:
            m = md.state_dict_metadata[have[key]]
            if not isinstance(m, TensorStorageMetadata):
                wrong.append(f"{key!r} is not a tensor in the checkpoint")
            elif list(m.size) != shape:
                wrong.append(f"{key!r} is {list(m.size)} in the checkpoint, {shape} in the model")
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_describe(missing)}")
        if unexpected:
            parts.append(f"in the checkpoint but not in this model: {_describe(unexpected)}")
        if wrong:
            parts.append("shapes differ: " + "; ".join(wrong[:4]) + (" ..." if len(wrong) > 4 else ""))
        raise ShardcError(
            f"shardc.checkpoint.load: checkpoint {where} does not match this model ("
            + "; ".join(parts) + "). Load it into the model it was saved from (same "
            "architecture, sizes and names); a checkpoint is not tied to a mesh.")
    for key in want:
        _check_covered(md, have[key], key, where)


def _check_covered(md: Metadata, fqn: str, name: str, where: str) -> None:
    m = md.state_dict_metadata[fqn]
    if not isinstance(m, TensorStorageMetadata):
        return
    total = 1
    for n in m.size:
        total *= n
    got = 0
    for c in m.chunks:
        v = 1
        for n in c.sizes:
            v *= n
        got += v
    if got != total:
        raise ShardcError(
            f"shardc.checkpoint.load: checkpoint {where} holds only {got} of the {total} elements "
            f"of {name!r}: a rank's shards are missing from its metadata (a save that did not "
            "finish?). Load the previous checkpoint (keep=2 keeps one).")


def _model_dest(sm: Any, paths: dict[tuple[Any, ...], str]) -> dict[str, Any]:
    coords = sm.mesh.coords(sm.ctx.rank)
    out: dict[str, Any] = {}
    seen: set[str] = set()
    for key, name in _model_items(sm):
        fqn = paths[("model", key)]
        if name is None:
            out[fqn] = sm._buffers_full[key]
        elif name not in seen:  # a tied alias holds the same tensor: read it once
            seen.add(name)
            layout = sm.param_layouts[name]
            out[fqn] = _Pieces(sm.get_parameter(name).detach(), sm._global_shapes[name],
                               blocks(layout, sm._global_shapes[name], coords, sm.mesh), write=False)
    return out


def _optimizer_dest(sm: Any, optimizer: torch.optim.Optimizer, md: Metadata,
                    paths: dict[tuple[Any, ...], str], where: str, whole: set[str] | None = None
                    ) -> tuple[dict[str, Any], dict[tuple[str, str], str], dict[tuple[int, str], str]]:
    coords = sm.mesh.coords(sm.ctx.rank)
    saved_groups = sorted({p[2] for p in paths if len(p) == 4 and p[:2] == ("optimizer", "param_groups")})
    if not saved_groups:
        raise ShardcError(
            f"shardc.checkpoint.load: checkpoint {where} holds no optimizer state (it was saved "
            "with optimizer=None). Pass optimizer=None to load only the model.")
    if len(saved_groups) != len(optimizer.param_groups):
        raise ShardcError(
            f"shardc.checkpoint.load: checkpoint {where} has {len(saved_groups)} optimizer param "
            f"groups, this optimizer {len(optimizer.param_groups)}. Build the optimizer with the "
            "same groups as the run that saved it.")
    dest: dict[str, Any] = {}
    state_keys: dict[tuple[str, str], str] = {}
    group_keys: dict[tuple[int, str], str] = {}
    for p_, fqn in paths.items():
        if len(p_) == 4 and p_[:2] == ("optimizer", "state"):
            name, k = p_[2], p_[3]
            if name not in sm.param_layouts and whole is not None and name in whole:
                continue  # another pipeline stage's parameter
            if name not in sm.param_layouts:
                raise ShardcError(
                    f"shardc.checkpoint.load: checkpoint {where} has optimizer state for "
                    f"{name!r}, which this model does not have. Load it into the model it was "
                    "saved from.")
            m = md.state_dict_metadata[fqn]
            if isinstance(m, TensorStorageMetadata):
                if len(m.size) == 0:
                    dest[fqn] = torch.empty((), dtype=m.properties.dtype)
                elif list(m.size) == list(sm._global_shapes[name]):
                    _check_covered(md, fqn, f"{name}.{k}", where)
                    layout = sm.param_layouts[name]
                    local = torch.empty(layout.local_shape(m.size, sm.mesh), dtype=m.properties.dtype,
                                        device=sm.get_parameter(name).device)
                    dest[fqn] = _Pieces(local, m.size, blocks(layout, m.size, coords, sm.mesh), write=False)
                else:
                    raise ShardcError(
                        f"shardc.checkpoint.load: optimizer state {k!r} of {name!r} is "
                        f"{list(m.size)} in checkpoint {where}, the parameter "
                        f"{list(sm._global_shapes[name])}. Load it into the model it was saved from.")
            else:
                dest[fqn] = None
            state_keys[(name, k)] = fqn
        elif len(p_) == 4 and p_[:2] == ("optimizer", "param_groups"):
            i, k = int(p_[2]), p_[3]
            m = md.state_dict_metadata[fqn]
            dest[fqn] = torch.empty(m.size, dtype=m.properties.dtype) \
                if isinstance(m, TensorStorageMetadata) else None
            group_keys[(i, k)] = fqn
    for i in range(len(optimizer.param_groups)):
        if (i, "params") not in group_keys:
            raise ShardcError(f"shardc.checkpoint.load: checkpoint {where} is missing the "
                              f"parameter list of optimizer param group {i}.")
    return dest, state_keys, group_keys


def load(sm: Any, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *,
         verify: bool = True) -> int:
    """Read a checkpoint written by ``save`` into ``sm`` and ``optimizer`` (may be None),
    on any mesh and world size: each rank reads only the blocks its layouts hold
    (collective). ``path`` is the directory given to ``save`` (its ``latest``
    checkpoint is read) or one ``step_*`` directory. ``verify`` checks every file's size
    and SHA-256 against the manifest first (each rank hashes a share). Returns the step."""
    root = os.fspath(path)
    ckpt = latest(root)
    if ckpt is None:
        raise ShardcError(
            f"shardc.checkpoint.load: no checkpoint in {root} (no .metadata, no 'latest' pointer, "
            "no complete step_* directory). Pass the directory given to shardc.checkpoint.save.")
    man: dict[str, Any] = {}
    if verify:
        man = _read_manifest(ckpt)
        _verify(ckpt, man)
    elif os.path.exists(os.path.join(ckpt, MANIFEST)):
        man = _read_manifest(ckpt)
    md = read_metadata(ckpt)
    where = f"{ckpt} (step {man.get('step', '?')}, saved on {man.get('mesh', 'an unknown mesh')})"
    paths = _paths(md)
    sm, pipeline = _stage_of(sm)
    whole = None if pipeline is None else set(pipeline.state_keys())
    _check_model(sm, md, paths, where, whole=whole)
    dest = _model_dest(sm, paths)
    if optimizer is None:
        _read(dest, ckpt, where)
        return int(man.get("step", 0))
    opt_dest, state_keys, group_keys = _optimizer_dest(sm, optimizer, md, paths, where,
                                                       whole=whole)
    # the groups' parameter lists first (a few strings): a mismatch is refused before
    # any parameter is overwritten
    lists = {group_keys[(i, "params")]: None for i in range(len(optimizer.param_groups))}
    _check_groups(sm, optimizer, _read(lists, ckpt, where), group_keys, where, partial=pipeline is not None)
    dest.update({k: v for k, v in opt_dest.items() if k not in lists})
    values = _read(dest, ckpt, where)
    _apply_optimizer(sm, optimizer, dest, values, state_keys, group_keys)
    return int(man.get("step", 0))


def _read(dest: dict[str, Any], ckpt: str, where: str) -> dict[str, Any]:
    """DCP load of ``dest`` in place (collective); returns the non-tensor values read."""
    planner = _LoadPlanner()
    try:
        with torch.no_grad():
            dcp.load(dest, storage_reader=_SafeReader(ckpt), planner=planner)
    except BaseException as e:  # DCP wraps every rank's failure in CheckpointException
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ShardcError(
            f"shardc.checkpoint.load: reading {where} failed ({_failure(e)}). If the "
            "files were damaged after the save, load the previous checkpoint.") from e
    return planner.values


def _check_groups(sm: Any, optimizer: torch.optim.Optimizer, values: dict[str, Any],
                  group_keys: dict[tuple[int, str], str], where: str, partial: bool = False) -> None:
    names = _names(sm)
    for i, g in enumerate(optimizer.param_groups):
        live = [names[id(p)] for p in g["params"]]
        saved = values[group_keys[(i, "params")]]
        if partial:  # a pipeline stage: its part of each group
            held = set(names.values())
            saved = [n for n in saved if n in held]
        if list(saved) != live:
            raise ShardcError(
                f"shardc.checkpoint.load: optimizer param group {i} holds {_describe(live, 3)} "
                f"here but {_describe(list(saved), 3)} in checkpoint {where}. Build the "
                "optimizer over the same parameters, in the same groups and order.")


def _apply_optimizer(sm: Any, optimizer: torch.optim.Optimizer, dest: dict[str, Any],
                     values: dict[str, Any], state_keys: dict[tuple[str, str], str],
                     group_keys: dict[tuple[int, str], str]) -> None:
    """Hand the loaded state to ``optimizer.load_state_dict`` (torch's own casting and
    checks), in its index-keyed format."""
    names = _names(sm)

    def value(fqn: str) -> Any:
        v = dest[fqn]
        if isinstance(v, _Pieces):
            return v.local
        return values[fqn] if v is None else v

    index: dict[str, int] = {}
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        h = {k: v for k, v in g.items() if k != "params"}
        for (j, k), fqn in group_keys.items():
            if j == i and k != "params":
                h[k] = value(fqn)
        h["params"] = []
        for p in g["params"]:
            index[names[id(p)]] = len(index)
            h["params"].append(index[names[id(p)]])
        groups.append(h)
    state: dict[int, dict[str, Any]] = {}
    for (name, k), fqn in state_keys.items():
        if name in index:
            state.setdefault(index[name], {})[k] = value(fqn)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
