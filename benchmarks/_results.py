"""Sections of `benchmarks/RESULTS.md`: each benchmark rewrites its own, leaving the rest."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
    """Put `body` between `<!-- name:start -->` and `<!-- name:end -->` in RESULTS.md."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)
