"""Exceptions shardc raises for bad input (ValueError/TypeError subclasses)."""
from __future__ import annotations


class ShardcError(ValueError):
    """Bad input to shardc: the message says what, where and how to fix it."""


class TraceError(ShardcError):
    """The model could not be traced."""
