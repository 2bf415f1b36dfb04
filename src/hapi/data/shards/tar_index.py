"""`TarIndex`: where each WebDataset sample's image lies in a `.tar` shard, from its headers.

A shard is indexed once (per version) by reading its 512-byte headers with ranged reads:
a `SPAN` covering many small members, a small `WINDOW` after a large one. A shard that
breaks off keeps the samples before the break; the rest is its `damage`. Why, with
figures: docs/data.md, "Indexing a tar shard".
"""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hapi.data.shards.damage import ShardDamage
from hapi.errors import CorruptObject, shorten

__all__ = ["IMAGE_EXTS", "TarIndex", "TarMember", "split_wds_name"]

BLOCK = 512
WINDOW = 16 << 10
"""Bytes read at a header after a large member: labels and the next header come with it."""

SPAN = 4 << 20
"""Bytes read at a header after small members: many samples' headers in one request."""

LARGE = 1 << 20
"""A member this large is jumped: the read after it is a `WINDOW`, not a `SPAN`."""

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp")
"""WebDataset extensions (any case) that hold a sample's image."""

# WebDataset's rule (`base_plus_ext`): the key is the name up to the first dot of its
# last path part; the extension is the rest, so `a/b.seg.png` is key `a/b`, ext `seg.png`.
_NAME = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")

ReadRange = Callable[[int, int], bytes]
"""Bytes `start` to `end` (exclusive) of the shard, one request each."""


def split_wds_name(name: str) -> tuple[str, str] | None:
    """A member name's (key, extension) by WebDataset's rule; None for names without one."""
    match = _NAME.match(name)
    return (match.group(1), match.group(2)) if match else None


@dataclass(frozen=True)
class TarMember:
    """One sample of a shard: its image member's data and its label."""

    key: str
    offset: int
    """Where the image's bytes start in the shard."""
    size: int
    label: int | str | None
    """From `KEY.cls` (an integer) or `KEY.json` (its `label`, `cls` or `class`)."""


