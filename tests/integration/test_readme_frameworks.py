"""The README's framework examples run as written, each in a process of its own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _examples() -> list[tuple[str, str]]:
    text = README.read_text()
    section = text[text.index("## Training in a framework") :]
    section = section[: section.index("\n## ", 1)]
    found = []
    for part in re.split(r"\n### ", section)[1:]:
        title = part.splitlines()[0]
        found += [(title, code) for code in re.findall(r"```python\n(.*?)```", part, re.S)]
    return found


def test_the_readme_has_an_example_for_each_framework() -> None:
    assert [t for t, _ in _examples()] == [
        "A PyTorch dataset",
        "PyTorch Lightning",
        "Hugging Face Trainer",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("title", "code"), _examples(), ids=lambda v: v[:20])
def test_a_readme_example_runs(title: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    # A guard against a hang, not a measurement.
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{title}:\n{done.stderr[-4000:]}"
