"""Running `hapi ARGS...` in this process, through the same `main()` as the console script.

In-process runs skip a Python start and torch's import per call, which keeps CLI tests fast.
"""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass

from hapi.cli import main

__all__ = ["Result", "hapi"]


@dataclass(frozen=True)
class Result:
    """What one run printed, and its exit code."""

    code: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        """The lines of stderr that report an error."""
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]

    @property
    def error(self) -> str:
        """The one `error:` line (fails the test when there is not exactly one)."""
        assert len(self.error_lines) == 1, self.stderr
        return self.error_lines[0]


def hapi(*args: str) -> Result:
    """Run `hapi ARGS...` and return its exit code and output."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["hapi", *args]
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    return Result(code, out.getvalue(), err.getvalue())
