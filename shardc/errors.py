"""Exceptions shardc raises for bad input (ValueError/TypeError subclasses)."""
from __future__ import annotations


class ShardcError(ValueError):
    """Bad input to shardc: the message says what, where and how to fix it."""


class TraceError(ShardcError):
    """The model could not be traced."""


class ShardcWarning(UserWarning):
    """Something the compiled program does differently from what the model asked for,
    without changing its results (e.g. a torch.utils.checkpoint it cannot honour)."""
