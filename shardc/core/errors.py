"""Exceptions shardc raises for bad input (ValueError/TypeError subclasses), and for a
collective that failed at run time."""
from __future__ import annotations


class ShardcError(ValueError):
    """Bad input to shardc: the message says what, where and how to fix it."""


class OptionError(ShardcError):
    """An option of ``compile`` with a value it cannot take, or two that cannot go together."""


class OptionTypeError(OptionError, TypeError):
    """An option of ``compile`` of the wrong type (also a TypeError, as Python's own are)."""


class TraceError(ShardcError):
    """The model could not be traced."""


class CollectiveError(ShardcError, RuntimeError):
    """A collective failed on this rank (a peer died, stalled past the process group's
    timeout, or issued another collective). Also a RuntimeError, as torch.distributed's
    own errors are, so code that caught those still catches it."""
class ShardcWarning(UserWarning):
    """Something the compiled program does differently from what the model asked for,
    without changing its results (e.g. a torch.utils.checkpoint it cannot honour)."""
