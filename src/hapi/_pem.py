"""Reading the PEM files TLS is configured with, shared by the client and the server.

Both sides name the option a bad file came from, so a user knows which flag to fix;
the file lives here because the client and the server must not import each other.
"""

from __future__ import annotations

from pathlib import Path

from hapi.errors import InvalidRequest

__all__ = ["read_pem"]


def read_pem(path: str | Path, option: str, what: str) -> bytes:
    """The bytes of the PEM file at `path`.

    Args:
        path: the file.
        option: the option or flag that named it (`tls_ca`, `--tls-cert`), for the error.
        what: what it holds ("CA bundle", "private key"), for the error.

    Raises:
        InvalidRequest: the file cannot be read, or holds no PEM block.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequest(
            f"cannot read the TLS {what} {path} ({exc.strerror or exc}): check {option}"
        ) from None
    if b"-----BEGIN " not in data:
        raise InvalidRequest(f"TLS {what} {path} is not PEM (no '-----BEGIN' line): check {option}")
    return data
