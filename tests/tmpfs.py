"""A real, tiny tmpfs for tests of a disk that fills or is read-only, unmounted after.

Mounting needs root (CI runs as root); elsewhere the test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["full", "read_only", "tmpfs"]


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (`mount -o size=`) at `where`, unmounted on exit."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def read_only(where: Path) -> None:
    """Remount the tmpfs at `where` read-only (root ignores file modes; a mount does not)."""
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)


def full(where: Path) -> None:
    """Fill the tmpfs at `where` to its last byte."""
    with open(where / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
