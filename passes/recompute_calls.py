"""Find the ``torch.utils.checkpoint`` calls a model makes while it is traced.

``torch.export`` runs a checkpointed function once, like any other code, and the graph
keeps no trace of the checkpoint: the recompute the user asked for would silently
disappear and every activation be kept. Recording the calls lets ``compile`` recompute
those submodules' segments of the rank's program (``passes/recompute.py``), and name the
calls it cannot honour.

Both forms of ``torch.utils.checkpoint.checkpoint`` go through a name in that module's
globals at call time (``_checkpoint_without_reentrant_generator`` for
``use_reentrant=False``, ``_checkpoint_without_reentrant_generator_impl`` from torch 2.15,
``CheckpointFunction`` for the reentrant form), so replacing
those two names for the duration of the trace sees every call, however the model imported
``checkpoint``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.nn as nn
import torch.utils.checkpoint as tuc


def _name_of(fn: Any, names: dict[int, str]) -> str:
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module) and id(owner) in names:
        return names[id(owner)] or "<root>"
    return getattr(fn, "__qualname__", None) or repr(fn)


# the function checkpoint(use_reentrant=False) calls, newest torch first
_GENERATORS = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")


@contextlib.contextmanager
def record_recompute_calls(model: nn.Module, found: list[str]) -> Iterator[None]:
    """While active, append to ``found`` the qualified name of each module (or the name of
    each function) that ``torch.utils.checkpoint.checkpoint`` is called on."""
    names = {id(m): n for n, m in model.named_modules()}
    # torch 2.15 calls a new name (its args as one tuple); the old one stays as a shim
    gen_name = next((n for n in _GENERATORS if hasattr(tuc, n)), _GENERATORS[-1])
    gen = getattr(tuc, gen_name, None)
    fn_cls = getattr(tuc, "CheckpointFunction", None)
    if gen is None or fn_cls is None:  # another torch layout: nothing to hook, say nothing
        yield
        return

    def recording_gen(fn: Any, *args: Any, **kwargs: Any) -> Any:
        found.append(_name_of(fn, names))
        return gen(fn, *args, **kwargs)

    base: Any = fn_cls

    class RecordingFunction(base):  # type: ignore[misc, valid-type]
        @classmethod
        def apply(cls, function: Any, preserve_rng_state: Any, *args: Any) -> Any:
            found.append(_name_of(function, names))
            # A plain call, not the Function: the reentrant form runs ``function`` under
            # no_grad and gets its gradient from its own backward, which export drops, so
            # the no_grad region export records would cut the gradient (passes/trace.py
            # detaches what forward computes under no_grad). The ops and the random draws
            # are the same. A module's own ``forward`` is called through the module, so
            # that export attributes its ops to it and the block can be recomputed.
            owner = getattr(function, "__self__", None)
            if isinstance(owner, nn.Module) and \
                    getattr(function, "__func__", None) is getattr(type(owner), "forward", None):
                function = owner
            return function(*args)

    setattr(tuc, gen_name, recording_gen)
    tuc.CheckpointFunction = RecordingFunction  # type: ignore[attr-defined, misc]
    try:
        yield
    finally:
        setattr(tuc, gen_name, gen)
        tuc.CheckpointFunction = fn_cls  # type: ignore[attr-defined, misc]


def unique(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


__all__ = ["record_recompute_calls", "unique"]
