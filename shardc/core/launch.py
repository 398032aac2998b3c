"""One process per GPU: which device a rank uses, and starting torch.distributed.

torchrun (and SLURM wrappers that mimic it) start one process per GPU and tell each its
``LOCAL_RANK``, its index among the processes of its node. Nothing makes a process use
that GPU: CUDA's current device is 0 until someone calls ``torch.cuda.set_device``, so
without it every rank of a node would put its tensors, and NCCL its communicator, on GPU
0 (NCCL then fails with "Duplicate GPU detected", or ranks silently share one GPU).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from shardc.core.errors import ShardcError


def local_rank() -> int | None:
    """This process's index on its node, from torchrun's ``LOCAL_RANK`` (or None)."""
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value is not None else None


def local_device() -> torch.device:
    """The device this rank should use: the ``LOCAL_RANK``-th visible GPU when there are
    GPUs, else the CPU. With one visible GPU per process (``CUDA_VISIBLE_DEVICES`` set per
    rank by the launcher) that GPU is device 0 whatever the local rank."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    lr = local_rank() or 0
    if count > 1 and lr >= count:
        raise ShardcError(
            f"shardc: LOCAL_RANK={lr} but this node shows only {count} GPUs; start at most "
            f"{count} processes per node (torchrun --nproc-per-node {count}).")
    return torch.device("cuda", lr if count > 1 else 0)


def init_distributed(backend: str | None = None) -> torch.device:
    """Select this rank's device and initialise torch.distributed from the environment
    torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, ...): NCCL on the local GPU, gloo on
    CPU. Returns the device to build the model on."""
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"))
    return device


def check_device(model: torch.nn.Module) -> None:
    """Refuse a model on a GPU other than the current device under NCCL: its collectives
    would run on one GPU while its tensors live on another."""
    if not (dist.is_initialized() and dist.get_backend() == "nccl"):
        return
    current = torch.cuda.current_device()
    for name, p in model.named_parameters():
        if p.device.type == "cuda" and p.device.index != current:
            raise ShardcError(
                f"shardc.compile: parameter {name!r} is on {p.device} but this rank's current "
                f"CUDA device is cuda:{current}. Call torch.cuda.set_device(LOCAL_RANK) (or "
                "shardc.core.launch.init_distributed()) before building the model.")
        if p.device.type == "cpu":
            raise ShardcError(
                f"shardc.compile: parameter {name!r} is on the CPU but the process group is "
                f"NCCL, which moves CUDA tensors only. Move the model to cuda:{current} first.")
