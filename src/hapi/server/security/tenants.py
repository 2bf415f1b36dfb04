"""Tenants: who holds which token, which store prefixes each may read, and its fair share.

A server knows its tenants from a TOML file (`hapi serve --tenants FILE`), one table per
tenant (`token_env` or `token`, `prefixes`, `weight`), re-read on SIGHUP. `prefixes` are
whole path segments; `[""]` allows every key. One `--token` gives one tenant that reads
everything (`Tenants.single`), no token one anonymous tenant (`Tenants.open`). The file's
format, with an example: docs/server.md, "Tenants".
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import math
import os
import re
import signal
import threading
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hapi.data.store.keys import key_under
from hapi.errors import Forbidden, InvalidRequest, Unauthenticated, shorten

__all__ = ["Tenant", "Tenants", "reload_on_sighup"]

log = logging.getLogger("hapi.server")

# Tenant names become metric labels and log fields: keep them short and plain.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_BAD_PART = r"(^|/)(\.{1,2})?(/|$)"
"""An empty, '.' or '..' part (an empty key, a leading or trailing '/', '//'), in RE2 as
Arrow reads it: with `_CONTROL`, `_well_formed` for a whole column."""
_FIELDS = ("token", "token_env", "prefixes", "weight")
_EXAMPLE = '[team-a]\ntoken_env = "TEAM_A_TOKEN"\nprefixes = ["datasets/team-a"]\nweight = 1.0'


@dataclass(frozen=True, kw_only=True)
class Tenant:
    """Whoever holds one token: the store prefixes it may read and its weight in the fair share."""

    name: str
    """Name in logs, metrics and errors: the tenant's table in the tenants file."""
    token: str | None = field(default=None, repr=False)
    """Bearer token that identifies the tenant; None only for an open server's anonymous tenant."""
    prefixes: tuple[str, ...] = ("",)
    """Store key prefixes the tenant may read, in whole path segments; `""` is every key."""
    weight: float = 1.0
    """The tenant's share of a busy server relative to the other tenants' weights."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise InvalidRequest(
                f"tenant name {shorten(repr(self.name))} is not usable: use 1-64 letters, "
                "digits, '_', '.' or '-', starting with a letter or digit"
            )
        if self.token is not None and (
            not isinstance(self.token, str)
            or not self.token
            or not self.token.isprintable()
            or any(c.isspace() for c in self.token)
        ):
            raise InvalidRequest(
                "the token is empty or holds spaces or control characters: a bearer token is "
                "one printable word, e.g. from `python -c 'import secrets; "
                "print(secrets.token_urlsafe())'`"
            )
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float):
            raise InvalidRequest(f"weight must be a number, got {shorten(repr(self.weight))}")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise InvalidRequest(f"weight must be a finite number > 0, got {self.weight}")
        object.__setattr__(self, "weight", float(self.weight))
        object.__setattr__(self, "prefixes", _normalise_prefixes(self.prefixes))

    @property
    def reads_all(self) -> bool:
        """Whether the tenant may read every key of the store."""
        return self.prefixes == ("",)

    def allows(self, key: str) -> bool:
        """Whether `key`, a well-formed store key, lies under one of the tenant's prefixes."""
        return _well_formed(key) and any(key_under(key, p) for p in self.prefixes)

    def allows_all(self, keys: pa.Array) -> np.ndarray | None:
        """`allows` of a column of keys at once, in Arrow (a listing of 10^5 keys spent a
        fifth of its time in `allows`, a call a key), for a tenant that reads every key;
        None for others (their prefixes are checked a key at a time)."""
        if not self.reads_all:
            return None
        text = keys.cast(pa.string())
        bad = pc.or_(
            pc.match_substring_regex(text, _BAD_PART),
            pc.match_substring_regex(text, _CONTROL.pattern),
        )
        return np.asarray(pc.invert(pc.fill_null(bad, True)).to_numpy(zero_copy_only=False))

    def check_key(self, key: str) -> str:
        """Return `key` if the tenant may read it.

        Check every key of a chunk or manifest before the store sees it, so a refusal
        says nothing about whether the object exists.

        Raises:
            InvalidRequest: `key` is malformed.
            Forbidden: `key` is outside the tenant's prefixes.
        """
        _check_well_formed(key, "key")
        if not any(key_under(key, p) for p in self.prefixes):
            raise self._forbidden("key", key)
        return key

    def check_prefix(self, prefix: str) -> str:
        """Return `prefix` without surrounding '/' if the tenant may list everything under it.

        Listing is by whole segments only where the store does so; filter the keys listed
        with `allows` as well.

        Raises:
            InvalidRequest: `prefix` is malformed.
            Forbidden: `prefix` is not inside one of the tenant's prefixes.
        """
        normal = prefix.strip("/") if isinstance(prefix, str) else prefix
        if normal != "":
            _check_well_formed(normal, "prefix")
        if not any(key_under(normal, p) for p in self.prefixes):
            raise self._forbidden("prefix", prefix)
        return normal

    def _forbidden(self, what: str, value: str) -> Forbidden:
        allowed = ", ".join(repr(p) for p in self.prefixes)
        return Forbidden(
            f"{what} {shorten(repr(value))} is outside the prefixes tenant {self.name!r} may "
            f"read ({shorten(allowed)}): ask the server's operator to add it to the tenant "
            "in the tenants file"
        )


