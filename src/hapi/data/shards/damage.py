"""`ShardDamage`: a shard that breaks off before its end - an upload cut short, a damaged
tar header, a Parquet file without its footer - and the samples it lost.

A damaged shard does not take its dataset down: its complete samples are listed and
trained, and the shard is named with where it broke, so `on_error="skip"` reports what was
lost and `on_error="raise"` says which shard to upload again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hapi.errors import CorruptObject, shorten

__all__ = ["ShardDamage"]


@dataclass(frozen=True)
class ShardDamage:
    """Where a shard breaks off, and what was lost there."""

    shard: str
    """The shard's key in the store."""
    size: int
    """Its bytes, as stored."""
    at: int
    """The byte where the unusable part starts (the header of the member cut short)."""
    reason: str
    """What is wrong there, for a person."""
    lost: tuple[str, ...] = ()
    """The samples known lost (their headers are there): keys within the shard. Samples
    wholly past the break cannot be named."""

    def lost_keys(self) -> list[str]:
        """The lost samples as dataset keys (`shard#key`); where none can be named, the
        shard's unusable byte range (`shard@bytes=AT-SIZE`)."""
        if self.lost:
            return [f"{self.shard}#{k}" for k in self.lost]
        return [f"{self.shard}@bytes={self.at}-{self.size}"]

    def describe(self) -> str:
        """One line: the shard, where it breaks and what was lost."""
        lost = f"; lost {len(self.lost)} sample(s), e.g. {self.lost[0]!r}" if self.lost else ""
        return f"{self.shard}: {self.reason} at byte {self.at} of {self.size}{lost}"

    def error(self) -> CorruptObject:
        """The error a job that may not skip samples raises, naming the shard and the fix."""
        return CorruptObject(
            f"shard {shorten(self.describe())}: upload it again whole, or pass "
            "on_error='skip' to train its complete samples"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "size": self.size,
            "at": self.at,
            "reason": self.reason,
            "lost": list(self.lost),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardDamage:
        lost = data.get("lost", [])
        if not all(isinstance(k, str) for k in lost):
            raise TypeError("lost must be strings")
        return cls(
            str(data["shard"]), int(data["size"]), int(data["at"]), str(data["reason"]), tuple(lost)
        )
