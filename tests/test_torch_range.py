"""The torch range: what pyproject asks for is what shardc.core.compat and the README state (the
audit table of torch APIs is in docs/torch_versions.md), and the project trains on a torch
without the names newer than the floor."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from shardc.core.compat import (
    NEWER_THAN_FLOOR,
    TORCH_CEILING,
    TORCH_FLOOR,
    supported,
    torch_version,
)

pytestmark: list = []  # fast, but for the test marked slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pyproject_range_is_compat_range_and_installed_torch_is_in_it() -> None:
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    req = re.search(r'"torch([^"]*)"', text)
    assert req is not None, "pyproject.toml lists no torch requirement"
    floor = ".".join(map(str, TORCH_FLOOR))
    ceiling = str(TORCH_CEILING[0]) if TORCH_CEILING[1] == 0 else ".".join(map(str, TORCH_CEILING))
    assert req.group(1) == f">={floor},<{ceiling}"
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert f"torch >= {floor}, < {ceiling}" in readme
    assert supported(torch.__version__), torch.__version__
    assert not supported("2.7.1") and supported("2.8.0") and not supported("3.0.0")
    assert torch_version("2.13.0+cpu") == (2, 13)


def test_names_newer_than_floor_are_named_in_docs_audit() -> None:
    audit = open(os.path.join(ROOT, "docs", "torch_versions.md")).read()
    for name, first in NEWER_THAN_FLOOR.items():
        short = name.replace("torch.distributed.", "dist.")
        row = [line for line in audit.splitlines() if f"`{short}`" in line and line.startswith("|")]
        assert row, f"{name} has no row in the audit table of docs/torch_versions.md"
        assert f"| {first} |" in row[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_trains_without_names_newer_than_floor() -> None:
    """tests/compat_run.py deletes NEWER_THAN_FLOOR from torch before shardc loads, in
    the test process and both gloo ranks, then trains the GPT on z2 (every weight
    gathered, every gradient reduce-scattered) and compares with one device."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "compat_run.py")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "trained without" in out.stdout