class Tenants:
    """The tenants a server knows, found by token in time that does not depend on which matched.

    `reload()` swaps in the file's new contents at once; a bad file keeps the old tenants.
    Sessions should hold a tenant's name and find it again per call (`get`), so a reload
    that narrows its prefixes applies to sessions already open.
    """

    def __init__(self, tenants: Iterable[Tenant], *, path: Path | None = None) -> None:
        """Tenants from `tenants`; `path` is the file `reload` re-reads (None: no file)."""
        self._path = path
        self._table = _Table.of(tuple(tenants), path=path)
        self._reload_lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | Path, *, environ: Mapping[str, str] | None = None) -> Tenants:
        """Tenants from a TOML file (see the module's docstring).

        Args:
            path: the tenants file.
            environ: where `token_env` names are looked up; `os.environ` when None.

        Raises:
            InvalidRequest: the file cannot be read or a tenant is invalid; the message
                names the file, the tenant and the fix.
        """
        path = Path(path)
        return cls(_read(path, os.environ if environ is None else environ), path=path)

    @classmethod
    def single(cls, token: str) -> Tenants:
        """One tenant, `default`, that holds `token` and may read every key (`--token`)."""
        return cls([Tenant(name="default", token=token)])

    @classmethod
    def open(cls) -> Tenants:
        """One anonymous tenant that needs no token and may read every key (loopback use)."""
        return cls([Tenant(name="anonymous")])

    @property
    def path(self) -> Path | None:
        """The file `reload` re-reads; None for `single` and `open`."""
        return self._path

    @property
    def requires_token(self) -> bool:
        """Whether callers must send a token (False only for `open`)."""
        return self._table.anonymous is None

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self._table.tenants)

    def __len__(self) -> int:
        return len(self._table.tenants)

    def __repr__(self) -> str:
        names = ", ".join(t.name for t in self._table.tenants)
        return f"Tenants([{names}], path={self._path})"

    def get(self, name: str) -> Tenant | None:
        """The tenant called `name` now (None once a reload removed it)."""
        return self._table.by_name.get(name)

    def authenticate(self, token: str | None) -> Tenant:
        """The tenant that holds `token`.

        Raises:
            Unauthenticated: no token, or a token no tenant holds.
        """
        table = self._table  # one read: a concurrent reload swaps the whole table
        if table.anonymous is not None:
            return table.anonymous
        if not token:
            raise Unauthenticated(
                "missing bearer token: this server needs one; pass it with "
                "hapi.connect(address, token=...)"
            )
        digest = _digest(token)
        found: Tenant | None = None
        # Compare with every tenant's digest, without stopping at a match, so the time taken
        # says nothing about which tenant (or how many) there are before it. Digests have
        # one length, so compare_digest does not reveal the token's length either.
        for expected, tenant in table.digests:
            if hmac.compare_digest(expected, digest):
                found = tenant
        if found is None:
            raise Unauthenticated("wrong bearer token: the server knows no tenant with it")
        return found

    def authenticate_header(self, values: Sequence[str]) -> Tenant:
        """The tenant of a call's `authorization` header values (`Bearer <token>`).

        Raises:
            Unauthenticated: no bearer token, or one no tenant holds.
        """
        tokens: list[str | None] = [v[7:].strip() for v in values if v[:7].lower() == "bearer "]
        tokens = tokens or [None]
        for token in tokens[:-1]:
            with contextlib.suppress(Unauthenticated):
                return self.authenticate(token)
        return self.authenticate(tokens[-1])

    def reload(self) -> bool:
        """Re-read the tenants file and swap in its tenants; keep the old ones if it is bad.

        Returns:
            Whether new tenants were swapped in.
        """
        if self._path is None:
            log.warning("tenants: nothing to reload (the server has no tenants file)")
            return False
        with self._reload_lock:
            try:
                table = _Table.of(_read(self._path, os.environ), path=self._path)
            except InvalidRequest as exc:
                log.error("tenants: kept the %d tenants loaded before: %s", len(self), exc)
                return False
            self._table = table
        log.info("tenants: reloaded %s: %s", self._path, ", ".join(table.by_name))
        return True


