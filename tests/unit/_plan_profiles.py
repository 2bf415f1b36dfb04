"""Small profiles of cuts 0..2 that the planner's unit tests compute epochs from by hand."""

from __future__ import annotations

from hapi.plan import LinkProfile, ServerProfile, TrainerProfile, Workload

NAMES = ("block1", "pool")


def server_profile(**kw: object) -> ServerProfile:
    base: dict[str, object] = {
        "read_s": 0.001,
        "decode_s": 0.004,
        "head_s": (0.0, 0.002, 0.003),
        "out_bytes": (150_000, 50_000, 2_000),
        "memory_bytes": (150_000, 350_000, 400_000),
        "raw_bytes": 100_000,
    }
    return ServerProfile(**{**base, **kw})  # type: ignore[arg-type]


def trainer_profile(**kw: object) -> TrainerProfile:
    base: dict[str, object] = {
        "decode_s": 0.004,
        "head_s": (0.0, 0.002, 0.003),
        "tail_s": (0.006, 0.004, 0.003),
    }
    return TrainerProfile(**{**base, **kw})  # type: ignore[arg-type]


def one_cut(*, head_s: float, input_bytes: int, raw_bytes: int) -> ServerProfile:
    """A server that reads for free, decodes in 1 ms and has one cut of 1,000 bytes."""
    return ServerProfile(
        read_s=0.0,
        decode_s=0.001,
        head_s=(0.0, head_s),
        out_bytes=(input_bytes, 1_000),
        memory_bytes=(0, 0),
        raw_bytes=raw_bytes,
    )


def equal_cores() -> tuple[ServerProfile, TrainerProfile, LinkProfile]:
    """One core each side doing the same decode + head; training costs nothing; no link."""
    server = ServerProfile(
        read_s=0.0,
        decode_s=0.001,
        head_s=(0.0, 0.003),
        out_bytes=(12_288, 1_000),
        memory_bytes=(12_288, 20_000),
        raw_bytes=1_000,
    )
    trainer = TrainerProfile(decode_s=0.001, head_s=(0.0, 0.003), tail_s=(0.003, 0.0))
    return server, trainer, LinkProfile(bytes_per_s=1e12)


# The re-planner's tests: a plan at 1 MB/s whose link turns they account.
REPLAN_SERVER = ServerProfile(
    read_s=0.001,
    decode_s=0.010,
    head_s=(0.0, 0.010, 0.020),
    out_bytes=(150_000, 50_000, 2_000),
    memory_bytes=(0, 0, 0),
    raw_bytes=100_000,
)
REPLAN_TRAINER = TrainerProfile(
    decode_s=0.002, head_s=(0.0, 0.0005, 0.001), tail_s=(0.0015, 0.001, 0.0005)
)
REPLAN_WORK = Workload(samples=6400, chunk_size=64, local_window=4)
"""A hybrid's raw chunks in flight as many as its pushed ones: the most a turn can carry
of others' bytes, which these tests of the link's accounting are about."""
