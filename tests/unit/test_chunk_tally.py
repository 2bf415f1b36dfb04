"""The job's own chunks at the freeze cut, tallied for a plan measured beside training:
the session's first chunk (which pays for what later ones reuse), other cuts and
chunks without a server's report do not count."""

from __future__ import annotations

import threading
import time

from hapi.client.planning.chunk_tally import ChunkTally, ChunkTotals
from hapi.plan import ReadMeasurement


def _read(cut: int, samples: int = 16, server_s: float | None = 0.2) -> ReadMeasurement:
    return ReadMeasurement(samples=samples, bytes=samples * 100, cut=cut, server_s=server_s,
                           transfer_s=0.01)  # fmt: skip


def test_the_tally_sums_the_servers_chunks_at_its_cut_after_the_first() -> None:
    tally = ChunkTally(5)
    tally.add(_read(5, server_s=2.0))  # the first: a head loaded, buffers made
    tally.add(_read(-1))  # a local chunk's raw bytes
    tally.add(_read(5, server_s=None))  # no report: no evidence
    tally.add(_read(5, samples=0))
    tally.add(_read(5))
    tally.add(_read(5, samples=8, server_s=0.25))
    assert tally.wait(2, 0.0) == ChunkTotals(chunks=2, samples=24, bytes=2400, server_s=0.45)
    assert tally.wait(3, 0.05) is None  # not within the wait


def test_a_wait_ends_when_the_chunks_come() -> None:
    tally = ChunkTally(2, skip=0)

    def later() -> None:
        time.sleep(0.1)
        tally.add(_read(2))

    threading.Thread(target=later).start()
    t0 = time.monotonic()
    assert tally.wait(1, 10.0) == ChunkTotals(1, 16, 1600, 0.2)
    assert time.monotonic() - t0 < 5.0


def test_a_closed_tally_ends_a_wait_with_what_it_had() -> None:
    tally = ChunkTally(2, skip=0)
    tally.close()
    assert tally.wait(2, 10.0) is None  # nothing to give: at once, not in 10 s
    tally.reopen()
    tally.add(_read(2))
    threading.Timer(0.1, tally.close).start()
    t0 = time.monotonic()
    assert tally.wait(2, 10.0) == ChunkTotals(1, 16, 1600, 0.2)
    assert time.monotonic() - t0 < 5.0
