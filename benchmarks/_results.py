"""Sections of `benchmarks/RESULTS.md`: each benchmark rewrites its own, leaving the rest."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


DETAILS = "<!-- details -->"
"""In a section's body, what follows this line goes to `out/NAME.md`, linked from the
section: RESULTS.md keeps each benchmark's headline figures and command, short enough to
read, and the full tables stay one click away."""


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
    """Put `body` between `<!-- name:start -->` and `<!-- name:end -->` in RESULTS.md
    (what follows a `DETAILS` line in `out/NAME.md`, linked)."""
    if DETAILS in body:
        body, details = body.split(DETAILS, 1)
        out = path.parent / "out" / f"{name}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"# {name}: the full tables\n\n{details.strip()}\n")
        body = f"{body.rstrip()}\n\nThe full tables: [out/{name}.md](out/{name}.md)."
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)