@dataclass(frozen=True)
class TarIndex:
    """A shard's samples in the order they are stored, each with its image's byte range."""

    samples: tuple[TarMember, ...]
    damage: ShardDamage | None = None
    """Where the shard breaks off, if it does: its samples are those before the break."""

    def find(self, key: str) -> TarMember | None:
        """The sample named `key`, or None."""
        return self._by_key().get(key)

    def _by_key(self) -> dict[str, TarMember]:
        found: dict[str, TarMember] | None = self.__dict__.get("_keys")
        if found is None:
            found = {m.key: m for m in self.samples}
            object.__setattr__(self, "_keys", found)
        return found

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form (the on-disk index cache); `from_dict` reads it back."""
        damage = {"damage": self.damage.to_dict()} if self.damage is not None else {}
        return {"samples": [[m.key, m.offset, m.size, m.label] for m in self.samples], **damage}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TarIndex:
        damage = data.get("damage")
        return cls(
            tuple(TarMember(k, int(o), int(s), lab) for k, o, s, lab in data["samples"]),
            ShardDamage.from_dict(damage) if damage is not None else None,
        )

    @classmethod
    def build(cls, read: ReadRange, size: int, *, name: str) -> TarIndex:
        """Index a shard of `size` bytes by reading its headers through `read`.

        Raises:
            CorruptObject: a label unreadable, or a sample has no image; the message names
                the shard (`name`) and the member. A shard that breaks off is not an
                error: the samples before the break are indexed, and `damage` says where.
        """
        scan = _Scan(read, size, name)
        scan.walk()
        damage = scan.drop_broken()
        missing = [k for k in scan.order if k not in scan.images]
        if missing:
            raise CorruptObject(
                f"sample {shorten(repr(missing[0]))} of shard {name} has no image member "
                f"(.{'/.'.join(IMAGE_EXTS)}): every WebDataset sample needs KEY.jpg or KEY.png"
            )
        samples = tuple(TarMember(k, *scan.images[k], scan.labels.get(k)) for k in scan.order)
        return cls(samples, damage)


@dataclass
class _Scan:
    """One pass over a shard's headers: the samples' members, in order, and any break."""

    read: ReadRange
    size: int
    name: str
    images: dict[str, tuple[int, int]] = field(default_factory=dict)
    labels: dict[str, int | str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    broken: tuple[int, str, str | None] | None = None
    """(byte, why, the key of the member cut there if its header names one)."""
    window: bytes = b""
    start: int = 0
    last: int = 0
    """The size of the member before the next header: a large one is jumped."""

    def walk(self) -> None:
        """Read every header up to the archive's end or the break."""
        offset, long_name = 0, None
        while True:
            if offset + BLOCK > self.size:
                why = "a partial tar header" if offset < self.size else "no end-of-archive blocks"
                self.broken = (offset, f"cut short ({why})", None)
                return
            header = self._header(offset)
            if header == bytes(BLOCK):
                return  # the archive's end: two zero blocks
            try:
                info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
            except tarfile.HeaderError as exc:
                self.broken = (offset, f"a damaged tar header ({exc})", None)
                return
            data_at = offset + BLOCK
            member = long_name or info.name
            if data_at + info.size > self.size:
                parts = split_wds_name(member) if info.isfile() else None
                why = f"cut short (member {shorten(repr(member))} needs {info.size} bytes)"
                self.broken = (offset, why, parts[0] if parts else None)
                return
            offset = data_at + -(-info.size // BLOCK) * BLOCK
            self.last = info.size
            if info.type in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE, tarfile.XGLTYPE):
                body = self._data(data_at, info.size)
                if info.type == tarfile.GNUTYPE_LONGNAME:
                    long_name = body.rstrip(b"\0").decode("utf-8", "surrogateescape")
                elif info.type == tarfile.XHDTYPE:
                    long_name = _pax_path(body) or long_name
                continue
            long_name = None
            if info.isfile():
                self._add(member, data_at, info.size)

    def _header(self, offset: int) -> bytes:
        """The header block at `offset`, reading a new window when the current one ends."""
        if not self.start <= offset or offset + BLOCK > self.start + len(self.window):
            span = WINDOW if self.last >= LARGE else SPAN
            self.start = offset
            self.window = self.read(offset, min(self.size, offset + span))
        return self.window[offset - self.start : offset - self.start + BLOCK]

    def _data(self, at: int, size: int) -> bytes:
        return _data(self.read, self.window, self.start, at, size)

    def _add(self, member: str, data_at: int, size: int) -> None:
        """Record a regular member: a sample's image or its label; other members are skipped."""
        parts = split_wds_name(member)
        if parts is None:
            return
        key, ext = parts
        ext = ext.lower()
        if key not in self.images and key not in self.labels:
            self.order.append(key)
        if ext in IMAGE_EXTS:
            self.images[key] = (data_at, size)
        elif ext in ("cls", "json"):
            self.labels[key] = _label(self._data(data_at, size), ext, self.name, member)

    def drop_broken(self) -> ShardDamage | None:
        """Drop the sample lost at the break, if any, and say where the shard breaks off."""
        if self.broken is None:
            return None
        at, why, cut = self.broken
        # The sample at the break - the one whose member is cut, or where no header
        # names one, the one in progress - is lost unless it has its image and label.
        order = self.order
        at_break = cut if cut is not None else (order[-1] if order else None)
        whole = at_break in self.images and at_break in self.labels
        lost = [at_break] if at_break is not None and not whole else []
        self.order = [k for k in order if k not in lost]
        return ShardDamage(self.name, self.size, at, why, tuple(lost))


def _data(read: ReadRange, window: bytes, start: int, at: int, size: int) -> bytes:
    """A member's bytes: from the window when it holds them, else one more read."""
    if at >= start and at + size <= start + len(window):
        return window[at - start : at - start + size]
    return read(at, at + size)


def _pax_path(body: bytes) -> str | None:
    # Records are "LEN key=value\n"; only the path matters for WebDataset's names.
    for line in body.split(b"\n"):
        _, _, record = line.partition(b" ")
        field, _, value = record.partition(b"=")
        if field == b"path":
            return value.decode("utf-8", "surrogateescape")
    return None


def _label(body: bytes, ext: str, shard: str, member: str) -> int | str:
    try:
        if ext == "cls":
            return int(body.decode().strip())
        value = json.loads(body)
        if isinstance(value, dict):
            value = next((value[f] for f in ("label", "cls", "class") if f in value), None)
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError("no integer or string label, cls or class field")
        return value
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptObject(
            f"member {shorten(repr(member))} of shard {shard} holds no label ({exc}): "
            "write KEY.cls as an integer, or KEY.json with a 'label' field"
        ) from None
