"""Sizes in bytes as people write them (`4GiB`, `512MiB`) and read them (`3.2 GiB`)."""

from __future__ import annotations

import re

from hapi.errors import InvalidRequest, shorten

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kb": 10**3, "kib": 2**10,
    "m": 2**20, "mb": 10**6, "mib": 2**20,
    "g": 2**30, "gb": 10**9, "gib": 2**30,
    "t": 2**40, "tb": 10**12, "tib": 2**40,
}  # fmt: skip


def parse_bytes(text: str | int) -> int:
    """A size like `4GiB`, `512MiB`, `2GB` or `1073741824` in bytes.

    Raises:
        InvalidRequest: not a positive size with a known unit.
    """
    if isinstance(text, bool) or not isinstance(text, str | int):
        raise InvalidRequest(f"a size is a number of bytes or a string like 4GiB, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidRequest(
                f"cannot read size {shorten(repr(text), 60)}: use a number with a unit, "
                "such as 4GiB, 512MiB or 2GB"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise InvalidRequest(f"a size must be positive, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """`n` bytes for a person: `3.2 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