def reload_on_sighup(tenants: Tenants) -> Callable[[], None]:
    """Reload `tenants` when the process gets SIGHUP; call the result to stop.

    The reload runs in a thread of its own (named `hapi-tenants-reload`): a signal
    handler runs between two bytecodes of the main thread, which may hold the logging lock.
    Call from the main thread (Python's rule for signal handlers).
    """
    sighup = getattr(signal, "SIGHUP", None)
    if sighup is None:
        log.warning("tenants: this platform has no SIGHUP; restart the server to reload")
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        threading.Thread(target=tenants.reload, name="hapi-tenants-reload", daemon=True).start()

    before = signal.signal(sighup, handler)

    def restore() -> None:
        signal.signal(sighup, before)

    return restore


@dataclass(frozen=True)
class _Table:
    """One consistent set of tenants, swapped whole by a reload."""

    tenants: tuple[Tenant, ...]
    by_name: dict[str, Tenant]
    digests: tuple[tuple[bytes, Tenant], ...]
    anonymous: Tenant | None

    @classmethod
    def of(cls, tenants: tuple[Tenant, ...], *, path: Path | None = None) -> _Table:
        where = f"tenants file {path}: " if path else ""
        if not tenants:
            raise InvalidRequest(f"{where}no tenants: add a table per tenant, e.g.\n{_EXAMPLE}")
        anonymous = [t for t in tenants if t.token is None]
        if anonymous and len(tenants) > 1:
            raise InvalidRequest(
                f"{where}tenant {anonymous[0].name!r} has no token: with more than one "
                "tenant each needs its own token"
            )
        by_name: dict[str, Tenant] = {}
        by_digest: dict[bytes, Tenant] = {}
        for tenant in tenants:
            if tenant.name in by_name:
                raise InvalidRequest(f"{where}two tenants are called {tenant.name!r}: rename one")
            by_name[tenant.name] = tenant
            if tenant.token is not None:
                digest = _digest(tenant.token)
                if digest in by_digest:
                    # Name the tenants, never the token.
                    raise InvalidRequest(
                        f"{where}tenants {by_digest[digest].name!r} and {tenant.name!r} have "
                        "the same token: give each tenant a token of its own"
                    )
                by_digest[digest] = tenant
        return cls(
            tenants=tenants,
            by_name=by_name,
            digests=tuple(by_digest.items()),
            anonymous=anonymous[0] if anonymous else None,
        )


