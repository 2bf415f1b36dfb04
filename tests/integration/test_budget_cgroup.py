"""`hapi serve` in a real memory cgroup: its default budget comes from the group's limit.

The group is made at the top of the memory hierarchy (root needed, as in CI) and removed
after; the server joins it before it execs, as a container's processes do.
"""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hapi._sizes import parse_bytes
from hapi.data import open_store, synth_dataset

from ..memory_cgroup import CgroupUnavailable, MemoryCgroup

GiB = 1 << 30
BUDGET_LINE = re.compile(
    r"memory budget (?P<budget>[\d.]+ \w+): half of cgroup (?P<file>memory\.\w+) of "
    r"(?P<where>\S+) (?P<limit>[\d.]+ \w+) less (?P<used>[\d.]+ \w+) in use"
)


@pytest.fixture
def group() -> Iterator[MemoryCgroup]:
    try:
        with MemoryCgroup(GiB, name="hapi-budget") as made:
            yield made
    except CgroupUnavailable as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")


@pytest.fixture
def store(tmp_path: Path) -> Path:
    synth_dataset(open_store(str(tmp_path)), "train", classes=2, per_class=2, size=32)
    return tmp_path


def _start_up(store: Path, group: MemoryCgroup, *options: str) -> list[str]:
    """The lines `hapi serve` prints up to its budget, run in `group`; then it is ended."""
    command = [sys.executable, "-m", "hapi.cli", "serve", "--store", str(store)]
    proc = subprocess.Popen(
        [*command, "--port", "0", "--threads", "1", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=group.preexec,
    )
    lines: queue.Queue[str] = queue.Queue()
    out = proc.stdout
    threading.Thread(target=lambda: [lines.put(line) for line in out], daemon=True).start()
    seen: list[str] = []
    try:
        assert proc.pid in group.pids()
        while not any("memory budget" in line for line in seen):
            try:
                seen.append(lines.get(timeout=120))
            except queue.Empty:
                pytest.fail(f"hapi serve printed no budget: {seen}")
        if options:  # a warning comes after the line
            seen.append(lines.get(timeout=30))
    finally:
        proc.terminate()
        proc.wait(30)
    return seen


def test_the_default_budget_is_half_the_room_under_the_cgroup_limit(
    store: Path, group: MemoryCgroup
) -> None:
    text = " ".join(_start_up(store, group))
    match = BUDGET_LINE.search(text)
    assert match is not None, text
    budget, limit, used = (parse_bytes(match[k]) for k in ("budget", "limit", "used"))
    assert match["where"] == group.name and limit == GiB
    assert match["file"] == ("memory.limit_in_bytes" if group.version == 1 else "memory.max")
    # The server had imported torch when it chose: its own memory is counted as used.
    assert used > 50 << 20
    assert budget < GiB - used
    assert abs(budget - (limit - used) / 2) < 0.1 * GiB / 2


def test_a_configured_budget_beyond_the_cgroup_is_warned_about(
    store: Path, group: MemoryCgroup
) -> None:
    text = " ".join(_start_up(store, group, "--memory-budget", "4GiB"))
    assert "memory budget 4.0 GiB: --memory-budget" in text
    limit_file = "memory.limit_in_bytes" if group.version == 1 else "memory.max"
    assert "4.0 GiB is more than the" in text and f"{limit_file} of {group.name}" in text
