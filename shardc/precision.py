"""Precision guards: what shardc does about ``torch.autocast`` today.

The comm report and the runtime's byte counters are exact only if the program runs in
the dtypes it was compiled with. ``torch.autocast`` around ``compile`` is invisible to
``torch.export`` (the traced graph stays fp32), and around a compiled program's forward
it recasts the GEMMs at run time, so the collectives move other dtypes than the report
counts. Until the compiler captures a precision policy itself (``compile(precision=...)``),
both are refused. An autocast region inside the model's own forward is different: the
trace records its casts as ops, so the program, the report and the runtime agree.
"""
from __future__ import annotations

import torch

from shardc.errors import ShardcError

_DEVICE_TYPES = ("cpu", "cuda")


def active_autocast() -> list[str]:
    """The device types on which ``torch.autocast`` is enabled here and now."""
    out = []
    for dev in _DEVICE_TYPES:
        try:
            on = torch.is_autocast_enabled(dev)
        except (RuntimeError, TypeError):  # a torch without this device type's autocast
            on = False
        if on:
            out.append(dev)
    return out


def check_no_autocast(where: str) -> None:
    devs = active_autocast()
    if devs:
        dtype = torch.get_autocast_dtype(devs[0])
        raise ShardcError(
            f"{where}: torch.autocast is active ({', '.join(devs)}, {dtype}). shardc compiles "
            "and reports its program in the dtypes it traced, so autocast would make the "
            "runtime move other bytes than the comm report counts. Run shardc.compile and "
            "the compiled module outside torch.autocast (mixed precision as a compile option, "
            "precision='bf16', is not implemented yet; cast the model with model.to(dtype) to "
            "train in one lower precision).")

