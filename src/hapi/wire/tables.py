"""A whole Arrow table as the body of a Flight action's reply (a dataset's manifest).

An action's reply is one message, not a stream of batches: the table is written as an
Arrow IPC stream with ZSTD buffers (a manifest's keys share long prefixes; a million
compress from about 60 MB to a few) and read back without a Python object per row.
"""

from __future__ import annotations

import pyarrow as pa

from hapi.errors import InvalidRequest, shorten

__all__ = ["table_from_ipc", "table_to_ipc"]

_WRITE = pa.ipc.IpcWriteOptions(compression="zstd")


def table_to_ipc(table: pa.Table) -> bytes:
    """`table` as the bytes of an Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=_WRITE) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue())


def table_from_ipc(body: bytes) -> pa.Table:
    """The table `table_to_ipc` wrote.

    Raises:
        InvalidRequest: not an Arrow IPC stream.
    """
    try:
        return pa.ipc.open_stream(pa.py_buffer(body)).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise InvalidRequest(f"not an Arrow IPC table: {shorten(str(exc))}") from None