def _read(path: Path, environ: Mapping[str, str]) -> tuple[Tenant, ...]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidRequest(
            f"tenants file {path}: cannot read it ({exc.strerror or exc}); check the --tenants path"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(
            f"tenants file {path}: not valid TOML ({exc}); write a table per tenant, "
            f"e.g.\n{_EXAMPLE}"
        ) from None
    tenants = []
    for name, table in data.items():
        try:
            tenants.append(_tenant(name, table, environ))
        except InvalidRequest as exc:
            raise InvalidRequest(f"tenants file {path}: tenant {name!r}: {exc}") from None
    return tuple(tenants)


def _tenant(name: str, table: Any, environ: Mapping[str, str]) -> Tenant:
    if not isinstance(table, dict):
        raise InvalidRequest(f"is not a table: write it as [{name}] with token_env and prefixes")
    unknown = sorted(set(table) - set(_FIELDS))
    if unknown:
        raise InvalidRequest(f"unknown field(s) {unknown}: a tenant has {', '.join(_FIELDS)}")
    if ("token" in table) == ("token_env" in table):
        raise InvalidRequest(
            "give exactly one of token_env (the name of an environment variable holding the "
            "token, best) or token"
        )
    if "token_env" in table:
        variable = table["token_env"]
        if not isinstance(variable, str) or not variable:
            raise InvalidRequest("token_env must name an environment variable")
        token = environ.get(variable)
        if not token:
            raise InvalidRequest(
                f"token_env names {variable}, which is not set (or empty) in the server's "
                f"environment: export {variable} before `hapi serve`"
            )
    else:
        token = table["token"]
        if not isinstance(token, str):
            raise InvalidRequest("token must be a string")
    if "prefixes" not in table:
        # No default: a forgotten line must not open the whole store.
        raise InvalidRequest(
            'no prefixes: list the key prefixes it may read, e.g. prefixes = ["datasets/a"], '
            'or prefixes = [""] for every key'
        )
    prefixes = table["prefixes"]
    if not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes):
        raise InvalidRequest('prefixes must be a list of strings, e.g. ["datasets/a"]')
    return Tenant(name=name, token=token, prefixes=tuple(prefixes), weight=table.get("weight", 1.0))


def _normalise_prefixes(prefixes: Any) -> tuple[str, ...]:
    if isinstance(prefixes, str) or not isinstance(prefixes, tuple | list):
        raise InvalidRequest(f"prefixes must be a list of strings, got {shorten(repr(prefixes))}")
    if not prefixes:
        raise InvalidRequest('prefixes is empty: list what the tenant may read ([""] is every key)')
    normal = set()
    for prefix in prefixes:
        if not isinstance(prefix, str):
            raise InvalidRequest(f"prefix {shorten(repr(prefix))} is not a string")
        stripped = prefix.strip("/")
        if stripped and not _well_formed(stripped):
            raise InvalidRequest(
                f"prefix {shorten(repr(prefix))} has an empty, '.' or '..' part or a control "
                "character: write it as a plain path such as 'datasets/a'"
            )
        normal.add(stripped)
    if "" in normal:
        return ("",)
    # Drop prefixes inside others: the error messages list what the tenant really has.
    kept = [p for p in normal if not any(q != p and key_under(p, q) for q in normal)]
    return tuple(sorted(kept))


def _well_formed(key: object) -> bool:
    # The store's own rule for keys: no absolute paths, no empty, '.' or '..' parts (which
    # would let "a/../b" pass a prefix check for "a"), no control characters.
    return (
        isinstance(key, str)
        and bool(key)
        and not key.startswith("/")
        and all(part not in ("", ".", "..") for part in key.split("/"))
        and not _CONTROL.search(key)
    )


def _check_well_formed(key: object, what: str) -> None:
    if not _well_formed(key):
        raise InvalidRequest(
            f"invalid {what} {shorten(repr(key))}: keys are relative '/'-separated paths "
            "without empty, '.' or '..' parts or control characters"
        )


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
